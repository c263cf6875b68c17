"""Fake-weight builds: compile a model whose weights need no memory on the build device.

A default build (``weights: empty``) makes the model on the meta device and
``to_empty()``s it onto the target: real Parameters in uninitialised memory, so
the weights still take their bytes on the build GPU, and a model larger than it
fails early (``farm.build.weightless.check_fits``). A fake-weight build
(``weights: fake``) does the ``to_empty()`` inside
``FakeTensorMode(allow_non_fake_inputs=True)``: every parameter and buffer is
a FakeTensor (shape, dtype and device, no storage), the example inputs too, and
``aot_compile`` traces and lowers them as it traces real ones. On the H200
(torch 2.11) an MLP block compiled so in 4.4 s with 512 bytes of GPU memory and,
loaded with real weights, matched eager (3.6e-6); on CPU with torch 2.13 the
same holds (tests/unit/test_fake_weights.py). A CUDA build still needs the GPU
(Inductor's ``mm`` lowering asks for it), not its memory.

Guards: an artifact traced with fake parameters fails its TYPE_MATCH guards on
a real module ("expected ... tensor type, but found Parameter"), so the guard
filter drops TYPE_MATCH and TENSOR_MATCH guards on parameters and buffers
(``WeightFreeGuards``). They were what checked the weights, so the build
records the weights' manifest (``farm.node.weight_check``) and the node checks
its module against it before the first call.

``weights: auto`` (the default) is ``empty`` where the weights fit and ``fake``
for a CUDA build where they do not; a fake build that torch cannot do fails
with the numbers of the fit check and torch's reason.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from farm.build.guards import GuardPolicy
from farm.core.aliases import to_empty_keeping_aliases
from farm.core.inputs import TensorSpec
from farm.core.modelref import apply_grad_mode, build_module, mark_dynamic_dims
from farm.core.specs import JobSpec
from farm.node.weight_check import weights_manifest

WEIGHTS_EMPTY = "empty"
WEIGHTS_FAKE = "fake"
WEIGHTS_AUTO = "auto"

# A guard on one parameter or buffer itself (``module._modules['fc1']._parameters['weight']``),
# not on the dicts that hold them (``module._parameters``), whose type guards stay.
_WEIGHT_SOURCE = re.compile(r"\._(parameters|buffers)\[['\"][^'\"]*['\"]\]$")
_WEIGHT_GUARD_TYPES = frozenset({"TYPE_MATCH", "TENSOR_MATCH"})


def is_weight_guard(entry: Any) -> bool:
    """A TYPE_MATCH or TENSOR_MATCH guard on a parameter or buffer."""
    return entry.guard_type in _WEIGHT_GUARD_TYPES and bool(
        _WEIGHT_SOURCE.search(str(entry.name)))


class WeightFreeGuards(GuardPolicy):
    """The job's guard policy, less the guards on the weights themselves
    (listed as dropped in the summary, and counted under ``weight_guards_dropped``)."""

    def __call__(self, entries: Sequence[Any]) -> list[bool]:
        keep = super().__call__(entries)
        weights = [is_weight_guard(e) for e in entries]
        keep = [k and not w for k, w in zip(keep, weights, strict=True)]
        self.summary = self._summarise(entries, keep)
        self.summary["weight_guards_dropped"] = sum(weights)
        self.summary["weights_checked_by"] = "farm.node.weight_check (weights_manifest)"
        return keep


@dataclass
class WeightsPlan:
    """How the build's weights are made, and why."""

    mode: str  # WEIGHTS_EMPTY or WEIGHTS_FAKE
    why: str
    fake_mode: Any = None  # the FakeTensorMode of a fake build
    # Set when ``auto`` fell back to fake because the weights do not fit: the
    # fit check's message, for a fake build that fails too.
    does_not_fit: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"mode": self.mode, "why": self.why}


def fake_tensor_mode() -> Any:
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


def build_fake(spec: JobSpec, device: torch.device) -> tuple[Any, Any]:
    """The model with FakeTensor parameters and buffers on ``device`` (no
    storage anywhere), and the FakeTensorMode they belong to."""
    model = build_module(spec.model, device="meta")
    mode = fake_tensor_mode()
    if isinstance(model, nn.Module):
        with mode:
            to_empty_keeping_aliases(model, device)
        apply_grad_mode(model, spec.grad_mode)
    return model, mode


def fake_inputs(specs: Sequence[TensorSpec], device: torch.device, mode: Any, *,
                mark_dynamic: bool = True) -> list[torch.Tensor]:
    """The example inputs as FakeTensors of ``mode`` (dynamic dims marked)."""
    out = []
    with mode:
        for s in specs:
            out.append(torch.empty(s.shape, dtype=getattr(torch, s.dtype), device=device))
    if mark_dynamic:
        for t, s in zip(out, specs, strict=True):
            mark_dynamic_dims(t, s)
    return out


def fake_unsupported(spec: JobSpec) -> str | None:
    """Why ``spec`` cannot be a fake-weight build (None: it can)."""
    if spec.options.parallel is not None:
        return ("a tensor-parallel build (options.parallel) shards real weights across a fake "
                "process group; fake weights are not supported there")
    if spec.model.external_data:
        return ("a function with external_data captures the node's own objects; fake weights "
                "are for modules")
    return None


def manifest_of(spec: JobSpec, model: Any) -> list[dict[str, Any]] | None:
    """The weights' manifest the node checks (None: not a module, or a
    tensor-parallel one: never a fake build, its DTensor weights keep their
    guards, and a rank's module is parallelized only after it is bound)."""
    if not isinstance(model, nn.Module) or spec.options.parallel is not None:
        return None
    return weights_manifest(model)


def describe_failure(plan: WeightsPlan, exc: BaseException) -> str:
    """The message of a fake-weight build torch could not do."""
    reason = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
    if plan.does_not_fit:
        return (f"{plan.does_not_fit}. A fake-weight build (no memory for the weights) was "
                f"tried and torch could not do it: {reason}")
    return f"the fake-weight build (options.weights fake) failed in torch: {reason}"


__all__ = [
    "WEIGHTS_AUTO",
    "WEIGHTS_EMPTY",
    "WEIGHTS_FAKE",
    "WeightFreeGuards",
    "WeightsPlan",
    "build_fake",
    "describe_failure",
    "fake_inputs",
    "fake_unsupported",
    "is_weight_guard",
    "manifest_of",
]
