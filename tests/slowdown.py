"""How much slower than the reference machine this run is, measured once at
the start of the session (``TORCH_FARM_TEST_SLOWDOWN``; not ``FARM_...``, a name
model code must never see), so that time limits in the tests scale with the
machine instead of assuming an idle one.

The workload is single-threaded pure Python (hashing and integer arithmetic),
so it measures the share of one core a test process gets: on 2 cores with
another CPU-heavy job beside the suite it reads about 1.5-2. The controller
measures it (xdist workers inherit the variable); a value set by hand wins.
"""

from __future__ import annotations

import hashlib
import os
import statistics
import time

ENV = "TORCH_FARM_TEST_SLOWDOWN"
# The median workload time on an idle core of the 2-core CI machine (s).
REFERENCE_S = 0.11


def _workload() -> float:
    t0 = time.perf_counter()
    h = b"farm"
    for _ in range(200_000):
        h = hashlib.sha256(h).digest()
    s = 0
    for i in range(1_000_000):
        s += i * i % 7
    return time.perf_counter() - t0


def measure() -> float:
    """Median of three runs over the reference, never below 1."""
    return max(1.0, statistics.median(_workload() for _ in range(3)) / REFERENCE_S)


def factor() -> float:
    """The session's slowdown (measured on first use if nobody set it)."""
    raw = os.environ.get(ENV)
    if raw is None:
        raw = f"{measure():.2f}"
        os.environ[ENV] = raw
    try:
        return max(1.0, float(raw))
    except ValueError as e:
        raise ValueError(f"{ENV}={raw!r} is not a number (e.g. 1.5), or unset it") from e


def scaled(seconds: float) -> int:
    """``seconds`` on the reference machine, in whole seconds on this one."""
    return round(seconds * factor())
