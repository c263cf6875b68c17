"""Node reports: what this node did with the farm's answers, sent in the background.

Every miss, guard failure, JIT fallback and load is a ``Report``; ``Reporter.add``
puts it on a bounded queue and returns at once. A daemon thread sends the
queue to ``POST /v1/reports`` in batches, every ``interval_s`` seconds or as
soon as a batch fills. Nothing here ever waits on the network in the caller's
thread, and nothing here raises: when the farm cannot be reached, or the queue
is full, reports are dropped and counted (``dropped``), since a node's work
matters more than its telemetry. One try per batch: a farm that is down does
not get a backlog replayed at it when it comes back.
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from typing import Any

import httpx

log = logging.getLogger(__name__)

KINDS = ("miss", "guard_failure", "fallback", "load")
MAX_QUEUE = 10_000
MAX_BATCH = 500
# Seconds a send may take; the thread is the only one that waits for it.
SEND_TIMEOUT_S = 5.0
# At exit: how long the last batch may hold the process up.
EXIT_FLUSH_S = 1.0


def node_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


@dataclass(frozen=True)
class Report:
    """One event, as ``POST /v1/reports`` takes it (field for field)."""

    kind: str
    model: str
    inputs: list[str]
    grad_mode: str
    target: str
    ref: str | None = None
    version: str | None = None
    format: str | None = None
    digest: str | None = None
    code: str | None = None
    reason: str | None = None
    seconds: float | None = None
    at: str = field(default_factory=lambda: datetime.now(timezone.utc).isoformat())

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"report kind {self.kind!r} is not one of {', '.join(KINDS)}")

    def to_json(self) -> dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if v is not None}
        if self.reason is not None:
            out["reason"] = self.reason[:2000]
        return out


class Reporter:
    """A bounded queue of reports and the daemon thread that sends them.

    ``http`` is the client's ``httpx.Client`` (its base URL and token); the
    thread starts on the first ``add``.
    """

    def __init__(self, http: httpx.Client, *, interval_s: float = 5.0,
                 max_queue: int = MAX_QUEUE, max_batch: int = MAX_BATCH,
                 node: str | None = None) -> None:
        self._http = http
        self.interval_s = max(0.05, float(interval_s))
        self.max_batch = max_batch
        self.node = node or node_id()
        self._queue: deque[Report] = deque()
        self._max_queue = max_queue
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._idle = threading.Condition(self._lock)
        self._sending = 0
        self._thread: threading.Thread | None = None
        self._closed = False
        self.sent = 0
        self.dropped = 0

    def add(self, report: Report) -> None:
        """Queue ``report``; never blocks and never raises."""
        with self._lock:
            if self._closed:
                return
            if len(self._queue) >= self._max_queue:
                self.dropped += 1  # the newest is dropped: the queue's are as telling
                return
            self._queue.append(report)
            full = len(self._queue) >= self.max_batch
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="farm-reports",
                                                daemon=True)
                self._thread.start()
                atexit.register(self.close)
        if full:
            self._wake.set()

    def pending(self) -> int:
        with self._lock:
            return len(self._queue) + self._sending

    def flush(self, timeout: float = 10.0) -> bool:
        """Ask the thread to send now and wait until the queue is empty (or
        ``timeout``); True when everything queued was sent or dropped."""
        deadline = time.monotonic() + timeout
        self._wake.set()
        with self._idle:
            while self._queue or self._sending:
                left = deadline - time.monotonic()
                if left <= 0 or self._thread is None:
                    return False
                self._wake.set()
                self._idle.wait(min(left, 0.1))
        return True

    def close(self) -> None:
        """Send what is queued (for at most ``EXIT_FLUSH_S``), then stop taking reports."""
        if self._thread is not None and not self._closed:
            self.flush(EXIT_FLUSH_S)
        with self._lock:
            self._closed = True
        self._wake.set()

    def _take(self) -> list[Report]:
        with self._lock:
            n = min(len(self._queue), self.max_batch)
            batch = [self._queue.popleft() for _ in range(n)]
            self._sending = n
            return batch

    def _loop(self) -> None:
        while True:
            self._wake.wait(self.interval_s)
            self._wake.clear()
            while True:
                batch = self._take()
                if not batch:
                    break
                self._send(batch)
                with self._idle:
                    self._sending = 0
                    self._idle.notify_all()
            with self._lock:
                if self._closed and not self._queue:
                    return

    def _send(self, batch: list[Report]) -> None:
        try:
            r = self._http.post("/v1/reports", json={
                "node": self.node, "reports": [b.to_json() for b in batch]},
                timeout=SEND_TIMEOUT_S)
            if r.status_code >= 400:
                raise httpx.HTTPStatusError(f"HTTP {r.status_code}: {r.text[:200]}",
                                            request=r.request, response=r)
            self.sent += len(batch)
        except Exception as exc:  # telemetry: dropped, never the node's problem
            with self._lock:
                self.dropped += len(batch)
            log.debug("torch-farm: dropped %d report(s): %s", len(batch), exc)
