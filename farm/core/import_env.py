"""Environment variables a process reads when it imports torch, and those it
reads later: a process forked from one that already imported torch (the node
agent, a build zygote) keeps its parent's import-time values, so a request
whose import-time variables differ must run elsewhere."""

from __future__ import annotations

from collections.abc import Mapping

# Read when a module is imported (torch's, Inductor's, Triton's configs; the
# OpenMP/BLAS runtimes; the interpreter), and the C++ compiler Inductor's config
# takes from CC/CXX at import.
IMPORT_TIME_ENV = ("TORCH", "PYTORCH", "TRITON", "INDUCTOR", "MKL_", "KMP_", "OPENBLAS_",
                   "GOMP_", "OMP_", "LD_", "PYTHON", "MALLOC_")
# ...except these, read when used (cache dirs), or applied in the child.
LAZY_ENV = frozenset({"TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "TORCH_HOME",
                      "OMP_NUM_THREADS", "PYTHONPATH", "PYTHONUNBUFFERED",
                      "PYTHONSTARTUP", "PYTHONBREAKPOINT"})


def import_time_env(env: Mapping[str, str], *, extra: tuple[str, ...] = ()) -> dict[str, str]:
    """The part of ``env`` read at import (and ``extra`` names, exactly)."""
    return {k: v for k, v in env.items()
            if (k.startswith(IMPORT_TIME_ENV) and k not in LAZY_ENV) or k in extra}
