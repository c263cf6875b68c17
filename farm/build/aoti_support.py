"""What the AOTInductor build (farm.build.aoti_compile.compile_aoti) stands on: the
wrapper that makes a free function exportable, the compiler and the -march it
records, and a reproducible Inductor cache directory per package
(``farm.build.aoti_cache`` names it).

Split out of farm.build.compile; the bodies are as they were.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from torch import nn

# A portable -march per inductor ISA: code for the target ISA, not for the
# exact CPU model of the build host (-march=native would let gcc use, say,
# AVX-512 instructions in an "avx2" package and SIGILL on other AVX2 hosts).
PORTABLE_MARCH = {"avx2": "x86-64-v3", "avx512": "x86-64-v4"}


class _FunctionModule(nn.Module):
    """``torch.export`` exports modules: wrap a free function in one."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)


def cxx_identity() -> str:
    """The compiler Inductor runs in this process, as artifacts record it."""
    from farm.build.toolchain import compiler_identity, inductor_compiler

    try:
        return compiler_identity(inductor_compiler())
    except Exception as exc:  # no compiler at all: a CUDA aot_compile build needs none
        return f"none ({type(exc).__name__})"


def portable_march(isa: str) -> str | None:
    head = isa.split()[0] if isa else ""
    return PORTABLE_MARCH.get(head)


@contextlib.contextmanager
def reproducible_cache_dir(key: str) -> Iterator[Path]:
    """An empty Inductor cache at a path fixed by ``key``, for this block.

    AOTI packages hold the cache path (in debug info, and in "Compile cmd"
    comments that a warm cache appends to the sources), so the same package
    key (``farm.build.aoti_cache.package_key``) in a fresh cache at the same
    path gives the same bytes. A lock file makes
    concurrent builds of the same key on one host take turns.
    """
    from filelock import FileLock
    from torch._inductor.utils import clear_caches

    base = Path(tempfile.gettempdir()) / "torch-farm-aoti"
    base.mkdir(parents=True, exist_ok=True)
    d = base / key
    with FileLock(str(base / f"{key}.lock")):
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir()
        old = {k: os.environ.get(k) for k in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(d)
        os.environ["TRITON_CACHE_DIR"] = str(d / "triton")
        clear_caches()
        try:
            yield d
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
            clear_caches()
            shutil.rmtree(d, ignore_errors=True)
