"""What a node's calls accept, made into the farm's own types: grad modes,
input specs (strings, specs or example tensors, named by a mapping) and
targets ("auto": this node's)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any
from urllib.parse import urlsplit

from farm.core.inputs import TensorSpec, canonical_inputs, parse_inputs
from farm.core.specs import GradMode, SpecError
from farm.core.target import Target


def module_tensors(module_or_fn: Any) -> Iterator[Any]:
    """A module's parameters, then its buffers; nothing for a function."""
    for get in ("parameters", "buffers"):
        tensors = getattr(module_or_fn, get, None)
        if callable(tensors):
            yield from tensors()


def is_loopback(url: str) -> bool:
    import ipaddress

    host = (urlsplit(url).hostname or "").strip("[]").lower()
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def as_grad_mode(value: GradMode | str | bool | None) -> GradMode:
    """``None`` means the current torch grad mode; ``True`` means training."""
    if isinstance(value, GradMode):
        return value
    if value is None:
        import torch

        return GradMode.TRAINING if torch.is_grad_enabled() else GradMode.INFERENCE
    if isinstance(value, bool):
        return GradMode.TRAINING if value else GradMode.INFERENCE
    try:
        return GradMode(value)
    except ValueError:
        raise SpecError(f"unknown grad_mode {value!r}; known: inference, training") from None


def as_input_specs(inputs: Any) -> tuple[TensorSpec, ...]:
    """Input specs from spec strings, ``TensorSpec``s or example tensors (static
    shapes); a mapping names them: ``{"input_ids": ids, "batch": {"x": x}}``
    is ``input_ids=...`` and ``batch.x=...`` (keyword and dict inputs)."""
    if inputs is None:
        raise SpecError("input specs are needed to resolve an artifact")
    if isinstance(inputs, str):
        return parse_inputs(p for p in inputs.split(";") if p)
    if isinstance(inputs, Mapping):
        named = []
        for path, item in _named_items(inputs, ""):
            (spec,) = as_input_specs([item])
            named.append(dataclasses.replace(spec, name=path))
        return canonical_inputs(named)
    out = []
    for item in inputs:
        if isinstance(item, TensorSpec):
            out.append(item)
        elif isinstance(item, str):
            out.append(TensorSpec.parse(item))
        elif hasattr(item, "shape") and hasattr(item, "dtype"):
            dtype = str(item.dtype).removeprefix("torch.")
            out.append(TensorSpec.parse(f"{dtype}[{','.join(str(int(d)) for d in item.shape)}]"))
        else:
            raise SpecError(f"cannot make an input spec of {type(item).__name__}: give a spec "
                            "string like 'float32[8,64]' or an example tensor")
    if not out:
        raise SpecError("at least one input spec is needed")
    return canonical_inputs(out)


def _named_items(mapping: Mapping[str, Any], prefix: str) -> list[tuple[str, Any]]:
    """(dotted path, leaf) of a nested mapping of example tensors or specs."""
    out: list[tuple[str, Any]] = []
    for key, item in mapping.items():
        path = f"{prefix}{key}"
        if isinstance(item, Mapping):
            out += _named_items(item, path + ".")
        else:
            out.append((path, item))
    return out


def as_target(target: Target | str | None, device: str | None = None) -> Target:
    if isinstance(target, Target):
        return target
    if target is None or target == "auto":
        # A node: what it can run depends on its CPU, not on a compiler; kept
        # per machine so that a CLI call need not import torch for it.
        from farm.node.local_target import node_target

        return node_target(device)
    return Target.parse(target)
