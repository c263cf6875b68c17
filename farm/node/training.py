"""Train with a farm-built ``training_step`` artifact, alone or under DDP.

The artifact is the model's forward and loss with their backward (see
``farm.core.training``); the optimizer step runs uncompiled, torch's
multi-tensor kernels. One step is::

    opt.zero_grad(); loss = artifact(*inputs, *targets); loss.backward(); opt.step()

(zeroing first, so a step's gradients stay readable until the next one.)

    step = compiled_train_step(client, resolved, model)      # model: your nn.Module
    for x, y in data:
        loss = step(x, y)

Under ``DistributedDataParallel`` (``ddp=True``) the compiled module is the
one handed to DDP, as the 004 guide recommends: DDP wraps a module whose
forward is the artifact, so DDP's gradient all-reduce stays outside the
compiled program, in its autograd hooks, and every rank loads the same
artifact (nothing rank-specific is compiled in).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from farm.core.specs import TrainSpec
from farm.core.training import LossStep, loss_step, make_optimizer


class CompiledForward(nn.Module):
    """``module`` (a model, or a LossStep) whose forward is its loaded
    artifact: what DDP wraps. Its parameters are the module's, so DDP syncs
    and reduces them; the artifact reads them from ``module``."""

    def __init__(self, module: nn.Module, artifact: Callable[..., Any]) -> None:
        super().__init__()
        self.module = module
        self._artifact = artifact

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._artifact(*args, **kwargs)


def compiled_ddp_module(client: Any, resolved: Mapping[str, Any], model: nn.Module,
                        **ddp_kwargs: Any) -> nn.Module:
    """The guide's "compile the module handed to DDP" for any training-mode
    artifact of ``model`` (a factory job with grad_mode training): fetch,
    verify and load it for ``model``, and return DistributedDataParallel
    around the module whose forward is the artifact. The loss, the
    optimizer and the loop are the caller's, as with ``model.compile()``
    followed by ``DistributedDataParallel(model)``. Call after
    ``torch.distributed.init_process_group``."""
    from torch.nn.parallel import DistributedDataParallel

    artifact = resolved.get("artifact", resolved)
    if (artifact.get("meta") or {}).get("grad_mode") != "training":
        raise ValueError(f"artifact {str(artifact.get('digest', ''))[:12]} was compiled for "
                         "inference: it has no backward to train under DDP (resolve with "
                         "GradMode.TRAINING)")
    # The class check reads the signed statement (client.load), not the row.
    fn = client.load(resolved, module=model, class_of=model)
    return DistributedDataParallel(CompiledForward(model, fn), **ddp_kwargs)


class TrainStep:
    """Callable training step; ``source`` says what computes the forward and
    backward ("farm" artifact, or "eager" for a reference run)."""

    def __init__(self, forward: Callable[..., torch.Tensor], optimizer: torch.optim.Optimizer,
                 *, program: LossStep, source: str) -> None:
        self.forward = forward
        self.optimizer = optimizer
        self.program = program
        self.source = source

    @property
    def model(self) -> nn.Module:
        return self.program.model

    def __call__(self, *inputs_and_targets: torch.Tensor) -> torch.Tensor:
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.forward(*inputs_and_targets)
        loss.backward()
        self.optimizer.step()
        return loss.detach()


def train_spec_of(artifact: Mapping[str, Any]) -> TrainSpec:
    """The loss and optimizer the artifact was built and verified with."""
    meta = artifact.get("meta") or {}
    if "train" not in meta:
        raise ValueError(f"artifact {str(artifact.get('digest', ''))[:12]} is not a training "
                         "step (its job's model kind is not 'training_step')")
    return TrainSpec.from_json(meta["train"])


def make_train_step(program: LossStep, forward: Callable[..., torch.Tensor], train: TrainSpec, *,
                    optimizer: torch.optim.Optimizer | None = None, ddp: bool = False,
                    ddp_kwargs: Mapping[str, Any] | None = None, source: str) -> TrainStep:
    """The loop around ``forward`` (the artifact bound to ``program``, or
    ``program`` itself for eager), with the spec's optimizer unless given one;
    with ``ddp``, the forward runs inside DistributedDataParallel."""
    fwd: Callable[..., torch.Tensor] = forward
    if ddp:
        from torch.nn.parallel import DistributedDataParallel

        inner: nn.Module = (program if forward is program
                            else CompiledForward(program, forward))
        fwd = DistributedDataParallel(inner, **dict(ddp_kwargs or {}))
    opt = optimizer if optimizer is not None else make_optimizer(train, program.parameters())
    return TrainStep(fwd, opt, program=program, source=source)


def compiled_train_step(client: Any, resolved: Mapping[str, Any], model: nn.Module, *,
                        loss: Callable[..., torch.Tensor] | None = None,
                        optimizer: torch.optim.Optimizer | None = None, ddp: bool = False,
                        ddp_kwargs: Mapping[str, Any] | None = None) -> TrainStep:
    """Fetch, verify and load a training-step artifact (``client``: a
    ``FarmClient``; ``resolved``: its ``resolve(..., GradMode.TRAINING, ...)``
    answer) for ``model`` (this node's module, with its weights), and return
    the step. ``loss`` defaults to the job's loss function, ``optimizer`` to
    the job's optimizer over ``model``'s parameters."""
    artifact = resolved.get("artifact", resolved)
    train = train_spec_of(artifact)
    program = loss_step(model, train, loss)
    # Another model's program would train this one's parameters wrongly: the
    # signed statement's class must be this program's (client.load checks).
    fn = client.load(resolved, module=program, class_of=program)
    return make_train_step(program, fn, train, optimizer=optimizer, ddp=ddp,
                           ddp_kwargs=ddp_kwargs, source="farm")


def eager_train_step(model: nn.Module, train: TrainSpec, *, ddp: bool = False,
                     ddp_kwargs: Mapping[str, Any] | None = None) -> TrainStep:
    """The same loop uncompiled: the reference a node can compare with."""
    program = loss_step(model, train)
    return make_train_step(program, program, train, ddp=ddp, ddp_kwargs=ddp_kwargs,
                           source="eager")
