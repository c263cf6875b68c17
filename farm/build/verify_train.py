"""Verification of a ``training_step`` artifact beyond one forward and
backward: the loop a node runs (``loss = artifact(*inputs, *targets);
loss.backward(); opt.step(); opt.zero_grad()``) for a few steps, beside the
same loop in eager from the same weights, comparing at every step the loss,
every parameter's gradient, every parameter after the step and every tensor
of the optimizer's state (momentum buffers, Adam's moments and step count).

Called by ``farm.build.verify.verify_step`` in its sandboxed child.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from farm.core.specs import TrainSpec
from farm.core.training import OPTIMIZER_STEP, make_optimizer, optimizer_tensors

STEPS = 2

# add(got, ref, what, factor): the verifier's per-leaf comparison (farm.build.compare.Worst.add).
Compare = Callable[[torch.Tensor, torch.Tensor, str, float], None]


def check_train_steps(train: TrainSpec, *, eager: nn.Module, compiled_module: nn.Module,
                      fn: Callable[..., Any], inputs: Sequence[torch.Tensor], compare: Compare,
                      grad_factor: float, steps: int = STEPS) -> dict[str, Any]:
    """Run ``steps`` optimizer steps with the eager module and with the loaded
    artifact ``fn`` (bound to ``compiled_module``, which starts with the same
    weights), comparing as the module docstring says. Returns what the
    verification record says about the loop."""
    opt_e = make_optimizer(train, eager.parameters())
    opt_c = make_optimizer(train, compiled_module.parameters())
    names_e = {id(p): n for n, p in eager.named_parameters()}
    names_c = {id(p): n for n, p in compiled_module.named_parameters()}
    params_c = dict(compiled_module.named_parameters())
    losses = []
    for k in range(1, steps + 1):
        eager.zero_grad(set_to_none=True)
        compiled_module.zero_grad(set_to_none=True)
        with torch.enable_grad():
            loss_e = eager(*inputs)
            loss_c = fn(*inputs)
            if not isinstance(loss_e, torch.Tensor) or loss_e.dim() != 0:
                raise ValueError(f"the loss {train.loss} returned "
                                 f"{getattr(loss_e, 'shape', type(loss_e))}; a training step "
                                 "needs a scalar loss (reduction 'mean' or 'sum')")
            loss_e.backward()
            loss_c.backward()
        compare(loss_c, loss_e, f"step{k} loss", 1.0)
        losses.append(float(loss_c.detach()))
        for name, p in eager.named_parameters():
            q = params_c[name]
            if (p.grad is None) != (q.grad is None):
                raise AssertionError(f"step{k} grad {name}: eager has one: {p.grad is not None}, "
                                     f"artifact: {q.grad is not None}")
            if p.grad is not None and q.grad is not None:
                compare(q.grad, p.grad, f"step{k} grad {name}", grad_factor)
        opt_e.step()
        opt_c.step()
        for name, p in eager.named_parameters():
            compare(params_c[name].detach(), p.detach(), f"step{k} param {name}", grad_factor)
        state_e = optimizer_tensors(opt_e, names_e)
        state_c = optimizer_tensors(opt_c, names_c)
        if sorted(state_e) != sorted(state_c):
            raise AssertionError(f"step{k}: optimizer state {sorted(state_c)}, "
                                 f"eager {sorted(state_e)}")
        for key, ref in state_e.items():
            compare(state_c[key], ref, f"step{k} optimizer {key}", grad_factor)
    return {"steps": steps, "optimizer": train.optimizer,
            "optimizer_kwargs": dict(train.optimizer_kwargs), "losses": losses,
            "optimizer_step": OPTIMIZER_STEP}
