"""Analysis of a captured graph for the trace report: FLOPs (``FlopCounterMode``
on fresh static fake tensors, a nested compile region counted once and
multiplied by its calls), node counts and the op histogram.

Split out of farm.build.trace (which calls ``_analyse``); the bodies are as they were.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx

from farm.core import fingerprint as fp

log = logging.getLogger("farm.build.trace")

@dataclass
class _Analysis:
    flops: int = 0
    nodes: int = 0
    ops: Counter[str] = field(default_factory=Counter)
    region_calls: int = 0


def _analyse(gm: torch.fx.GraphModule) -> _Analysis:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.flop_counter import FlopCounterMode

    # A fresh mode without a shape env: symbolic sizes become their example
    # values, and nothing here can add a guard to Dynamo's shape env.
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    counter = FlopCounterMode(display=False)
    memo: dict[str, _Analysis] = {}
    with fake, counter:
        return _analyse_graph(gm, memo, counter)


def _analyse_graph(
    gm: torch.fx.GraphModule,
    memo: dict[str, _Analysis],
    counter: Any,
) -> _Analysis:
    out = _Analysis()
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method", "call_module"):
            continue
        if isinstance(node.target, torch._ops.HigherOrderOperator):
            _add(out, _analyse_hop(gm, node, memo, counter))
            continue
        name = fp.target_name(node)
        out.nodes += 1
        out.ops[name] += 1
        if name in _ZERO_FLOP:
            continue
        before = counter.get_total_flops()
        _run_node(gm, node)
        out.flops += counter.get_total_flops() - before
    return out


# Targets that never reach a matmul, convolution or attention kernel (the only ops
# FlopCounterMode counts): skipping them saves replaying most of a graph.
# Anything not listed is replayed, so a missing name costs time, never accuracy.
_ZERO_FLOP = frozenset(
    [f"_operator.{n}" for n in (
        "add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "neg", "pos", "getitem",
        "lt", "le", "gt", "ge", "eq", "ne", "and_", "or_", "not_", "invert", "iadd", "imul",
    )]
    + [f"Tensor.{n}" for n in (
        "view", "reshape", "transpose", "permute", "contiguous", "to", "float", "half",
        "bfloat16", "type_as", "chunk", "split", "size", "dim", "unsqueeze", "squeeze",
        "expand", "expand_as", "repeat", "repeat_interleave", "flatten", "unflatten",
        "narrow", "select", "clone", "detach", "masked_fill", "pow", "mean", "sum", "exp",
        "sin", "cos", "rsqrt", "sqrt", "softmax", "add", "mul", "sub", "div", "t",
    )]
    + [f"torch.{n}" for n in (
        "cat", "stack", "arange", "zeros", "ones", "empty", "full", "rsqrt", "sqrt", "exp",
        "sin", "cos", "tanh", "sigmoid", "relu", "softmax", "where", "triu", "tril", "outer",
        "polar", "view_as_real", "view_as_complex", "flatten", "reshape", "mean", "sum",
    )]
    + [f"torch.nn.functional.{n}" for n in (
        "silu", "gelu", "relu", "softmax", "dropout", "embedding", "pad", "layer_norm",
        "rms_norm",
    )]
)


def _analyse_hop(
    gm: torch.fx.GraphModule,
    node: torch.fx.Node,
    memo: dict[str, _Analysis],
    counter: Any,
) -> _Analysis:
    subgraphs = [
        sub
        for a in node.args
        if isinstance(a, torch.fx.Node) and a.op == "get_attr"
        for sub in [fp._get_attr(gm, str(a.target))]
        if isinstance(sub, torch.fx.GraphModule)
    ]
    name = node.target.name()
    if name == "invoke_subgraph" and len(node.args) > 1 and isinstance(node.args[1], str):
        # Dynamo reuses a region's identifier only for calls it proved identical.
        key = node.args[1]
        if key not in memo:
            memo[key] = _sum(_analyse_graph(s, memo, counter) for s in subgraphs)
        result = _copy(memo[key])
        result.region_calls += 1
        return result
    total = _sum(_analyse_graph(s, memo, counter) for s in subgraphs)
    total.nodes += 1
    total.ops[f"higher_order.{name}"] += 1
    return total


def _add(a: _Analysis, b: _Analysis) -> None:
    a.flops += b.flops
    a.nodes += b.nodes
    a.ops.update(b.ops)
    a.region_calls += b.region_calls


def _sum(parts: Iterable[_Analysis]) -> _Analysis:
    out = _Analysis()
    for p in parts:
        _add(out, p)
    return out


def _copy(a: _Analysis) -> _Analysis:
    return _Analysis(a.flops, a.nodes, Counter(a.ops), a.region_calls)


def _run_node(gm: torch.fx.GraphModule, node: torch.fx.Node) -> None:
    """Run one node on fresh fakes shaped like its recorded inputs, so the FLOP
    counter sees the aten ops it dispatches to. Only tensor-in, tensor-out nodes
    run: the rest (grad-mode and autocast switches, getitem on sizes) compute
    nothing and some of them change global state."""
    if not _is_tensorish(node.meta.get("example_value", node.meta.get("val"))):
        return
    has_tensor_input = False

    def concrete(a: Any) -> Any:
        nonlocal has_tensor_input
        if isinstance(a, torch.fx.Node):
            a = a.meta.get("example_value", a.meta.get("val"))
        if isinstance(a, torch.Tensor):
            has_tensor_input = True
            return _static_fake(a)
        if isinstance(a, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            return _hint(a)
        if isinstance(a, (list, tuple)):
            items = [concrete(x) for x in a]
            if hasattr(a, "_fields"):  # a namedtuple takes its fields positionally
                return type(a)(*items)
            return type(a)(items)
        if isinstance(a, dict):
            return {k: concrete(v) for k, v in a.items()}
        return a

    try:
        args = concrete(node.args)
        kwargs = concrete(node.kwargs)
        if not has_tensor_input:
            return
        if node.op == "call_method":
            getattr(args[0], str(node.target))(*args[1:], **kwargs)
        elif node.op == "call_function":
            node.target(*args, **kwargs)
        elif node.op == "call_module":
            # Only without inline_inbuilt_nn_modules: the submodule's own (meta)
            # parameters are fakified on the fly (allow_non_fake_inputs).
            gm.get_submodule(str(node.target))(*args, **kwargs)
    except Exception:
        # A node we cannot replay counts no FLOPs; the capture itself succeeded.
        log.debug("FLOP count skipped %s", node.format_node(), exc_info=True)


def _is_tensorish(v: Any) -> bool:
    if isinstance(v, torch.Tensor):
        return True
    return isinstance(v, (list, tuple)) and any(isinstance(x, torch.Tensor) for x in v)


def _static_fake(t: torch.Tensor) -> torch.Tensor:
    shape = [_hint(s) for s in t.shape]
    try:
        stride = [_hint(s) for s in t.stride()]
        return torch.empty_strided(shape, stride, dtype=t.dtype, device=t.device)
    except Exception:  # sparse or otherwise strideless
        return torch.empty(shape, dtype=t.dtype, device=t.device)


def _hint(v: Any) -> Any:
    """The example value behind a symbolic size, read without adding a guard."""
    if not isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return v
    node = v.node
    hint = getattr(node, "_hint", None)
    if hint is None:
        try:
            hint = node.shape_env.size_hint(node.expr, allow_none=True)
        except Exception:
            hint = None
    if hint is None:  # unbacked (data-dependent) size: 1 keeps the count finite
        hint = 1
    if isinstance(v, torch.SymInt):
        return int(hint)
    if isinstance(v, torch.SymFloat):
        return float(hint)
    return bool(hint)
