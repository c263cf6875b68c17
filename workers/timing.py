"""How long a task may run, in one place, from Settings.

Redis hands a delivered, unacknowledged message to another worker after its
visibility timeout. That must be longer than the longest a task may really
run, or a slow build would be delivered again while it runs (harmless, since
``begin_compile`` lets one worker own a claim, but a wasted worker each
time). The longest compile task: fetching and installing its code pack, the
compile, then a verification and an upload per artifact format, then the
wait for the database to take the result. Each part has its own limit, so
the sum is a real bound, not a guess.

The solo pool runs a task in the worker's main thread, where ``deadline``
bounds the parts that have no limit of their own (a code pack download, an
upload to the blob store): a SIGALRM raises ``DeadlineExceeded`` there,
which the tasks retry as any infrastructure error. Not a ``TimeoutError``:
urllib3 takes that for a socket timeout, and botocore retries it as one.
The alarm bounds what runs in the main thread: a code pack's pip install, a
blob store's HEAD, a file blob store's copy. S3 transfers run in
s3transfer's threads, which it cannot stop: there each request is bounded by
botocore (a 60 s read timeout, five attempts), and s3transfer reports the
request's own error once it ends. Celery's own task time limits
are not used: the solo and threads pools do not enforce them.
"""

from __future__ import annotations

import math
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

from farm.core.settings import Settings
from registry.entities import FORMATS

# How long a finished build waits for the database to take its artifacts.
FINISH_WAIT_S = 120.0
# Above the computed worst case: scheduling, a slow database, heartbeats.
MARGIN_S = 300.0


def compile_worst_case_s(s: Settings) -> float:
    n = len(FORMATS)  # one verification and one upload per format
    return (
        s.farm_code_fetch_timeout_s
        + s.build_timeout_s
        + n * (s.build_timeout_s + s.farm_upload_timeout_s)
        + FINISH_WAIT_S
    )


def trace_worst_case_s(s: Settings) -> float:
    return s.farm_code_fetch_timeout_s + s.trace_timeout_s


def visibility_timeout_s(s: Settings) -> int:
    """FARM_VISIBILITY_TIMEOUT_S when set, else the longest task's worst case
    plus a margin (one timeout serves every queue of the broker)."""
    if s.farm_visibility_timeout_s is not None:
        return s.farm_visibility_timeout_s
    return math.ceil(max(compile_worst_case_s(s), trace_worst_case_s(s)) + MARGIN_S)


def redis_transport_options(s: Settings) -> dict[str, float]:
    """kombu's Redis options: the visibility timeout, and with
    FARM_UNACKED_RESTORE_S how often idle workers look for messages past it
    (an interval and no throttle: that interval alone decides)."""
    options: dict[str, float] = {"visibility_timeout": visibility_timeout_s(s)}
    if s.farm_unacked_restore_s is not None:
        options["unacked_restore_interval"] = s.farm_unacked_restore_s
        options["unacked_restore_throttle"] = 1
    return options


class DeadlineExceeded(Exception):
    """A part of a task ran past its limit (``deadline``)."""


@contextmanager
def deadline(seconds: float, what: str) -> Iterator[None]:
    """Raise ``DeadlineExceeded`` in the block after ``seconds``. Only in the main
    thread (signals are delivered there); elsewhere (the threads pool) the
    block runs unbounded but for its own timeouts (botocore's socket ones)."""
    if seconds <= 0 or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum: int, frame: FrameType | None) -> None:
        raise DeadlineExceeded(
            f"{what} took longer than {seconds:g} s (its limit); the task is retried"
        )

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
