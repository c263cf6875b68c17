"""Memory a build takes, as a test's sandboxed child: a compile through
Inductor's parallel pool of worker processes (each a Python with torch),
and a hostile model filling the sandbox's /tmp, memory no process maps."""

from __future__ import annotations

import os
import time
from typing import Any


def pool_compile(payload: dict[str, Any]) -> dict[str, Any]:
    """A small model compiled with Inductor's subprocess pool running (on a
    CPU-only torch the pool starts only with Triton present; started here as
    Inductor starts it on a GPU host)."""
    import torch
    from torch._inductor import config
    from torch._inductor.async_compile import AsyncCompile

    AsyncCompile.warm_pool()
    AsyncCompile.wakeup()
    deadline = time.monotonic() + float(payload.get("pool_timeout_s", 600))
    while not AsyncCompile.use_process_pool():
        if time.monotonic() > deadline:
            raise RuntimeError("Inductor's compile pool never became ready")
        time.sleep(0.2)
    import psutil

    workers = len(psutil.Process().children(recursive=True))
    m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    x = torch.randn(4, 64)
    ok = torch.allclose(torch.compile(m)(x), m(x), atol=1e-5)
    return {"compile_threads": config.compile_threads, "pool_processes": workers, "ok": ok}


def tmpfs_burst(payload: dict[str, Any]) -> None:
    """Writes 64 MB files into /tmp until it is full, then holds them."""
    chunk = b"\x01" * (64 << 20)
    i = 0
    while True:
        try:
            with open(f"/tmp/fill-{i}", "wb") as f:
                f.write(chunk)
            i += 1
        except OSError:
            while True:  # full: keep it, as a hostile model would
                time.sleep(1)


def hog(payload: dict[str, Any]) -> None:
    """Allocates (and touches) until stopped."""
    keep = []
    while True:
        keep.append(bytearray(os.urandom(1) * (32 << 20)))
