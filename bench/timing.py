"""The steady-state timing loop the benches share: a few warm-up calls, then
the median of timed ones (``python bench/x.py`` puts this folder on the
path, as ``bench_farm`` is imported)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any


def median_s(call: Callable[[], Any], *, calls: int, warm_up: int) -> float:
    """Seconds of ``call()``: the median of ``calls`` timed calls after
    ``warm_up`` untimed ones."""
    for _ in range(warm_up):
        call()
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        call()
        times.append(time.perf_counter() - t)
    return statistics.median(times)
