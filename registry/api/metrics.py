"""Prometheus metrics.

Counts that live in SQL (jobs and builds by state, compile seconds) and queue
depths that live in the broker are read when scraped, by a collector, so
every API replica reports the same numbers. What happens inside this process
(resolve hits and misses, request latency) is counted here and is per replica.
Each app has its own registry, so several apps in one process (tests) do not
collide.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily
from prometheus_client.registry import Collector

from farm.core.net import is_redis_url
from registry import service
from registry.dispatch import TRACE_QUEUE

from .state import AppState

log = logging.getLogger(__name__)

JOB_STATES = ("queued", "tracing", "compiling", "succeeded", "failed", "partial")
BUILD_STATES = ("pending", "queued", "running", "succeeded", "reused", "failed")
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.resolves = Counter("farm_resolve", "Resolve requests answered, by result",
                                ["result"], registry=self.registry)
        for result in ("hit", "miss"):
            self.resolves.labels(result)
        # What nodes report (POST /v1/reports), per replica: kind is miss,
        # guard_failure, fallback or load; reason the report's code.
        self.reports = Counter("farm_node_reports", "Node reports received, by model, target, "
                               "kind and reason", ["model", "target", "kind", "reason"],
                               registry=self.registry)
        self.latency = Histogram("farm_http_request_duration_seconds",
                                 "HTTP request latency by method, route template and status",
                                 ["method", "route", "status"], buckets=LATENCY_BUCKETS,
                                 registry=self.registry)

    def attach(self, state: AppState) -> None:
        self.registry.register(FarmCollector(state))


def _up(name: str, what: str, ok: bool) -> GaugeMetricFamily:
    """``name`` 1 if the last scrape could read ``what``, else 0."""
    up = GaugeMetricFamily(name, f"1 if the last scrape could read {what}")
    up.add_metric([], 1 if ok else 0)
    return up


def _by_state(name: str, doc: str, known: tuple[str, ...],
              counts: dict[str, int]) -> GaugeMetricFamily:
    """A gauge per state: every known one (0 when none), then any other counted."""
    family = GaugeMetricFamily(name, doc, labels=["state"])
    for st in sorted(set(known) | set(counts)):
        family.add_metric([st], counts.get(st, 0))
    return family


class FarmCollector(Collector):
    def __init__(self, state: AppState) -> None:
        self.state = state
        self._redis: Any = None
        self._targets: dict[str, str] = {}  # compile queue -> its target

    def collect(self) -> Iterator[Any]:
        try:
            counts = service.counts(self.state.db)
        except Exception as exc:  # a scrape must still answer while the database is down
            log.warning("metrics: database unreadable: %s", exc)
            yield _up("farm_database_up", "the database", False)
            return
        yield _up("farm_database_up", "the database", True)
        yield _by_state("farm_jobs", "Jobs by state", JOB_STATES, counts["jobs"])
        yield _by_state("farm_builds", "Builds by state", BUILD_STATES, counts["builds"])
        yield GaugeMetricFamily("farm_artifacts", "Artifacts stored", value=counts["artifacts"])
        yield CounterMetricFamily("farm_resolve_misses_recorded",
                                  "Resolve misses recorded in the database (all replicas)",
                                  value=counts["misses"])
        yield CounterMetricFamily("farm_compile_seconds",
                                  "Seconds spent compiling, summed over finished builds",
                                  value=counts["compile_seconds"])
        yield from self._per_target()
        yield from self._queue_depth()

    def _per_target(self) -> Iterator[Any]:
        """The workers' side, per target: builds by state (failures among
        them) and the compile task's durations (a summary: count and sum)."""
        try:
            rows = service.build_stats_by_target(self.state.db)
        except Exception as exc:
            log.warning("metrics: cannot read builds per target: %s", exc)
            return
        builds = GaugeMetricFamily("farm_target_builds", "Builds by target and state",
                                   labels=["target", "state"])
        failed = GaugeMetricFamily("farm_target_builds_failed",
                                   "Failed builds by target", labels=["target"])
        durations = SummaryMetricFamily("farm_target_compile_seconds",
                                        "Compile task durations by target (finished builds)",
                                        labels=["target"])
        per_target: dict[str, tuple[int, float, int]] = {}
        for r in rows:
            builds.add_metric([r["target"], r["state"]], r["builds"])
            timed, secs, fails = per_target.get(r["target"], (0, 0.0, 0))
            per_target[r["target"]] = (timed + r["timed"], secs + r["compile_s"],
                                       fails + (r["builds"] if r["state"] == "failed" else 0))
        for target, (timed, secs, fails) in sorted(per_target.items()):
            failed.add_metric([target], fails)
            durations.add_metric([target], count_value=timed, sum_value=secs)
        yield builds
        yield failed
        yield durations

    def _queue_names(self) -> list[str]:
        names = {TRACE_QUEUE}
        try:
            for w in service.live_workers(self.state.db,
                                          max_age_s=self.state.heartbeat_max_age_s):
                if w.get("queue"):
                    names.add(w["queue"])
                    if w.get("target"):
                        self._targets[w["queue"]] = w["target"]
        except Exception as exc:
            log.warning("metrics: cannot list workers: %s", exc)
        return sorted(names)

    def _queue_depth(self) -> Iterator[Any]:
        broker = self.state.settings.resolved_broker_url()
        if not is_redis_url(broker):
            return  # other brokers (the embedded SQLite one) have no cheap LLEN
        depth = GaugeMetricFamily("farm_queue_depth", "Messages waiting in each queue",
                                  labels=["queue"])
        by_target = GaugeMetricFamily("farm_target_queue_depth",
                                      "Compile tasks waiting, by target", labels=["target"])
        try:
            if self._redis is None:
                import redis

                self._redis = redis.Redis.from_url(broker, socket_timeout=1.0,
                                                   socket_connect_timeout=1.0)
            names = self._queue_names()
            pipe = self._redis.pipeline(transaction=False)
            for name in names:
                pipe.llen(name)
            for name, n in zip(names, pipe.execute(), strict=True):
                depth.add_metric([name], int(n))
                if name != TRACE_QUEUE:
                    by_target.add_metric([self._targets.get(name, name)], int(n))
        except Exception as exc:
            log.warning("metrics: broker unreadable: %s", exc)
            yield _up("farm_broker_up", "the broker", False)
            return
        yield _up("farm_broker_up", "the broker", True)
        yield depth
        yield by_target
