"""Job and input specs: what a user asks the farm to build.

Every spec is a frozen value with a canonical string or JSON form that parses
back to the same value, so it can be hashed into build keys, stored in SQL and
typed on a command line.

Input spec grammar (one tensor)::

    spec   := dtype "[" [dim ("," dim)*] "]" [values]
    dim    := INT                  static size
            | INT ".." [INT]       dynamic, inclusive range; no upper bound if omitted
    values := "{" INT ".." INT "}" integer dtypes: the inclusive range of the
                                   values the verifier draws (token ids, say)

    float32[8,64]       bfloat16[8,512,1024]     int64[1,16]
    float32[2..64,128]  one artifact for every batch size from 2 to 64
    int64[1,16]{0..50256}  token ids below a 50257-entry vocabulary

Without ``{..}`` an integer input's values are drawn below the model's first
``nn.Embedding``'s ``num_embeddings`` (zeros when it has none). The value
range is part of the spec's text, so of the build key: it changes what the
artifact was verified on, not what it accepts (``covers`` ignores it).

Dynamic dims start at 2 or more: torch specialises sizes 0 and 1, so an
artifact "for 1..64" would silently recompile (or fail its guards) at 1.

Keyword and structured inputs: a spec may start with where its tensor goes::

    item   := [path "="] spec
    path   := NAME                 keyword argument NAME
            | NAME ("." KEY)+      key KEY of the dict passed as keyword NAME
            | INT ("." KEY)+       key KEY of the dict passed as positional INT

    input_ids=int64[1,16]{0..31999}  attention_mask=int64[1,16]{1..1}
    batch.x=float32[4,8]  batch.mask=bool[4,8]    forward(self, batch: dict)

A spec without a path is the next positional argument, as before, so every
stored spec keeps its exact text (and its build key). ``parse_inputs`` puts a
list in its canonical order (positional arguments by position, then keywords
by name, dict keys sorted), so one call has one text whatever order it was
typed in; ``call_args`` turns one tensor per spec into that ``(args, kwargs)``.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

DTYPES: tuple[str, ...] = (
    "float32",
    "float16",
    "bfloat16",
    "float64",
    "int64",
    "int32",
    "int16",
    "int8",
    "uint8",
    "bool",
)
FLOAT_DTYPES = frozenset({"float32", "float16", "bfloat16", "float64"})
INT_DTYPES = frozenset({"int64", "int32", "int16", "int8", "uint8"})
# Representable values per integer dtype: a declared range must fit.
_INT_LIMITS = {"int64": (-(2**63), 2**63 - 1), "int32": (-(2**31), 2**31 - 1),
               "int16": (-(2**15), 2**15 - 1), "int8": (-128, 127), "uint8": (0, 255)}
_SIGNED_INT_RE = re.compile(r"^-?[0-9]+$")
_DTYPE_ALIASES = {
    "float": "float32",
    "fp32": "float32",
    "half": "float16",
    "fp16": "float16",
    "bf16": "bfloat16",
    "double": "float64",
    "fp64": "float64",
    "long": "int64",
    "int": "int32",
}

_SPEC_RE = re.compile(r"^\s*([A-Za-z0-9_]+)\s*\[([^\]]*)\]\s*(?:\{([^}]*)\})?\s*$")
# ASCII digits only: int() also takes "+8", "1_000" and non-ASCII digits, which
# would let two different texts name one spec (and one build key).
_INT_RE = re.compile(r"^[0-9]+$")
MAX_DIMS = 8
_ENTRYPOINT_RE = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")
MIN_DYNAMIC = 2
_DIGEST_RE = re.compile(r"^[0-9a-f]{64}$")
_IDENT_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# An input's path: a keyword NAME or a positional INT, then dict KEYs.
_PATH_RE = re.compile(r"^(?:[A-Za-z_]\w*|[0-9]+)(?:\.[A-Za-z_]\w*)*$")


class SpecError(ValueError):
    """A spec that does not parse or does not make sense; the message says why."""


@dataclass(frozen=True)
class Dim:
    """One tensor dimension: static (lo == hi) or a dynamic inclusive range.

    ``hi`` is None for an unbounded dynamic dim.
    """

    lo: int
    hi: int | None

    def __post_init__(self) -> None:
        # Checked here as well as in parse(): a Dim built in code must obey the
        # same rules, or covers() would promise shapes torch specialises.
        for name, value in (("lo", self.lo), ("hi", self.hi)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise SpecError(f"dim {name} must be an int, got {value!r}")
        if self.lo < 0:
            raise SpecError(f"negative dim {self.lo}")
        if self.hi is not None and self.hi < self.lo:
            raise SpecError(f"dim {self.lo}..{self.hi} has its upper bound below its lower bound")
        if self.dynamic and self.lo < MIN_DYNAMIC:
            raise SpecError(
                f"dynamic dim {self} starts below {MIN_DYNAMIC}: torch specialises "
                "sizes 0 and 1, so give those their own static spec"
            )

    @property
    def dynamic(self) -> bool:
        return self.hi != self.lo

    @property
    def example(self) -> int:
        """The size used for the example input at compile time."""
        return self.lo

    def contains(self, other: Dim) -> bool:
        if other.lo < self.lo:
            return False
        if self.hi is None:
            return True
        return other.hi is not None and other.hi <= self.hi

    def __str__(self) -> str:
        if not self.dynamic:
            return str(self.lo)
        return f"{self.lo}..{'' if self.hi is None else self.hi}"

    @classmethod
    def parse(cls, text: str) -> Dim:
        text = text.strip()
        if ".." in text:
            lo_s, hi_s = (p.strip() for p in text.split("..", 1))
            if not _INT_RE.match(lo_s) or (hi_s and not _INT_RE.match(hi_s)):
                raise SpecError(f"bad dynamic dim {text!r}: expected LO..HI or LO..")
            lo = int(lo_s)
            hi = int(hi_s) if hi_s else None
            if lo < MIN_DYNAMIC:
                raise SpecError(
                    f"dynamic dim {text!r} starts below {MIN_DYNAMIC}: torch specialises "
                    "sizes 0 and 1, so give those their own static spec"
                )
            if hi is not None and hi < lo:
                raise SpecError(f"dynamic dim {text!r} has its upper bound below its lower bound")
            return cls(lo, hi)
        if text.startswith("-") and _INT_RE.match(text[1:]):
            raise SpecError(f"negative dim {text!r}")
        if not _INT_RE.match(text):
            raise SpecError(f"bad dim {text!r}: expected an integer or LO..HI")
        size = int(text)
        return cls(size, size)


@dataclass(frozen=True)
class TensorSpec:
    """One example input: a dtype and a shape whose dims may be dynamic ranges."""

    dtype: str
    dims: tuple[Dim, ...]
    # Integer dtypes only: (lo, hi), the inclusive range of values realistic
    # inputs take (verification draws from it); None: not declared.
    values: tuple[int, int] | None = None
    # Where the tensor goes in the call: "" the next positional argument,
    # "input_ids" a keyword, "batch.x" key x of the dict passed as batch,
    # "0.x" key x of the dict passed as positional argument 0.
    name: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or (self.name and not _PATH_RE.match(self.name)):
            raise SpecError(f"bad input name {self.name!r}: a keyword (input_ids), a dict key "
                            "under a keyword (batch.x) or under a position (0.x)")
        if self.name and self.name.isdigit():
            raise SpecError(f"input name {self.name!r} is a position: write a positional input "
                            "without a name, or a dict key under it (0.x)")
        if self.dtype not in DTYPES:
            raise SpecError(f"unknown dtype {self.dtype!r}; known: {', '.join(DTYPES)}")
        if self.values is not None:
            if self.dtype not in INT_DTYPES:
                raise SpecError(f"a value range {{lo..hi}} is for integer inputs, not {self.dtype}")
            if (not isinstance(self.values, tuple) or len(self.values) != 2
                    or not all(isinstance(v, int) and not isinstance(v, bool)
                               for v in self.values)):
                raise SpecError(f"values must be a (lo, hi) tuple of ints, got {self.values!r}")
            lo, hi = self.values
            if hi < lo:
                raise SpecError(f"value range {{{lo}..{hi}}} has its upper bound below its lower")
            tlo, thi = _INT_LIMITS[self.dtype]
            if lo < tlo or hi > thi:
                raise SpecError(f"value range {{{lo}..{hi}}} does not fit {self.dtype} "
                                f"({tlo}..{thi})")
        if not isinstance(self.dims, tuple) or not all(isinstance(d, Dim) for d in self.dims):
            # A list would make the frozen value unhashable and unequal to its parse.
            raise SpecError(f"dims must be a tuple of Dim, got {self.dims!r}")
        if len(self.dims) > MAX_DIMS:
            raise SpecError(f"input spec {self} has more than {MAX_DIMS} dims")

    @property
    def shape(self) -> tuple[int, ...]:
        """The concrete shape of the example input used at compile time."""
        return tuple(d.example for d in self.dims)

    @property
    def dynamic_dims(self) -> tuple[int, ...]:
        return tuple(i for i, d in enumerate(self.dims) if d.dynamic)

    def covers(self, other: TensorSpec) -> bool:
        """True when an artifact built for ``self`` accepts every input ``other`` describes."""
        return (
            self.name == other.name
            and self.dtype == other.dtype
            and len(self.dims) == len(other.dims)
            and all(a.contains(b) for a, b in zip(self.dims, other.dims, strict=True))
        )

    def __str__(self) -> str:
        text = f"{self.dtype}[{','.join(str(d) for d in self.dims)}]"
        if self.values is not None:
            text += f"{{{self.values[0]}..{self.values[1]}}}"
        return f"{self.name}={text}" if self.name else text

    @property
    def path(self) -> tuple[str, ...]:
        """The name's parts: ("input_ids",), ("batch", "x"), ("0", "x"); () positional."""
        return tuple(self.name.split(".")) if self.name else ()

    @classmethod
    def parse(cls, text: str) -> TensorSpec:
        if not isinstance(text, str):
            raise SpecError(f"input spec must be a string like 'float32[8,64]', got {text!r}")
        name = ""
        if "=" in text:
            name, _, text = (p.strip() for p in text.partition("="))
            if not _PATH_RE.match(name) or name.isdigit():
                raise SpecError(f"bad input name {name!r} in {name}={text}: expected a keyword "
                                "(input_ids=int64[1,16]), a dict key under a keyword "
                                "(batch.x=float32[4,8]) or under a position (0.x=float32[4,8])")
        m = _SPEC_RE.match(text)
        if not m:
            raise SpecError(
                f"bad input spec {text!r}: expected DTYPE[D0,D1,...], e.g. float32[8,64]"
            )
        dtype = _DTYPE_ALIASES.get(m.group(1), m.group(1))
        if dtype not in DTYPES:
            raise SpecError(f"unknown dtype {m.group(1)!r} in {text!r}; known: {', '.join(DTYPES)}")
        body = m.group(2).strip()
        dims = tuple(Dim.parse(p) for p in body.split(",")) if body else ()
        if len(dims) > MAX_DIMS:
            raise SpecError(f"input spec {text!r} has more than {MAX_DIMS} dims")
        values = None
        if m.group(3) is not None:
            lo_s, sep, hi_s = (p.strip() for p in m.group(3).partition(".."))
            if not sep or not _SIGNED_INT_RE.match(lo_s) or not _SIGNED_INT_RE.match(hi_s):
                raise SpecError(f"bad value range {{{m.group(3)}}} in {text!r}: expected "
                                "{LO..HI}, e.g. int64[1,16]{0..50256}")
            values = (int(lo_s), int(hi_s))
        return cls(dtype, dims, values, name)


def parse_inputs(specs: Iterable[str]) -> tuple[TensorSpec, ...]:
    """Specs in their canonical order (``canonical_inputs``)."""
    if isinstance(specs, str):
        # Iterating a string would parse it one character at a time.
        raise SpecError(f"inputs must be a list of specs like ['float32[8,64]'], got {specs!r}")
    return canonical_inputs(TensorSpec.parse(s) for s in specs)


def _call_keys(specs: Iterable[TensorSpec]) -> list[tuple[tuple[int, int | str], tuple[str, ...]]]:
    """Per spec: ((0, position) or (1, keyword), dict keys): where its tensor goes.
    A spec without a name takes the position after the previous positional one."""
    out: list[tuple[tuple[int, int | str], tuple[str, ...]]] = []
    last = -1
    for s in specs:
        path = s.path
        if not path:
            last += 1
            out.append(((0, last), ()))
        elif path[0].isdigit():
            last = int(path[0])
            out.append(((0, last), path[1:]))
        else:
            out.append(((1, path[0]), path[1:]))
    return out


def canonical_inputs(specs: Iterable[TensorSpec]) -> tuple[TensorSpec, ...]:
    """Check that the specs describe one call, and put them in its canonical
    order: positional arguments by position, then keyword arguments by name,
    a dict's keys sorted (the order ``call_args`` builds, which is also the
    order ``torch.utils._pytree`` flattens that call in). Positional-only
    lists come back unchanged."""
    specs = tuple(specs)
    if all(not s.name for s in specs):
        return specs
    keys = _call_keys(specs)
    seen: dict[tuple[Any, ...], TensorSpec] = {}
    for s, (arg, sub) in zip(specs, keys, strict=True):
        full = (arg, *sub)
        for other_full, other in seen.items():
            if other_full == full:
                raise SpecError(f"inputs {other} and {s} name the same argument")
            shorter, longer = sorted((other_full, full), key=len)
            if longer[:len(shorter)] == shorter:
                raise SpecError(f"inputs {other} and {s}: one is a tensor, the other a key "
                                "inside it (an argument is a tensor or a dict of tensors)")
        seen[full] = s
    positions = sorted({int(arg[1]) for arg, _ in keys if arg[0] == 0})
    if positions != list(range(len(positions))):
        missing = sorted(set(range(max(positions) + 1)) - set(positions))
        raise SpecError(f"positional argument {missing[0]} has no input spec (positions "
                        f"{positions}); give one for each, in order")
    order = sorted(range(len(specs)), key=lambda i: (keys[i][0], keys[i][1]))
    # A positional dict is always written with its position (0.x), so the
    # text is the same after sorting; plain positional tensors keep their order.
    return tuple(specs[i] for i in order)


def call_args(specs: Sequence[TensorSpec], leaves: Sequence[Any]) -> tuple[tuple[Any, ...],
                                                                          dict[str, Any]]:
    """``(args, kwargs)`` of the call the specs describe, with ``leaves[i]``
    (a tensor, say) where ``specs[i]`` says; dicts are built in the specs'
    order (canonical: sorted keys)."""
    if len(specs) != len(leaves):
        raise SpecError(f"{len(leaves)} values for {len(specs)} input specs")
    positional: dict[int, Any] = {}
    kwargs: dict[str, Any] = {}
    for (arg, sub), leaf in zip(_call_keys(specs), leaves, strict=True):
        kind, where = arg
        if not sub:
            if kind == 0:
                positional[int(where)] = leaf
            else:
                kwargs[str(where)] = leaf
            continue
        holder: dict[Any, Any] = positional if kind == 0 else kwargs
        node = holder.setdefault(where, {})
        for key in sub[:-1]:
            node = node.setdefault(key, {})
        node[sub[-1]] = leaf
    return tuple(positional[i] for i in sorted(positional)), kwargs


def call_leaves(specs: Sequence[TensorSpec], args: Sequence[Any],
                kwargs: Mapping[str, Any]) -> list[Any]:
    """The inverse of ``call_args``: the value at each spec's place in a call
    (a node's call to an AOTI package); a missing or extra argument or key
    raises SpecError naming it."""
    out: list[Any] = []
    used_pos: set[int] = set()
    used_kw: set[str] = set()
    for s, (arg, sub) in zip(specs, _call_keys(specs), strict=True):
        kind, where = arg
        if kind == 0:
            if int(where) >= len(args):
                raise SpecError(f"input {s}: the call has {len(args)} positional arguments")
            node: Any = args[int(where)]
            used_pos.add(int(where))
        else:
            if where not in kwargs:
                raise SpecError(f"input {s}: the call has no keyword {where!r} "
                                f"(it has {sorted(kwargs)})")
            node = kwargs[str(where)]
            used_kw.add(str(where))
        for key in sub:
            if not isinstance(node, Mapping) or key not in node:
                raise SpecError(f"input {s}: no key {key!r} in what the call passes there")
            node = node[key]
        out.append(node)
    extra = [f"positional {i}" for i in range(len(args)) if i not in used_pos] + [
        f"keyword {k!r}" for k in kwargs if k not in used_kw]
    if extra:
        raise SpecError(f"the call passes {', '.join(extra)}, which no input spec describes")
    return out


def format_inputs(specs: Sequence[TensorSpec]) -> str:
    """Canonical text of an input list, used as a column value and in keys."""
    return ";".join(str(s) for s in specs)


def parse_input_list(text: str) -> tuple[TensorSpec, ...]:
    return parse_inputs(p for p in text.split(";") if p) if text else ()


def inputs_cover(artifact: Sequence[TensorSpec], request: Sequence[TensorSpec]) -> bool:
    """Same call (positions, keywords, dict keys) and each tensor covered."""
    if len(artifact) != len(request):
        return False
    try:
        artifact, request = canonical_inputs(artifact), canonical_inputs(request)
    except SpecError:
        return False
    return all(a.covers(r) for a, r in zip(artifact, request, strict=True))


class GradMode(str, Enum):
    """What the artifact is compiled for; guards pin it (grad_mode, inference_mode)."""

    INFERENCE = "inference"  # called under torch.no_grad()
    TRAINING = "training"  # grad enabled, the artifact supports backward

    def __str__(self) -> str:
        return self.value


COMPILE_MODES = ("default", "max-autotune", "max-autotune-no-cudagraphs")
# Every backend torch.compile(...).aot_compile can save and load (the guide's
# "inductor", "eager", "aot_eager"): eager and aot_eager generate no code, for
# debugging a build; only inductor has modes, and only it gives AOTI packages.
BACKENDS = ("inductor", "eager", "aot_eager")
GUARD_FILTERS = ("drop-unserializable", "keep-all")
OPTION_NAMES = ("mode", "backend", "guard_filter", "disable_guard_check", "regional", "parallel",
                "weights")
# How a build makes the model's weights (farm.build.fake_weights): "empty"
# (to_empty on the target: real Parameters, uninitialised memory), "fake"
# (FakeTensors: no memory at all), "auto" (empty where they fit, fake for a
# CUDA build whose weights do not fit the build GPU).
WEIGHT_MODES = ("auto", "empty", "fake")
# Tensor-parallel styles a plan may name (torch.distributed.tensor.parallel).
PARALLEL_STYLES = ("colwise", "rowwise")
_MODULE_PATH_RE = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_0-9]\w*)*$")


@dataclass(frozen=True)
class MeshLayout:
    """What a node states about its process group: the world size and the
    device mesh (shape, dimension names). An artifact built for another one
    is refused (``registry.resolver`` rule ``layout``)."""

    world_size: int
    mesh_shape: tuple[int, ...]
    mesh_dim_names: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.world_size, bool) or not isinstance(self.world_size, int) \
                or self.world_size < 1:
            raise SpecError(f"world_size must be a positive int, got {self.world_size!r}")
        if (not isinstance(self.mesh_shape, tuple) or not self.mesh_shape
                or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1
                           for n in self.mesh_shape)):
            raise SpecError(f"mesh_shape must be a non-empty list of positive ints, "
                            f"got {self.mesh_shape!r}")
        size = 1
        for n in self.mesh_shape:
            size *= n
        if size != self.world_size:
            raise SpecError(f"mesh {list(self.mesh_shape)} holds {size} ranks, world_size is "
                            f"{self.world_size}: the mesh must cover every rank")
        if self.mesh_dim_names and (
                len(self.mesh_dim_names) != len(self.mesh_shape)
                or not all(isinstance(n, str) and _IDENT_RE.match(n) for n in self.mesh_dim_names)
                or len(set(self.mesh_dim_names)) != len(self.mesh_dim_names)):
            raise SpecError(f"mesh_dim_names must be one distinct identifier per mesh dim "
                            f"({len(self.mesh_shape)}), got {list(self.mesh_dim_names)!r}")

    def __str__(self) -> str:
        dims = ",".join(f"{n}:{s}" if n else str(s) for n, s in
                        zip(self.mesh_dim_names or ("",) * len(self.mesh_shape),
                            self.mesh_shape, strict=True))
        return f"world {self.world_size}, mesh [{dims}]"

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {"world_size": self.world_size,
                                "mesh_shape": list(self.mesh_shape)}
        if self.mesh_dim_names:
            data["mesh_dim_names"] = list(self.mesh_dim_names)
        return data

    @classmethod
    def from_json(cls, data: Any) -> MeshLayout:
        if not isinstance(data, Mapping):
            raise SpecError(f"a layout is an object like {{\"world_size\": 2, \"mesh_shape\": "
                            f"[2]}}, got {data!r}")
        unknown = set(data) - {"world_size", "mesh_shape", "mesh_dim_names"}
        if unknown:
            raise SpecError(f"unknown layout fields: {', '.join(sorted(unknown))}; known: "
                            "world_size, mesh_shape, mesh_dim_names")
        shape = data.get("mesh_shape", [data.get("world_size")])
        names = data.get("mesh_dim_names") or ()
        if not isinstance(shape, list | tuple) or not isinstance(names, list | tuple):
            raise SpecError("mesh_shape and mesh_dim_names are lists")
        return cls(world_size=data.get("world_size"), mesh_shape=tuple(shape),  # type: ignore[arg-type]
                   mesh_dim_names=tuple(names))


@dataclass(frozen=True)
class ParallelLayout:
    """A tensor-parallel build (issue 19): the model is parallelized over a
    1-D device mesh with ``plan`` (module path -> ``colwise``/``rowwise``,
    ``parallelize_module``), its inputs are replicated DTensors, and it is
    compiled once under a fake process group with
    ``torch.distributed.config.compile_on_one_rank`` so one artifact serves
    every rank of ``mesh``."""

    mesh: MeshLayout
    plan: tuple[tuple[str, str], ...]

    def __post_init__(self) -> None:
        if len(self.mesh.mesh_shape) != 1:
            # parallelize_module takes a 1-D mesh (or a named sub-mesh of one);
            # a plan naming which dim each module uses is not designed yet.
            raise SpecError(f"a parallel plan needs a 1-D mesh, got {list(self.mesh.mesh_shape)}")
        if not isinstance(self.plan, tuple) or not self.plan:
            raise SpecError("parallel.plan names at least one module: "
                            "{\"linear1\": \"colwise\", \"linear2\": \"rowwise\"}")
        for path, style in self.plan:
            if not isinstance(path, str) or not _MODULE_PATH_RE.match(path):
                raise SpecError(f"bad module path {path!r} in parallel.plan: a dotted "
                                "submodule path such as layers.0.mlp.up")
            if style not in PARALLEL_STYLES:
                raise SpecError(f"unknown parallel style {style!r} for {path}; known: "
                                f"{', '.join(PARALLEL_STYLES)}")
        if [p for p, _ in self.plan] != sorted({p for p, _ in self.plan}):
            raise SpecError("parallel.plan must name each module once, sorted "
                            "(ParallelLayout.from_json sorts)")

    def to_json(self) -> dict[str, Any]:
        return {**self.mesh.to_json(), "plan": dict(self.plan)}

    @classmethod
    def from_json(cls, data: Any) -> ParallelLayout:
        if not isinstance(data, Mapping) or not isinstance(data.get("plan"), Mapping):
            raise SpecError("parallel must be an object with world_size, mesh_shape, "
                            "mesh_dim_names and plan ({module path: colwise|rowwise})")
        mesh = MeshLayout.from_json({k: v for k, v in data.items() if k != "plan"})
        return cls(mesh=mesh, plan=tuple(sorted(dict(data["plan"]).items())))


@dataclass(frozen=True)
class CompileOptions:
    mode: str = "default"
    backend: str = "inductor"
    # Which guards to keep when saving: real-world modules carry guards on
    # closures (ID_MATCH) that cannot be serialized; "drop-unserializable"
    # drops only those, never tensor or global-state guards.
    guard_filter: str = "drop-unserializable"
    # The loaded function skips its guard check on every call
    # (``AOTCompiledFunction.disable_guard_check()``): a call on other shapes,
    # dtypes or devices than the artifact's is then not refused but wrong.
    # Recorded, so a node gets it only when it asks for it (or for any options).
    disable_guard_check: bool = False
    # Regional compilation: each repeated block class (a transformer layer)
    # is a torch.compiler.nested_compile_region, compiled once and stamped
    # for every layer, in the same one aot_compile artifact.
    regional: bool = False
    # A tensor-parallel build (ParallelLayout); None: a single-process model.
    parallel: ParallelLayout | None = None
    # WEIGHT_MODES: how the build makes the weights; "auto" unless a job asks.
    weights: str = "auto"

    def __post_init__(self) -> None:
        if self.weights not in WEIGHT_MODES:
            raise SpecError(f"unknown weights {self.weights!r}; known: {', '.join(WEIGHT_MODES)} "
                            "(fake: build without memory for the weights)")
        if self.parallel is not None and not isinstance(self.parallel, ParallelLayout):
            raise SpecError(f"parallel must be a ParallelLayout, got {self.parallel!r}")
        if self.mode not in COMPILE_MODES:
            raise SpecError(f"unknown mode {self.mode!r}; known: {', '.join(COMPILE_MODES)}")
        if self.backend not in BACKENDS:
            raise SpecError(f"unknown backend {self.backend!r}; known: {', '.join(BACKENDS)}")
        if self.backend != "inductor" and self.mode != "default":
            raise SpecError(
                f"mode {self.mode!r} is an inductor mode; backend {self.backend!r} has none "
                "(leave mode at default, or use backend inductor)"
            )
        if self.guard_filter not in GUARD_FILTERS:
            raise SpecError(
                f"unknown guard filter {self.guard_filter!r}; known: {', '.join(GUARD_FILTERS)}"
            )
        if not isinstance(self.disable_guard_check, bool):
            raise SpecError(f"disable_guard_check must be true or false, "
                            f"got {self.disable_guard_check!r}")
        if not isinstance(self.regional, bool):
            raise SpecError(f"regional must be true or false, got {self.regional!r}")

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "mode": self.mode, "backend": self.backend, "guard_filter": self.guard_filter}
        if self.disable_guard_check:
            # Only when set: options stored before it existed keep their exact
            # canonical text, so their build keys and rows still match.
            data["disable_guard_check"] = True
        if self.regional:
            # Only when set, as above.
            data["regional"] = True
        if self.parallel is not None:
            # Only when set, as above: the layout is in the build key.
            data["parallel"] = self.parallel.to_json()
        if self.weights != "auto":
            # Only when set, as above: a fake-weight artifact's guards differ.
            data["weights"] = self.weights
        return data

    def canonical(self) -> str:
        return canonical_json(self.to_json())

    @classmethod
    def from_json(cls, data: Mapping[str, Any] | None) -> CompileOptions:
        data = dict(data or {})
        regional = data.pop("regional", False)
        if isinstance(regional, str) and regional.lower() in ("true", "false"):
            regional = regional.lower() == "true"
        if not isinstance(regional, bool):
            raise SpecError(f"regional must be true or false, got {regional!r}")
        unknown = set(data) - set(OPTION_NAMES)
        if unknown:
            raise SpecError(f"unknown compile options: {', '.join(sorted(unknown))}; "
                            f"known: {', '.join(OPTION_NAMES)}")
        dgc = data.pop("disable_guard_check", False)
        if isinstance(dgc, str) and dgc.lower() in ("true", "false"):
            dgc = dgc.lower() == "true"
        if not isinstance(dgc, bool):
            raise SpecError(f"disable_guard_check must be true or false, got {dgc!r}")
        raw_parallel = data.pop("parallel", None)
        parallel = None if raw_parallel is None else ParallelLayout.from_json(raw_parallel)
        return cls(**{k: str(v) for k, v in data.items()}, regional=regional,
                   disable_guard_check=dgc,
                   parallel=parallel)


_OPTIMIZER_RE = re.compile(r"^[A-Z][A-Za-z0-9_]*$")


@dataclass(frozen=True)
class TrainSpec:
    """A training step (model kind ``training_step``): the artifact is
    ``loss(model(*inputs), *targets)`` with its backward (AOTAutograd); the
    last ``targets`` job inputs are the loss's targets. ``optimizer`` names a
    ``torch.optim`` class, built with ``optimizer_kwargs`` on the node and in
    verification, which checks the loss, every gradient and the optimizer's
    state after two steps against eager. The step itself runs uncompiled
    (``farm.core.training.OPTIMIZER_STEP``)."""

    loss: str
    targets: int = 1
    optimizer: str = "SGD"
    optimizer_kwargs: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.loss, str) or not _ENTRYPOINT_RE.match(self.loss):
            raise SpecError(f"bad train.loss {self.loss!r}: expected 'package.module:function', "
                            "e.g. torch.nn.functional:mse_loss")
        if isinstance(self.targets, bool) or not isinstance(self.targets, int) \
                or self.targets < 0:
            raise SpecError(f"train.targets must be a count of trailing inputs (0 or more), "
                            f"got {self.targets!r}")
        if not isinstance(self.optimizer, str) or not _OPTIMIZER_RE.match(self.optimizer):
            raise SpecError(f"bad train.optimizer {self.optimizer!r}: a torch.optim class name, "
                            "e.g. SGD, AdamW")
        if not isinstance(self.optimizer_kwargs, Mapping):
            raise SpecError(f"train.optimizer_kwargs must be an object, "
                            f"got {self.optimizer_kwargs!r}")
        try:
            canonical_json(dict(self.optimizer_kwargs))
        except (TypeError, ValueError) as exc:
            raise SpecError(f"train.optimizer_kwargs must be JSON: {exc}") from None

    def __hash__(self) -> int:
        return hash(self.canonical())

    def to_json(self) -> dict[str, Any]:
        return {"loss": self.loss, "targets": self.targets, "optimizer": self.optimizer,
                "optimizer_kwargs": dict(self.optimizer_kwargs)}

    def canonical(self) -> str:
        return canonical_json(self.to_json())

    @classmethod
    def from_json(cls, data: Any) -> TrainSpec:
        if not isinstance(data, Mapping):
            raise SpecError(f"train must be an object with loss, targets, optimizer and "
                            f"optimizer_kwargs, got {data!r}")
        unknown = set(data) - {"loss", "targets", "optimizer", "optimizer_kwargs"}
        if unknown:
            raise SpecError(f"unknown train fields: {', '.join(sorted(unknown))}; known: loss, "
                            "targets, optimizer, optimizer_kwargs")
        if "loss" not in data:
            raise SpecError("train needs a loss, e.g. torch.nn.functional:mse_loss")
        return cls(loss=data["loss"], targets=data.get("targets", 1),
                   optimizer=data.get("optimizer", "SGD"),
                   optimizer_kwargs=dict(data.get("optimizer_kwargs") or {}))


MODEL_KINDS = ("factory", "function", "training_step")


@dataclass(frozen=True)
class ModelRef:
    """An importable callable: a factory returning an nn.Module (with JSON kwargs),
    or, with ``kind='function'``, a free function compiled as it is."""

    entrypoint: str
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    kind: str = "factory"
    # A free function's captured objects that torch cannot serialize (an
    # nn.Module with its weights): names of globals of the function's module.
    # Saved as references (``save_compiled_function(external_data=...)``); the
    # node supplies its own objects under the same names at load.
    external_data: tuple[str, ...] = ()
    # kind 'training_step': the factory's module trained with this loss and
    # optimizer (TrainSpec); None for every other kind.
    train: TrainSpec | None = None

    def __post_init__(self) -> None:
        if (self.kind == "training_step") != (self.train is not None):
            raise SpecError("model kind 'training_step' needs a train section (loss, targets, "
                            "optimizer, optimizer_kwargs), and only that kind takes one")
        if not isinstance(self.external_data, tuple) or not all(
                isinstance(n, str) and _IDENT_RE.match(n) for n in self.external_data):
            raise SpecError(f"external_data must be names of the function's globals (Python "
                            f"identifiers), got {self.external_data!r}")
        if len(set(self.external_data)) != len(self.external_data):
            raise SpecError(f"external_data names a global twice: {list(self.external_data)}")
        if self.external_data and self.kind != "function":
            raise SpecError("external_data is for a free function's captured objects "
                            "(kind 'function'); a factory's module holds its own weights")
        if not _ENTRYPOINT_RE.match(self.entrypoint):
            raise SpecError(
                f"bad entrypoint {self.entrypoint!r}: expected 'package.module:callable'"
            )
        if self.kind not in MODEL_KINDS:
            raise SpecError(f"unknown model kind {self.kind!r}; known: {', '.join(MODEL_KINDS)}")
        if self.kind == "function" and self.kwargs:
            raise SpecError("a free function takes no factory kwargs")
        try:
            canonical_json(dict(self.kwargs))
        except (TypeError, ValueError) as exc:
            raise SpecError(f"factory kwargs must be JSON: {exc}") from None

    def __hash__(self) -> int:
        return hash((self.entrypoint, canonical_json(dict(self.kwargs)), self.kind,
                     self.external_data, self.train))

    @property
    def identity(self) -> str:
        """What the fingerprint names the program by: the entrypoint, and for
        a training step its loss and optimizer too (two jobs training one
        model differently must not share an artifact and its verification)."""
        if self.train is None:
            return self.entrypoint
        return f"{self.entrypoint}|train:{self.train.canonical()}"

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "entrypoint": self.entrypoint, "kwargs": dict(self.kwargs), "kind": self.kind}
        if self.external_data:
            # Only when declared: specs stored before it keep their exact JSON.
            data["external_data"] = list(self.external_data)
        if self.train is not None:
            data["train"] = self.train.to_json()
        return data


@dataclass(frozen=True)
class JobSpec:
    """Everything needed to build one model for a set of targets."""

    name: str
    version: str
    model: ModelRef
    inputs: tuple[TensorSpec, ...]
    grad_mode: GradMode = GradMode.INFERENCE
    options: CompileOptions = field(default_factory=CompileOptions)
    targets: tuple[str, ...] = ()  # target selectors; empty means every live target
    # sha256 hex of the code pack the model's code travels in
    # (farm.core.codepack); None: the entrypoint is installed on the workers.
    code_digest: str | None = None

    def __post_init__(self) -> None:
        if not re.match(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$", self.name):
            raise SpecError(
                f"bad model name {self.name!r}: letters, digits, '.', '_' and '-', at most 128"
            )
        if not re.match(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,63}$", self.version):
            raise SpecError(f"bad version {self.version!r}: letters, digits, '.', '_', '+', '-'")
        # One call, one text (and one build key): keyword and dict inputs in
        # their canonical order, whatever order they were given in.
        object.__setattr__(self, "inputs", canonical_inputs(tuple(self.inputs)))
        if not self.inputs:
            raise SpecError("a job needs at least one input spec")
        train = self.model.train
        if train is not None:
            if self.grad_mode is not GradMode.TRAINING:
                raise SpecError("a training_step job is compiled for training: set "
                                "grad_mode 'training'")
            if train.targets >= len(self.inputs):
                raise SpecError(f"train.targets is {train.targets}, and the job has "
                                f"{len(self.inputs)} inputs: the model needs at least one "
                                "input before the loss's targets")
        if self.code_digest is not None and not _DIGEST_RE.match(self.code_digest):
            raise SpecError(f"bad code_digest {self.code_digest!r}: expected the sha256 of the "
                            "code pack, 64 lowercase hex characters")

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "name": self.name,
            "version": self.version,
            "model": self.model.to_json(),
            "inputs": [str(s) for s in self.inputs],
            "grad_mode": self.grad_mode.value,
            "options": self.options.to_json(),
            "targets": list(self.targets),
        }
        if self.code_digest is not None:
            # Left out when there is none, so specs stored before code packs
            # existed keep their exact JSON.
            data["code_digest"] = self.code_digest
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> JobSpec:
        try:
            model = data["model"]
            grad = data.get("grad_mode", GradMode.INFERENCE.value)
            try:
                grad_mode = GradMode(grad)
            except ValueError:
                raise SpecError(f"unknown grad_mode {grad!r}; known: inference, training") from None
            return cls(
                name=str(data["name"]),
                version=str(data["version"]),
                model=ModelRef(
                    entrypoint=str(model["entrypoint"]),
                    kwargs=dict(model.get("kwargs") or {}),
                    kind=str(model.get("kind", "factory")),
                    external_data=_names(model.get("external_data")),
                    train=None if model.get("train") is None
                    else TrainSpec.from_json(model["train"]),
                ),
                inputs=parse_inputs(data["inputs"]),
                grad_mode=grad_mode,
                options=CompileOptions.from_json(data.get("options")),
                targets=tuple(str(t) for t in data.get("targets") or ()),
                code_digest=None if data.get("code_digest") is None
                else str(data["code_digest"]),
            )
        except KeyError as exc:
            raise SpecError(f"job spec is missing {exc.args[0]!r}") from None
        except (TypeError, AttributeError) as exc:
            raise SpecError(f"malformed job spec: {exc}") from None


def _names(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise SpecError(f"external_data must be a list of names, e.g. [\"model\"], got {value!r}")
    return tuple(str(v) for v in value)


def canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)


def sha256_text(*parts: str) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode())
        h.update(b"\0")
    return h.hexdigest()


def build_key(
    *,
    fingerprint: str,
    inputs: Sequence[TensorSpec],
    grad_mode: GradMode,
    options: CompileOptions,
    target: str,
) -> str:
    """Identity of one build: artifacts are deduplicated on it.

    ``aot_compile`` output is not byte-reproducible, so builds are keyed by
    what went in, never by the bytes that came out.
    """
    return sha256_text(
        fingerprint, format_inputs(inputs), grad_mode.value, options.canonical(), target
    )
