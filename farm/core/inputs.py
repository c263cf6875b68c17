"""Input specs: the tensors a job's program is built for and called with.

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

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
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
MIN_DYNAMIC = 2
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
