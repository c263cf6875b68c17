"""Node reports in one API process: counted at once, written to SQL in bulk.

``POST /v1/reports`` only validates a batch, counts it (Prometheus, per
model, target, kind and reason code) and hands it to ``ReportSink.put``; a
thread writes what has gathered every ``flush_s`` in one INSERT and then
gives the rows to the build-on-miss handler. So a fleet of 10,000 nodes
reporting every 10 s is one insert a second, not a thousand transactions,
and the resolve path never waits behind it. The cost: reports accepted in
the last ``flush_s`` are lost if the process is killed (they are telemetry;
the node's own work never depended on them). Reads that must see what was
just posted (``GET /v1/misses``) call ``flush`` first.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from prometheus_client import Counter

from registry.db import Database
from registry.service import reports as report_service

log = logging.getLogger(__name__)

MAX_PENDING = 200_000
MAX_ROWS_PER_INSERT = 5_000
# Distinct label sets counted before the rest go to "other": model names
# and targets come from the fleet, and a counter per value must stay bounded.
MAX_LABEL_SETS = 5_000


class ReportSink:
    def __init__(self, db: Database, *, counter: Counter, flush_s: float = 0.5,
                 on_stored: Callable[[Sequence[dict[str, Any]]], None] | None = None) -> None:
        self.db = db
        self.counter = counter
        self.flush_s = flush_s
        self.on_stored = on_stored
        self._pending: deque[dict[str, Any]] = deque()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._done = threading.Condition(self._lock)
        self._writing = 0
        self._thread: threading.Thread | None = None
        self._stopped = False
        self._labels: set[tuple[str, str, str, str]] = set()
        self.stored = 0
        self.dropped = 0

    def put(self, rows: Sequence[dict[str, Any]]) -> int:
        """Count and queue ``rows``; returns how many were taken (the rest:
        dropped, the queue being full because the database is behind)."""
        for r in rows:
            self._count(r)
        with self._lock:
            room = max(0, MAX_PENDING - len(self._pending))
            taken = list(rows[:room])
            self.dropped += len(rows) - len(taken)
            self._pending.extend(taken)
            if self._thread is None and not self._stopped:
                self._thread = threading.Thread(target=self._loop, name="farm-report-sink",
                                                daemon=True)
                self._thread.start()
        return len(taken)

    def _count(self, r: dict[str, Any]) -> None:
        labels = (r["model"], r["target"], r["kind"], r.get("code") or "")
        if labels not in self._labels:
            if len(self._labels) >= MAX_LABEL_SETS:
                labels = ("other", "other", r["kind"], "other")
            else:
                self._labels.add(labels)
        self.counter.labels(*labels).inc()

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until everything queued so far is written (or ``timeout``)."""
        import time

        deadline = time.monotonic() + timeout
        with self._done:
            while self._pending or self._writing:
                left = deadline - time.monotonic()
                if left <= 0 or self._thread is None:
                    return False
                self._wake.set()
                self._done.wait(min(left, 0.05))
        return True

    def stop(self) -> None:
        self.flush(5.0)
        with self._lock:
            self._stopped = True
        self._wake.set()

    def _loop(self) -> None:
        while True:
            self._wake.wait(self.flush_s)
            self._wake.clear()
            with self._lock:
                n = min(len(self._pending), MAX_ROWS_PER_INSERT)
                batch = [self._pending.popleft() for _ in range(n)]
                self._writing = n
                stopped = self._stopped
            if batch:
                self._write(batch)
            with self._done:
                self._writing = 0
                self._done.notify_all()
                if stopped and not self._pending:
                    return
                more = bool(self._pending)
            if more:
                self._wake.set()

    def _write(self, batch: list[dict[str, Any]]) -> None:
        try:
            report_service.store_reports(self.db, batch)
            self.stored += len(batch)
        except Exception as exc:  # the database is down: telemetry is dropped, not retried
            with self._lock:
                self.dropped += len(batch)
            log.warning("dropped %d node report(s): %s", len(batch), exc)
            return
        if self.on_stored is not None:
            try:
                self.on_stored(batch)
            except Exception:
                log.exception("build on miss failed for a batch of reports")

