"""A module's tensors by every name torch gives them, and which names share one.

One tensor can have several names: a causal LM's output head tied to its
token embedding (GPT-2's ``lm_head.weight`` is ``transformer.wte.weight``), an
encoder that shares its parent's embedding (T5's ``encoder.embed_tokens``), a
buffer registered on two modules. ``named_parameters()`` lists such a tensor
once, under its first name; ``remove_duplicate=False`` lists every name. The
farm's weights manifest records every name and, for each, the first name that
shares its tensor (``tensor``), so that a node's module whose weights are tied
differently from the built one is refused rather than run with one of two
copies.

Other ways a module's tensors can be aliased or absent, and what this module
does with each:

- ``Module.to_empty()`` (how every build makes its weights) gives each
  module its own new tensor, which unties tied weights: a meta-built GPT-2
  ended with two ``lm_head``/``wte`` weights where the node's has one.
  ``to_empty_keeping_aliases`` ties them again.
- Non-persistent buffers (``register_buffer(..., persistent=False)``: RoPE
  ``inv_freq``, BERT's ``position_ids``) are not in ``state_dict()``; they are
  in the manifest with ``persistent: False``, checked where both sides have
  them, and a module may lack or add one: a rotary cache is created lazily, at
  a module's first call.
- Parametrizations (``torch.nn.utils.parametrize``): the stored tensors are
  ``x.parametrizations.weight.original0`` (and ``original1``), the names
  ``named_parameters`` gives; ``x.weight`` is computed and is not a tensor of
  the module's.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

PARAMETER = "parameter"
BUFFER = "buffer"


@dataclass(frozen=True)
class NamedTensor:
    """One name of one of a module's tensors."""

    name: str
    kind: str  # PARAMETER or BUFFER
    tensor: torch.Tensor
    owner: nn.Module  # the submodule that holds it
    attr: str  # its key in the owner's _parameters or _buffers
    persistent: bool  # in state_dict (every parameter; a buffer unless registered otherwise)


def named_tensors(module: nn.Module) -> Iterator[NamedTensor]:
    """Every parameter, then every buffer, under every name torch gives it
    (``remove_duplicate=False``), in torch's order."""
    for prefix, sub in module.named_modules(remove_duplicate=False):
        dot = f"{prefix}." if prefix else ""
        for attr, p in sub._parameters.items():
            if p is not None:
                yield NamedTensor(dot + attr, PARAMETER, p, sub, attr, True)
    for prefix, sub in module.named_modules(remove_duplicate=False):
        dot = f"{prefix}." if prefix else ""
        for attr, b in sub._buffers.items():
            if b is not None:
                yield NamedTensor(
                    dot + attr, BUFFER, b, sub, attr, attr not in sub._non_persistent_buffers_set
                )


def tensor_names(module: nn.Module) -> dict[str, str]:
    """Each name -> the first name of the same tensor (itself when it is the first)."""
    first: dict[int, str] = {}
    out: dict[str, str] = {}
    for t in named_tensors(module):
        out[t.name] = first.setdefault(id(t.tensor), t.name)
    return out


def _groups(module: nn.Module) -> list[list[NamedTensor]]:
    """The names of each tensor that has more than one."""
    by_id: dict[int, list[NamedTensor]] = {}
    for t in named_tensors(module):
        by_id.setdefault(id(t.tensor), []).append(t)
    return [g for g in by_id.values() if len(g) > 1]


def to_empty_keeping_aliases(module: nn.Module, device: torch.device | str) -> nn.Module:
    """``module.to_empty(device=device)``, with every tensor that had several
    names still one tensor afterwards (``to_empty`` makes one per name)."""
    groups = _groups(module)
    module.to_empty(device=device)
    for group in groups:
        head = group[0]
        kept: Any = getattr(head.owner, "_parameters" if head.kind == PARAMETER else "_buffers")[
            head.attr
        ]
        for t in group[1:]:
            # The dict, not setattr: a parametrized attribute is a property.
            store = t.owner._parameters if t.kind == PARAMETER else t.owner._buffers
            store[t.attr] = kept
    return module


def zero_unloaded(module: nn.Module) -> list[str]:
    """Zero what no checkpoint gives a weightless (``to_empty``-ed) module:
    non-persistent buffers (BERT's ``position_ids``, computed in ``__init__``
    and not in ``state_dict``) and every integer or boolean tensor (indices,
    masks). Uninitialised memory there is an out-of-range index the first
    time the build runs the model (a CPU warm-up call: Inductor's kernel
    aborts the process on it). Returns the names zeroed."""
    done: set[int] = set()
    names = []
    with torch.no_grad():
        for t in named_tensors(module):
            if id(t.tensor) in done or t.tensor.device.type == "meta":
                continue
            if not t.persistent or not (t.tensor.is_floating_point() or t.tensor.is_complex()):
                t.tensor.zero_()
                done.add(id(t.tensor))
                names.append(t.name)
    return names


__all__ = [
    "BUFFER",
    "PARAMETER",
    "NamedTensor",
    "named_tensors",
    "tensor_names",
    "to_empty_keeping_aliases",
    "zero_unloaded",
]
