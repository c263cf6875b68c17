"""What the workers do, per target: tasks waiting in the broker, live compile
workers, builds by state, failures and compile durations.

One reading for two readers, so they never disagree: ``/metrics`` (the
Prometheus families ``farm_target_*`` and ``farm_queue_depth``) and the
dashboard's workers table. Builds and their durations live in SQL; queue
depths in the broker, read with one pipelined LLEN per queue.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from farm.core.net import is_redis_url
from farm.core.target import Target, TargetError
from registry import service
from registry.dispatch import TRACE_QUEUE

log = logging.getLogger(__name__)


class QueueDepths:
    """Messages waiting per queue on a Redis broker. One client, kept and
    reused; short timeouts, so a broker outage costs a scrape or a page one
    second, not a hang."""

    def __init__(self, broker_url: str) -> None:
        self.broker_url = broker_url
        self._redis: Any = None

    @property
    def readable(self) -> bool:
        """False for brokers with no cheap LLEN (the embedded SQLite one)."""
        return is_redis_url(self.broker_url)

    def read(self, names: Iterable[str]) -> dict[str, int]:
        """LLEN of each queue; raises when the broker cannot be read."""
        if self._redis is None:
            import redis

            self._redis = redis.Redis.from_url(
                self.broker_url, socket_timeout=1.0, socket_connect_timeout=1.0
            )
        names = sorted(set(names))
        pipe = self._redis.pipeline(transaction=False)
        for name in names:
            pipe.llen(name)
        return {name: int(n) for name, n in zip(names, pipe.execute(), strict=True)}


@dataclass(frozen=True)
class TargetWork:
    """One target's row of the workers table."""

    target: str
    queue: str | None  # its compile queue (None: not a parsable target)
    workers: int  # live compile workers serving it
    queued: int | None  # compile tasks waiting in the broker (None: not read)
    builds: Mapping[str, int]  # builds by state
    timed: int  # finished builds with a compile duration
    compile_s: float  # their summed compile seconds

    @property
    def failed(self) -> int:
        return self.builds.get("failed", 0)

    @property
    def mean_compile_s(self) -> float | None:
        return self.compile_s / self.timed if self.timed else None


@dataclass(frozen=True)
class WorkerTable:
    targets: list[TargetWork]
    trace_queued: int | None  # trace tasks waiting (None: not read)
    broker_error: str | None  # why depths are missing, when they are


def _queue_of(target: str) -> str | None:
    try:
        return Target.parse(target).queue
    except TargetError:
        return None


def queue_names(
    build_rows: Iterable[Mapping[str, Any]], workers: Iterable[Mapping[str, Any]]
) -> dict[str, str]:
    """Compile queue -> target, for every target that has builds or a live
    worker: a target whose workers are all gone is the one whose backlog
    grows, so its queue is read too."""
    names: dict[str, str] = {}
    for r in build_rows:
        q = _queue_of(r["target"])
        if q:
            names[q] = r["target"]
    for w in workers:
        if w["kind"] == "compile" and w.get("queue") and w.get("target"):
            names[w["queue"]] = w["target"]
    return names


def worker_table(
    build_rows: Iterable[Mapping[str, Any]],
    workers: Iterable[Mapping[str, Any]],
    depths: Mapping[str, int] | None,
    *,
    broker_error: str | None = None,
) -> WorkerTable:
    """The table from its sources: ``build_rows`` as
    ``service.build_stats_by_target`` returns them, the live workers, and the
    queue depths (None when the broker was not read)."""
    build_rows, workers = list(build_rows), list(workers)
    by_target: dict[str, dict[str, Any]] = {}

    def row(target: str) -> dict[str, Any]:
        return by_target.setdefault(
            target, {"builds": {}, "timed": 0, "compile_s": 0.0, "workers": 0}
        )

    for r in build_rows:
        t = row(r["target"])
        t["builds"][r["state"]] = t["builds"].get(r["state"], 0) + int(r["builds"])
        t["timed"] += int(r["timed"])
        t["compile_s"] += float(r["compile_s"])
    for w in workers:
        if w["kind"] == "compile" and w.get("target"):
            row(w["target"])["workers"] += 1
    targets = []
    for target, t in sorted(by_target.items()):
        queue = _queue_of(target)
        queued = None if depths is None or queue is None else depths.get(queue, 0)
        targets.append(
            TargetWork(
                target=target,
                queue=queue,
                workers=t["workers"],
                queued=queued,
                builds=t["builds"],
                timed=t["timed"],
                compile_s=t["compile_s"],
            )
        )
    trace = None if depths is None else depths.get(TRACE_QUEUE, 0)
    return WorkerTable(targets=targets, trace_queued=trace, broker_error=broker_error)


def read_worker_table(db: Any, queues: QueueDepths, *, max_age_s: float) -> WorkerTable:
    """Read the sources and build the table; a broker that cannot be read
    leaves the depths out and says why (the database's errors propagate)."""
    rows = service.build_stats_by_target(db)
    workers = service.live_workers(db, max_age_s=max_age_s)
    depths: dict[str, int] | None = None
    error = None
    if not queues.readable:
        error = "the broker is not Redis: queue depths are not read"
    else:
        try:
            depths = queues.read([TRACE_QUEUE, *queue_names(rows, workers)])
        except Exception as exc:  # the page and the scrape still answer without it
            log.warning("worker table: broker unreadable: %s", exc)
            error = f"the broker cannot be read: {exc}"
    return worker_table(rows, workers, depths, broker_error=error)
