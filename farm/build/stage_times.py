"""Where a build's seconds went: the stages a build child times, torch's own
compile phases, and the worker's checks on what the child reports.

The child (``farm.build.sandbox.child_main``) returns ``snapshot()`` beside its
result; the compile step fills it (``stage``/``add``, and ``torch_phases``
around torch's compile). The worker shows them in the build's log and on the
job page, and believes none of it (docs/security.md): ``from_child`` keeps
only known stage names with finite, non-negative seconds no larger than the
child's wall time the worker measured itself, so a hostile child can at most
misreport its own timings, never inject text or numbers out of range.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

# The stages a build child reports, in the order a build runs them (the log
# and the job page print them so). Exclusive: they add up to at most the
# child's wall time; "other" is what none of them covers.
CHILD_START = "child start"  # from the worker's request to the child's first line
IMPORTS = "imports"  # torch, Dynamo, Inductor: ~0 in a child forked warm
GRAPH_CHECK = "graph check"  # the trace that checks the fingerprint (farm.build.steps)
MODEL = "model build"  # the model built weight-free for the compile
TOOLCHAIN = "toolchain checks"  # the CPU's ISA, the C++ compiler's identity
# per_block on CPU: the model run once as it is, and its distinct blocks compiled in
# forked processes side by side (farm.build.blocks.precompile_in_parallel)
BLOCKS_IN_PARALLEL = "blocks compiled in parallel"
DYNAMO = "Dynamo"  # bytecode tracing, guards
AOT_AUTOGRAD = "AOTAutograd"  # functionalisation, joint graph, partitioning, its cache
LOWERING = "Inductor lowering"  # FX passes, lowering, scheduling
CODEGEN = "Inductor codegen"  # kernel and wrapper source
KERNEL_COMPILE = "C++/Triton compile"  # waiting for kernel builds, loading them
SAVE = "save"  # serialising the artifact, bundling its kernels
WARM_UP = "warm-up"  # one call on the target: kernel loads, autotuning
AOTI_EXPORT = "AOTI export"  # torch.export of the model
AOTI_LOWERING = "AOTI lowering"  # Inductor's passes, lowering and scheduling of that graph
AOTI_CODEGEN = "AOTI codegen"  # its kernels' and wrapper's source (and CUDA kernels' builds)
AOTI_CXX = "AOTI C++ compile"  # the wrapper and kernels compiled and linked into the package
AOTI = "AOTI package"  # the rest: AOTAutograd's export, the package cache, writing the package
CHILD_EXIT = "child exit"  # from its result written to the worker seeing it end
OTHER = "other"

CHILD_STAGES = (
    CHILD_START,
    IMPORTS,
    GRAPH_CHECK,
    MODEL,
    TOOLCHAIN,
    BLOCKS_IN_PARALLEL,
    DYNAMO,
    AOT_AUTOGRAD,
    LOWERING,
    CODEGEN,
    KERNEL_COMPILE,
    SAVE,
    WARM_UP,
    AOTI_EXPORT,
    AOTI_LOWERING,
    AOTI_CODEGEN,
    AOTI_CXX,
    AOTI,
    CHILD_EXIT,
)
AOTI_STAGES = (AOTI_EXPORT, AOTI_LOWERING, AOTI_CODEGEN, AOTI_CXX, AOTI)
TORCH_STAGES = (DYNAMO, AOT_AUTOGRAD, LOWERING, CODEGEN, KERNEL_COMPILE)

_stages: dict[str, float] = {}


def reset() -> None:
    """Forget what an earlier call in this process timed (a forked child
    starts from the zygote's empty record; a test may run several)."""
    _stages.clear()


def add(name: str, seconds: float) -> None:
    _stages[name] = _stages.get(name, 0.0) + max(0.0, float(seconds))


@contextlib.contextmanager
def stage(name: str) -> Iterator[None]:
    t0 = time.perf_counter()
    try:
        yield
    finally:
        add(name, time.perf_counter() - t0)


def snapshot() -> dict[str, float]:
    return {k: round(v, 3) for k, v in _stages.items()}


def _metrics() -> dict[str, float]:
    from torch._dynamo.utils import compilation_time_metrics

    return {k: float(sum(v)) for k, v in compilation_time_metrics.items()}


@contextlib.contextmanager
def _split_by(split: Callable[[Mapping[str, float]], dict[str, float]]) -> Iterator[None]:
    """Add the stages ``split`` makes of what torch's timers measured inside
    the block."""
    before = _metrics()
    try:
        yield
    finally:
        after = _metrics()
        for name, seconds in split({k: v - before.get(k, 0.0) for k, v in after.items()}).items():
            add(name, seconds)


def torch_phases() -> contextlib.AbstractContextManager[None]:
    """Split the torch compile inside the block into ``TORCH_STAGES`` from
    torch's own timers (``dynamo_timed``), which nest: each stage here is
    what its timer measured minus the timers inside it. Whatever the block
    spent outside torch's timers (saving, warm-up) is the caller's to time."""
    return _split_by(split_phases)


def split_phases(m: Mapping[str, float]) -> dict[str, float]:
    """Exclusive stages from one compile's ``compilation_time_metrics`` sums.

    - the whole capture: ``fullgraph_capture`` (aot_compile: Dynamo, with the
      backend inside);
    - the backend: ``create_aot_dispatcher_function`` (AOTAutograd, with
      Inductor inside), and on an AOTAutograd cache hit
      ``AOTAutogradCache.inductor_load`` (loading what Inductor compiled);
    - Inductor: its forward and backward compilers, or that cache load;
    - codegen: ``GraphLowering.codegen`` (kernel and wrapper source);
    - kernel builds: what the compile waited for them, loading the wrapper
      module (``PyCodeCache.load_by_key_path``, which waits for the kernel
      pool, ``async_compile.wait``). ``compile_file`` is not used: the pool's
      threads add it up in parallel, past the wall time;
    - lowering: the rest of Inductor (passes, lowering, scheduling).
    """

    def g(*keys: str) -> float:
        return sum(m.get(k, 0.0) for k in keys)

    backend = g("create_aot_dispatcher_function", "AOTAutogradCache.inductor_load")
    capture = max(g("fullgraph_capture"), g("bytecode_tracing") + backend)
    inductor = min(
        backend,
        g(
            "compile_fx.<locals>.fw_compiler_base",
            "compile_fx.<locals>.bw_compiler",
            "AOTAutogradCache.inductor_load",
        ),
    )
    codegen = min(g("GraphLowering.codegen"), inductor)
    kernels = min(
        max(g("PyCodeCache.load_by_key_path"), g("async_compile.wait")), inductor - codegen
    )
    return {
        DYNAMO: max(0.0, capture - backend),
        AOT_AUTOGRAD: max(0.0, backend - inductor),
        LOWERING: max(0.0, inductor - codegen - kernels),
        CODEGEN: max(0.0, codegen),
        KERNEL_COMPILE: max(0.0, kernels),
    }


@contextlib.contextmanager
def aoti_package() -> Iterator[None]:
    """Time an AOTI package's build: what the block's own AOTI stages
    (``AOTI_EXPORT``, ``aoti_phases``) do not cover goes to ``AOTI``, so
    the five add up to the block's wall time."""
    parts = AOTI_STAGES[:-1]
    before = sum(_stages.get(k, 0.0) for k in parts)
    t0 = time.perf_counter()
    try:
        yield
    finally:
        covered = sum(_stages.get(k, 0.0) for k in parts) - before
        add(AOTI, time.perf_counter() - t0 - covered)


def aoti_phases() -> contextlib.AbstractContextManager[None]:
    """Split AOTInductor's compile inside the block into lowering, codegen
    and the C++ compile, from torch's own timers (``split_aoti_phases``)."""
    return _split_by(split_aoti_phases)


def split_aoti_phases(m: Mapping[str, float]) -> dict[str, float]:
    """Exclusive stages from one AOTInductor compile's
    ``compilation_time_metrics`` sums: Inductor's forward compiler
    (``compile_fx.<locals>.fw_compiler_base``) holds ``GraphLowering.codegen``
    and, beside it, ``AotCodeCompiler.compile`` (the package's C++ compile
    and link); lowering is the rest of Inductor. A package from the farm's
    cache compiles nothing: all three are 0."""
    inductor = m.get("compile_fx.<locals>.fw_compiler_base", 0.0)
    cxx = min(m.get("AotCodeCompiler.compile", 0.0), inductor)
    codegen = min(m.get("GraphLowering.codegen", 0.0), inductor - cxx)
    return {
        AOTI_LOWERING: max(0.0, inductor - cxx - codegen),
        AOTI_CODEGEN: max(0.0, codegen),
        AOTI_CXX: max(0.0, cxx),
    }


# --- the worker's side ------------------------------------------------------------

_MAX_STAGES = 32


def kept(reported: Any, names: Iterable[str], *, limit_s: float) -> dict[str, float]:
    """What the worker keeps of seconds a sandboxed process reported: the
    ``names`` it knows only, in their order, each a finite number of seconds
    in [0, ``limit_s``] (what the worker measured around them)."""
    out: dict[str, float] = {}
    if isinstance(reported, Mapping):
        for name in names:
            v = reported.get(name)
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                continue
            if math.isfinite(v) and 0.0 <= v <= limit_s + 1e-3:
                out[name] = round(float(v), 3)
    return out


def from_child(reported: Any, *, wall_s: float) -> dict[str, float]:
    """What the worker keeps of a child's stage times (``kept``, over
    ``CHILD_STAGES`` and the child's wall time), and ``other``: the child's
    wall time that no kept stage covers."""
    out = kept(reported, CHILD_STAGES, limit_s=wall_s)
    if len(out) > _MAX_STAGES:  # pragma: no cover - CHILD_STAGES is shorter
        out = dict(list(out.items())[:_MAX_STAGES])
    covered = sum(out.values())
    if out:
        out[OTHER] = round(max(0.0, wall_s - covered), 3)
    return out


def describe(stages: Mapping[str, float]) -> str:
    """One line for the build log: ``Dynamo 0.4 s, AOTAutograd 1.2 s, ...``."""
    return ", ".join(f"{k} {v:.1f} s" for k, v in stages.items())
