"""A stable hash of a captured FX graph: the identity of "the same model".

The canonical text of a graph keeps what determines the program (node kinds,
targets by qualified name, argument structure, constants, result dtypes and
shapes, the parameter and buffer names, shapes and dtypes) and drops what varies
from process to process for the same program: object ids and ``repr`` addresses,
source file paths and line numbers in node metadata, set and dict iteration order
(PYTHONHASHSEED), and the names torch gives shape symbols (numbered in order of
first appearance instead).

Weight-free tracing means tensor *values* are not part of the fingerprint: a
setting that only changes a buffer's contents (not the graph) is invisible here,
so models should compute such tables in ``forward`` from Python constants, which
the graph records (``farm.zoo.llama`` does this for its rotary tables).
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.fx

from farm.core.inputs import TensorSpec, format_inputs
from farm.core.specs import CompileOptions, GradMode

# /2: the code (pack digest, entrypoint and the built class) is part of it.
# /3: and the structure of what the program returns (``return_structure``).
FORMAT = "torch-farm-fingerprint/3"

_ADDRESS_RE = re.compile(r" at 0x[0-9a-fA-F]+")
# Names of sympy symbols torch uses for sizes: s0, s77, u3, zuf0, ...
_SYMBOL_RE = re.compile(r"\b[a-z]{1,4}\d+\b")


class _Canonicalizer:
    """Writes one canonical line per node; nested graphs (HOP bodies) inline."""

    def __init__(self) -> None:
        self.symbols: dict[str, str] = {}
        self.lines: list[str] = []
        self.regions: set[str] = set()

    # -- values -------------------------------------------------------------

    def sym(self, value: Any) -> str:
        text = str(value.node.expr) if hasattr(value, "node") else str(value)
        return _SYMBOL_RE.sub(self._symbol_name, text)

    def _symbol_name(self, m: re.Match[str]) -> str:
        return self.symbols.setdefault(m.group(0), f"d{len(self.symbols)}")

    def tensor_meta(self, t: torch.Tensor) -> str:
        dims = ",".join(str(d) if isinstance(d, int) else self.sym(d) for d in t.shape)
        return f"{str(t.dtype).removeprefix('torch.')}[{dims}]"

    def meta(self, value: Any) -> str:
        if isinstance(value, torch.Tensor):
            return self.tensor_meta(value)
        if isinstance(value, (tuple, list)):
            return "(" + ",".join(self.meta(v) for v in value) + ")"
        if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            return f"sym:{self.sym(value)}"
        if value is None or isinstance(value, (bool, int, float, str)):
            return _const(value)
        return type(value).__name__

    def arg(self, a: Any, index: dict[torch.fx.Node, int]) -> str:
        if isinstance(a, torch.fx.Node):
            return f"%{index[a]}"
        if isinstance(a, (tuple, list)):
            inner = ",".join(self.arg(x, index) for x in a)
            return f"({inner})" if isinstance(a, tuple) else f"[{inner}]"
        if isinstance(a, dict):
            items = sorted((str(k), self.arg(v, index)) for k, v in a.items())
            return "{" + ",".join(f"{k}:{v}" for k, v in items) + "}"
        if isinstance(a, slice):
            parts = (self.arg(x, index) for x in (a.start, a.stop, a.step))
            return f"slice({','.join(parts)})"
        if isinstance(a, torch.Tensor):
            # A tensor constant baked into the graph: values unknown on meta, so
            # its type stands in.
            return f"tensor:{self.tensor_meta(a)}"
        if isinstance(a, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            return f"sym:{self.sym(a)}"
        return _const(a)

    # -- graphs -------------------------------------------------------------

    def graph(self, gm: torch.fx.GraphModule, prefix: str = "") -> None:
        index: dict[torch.fx.Node, int] = {}
        for i, node in enumerate(gm.graph.nodes):
            index[node] = i
            meta = node.meta.get("example_value", node.meta.get("val"))
            if node.op == "placeholder":
                # Dynamo names placeholders after their source (L_x_,
                # L_self_modules_fc_parameters_weight_): parameter paths, not ids.
                head = f"placeholder {node.target}"
            elif node.op == "output":
                head = f"output {self.arg(node.args, index)}"
            elif node.op == "get_attr":
                head = f"get_attr {node.target}"
                sub = _get_attr(gm, str(node.target))
                if isinstance(sub, torch.fx.GraphModule):
                    region = _region_identifier(node)
                    if region is not None and region in self.regions:
                        # Dynamo gives a region's identifier only to calls it proved
                        # identical: the body was written at its first use.
                        self.lines.append(f"{prefix}{i} {head} = region {region!r}")
                        continue
                    if region is not None:
                        self.regions.add(region)
                    self.lines.append(f"{prefix}{i} {head} {{")
                    self.graph(sub, prefix + "  ")
                    self.lines.append(f"{prefix}}}")
                    continue
                if isinstance(sub, torch.Tensor):
                    head += f" tensor:{self.tensor_meta(sub)}"
            else:
                args = self.arg(node.args, index)
                kwargs = self.arg(node.kwargs, index) if node.kwargs else ""
                head = f"{node.op} {target_name(node)} {args}{kwargs}"
            line = f"{prefix}{i} {head}"
            if meta is not None and node.op != "output":
                line += f" -> {self.meta(meta)}"
            self.lines.append(line)


def target_name(node: torch.fx.Node) -> str:
    """A process-independent name for what a node calls."""
    t = node.target
    if isinstance(t, str):
        return t if node.op != "call_method" else f"Tensor.{t}"
    if isinstance(t, torch._ops.HigherOrderOperator):
        return f"higher_order.{t.name()}"
    if isinstance(t, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return str(t)
    try:
        return torch.fx.node._get_qualified_name(t)
    except Exception:
        name = getattr(t, "__qualname__", None) or type(t).__qualname__
        return f"{getattr(t, '__module__', None) or type(t).__module__}.{name}"


def _region_identifier(get_attr: torch.fx.Node) -> str | None:
    """The identifier of the invoke_subgraph call a subgraph attribute feeds."""
    for user in get_attr.users:
        t = user.target
        if (
            isinstance(t, torch._ops.HigherOrderOperator)
            and t.name() == "invoke_subgraph"
            and len(user.args) > 1
            and isinstance(user.args[1], str)
        ):
            return user.args[1]
    return None


def _const(v: Any) -> str:
    if isinstance(v, float):
        # repr is exact and process-independent; nan/inf spelled out.
        return repr(v) if math.isfinite(v) else str(v)
    if v is None or isinstance(v, (bool, int, str)):
        return repr(v)
    if v is Ellipsis:
        return "..."
    if isinstance(v, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
        return str(v)
    if isinstance(v, torch.fx.Node):
        return v.name
    if callable(v):
        try:
            return torch.fx.node._get_qualified_name(v)
        except Exception:
            pass
    # Anything else: its type and an address-free repr.
    return f"{type(v).__qualname__}:{_ADDRESS_RE.sub('', repr(v))}"


def _get_attr(gm: torch.nn.Module, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def canonical_graph(gm: torch.fx.GraphModule) -> str:
    c = _Canonicalizer()
    c.graph(gm)
    return "\n".join(c.lines)


def graph_hash(gm: torch.fx.GraphModule) -> str:
    return hashlib.sha256(canonical_graph(gm).encode()).hexdigest()


def tensor_lines(named: Iterable[tuple[str, str, torch.Tensor]]) -> list[str]:
    """``param name dtype[shape] requires_grad`` per tensor, in module order."""
    return [
        f"{kind} {name} {str(t.dtype).removeprefix('torch.')}{list(t.shape)}"
        f"{' grad' if t.requires_grad else ''}"
        for kind, name, t in named
    ]


def fingerprint(
    *,
    graph: str,
    tensors: Sequence[str],
    inputs: Sequence[TensorSpec],
    grad_mode: GradMode,
    options: CompileOptions,
    entrypoint: str,
    code_digest: str | None,
    model_class: str,
    returns: str = "",
    external_data: Sequence[str] = (),
) -> str:
    """sha256 over the graph hash, parameter/buffer lines, inputs, grad mode,
    options and the code, each part length-prefixed so no two part lists collide.

    The code is part of it because the graph alone does not say what an
    artifact is for: two classes with identical graphs would share one
    artifact whose type guard fails for the second class (its nodes then run
    JIT); two code packs that trace alike may still differ in what a node
    runs around the graph. ``model_class`` is the built object's
    ``module.qualname`` (``farm.core.modelref.model_class_name``).

    ``returns`` (``return_structure``) is the type structure of what the
    program returns: Dynamo's graph holds only the output tensors, and the
    code around it (which the artifact's bytecode replays) builds the
    returned object, so ``lambda x, y: x + y`` and a function that returns
    ``MyBox(x + y)`` have the same graph and must not share an artifact."""
    h = hashlib.sha256()
    for part in (
        FORMAT,
        graph,
        "\n".join(tensors),
        format_inputs(inputs),
        grad_mode.value,
        options.canonical(),
        entrypoint,
        code_digest or "",
        model_class,
        returns,
        ",".join(external_data),
    ):
        data = part.encode()
        h.update(len(data).to_bytes(8, "big"))
        h.update(data)
    return h.hexdigest()


def return_structure(value: Any) -> str:
    """The type structure of a program's result, process-independent: tensors
    by dtype and rank (shapes are in the graph), containers and pytree nodes
    by type and their children, any other object by ``module.qualname`` and
    its attributes (``__dict__`` or ``__slots__``) recursively, scalars by type.
    """
    return _structure(value, depth=0)


_MAX_DEPTH = 16


def _qualname(t: type) -> str:
    return f"{t.__module__}.{t.__qualname__}"


def _structure(v: Any, *, depth: int) -> str:
    import torch.utils._pytree as pytree

    if depth > _MAX_DEPTH:
        return "..."
    if isinstance(v, torch.Tensor):
        kind = "Parameter" if isinstance(v, torch.nn.Parameter) else "Tensor"
        return f"{kind}:{str(v.dtype).removeprefix('torch.')}/{v.dim()}"
    if v is None or isinstance(v, (bool, int, float, str, complex)):
        return type(v).__name__
    if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return type(v).__name__
    if isinstance(v, (tuple, list)) and type(v) in (tuple, list):
        inner = ",".join(_structure(x, depth=depth + 1) for x in v)
        return f"{type(v).__name__}({inner})"
    if isinstance(v, dict) and type(v) is dict:
        items = ",".join(f"{k!r}:{_structure(x, depth=depth + 1)}" for k, x in v.items())
        return f"dict({items})"
    if not pytree.tree_is_leaf(v):
        # A registered pytree node (namedtuple, ModelOutput, OrderedDict...):
        # its type, its context and its children.
        leaves, spec = pytree.tree_flatten(v)
        spec_text = " ".join(_ADDRESS_RE.sub("", str(spec)).split())
        return f"{_qualname(type(v))}<{spec_text}>(" + ",".join(
            _structure(x, depth=depth + 1) for x in leaves) + ")"
    attrs: dict[str, Any] | None = None
    if hasattr(v, "__dict__"):
        attrs = dict(vars(v))
    elif hasattr(type(v), "__slots__"):
        attrs = {n: getattr(v, n) for n in type(v).__slots__ if hasattr(v, n)}
    if attrs is not None:
        inner = ",".join(f"{k}={_structure(x, depth=depth + 1)}" for k, x in sorted(attrs.items()))
        return f"{_qualname(type(v))}({inner})"
    return _qualname(type(v))
