"""Watching a block of code for compilation: C++ builds, Triton compiles,
autotune benchmarks, Inductor cache misses and compiled files appearing in the
cache dir. The verifier's child (farm.build.verify) runs the artifact's load and
first call under it: an artifact whose first call still compiles is not finished.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any

# Files whose appearance in the Inductor/Triton cache means something was
# compiled or unpacked there (informational: loading a CUDA artifact unpacks
# its bundled cubins into the cache without compiling anything).
_COMPILED_SUFFIXES = (".so", ".o", ".cubin", ".ptx", ".hsaco", ".llir", ".ttgir", ".cpp")
# A GPU kernel's binary, as Triton writes it into its cache.
_KERNEL_BINARIES = (".cubin", ".hsaco", ".spv", ".zebin")
# Events that mean code was generated or compiled...
COMPILE_EVENTS = ("cpp_builds", "triton_compiles", "fxgraph_cache_miss",
                  "generated_module_cache_miss")
# ...and events that mean kernels were benchmarked to pick a config: on the H200
# (torch 2.11) even a default-mode artifact's first call ran the autotuner of
# every multi-config Triton kernel; the winners are not in the artifact.
AUTOTUNE_EVENTS = ("autotune_benchmarks", "select_algorithm_autotune", "coordesc_tuning_bench")


def compiled_in(events: Mapping[str, int]) -> bool:
    return any(events.get(k) for k in COMPILE_EVENTS)


def autotuned_in(events: Mapping[str, int]) -> bool:
    return any(events.get(k) for k in AUTOTUNE_EVENTS) or any(
        k.startswith("benchmarking.") for k in events
    )


class CompileWatch:
    """Counts compilation while a block runs: C++ builds, Triton kernel
    compiles and autotune benchmarks (by wrapping inductor's entry points),
    Inductor cache misses (``torch._dynamo.utils.counters``) and compiled files
    appearing in the cache dir. Each hook is optional: a torch that lacks one
    just does not report it."""

    def __init__(self, cache_dir: str | None = None) -> None:
        self.cache_dir = cache_dir
        self.counts: dict[str, int] = {
            "cpp_builds": 0, "triton_compiles": 0, "triton_cache_loads": 0,
            "autotune_benchmarks": 0,
        }
        self._restore: list[Callable[[], None]] = []

    def install(self) -> None:
        self._wrap("torch._inductor.cpp_builder", "CppBuilder", "build", "cpp_builds")
        self._wrap_triton_compile()
        self._wrap("torch._inductor.runtime.triton_heuristics", "CachingAutotuner",
                   "benchmark_all_configs", "autotune_benchmarks")

    def uninstall(self) -> None:
        for undo in reversed(self._restore):
            undo()
        self._restore.clear()

    def _wrap(self, module: str, cls_name: str, method: str, key: str) -> None:
        import importlib

        try:
            cls = getattr(importlib.import_module(module), cls_name)
            orig = getattr(cls, method)
        except Exception:  # not in this torch, or no triton
            return
        counts = self.counts

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            counts[key] += 1
            return orig(*args, **kwargs)

        setattr(cls, method, wrapper)
        self._restore.append(lambda: setattr(cls, method, orig))

    def _wrap_triton_compile(self) -> None:
        """Counts a kernel config's ``triton.compile`` as ``triton_compiles``
        only when it wrote a binary into Triton's cache; one answered from
        that cache (the binaries an artifact ships, unpacked there before the
        load: farm.node.bundle) is a ``triton_cache_loads``, tens of
        milliseconds, nothing compiled. Inductor asks for it where torch's
        own bundle has no static launcher for the kernel (on torch 2.11, one
        whose name passed Triton's 150 characters: farm.build.kernel_names)."""
        try:
            from torch._inductor.runtime import triton_heuristics
            from torch._inductor.runtime.cache_dir_utils import triton_cache_dir

            cls = triton_heuristics.CachingAutotuner
            orig = cls._precompile_config
        except Exception:  # not in this torch, or no triton
            return
        counts = self.counts

        def binaries(autotuner: Any) -> int:
            root = triton_cache_dir(int(autotuner.triton_meta.get("device", 0) or 0))
            return sum(1 for _, _, files in os.walk(root) for f in files
                       if f.endswith(_KERNEL_BINARIES))

        def wrapper(autotuner: Any, *args: Any, **kwargs: Any) -> Any:
            before = binaries(autotuner)
            try:
                return orig(autotuner, *args, **kwargs)
            finally:
                key = "triton_compiles" if binaries(autotuner) > before else "triton_cache_loads"
                counts[key] += 1

        cls._precompile_config = wrapper
        self._restore.append(lambda: setattr(cls, "_precompile_config", orig))

    def _files(self) -> set[str]:
        out: set[str] = set()
        if not self.cache_dir:
            return out
        for root, _, files in os.walk(self.cache_dir):
            out.update(os.path.join(root, f) for f in files if f.endswith(_COMPILED_SUFFIXES))
        return out

    @staticmethod
    def _counters() -> dict[str, int]:
        try:
            from torch._dynamo.utils import counters
        except Exception:
            return {}
        out = {}
        for k, v in counters.get("inductor", {}).items():
            if "miss" in k or "autotune" in k or k.startswith("benchmarking"):
                out[k] = int(v)
        return out

    @contextlib.contextmanager
    def phase(self) -> Iterator[dict[str, int]]:
        """Yields a dict filled, when the block ends, with what compiled in it."""
        before = dict(self.counts)
        c0 = self._counters()
        f0 = self._files()
        events: dict[str, int] = {}
        try:
            yield events
        finally:
            for k, v in self.counts.items():
                if v - before[k]:
                    events[k] = v - before[k]
            for k, v in self._counters().items():
                if v - c0.get(k, 0):
                    events[k] = v - c0.get(k, 0)
            new_files = len(self._files() - f0)
            if new_files:
                events["new_compiled_files"] = new_files
