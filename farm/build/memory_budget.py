"""How much memory a build child may use, and how many compile workers fit.

``BUILD_MEMORY_MB=0`` (the default) means half this machine's memory, at
least 8 GB: on a 16-core GPU host with 128 GB that is 64 GB, enough for any
model whose weights fit on the GPU, while two builds side by side still
leave the worker and the system their share. A fixed number sets it exactly.

Inductor's parallel compile pool starts one Python per worker, each with its
own copy of what it compiles; ``TORCHINDUCTOR_COMPILE_THREADS`` is sized so
the pool fits the limit (``MB_PER_COMPILE_WORKER`` each), capped by the cores.
"""

from __future__ import annotations

import os

import psutil

FLOOR_MB = 8192
# What one Inductor compile worker may take at its peak: its share of torch
# (about 120 MB of PSS each, measured on CPU for a small MLP, torch 2.13)
# and headroom for a large kernel's compiler.
MB_PER_COMPILE_WORKER = 512
SETTING = "BUILD_MEMORY_MB"


def machine_mb() -> int:
    return int(psutil.virtual_memory().total // 2**20)


def default_limit_mb(total_mb: int | None = None) -> int:
    """Half the machine's memory, at least ``FLOOR_MB``."""
    total = machine_mb() if total_mb is None else total_mb
    return max(FLOOR_MB, total // 2)


def build_limit_mb(configured: float | None = None) -> int:
    """The limit a build child runs under: ``configured`` (default: the
    ``BUILD_MEMORY_MB`` setting) when above 0, else ``default_limit_mb``."""
    if configured is None:
        from farm.core.settings import get_settings

        configured = float(get_settings().build_memory_mb)
    return int(configured) if configured > 0 else default_limit_mb()


def compile_threads(limit_mb: float, cores: int | None = None) -> int:
    """Inductor compile workers that fit ``limit_mb`` and this machine's cores."""
    n = len(os.sched_getaffinity(0)) if cores is None else cores
    return max(1, min(n, int(limit_mb // MB_PER_COMPILE_WORKER)))
