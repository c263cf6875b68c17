"""Which compiled C++ libraries a CPU build used, to ship them in its artifact.

A CPU ``aot_compile`` artifact holds its kernels as C++ source; a node loading
it compiles them again with g++ unless the libraries are already in its
Inductor cache (``farm.node.bundle``). Two kinds are recorded, each where
Inductor uses a library of the build's own cache dir:

- kernel libraries, at ``CppCodeCache._load_library``: aot_compile compiles
  them in worker processes and loads them when the graph first runs (the
  build's warm-up call), so these are exactly the libraries the artifact
  needs, not the whole cache dir (which the worker prefilled with other
  builds' kernels, ``farm.build.compile_cache``);
- Inductor's ISA probes, at ``VecISA._probe_load``: before its first kernel,
  every process test-compiles a small program per ISA feature (AVX-512 BF16,
  VNNI, AMX...) and dlopens it; with the libraries in place it only dlopens.
  Both together: a small MLP's load in a fresh process with an empty cache
  on 2 cores, 12.2 s without them, 3.0 s with them (bench/cpu_artifact_load.py).

Hook points that a torch release lacks are skipped: the node then compiles
what is missing, as it always could.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any


@contextlib.contextmanager
def record_loaded_kernels(cache: Path | None) -> Iterator[list[Path] | None]:
    """Yield a list that fills with the libraries under ``cache`` that
    Inductor loads or probes inside the block (None, and no hooks, with
    ``cache`` None). Outside the block the hooks are gone."""
    if cache is None:
        yield None
        return
    from torch._inductor import codecache, cpu_vec_isa

    root = cache.resolve()
    loaded: list[Path] = []

    def note(path: str) -> None:
        p = Path(path).resolve()
        if root in p.parents and p not in loaded:
            loaded.append(p)

    undo: list[Callable[[], None]] = []
    kernel_load = codecache.CppCodeCache.__dict__.get("_load_library")
    if isinstance(kernel_load, classmethod):
        def _load_library(klass: Any, path: str, key: str) -> Any:
            note(path)
            return kernel_load.__func__(klass, path, key)

        codecache.CppCodeCache._load_library = classmethod(_load_library)
        undo.append(lambda: setattr(codecache.CppCodeCache, "_load_library", kernel_load))
    probe = getattr(cpu_vec_isa.VecISA, "_probe_load", None)
    if callable(probe):
        def _probe_load(self: Any, output_path: str) -> Any:
            note(output_path)
            return probe(self, output_path)

        cpu_vec_isa.VecISA._probe_load = _probe_load
        undo.append(lambda: setattr(cpu_vec_isa.VecISA, "_probe_load", probe))
    try:
        yield loaded
    finally:
        for u in reversed(undo):
            u()
