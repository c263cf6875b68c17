"""The steady-state timing loop the benches share: a few warm-up calls, then
the median of timed ones (``python bench/x.py`` puts this folder on the
path, as ``bench_farm`` is imported)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any


def median_s(call: Callable[[], Any], *, calls: int, warm_up: int,
             after: Callable[[], Any] | None = None) -> float:
    """Seconds of ``call()``: the median of ``calls`` timed calls after
    ``warm_up`` untimed ones; ``after`` runs untimed after each (a GPU's
    synchronize, to time only what the host spends until ``call`` returns)."""
    for _ in range(warm_up):
        call()
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        call()
        times.append(time.perf_counter() - t)
        if after is not None:
            after()
    return statistics.median(times)
