"""The training step a ``training_step`` job compiles, shared by the build
(trace, compile, verify) and the fleet node, so all of them run one program.

The 004 guide recommends compiling the whole train step (zero_grad, forward,
loss, backward, optimizer step). Plain torch 2.13 cannot capture that in one
full graph: ``Tensor.backward()`` is unsupported under Dynamo, and
``Optimizer.step`` breaks the graph on purpose (``torch.optim.optimizer
._use_grad`` calls ``torch._dynamo.graph_break()`` so AOTAutograd sees the
step's ``no_grad``), so ``aot_compile``, which needs ``fullgraph=True``,
refuses it. What the farm compiles is the most torch can give ahead of time:

- ``LossStep``: ``loss(model(*inputs), *targets)``, compiled under grad
  with AOTAutograd's backward in the same artifact;
- the optimizer step runs uncompiled, as torch's multi-tensor (``foreach``)
  kernels where the optimizer has them: ``OPTIMIZER_STEP`` is what an
  artifact records about it. Unwrapping the graph breaks does not give a
  loadable step either (measured on 2.13, backend aot_eager: SGD with
  momentum compiles and saves, and the loaded function fails with an
  IndexError; AdamW raises TensorifyScalarRestartAnalysis inside
  ``aot_compile``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from farm.core.specs import TrainSpec

OPTIMIZER_STEP = {
    "compiled": False,
    "runs": "eager torch.optim step (foreach kernels where the optimizer has them)",
    "why": ("torch 2.13's Optimizer.step breaks the graph on purpose (_use_grad), and "
            "aot_compile needs one full graph; with the breaks unwrapped SGD's loaded step "
            "fails (IndexError) and AdamW's aot_compile raises TensorifyScalarRestartAnalysis"),
}


class LossStep(nn.Module):
    """``loss(model(*inputs), *targets)``: the module a training_step job
    compiles. The model is a submodule, so the artifact's parameters are the
    model's (names prefixed ``model.``) and an optimizer over either trains both."""

    def __init__(self, model: nn.Module, loss: Callable[..., torch.Tensor], targets: int) -> None:
        super().__init__()
        self.model = model
        self.loss = loss
        self.targets = targets

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        split = len(args) - self.targets
        return self.loss(self.model(*args[:split]), *args[split:])


def load_loss(train: TrainSpec) -> Callable[..., torch.Tensor]:
    from farm.core.modelref import load_callable

    return load_callable(train.loss)


def loss_step(model: nn.Module, train: TrainSpec,
              loss: Callable[..., torch.Tensor] | None = None) -> LossStep:
    """``model`` wrapped as its training step (``loss`` defaults to the spec's)."""
    return LossStep(model, loss if loss is not None else load_loss(train), train.targets)


def make_optimizer(train: TrainSpec, params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    """The spec's ``torch.optim`` class on ``params``, with the multi-tensor
    (foreach) implementation where it has one and the kwargs do not choose."""
    cls = getattr(torch.optim, train.optimizer, None)
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise ValueError(f"torch.optim has no optimizer {train.optimizer!r}")
    kwargs: dict[str, Any] = dict(train.optimizer_kwargs)
    if "foreach" in inspect.signature(cls).parameters and "fused" not in kwargs:
        kwargs.setdefault("foreach", True)
    return cls(params, **kwargs)


def optimizer_tensors(opt: torch.optim.Optimizer,
                      names: dict[int, str]) -> dict[str, torch.Tensor]:
    """Every tensor of the optimizer's state, keyed ``PARAM.KEY`` (``names``:
    id(parameter) -> its name): what verification compares after a step."""
    out: dict[str, torch.Tensor] = {}
    for p, state in opt.state.items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                out[f"{names.get(id(p), '?')}.{key}"] = value.detach().clone()
    return out
