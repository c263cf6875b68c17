"""Which stored artifacts a node can load, best first, and why the others cannot.

``resolve`` is a pure function of the candidates and the facts the node states
about itself: no database, no torch import, no clock. The API calls it on the
rows of one model version; tests call it on plain records.

Rules, checked in this order; a candidate is rejected with the FIRST rule it
breaks (``Rejection.code`` names the rule, ``Rejection.reason`` is one of the
``MSG_*`` format strings below, filled in):

 1. ``format``      the artifact's format is known and, when ``formats`` is given,
                    among them (the reason then adds why its build has none of
                    the requested formats, when the build recorded it).
 2. ``unverified``  the build worker loaded it in a fresh process and it matched
                    eager (``verified``).
 3. ``device``      it was built for the device the node asks for. torch itself
                    refuses a cuda artifact where cuda is not available; a cpu
                    artifact would run a cuda node's model on its CPU, which is
                    not what that node asked for.

    torch's own ``SystemInfo.check_compatibility`` (torch/_dynamo/package.py;
    the same rules in 2.11, 2.13 and 2.14.1). torch runs it from two loaders
    with the receiver swapped: ``load_compiled_function`` as
    ``current.check_compatibility(artifact)``, the precompile cache as
    ``artifact.check_compatibility(current)``. Where torch exempts the
    ``other`` side's missing value, which side that is depends on the loader,
    so the resolver compares both ways and accepts nothing either refuses:

 4. ``python``      Python version string equal (``platform.python_version()``,
                    so 3.11.7 and 3.11.9 differ).
 5. ``torch``       torch version string equal, local suffix included
                    (2.11.0+cu130 and 2.11.0+cu128 differ).
 6. ``cuda``        cuda artifacts: CUDA toolkit (``torch.version.cuda``) equal.
 7. ``triton``      cuda artifacts: Triton major.minor equal; a side without
                    Triton (torch's (0, 0)) equals only another without.
 8. ``gpu``         cuda artifacts: GPU name equal (a cuda Target always has one).

    Stricter than torch, where it is silently wrong or late:

 9. ``capability``  cuda artifacts: compute capability equal when both sides
                    know it (torch compares the name only).
10. ``isa``         cpu artifacts: CPU vector ISA equal, and known on both sides.
                    Released torch (2.11 to 2.14.1) does not check it; generated
                    code bakes it in, and a mismatch gave wrong numbers (AVX-512
                    code on an AVX2 node) or a crash (the reverse). An artifact of
                    another device that records an ISA (CPU kernels inside it) is
                    held to it too, as torch's pending ``cpu_codegen_target`` check
                    does for mixed graphs.
11. ``threads``     an artifact that records a thread count needs a node that
                    runs exactly that many (it is guarded and baked into CPU code
                    as ``num_threads(N)``). One that records none is accepted:
                    nothing to compare, and a mismatch fails a guard loudly.
11b. ``libstdcxx``  an artifact whose shared library needs libstdc++ symbol
                    versions (``libstdcxx_needs``: GLIBCXX_*, CXXABI_*; AOTI
                    packages record them) needs a node whose libstdc++ provides
                    every one (``libstdcxx``, reported by the node from its own
                    libstdc++'s ELF version definitions); the dynamic loader
                    would refuse it (``version `GLIBCXX_3.4.32' not found``). A
                    node that reports nothing is not held to it (older nodes).

    What the artifact is for:

12. ``grad_mode``   grad mode equal: guards pin it.
12b. ``layout``     an artifact built for a tensor-parallel layout
                    (``options.parallel``) needs a node that states the same world
                    size and mesh (``layout``; its rank may be any one of the
                    mesh's: the build ran with ``compile_on_one_rank``, so the
                    graph holds no rank). A node that states a layout gets no
                    single-process artifact, and one that states none gets no
                    parallel one: either would run with the wrong collectives.
13. ``options``     when ``options`` is given, mode, backend, guard filter and
                    disable_guard_check all equal. When it is None, any options
                    that compute the same function are accepted (see the
                    order), and none that change what a call means
                    (``farm.core.specs.unasked_options``: disable_guard_check,
                    CUDA max-autotune): options only when asked.
14. ``inputs``      the artifact's input specs cover the requested ones
                    (``farm.core.specs.inputs_cover``): same count, dtypes and ranks,
                    and every requested dim, static or a range, inside the
                    artifact's (a dynamic range serves every shape inside it).

Preference among the accepted, best first (``Resolution.accepted``):

 1. finished before unfinished: an artifact whose first call still compiles
    (``first_call_compiles``) costs the node seconds on the fleet.
 2. format, per device (``FORMAT_PREFERENCE``): on cpu ``aoti`` before
    ``aot_compile``, because a CPU ``aot_compile`` artifact holds C++ source that
    is recompiled at load (as slow as a JIT compile cold, and it needs a
    compiler on the node); on cuda too, because loading an ``aot_compile``
    artifact imports dynamo and Inductor (2-7 s of a node's cold start, measured
    on the H200) where an AOTI package loads its kernels from a shared library.
 3. options, which only differ when the request names none: the default
    ``CompileOptions()`` first, then by ``COMPILE_MODES`` and ``GUARD_FILTERS``
    order. A caller that asks for nothing gets the default semantics when such
    an artifact exists; ``max-autotune`` brings CUDA graphs, whose outputs are
    overwritten by the next call.
 4. specificity: exact static shapes first, then dynamic ranges by how much
    they serve (fewer unbounded dims, then fewer concrete shapes).
 5. newest ``created_at`` first (unknown last).
 6. lower ``id`` first, so the order is total and deterministic.

``Resolution.rejected`` is ordered by artifact id.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

from farm.core.elf import libstdcxx_versions, missing_versions
from farm.core.inputs import Dim, TensorSpec, format_inputs, inputs_cover
from farm.core.specs import (
    BACKENDS,
    COMPILE_MODES,
    GUARD_FILTERS,
    CompileOptions,
    GradMode,
    MeshLayout,
    unasked_options,
)
from farm.core.target import Target
from registry.entities import FORMATS, ArtifactRecord

# Rejection codes, in the order the rules run.
FORMAT = "format"
UNVERIFIED = "unverified"
DEVICE = "device"
PYTHON = "python"
TORCH = "torch"
CUDA = "cuda"
TRITON = "triton"
GPU = "gpu"
CAPABILITY = "capability"
ISA = "isa"
THREADS = "threads"
LIBSTDCXX = "libstdcxx"
GRAD_MODE = "grad_mode"
LAYOUT = "layout"
OPTIONS = "options"
INPUTS = "inputs"
CODES: tuple[str, ...] = (
    FORMAT,
    UNVERIFIED,
    DEVICE,
    PYTHON,
    TORCH,
    CUDA,
    TRITON,
    GPU,
    CAPABILITY,
    ISA,
    THREADS,
    LIBSTDCXX,
    GRAD_MODE,
    LAYOUT,
    OPTIONS,
    INPUTS,
)

# Rejection messages. Values are shown as stored; None never reaches a message
# whose wording assumes a value (those cases have their own message).
MSG_UNKNOWN_FORMAT = "unknown format {format!r}; known: {known}"
MSG_FORMAT = "format {format!r} is not among the requested formats: {wanted}"
# Appended to MSG_FORMAT when the build recorded why it has no such format.
MSG_FORMAT_FAILED = "its build's {format} failed at {stage}: {reason}"
MSG_FORMAT_SKIPPED = "its build has no {format}: {reason}"
MSG_UNVERIFIED = (
    "failed verification: the build worker could not load it in a fresh process and match eager"
)
MSG_DEVICE = "built for device {artifact}, the node asks for {node}"
MSG_PYTHON = "built with Python {artifact}, the node runs Python {node}; torch refuses to load it"
MSG_TORCH = "built with torch {artifact}, the node runs torch {node}; torch refuses to load it"
MSG_CUDA = (
    "built with CUDA toolkit {artifact}, the node has CUDA toolkit {node}; torch refuses to load it"
)
MSG_TRITON = (
    "built with Triton {artifact}, the node has Triton {node}; "
    "torch refuses a different Triton major.minor"
)
MSG_TRITON_NODE_NONE = (
    "built with Triton {artifact}, the node has no Triton; torch refuses to load it"
)
MSG_TRITON_ARTIFACT_NONE = (
    "built without Triton, the node has Triton {node}; torch's precompile cache refuses it"
)
MSG_GPU = "built for GPU {artifact!r}, the node has GPU {node!r}; torch refuses to load it"
MSG_CAPABILITY = (
    "built for compute capability {artifact}, the node's GPU has compute capability {node}"
)
MSG_ISA = (
    "built for CPU vector ISA {artifact!r}, the node's is {node!r}; the ISA is baked into "
    "the generated code and torch does not check it (wrong numbers or a crash)"
)
MSG_ISA_ARTIFACT_UNKNOWN = (
    "records no CPU vector ISA, so it cannot be matched to the node's ({node!r})"
)
MSG_ISA_NODE_UNKNOWN = "built for CPU vector ISA {artifact!r}, the node reports no CPU vector ISA"
MSG_THREADS = (
    "built for {artifact} threads, the node runs {node} threads; the thread count is "
    "guarded and baked into CPU code"
)
MSG_THREADS_NODE_UNKNOWN = "built for {artifact} threads, the node does not report its thread count"
MSG_LIBSTDCXX = (
    "its shared library needs {missing} from libstdc++ (built with {cxx}), which the "
    "node's libstdc++ lacks (newest it has: {newest}); the dynamic loader refuses it"
)
MSG_GRAD_MODE = "compiled for grad mode {artifact}, requested {requested}; guards pin it"
MSG_LAYOUT = "built for {artifact}, the node runs {node}"
MSG_LAYOUT_NODE_NONE = ("built tensor-parallel for {artifact}; the node states no layout "
                        "(pass its world size and mesh as layout)")
MSG_LAYOUT_ARTIFACT_NONE = "built for one process, the node runs {node}"
MSG_LAYOUT_RANK = "rank {rank} is outside {artifact}"
MSG_OPTIONS = "compiled with options {artifact}, requested {requested}"
MSG_UNASKED = ("built with options the request did not ask for: {options}; name them "
               "(options {artifact}) to get this artifact")
MSG_INPUTS = "input specs {artifact} do not cover the requested {requested}"

# Best first, per artifact device. See the module docstring for why.
FORMAT_PREFERENCE: dict[str, tuple[str, ...]] = {
    "cpu": ("aoti", "aot_compile"),
    "cuda": ("aoti", "aot_compile"),
}


@dataclass(frozen=True)
class Rejection:
    artifact: ArtifactRecord
    code: str  # one of CODES
    reason: str

    def __str__(self) -> str:
        return f"artifact {self.artifact.id}: {self.reason}"


@dataclass(frozen=True)
class Resolution:
    accepted: list[ArtifactRecord]
    rejected: list[Rejection]

    @property
    def best(self) -> ArtifactRecord | None:
        return self.accepted[0] if self.accepted else None


def _major_minor(version: str | None) -> str | None:
    """Triton as torch compares it: (major, minor)."""
    if version is None:
        return None
    return ".".join(version.split(".")[:2])


@dataclass(frozen=True)
class Request:
    """What a node states about itself and asks for (``resolve``'s arguments)."""

    target: Target
    inputs: Sequence[TensorSpec]
    grad_mode: GradMode
    options: CompileOptions | None = None
    formats: Sequence[str] | None = None
    libstdcxx: Collection[str] | None = None
    layout: MeshLayout | None = None
    rank: int | None = None


def check(artifact: ArtifactRecord, request: Request) -> tuple[str, str] | None:
    """``(code, reason)`` for the first rule ``artifact`` breaks, or None if it loads."""
    a, target, formats = artifact.target, request.target, request.formats
    if artifact.format not in FORMATS:
        return FORMAT, MSG_UNKNOWN_FORMAT.format(format=artifact.format, known=", ".join(FORMATS))
    if formats is not None and artifact.format not in formats:
        reason = MSG_FORMAT.format(format=artifact.format, wanted=", ".join(formats))
        return FORMAT, reason + _missing_formats(artifact, formats)
    if not artifact.verified:
        return UNVERIFIED, MSG_UNVERIFIED
    if a.device != target.device:
        return DEVICE, MSG_DEVICE.format(artifact=a.device, node=target.device)

    if a.python_version != target.python_version:
        return PYTHON, MSG_PYTHON.format(artifact=a.python_version, node=target.python_version)
    if a.torch_version != target.torch_version:
        return TORCH, MSG_TORCH.format(artifact=a.torch_version, node=target.torch_version)
    if a.device == "cuda":
        if a.cuda_version != target.cuda_version:
            return CUDA, MSG_CUDA.format(artifact=a.cuda_version, node=target.cuda_version)
        art_triton = _major_minor(a.triton_version)
        node_triton = _major_minor(target.triton_version)
        if art_triton != node_triton:
            if node_triton is None:
                return TRITON, MSG_TRITON_NODE_NONE.format(artifact=art_triton)
            if art_triton is None:
                return TRITON, MSG_TRITON_ARTIFACT_NONE.format(node=node_triton)
            return TRITON, MSG_TRITON.format(artifact=art_triton, node=node_triton)
        if a.gpu_name != target.gpu_name:
            return GPU, MSG_GPU.format(artifact=a.gpu_name, node=target.gpu_name)
        if (
            a.capability is not None
            and target.capability is not None
            and a.capability != target.capability
        ):
            return CAPABILITY, MSG_CAPABILITY.format(artifact=a.capability, node=target.capability)

    # A cpu artifact is always CPU code; another device's artifact only holds
    # CPU kernels when its build recorded the ISA they were built for.
    if a.device == "cpu" or a.cpu_isa is not None:
        if a.cpu_isa is None:
            return ISA, MSG_ISA_ARTIFACT_UNKNOWN.format(node=target.cpu_isa)
        if target.cpu_isa is None:
            return ISA, MSG_ISA_NODE_UNKNOWN.format(artifact=a.cpu_isa)
        if a.cpu_isa != target.cpu_isa:
            return ISA, MSG_ISA.format(artifact=a.cpu_isa, node=target.cpu_isa)
    if a.threads is not None and a.threads != target.threads:
        if target.threads is None:
            return THREADS, MSG_THREADS_NODE_UNKNOWN.format(artifact=a.threads)
        return THREADS, MSG_THREADS.format(artifact=a.threads, node=target.threads)
    if request.libstdcxx is not None and artifact.libstdcxx_needs:
        missing = missing_versions(artifact.libstdcxx_needs, request.libstdcxx)
        if missing:
            glibcxx = [v for v in libstdcxx_versions(request.libstdcxx)
                       if v.startswith("GLIBCXX_")]
            return LIBSTDCXX, MSG_LIBSTDCXX.format(
                missing=", ".join(missing), cxx=artifact.cxx or "an unrecorded compiler",
                newest=glibcxx[-1] if glibcxx else "none")

    if artifact.grad_mode != request.grad_mode:
        return GRAD_MODE, MSG_GRAD_MODE.format(artifact=artifact.grad_mode,
                                               requested=request.grad_mode)
    problem = _layout_problem(artifact, request.layout, request.rank)
    if problem is not None:
        return LAYOUT, problem
    if request.options is not None and artifact.options != request.options:
        return OPTIONS, MSG_OPTIONS.format(
            artifact=artifact.options.canonical(), requested=request.options.canonical()
        )
    unasked = [] if request.options is not None else unasked_options(
        artifact.options, artifact.target.device)
    if unasked:
        return OPTIONS, MSG_UNASKED.format(options=", ".join(unasked),
                                           artifact=artifact.options.canonical())
    if not inputs_cover(artifact.inputs, request.inputs):
        return INPUTS, MSG_INPUTS.format(
            artifact=format_inputs(artifact.inputs) or "(none)",
            requested=format_inputs(request.inputs) or "(none)",
        )
    return None


def _layout_problem(artifact: ArtifactRecord, layout: MeshLayout | None,
                    rank: int | None) -> str | None:
    built = artifact.options.parallel.mesh if artifact.options.parallel else None
    if built is None and layout is None:
        return None
    if built is None:
        return MSG_LAYOUT_ARTIFACT_NONE.format(node=layout)
    if layout is None:
        return MSG_LAYOUT_NODE_NONE.format(artifact=built)
    if built != layout:
        return MSG_LAYOUT.format(artifact=built, node=layout)
    if rank is not None and not 0 <= rank < built.world_size:
        return MSG_LAYOUT_RANK.format(rank=rank, artifact=built)
    return None


def _missing_formats(artifact: ArtifactRecord, formats: Sequence[str]) -> str:
    """Why this artifact's build has none of the requested formats, from what
    its compile worker recorded (``formats_failed``, ``formats_skipped``)."""
    failed = artifact.meta.get("formats_failed") or {}
    skipped = artifact.meta.get("formats_skipped") or {}
    notes = []
    for fmt in formats:
        why = failed.get(fmt)
        if isinstance(why, dict):
            notes.append(MSG_FORMAT_FAILED.format(format=fmt, stage=why.get("stage"),
                                                  reason=why.get("reason")))
        elif fmt in skipped:
            notes.append(MSG_FORMAT_SKIPPED.format(format=fmt, reason=skipped[fmt]))
    return "".join(f"; {n}" for n in notes)


def _index(seq: Sequence[str], value: str) -> int:
    return seq.index(value) if value in seq else len(seq)


def _served(specs: Sequence[TensorSpec]) -> tuple[int, int]:
    """(unbounded dims, concrete shapes served by the bounded ones): smaller is narrower.

    A static spec serves exactly one shape: (0, 1), ahead of every range.
    """
    unbounded = 0
    shapes = 1
    for spec in specs:
        for dim in spec.dims:
            if dim.hi is None:
                unbounded += 1
            else:
                shapes *= dim.hi - dim.lo + 1
    return unbounded, shapes


_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)


def _micros(when: datetime) -> int:
    # SQLite hands back naive datetimes; the registry writes UTC.
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    return (when - _EPOCH) // timedelta(microseconds=1)


def preference_key(artifact: ArtifactRecord) -> tuple[object, ...]:
    """Sort key for accepted artifacts: smaller is better (see the module docstring)."""
    # Newest first; an unknown time sorts after every known one.
    created = artifact.created_at
    age = (1, 0) if created is None else (0, -_micros(created))
    opts = artifact.options
    return (
        artifact.first_call_compiles,
        _index(FORMAT_PREFERENCE.get(artifact.target.device, FORMATS), artifact.format),
        (
            opts != CompileOptions(),
            _index(COMPILE_MODES, opts.mode),
            _index(GUARD_FILTERS, opts.guard_filter),
            # inductor (generated code) before the debugging backends.
            _index(BACKENDS, opts.backend),
            # Guards checked before guards skipped.
            opts.disable_guard_check,
        ),
        _served(artifact.inputs),
        age,
        artifact.id,
    )


def resolve(
    candidates: Sequence[ArtifactRecord],
    *,
    target: Target,
    inputs: Sequence[TensorSpec],
    grad_mode: GradMode,
    options: CompileOptions | None = None,
    formats: Sequence[str] | None = None,
    libstdcxx: Collection[str] | None = None,
    layout: MeshLayout | None = None,
    rank: int | None = None,
) -> Resolution:
    """Split ``candidates`` into what ``target`` can load (best first) and the rest, with reasons.

    ``target`` is the node's own target for the device it will run on;
    ``inputs`` may hold dynamic ranges, which an artifact must cover whole.
    ``formats`` restricts the formats the node can load; it does not reorder them.
    ``libstdcxx`` is the set of GLIBCXX_/CXXABI_ versions the node's libstdc++
    provides (``farm.core.elf.libstdcxx_provides``); None: not reported.
    ``layout`` is the node's world size and mesh (None: one process), ``rank``
    its rank in it (None: not stated).
    """
    if isinstance(formats, str):
        raise ValueError(f"formats must be a sequence of format names, got {formats!r}")
    if formats is not None:
        unknown = [f for f in formats if f not in FORMATS]
        if unknown:
            raise ValueError(
                f"unknown formats requested: {', '.join(unknown)}; known: {', '.join(FORMATS)}"
            )
    request = Request(target, inputs, grad_mode, options, formats, libstdcxx, layout, rank)
    accepted: list[ArtifactRecord] = []
    rejected: list[Rejection] = []
    for artifact in candidates:
        problem = check(artifact, request)
        if problem is None:
            accepted.append(artifact)
        else:
            rejected.append(Rejection(artifact=artifact, code=problem[0], reason=problem[1]))
    accepted.sort(key=preference_key)
    rejected.sort(key=lambda r: r.artifact.id)
    return Resolution(accepted=accepted, rejected=rejected)


def why_chosen(result: Resolution, *, target: Target, inputs: Sequence[TensorSpec],
               rejected: int | None = None) -> list[str]:
    """Why ``result.best`` is the artifact a node gets, one reason a line, in
    the order of the rules and the preference above (empty on a miss).
    ``rejected``: how many were refused, when ``result`` holds only the
    candidates that could match (the API's read model checks those alone)."""
    best = result.best
    if best is None:
        return []
    n_rejected = len(result.rejected) if rejected is None else rejected
    fields = ["python", "torch"] + (
        ["cuda", "triton", "gpu", "capability"] if target.device == "cuda" else ["isa", "threads"])
    out = [
        f"loads on this node: {best.target.device} target with the same {', '.join(fields)}",
        f"built for {format_inputs(best.inputs)} ({best.grad_mode.value}), which covers "
        f"the requested {format_inputs(inputs)}",
    ]
    err = "" if best.max_abs_err is None else f" (max abs err {best.max_abs_err:.2g})"
    out.append(f"verified by its builder in a fresh process against eager{err}")
    others = result.accepted[1:]
    if not others:
        out.append("the only artifact that fits" + (
            f"; {n_rejected} other(s) rejected" if n_rejected else ""))
        return out
    second = others[0]
    out.append(f"ahead of {second.digest[:12]} ({second.format}): "
               f"{behind_reason(best, second, accepted=len(result.accepted))}")
    return out


def behind_reason(best: ArtifactRecord, other: ArtifactRecord, *, accepted: int) -> str:
    """Which preference rule put ``best`` ahead of ``other`` (both accepted),
    said from ``best``'s side."""
    a, b = preference_key(best), preference_key(other)
    rule = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a) - 1)
    reasons = [
        f"its first call does not compile, unlike {other.digest[:12]}'s",
        f"format {best.format} comes before {other.format} on {best.target.device} "
        f"(no C++ compiler and no dynamo import needed to load it)",
        f"default compile options, ahead of {other.options.canonical()}",
        f"its input specs are narrower than {format_inputs(other.inputs)} (exact shapes "
        "first)",
        f"the newest of the {accepted} that fit",
        "the lowest id among equals",
    ]
    return reasons[rule]


def dynamic_hint(result: Resolution, *, inputs: Sequence[TensorSpec]) -> str | None:
    """On a miss where only the shapes differ: the input specs of one dynamic
    build that would serve both what was built and what was asked."""
    shape_misses = [r for r in result.rejected if r.code == INPUTS]
    if not shape_misses or len(shape_misses) != len(result.rejected):
        return None
    built = shape_misses[0].artifact.inputs
    if len(built) != len(inputs):
        return None
    specs = []
    for have, want in zip(built, inputs, strict=True):
        if have.name != want.name or have.dtype != want.dtype or len(have.dims) != len(want.dims):
            return None
        dims = []
        for h, w in zip(have.dims, want.dims, strict=True):
            if h == w:
                dims.append(h)
                continue
            lo = max(2, min(h.lo, w.lo))
            hi = None if h.hi is None or w.hi is None else max(h.hi, w.hi)
            dims.append(Dim(lo, hi))
        specs.append(TensorSpec(have.dtype, tuple(dims), name=have.name))
    wanted_small = any(w.lo < 2 and h != w for have, want in zip(built, inputs, strict=True)
                       for h, w in zip(have.dims, want.dims, strict=True))
    flags = " ".join(f"--input '{s}'" for s in specs)
    note = (" (sizes 0 and 1 are specialised by torch: they need a build of their own)"
            if wanted_small else "")
    return (f"built only for {format_inputs(built)}; one dynamic build serves both: "
            f"farm submit ... {flags}{note}")
