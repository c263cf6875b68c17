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

from registry import service
from registry.dispatch import TRACE_QUEUE

from .state import AppState
from .worker_stats import QueueDepths, read_worker_table

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
        # One broker client for the scrape and the dashboard's workers table.
        self.queues = QueueDepths(state.settings.resolved_broker_url())
        self.registry.register(FarmCollector(state, self.queues))


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
    def __init__(self, state: AppState, queues: QueueDepths) -> None:
        self.state = state
        self.queues = queues

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
        yield from self._workers()

    def _workers(self) -> Iterator[Any]:
        """The workers' side (registry.api.worker_stats, which the dashboard's
        workers table reads too): per target, builds by state, failures,
        compile durations (a summary: count and sum), live compile workers
        and tasks waiting; per queue, its depth."""
        try:
            table = read_worker_table(self.state.db, self.queues,
                                      max_age_s=self.state.heartbeat_max_age_s)
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
        live = GaugeMetricFamily("farm_target_workers", "Live compile workers by target",
                                 labels=["target"])
        for t in table.targets:
            for st, n in sorted(t.builds.items()):
                builds.add_metric([t.target, st], n)
            failed.add_metric([t.target], t.failed)
            durations.add_metric([t.target], count_value=t.timed, sum_value=t.compile_s)
            live.add_metric([t.target], t.workers)
        yield from (builds, failed, durations, live)
        if not self.queues.readable:
            return  # other brokers (the embedded SQLite one) have no cheap LLEN
        yield _up("farm_broker_up", "the broker", table.broker_error is None)
        if table.broker_error is not None:
            return
        depth = GaugeMetricFamily("farm_queue_depth", "Messages waiting in each queue",
                                  labels=["queue"])
        by_target = GaugeMetricFamily("farm_target_queue_depth",
                                      "Compile tasks waiting, by target", labels=["target"])
        depth.add_metric([TRACE_QUEUE], table.trace_queued or 0)
        for t in table.targets:
            if t.queue is not None and t.queued is not None:
                depth.add_metric([t.queue], t.queued)
                by_target.add_metric([t.target], t.queued)
        yield depth
        yield by_target
