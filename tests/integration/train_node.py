"""A fleet node that trains with a farm-built training-step artifact, run as a
fresh process (alone, or as one rank of a gloo group under
``tests.integration.dist_harness`` with ``--ddp``): resolve, fetch and verify,
load, run ``--steps`` steps, and beside it the same loop uncompiled from the
same init (with ``--ddp``: uncompiled DDP). Prints one JSON line: the losses,
and per step the worst error of the loss, the gradients, the parameters and
the optimizer state against eager.
"""

from __future__ import annotations

import argparse
import copy
import json
import os


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--input", action="append", required=True)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--ddp", action="store_true")
    p.add_argument("--inner", metavar="TARGET_SPEC", default=None,
                   help="the model is a plain training-mode factory job: DDP wraps its "
                        "compiled module (compiled_ddp_module), and the loss (MSE against a "
                        "target of this spec) and SGD are this script's")
    a = p.parse_args()

    import torch

    from farm.core.inputs import parse_inputs
    from farm.core.specs import GradMode
    from farm.core.target import detect_local_target
    from farm.core.training import optimizer_tensors
    from farm.node.client import FarmClient
    from farm.node.training import compiled_train_step, eager_train_step, train_spec_of
    from tests.models.training import make

    rank = 0
    if a.ddp:
        from tests.integration.dist_harness import init_gloo

        rank, _ = init_gloo()
    torch.manual_seed(0)  # every rank builds the same init, as DDP expects
    model = make()
    reference = copy.deepcopy(model)

    specs = parse_inputs(a.input)
    client = FarmClient()
    resolved = client.resolve(a.model, None, [str(s) for s in specs], GradMode.TRAINING,
                              detect_local_target("cpu"))
    artifact = resolved["artifact"]
    if a.inner:
        step, eager = inner_ddp_steps(client, resolved, model, reference)
        specs = (*specs, *parse_inputs([a.inner]))
    else:
        step = compiled_train_step(client, resolved, model, ddp=a.ddp)
        eager = eager_train_step(reference, train_spec_of(artifact), ddp=a.ddp)

    def errors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
        assert sorted(got) == sorted(want), (sorted(got), sorted(want))
        return max(float((got[k] - want[k]).abs().max()) for k in want)

    def grads(s: object) -> dict[str, torch.Tensor]:
        return {n: q.grad.detach().clone() for n, q in s.program.named_parameters()  # type: ignore[attr-defined]
                if q.grad is not None}

    result: dict[str, object] = {"rank": rank, "digest": artifact["digest"],
                                 "format": artifact["format"],
                                 "optimizer_step": artifact["meta"].get("optimizer_step"),
                                 "world_size": int(os.environ.get("WORLD_SIZE", "1"))}
    steps = []
    for k in range(a.steps):
        gen = torch.Generator().manual_seed(100 + 10 * rank + k)  # each rank its own batch
        batch = [torch.randn(s.shape, generator=gen) for s in specs]
        loss = step(*batch)
        loss_ref = eager(*batch)
        names = {id(q): n for n, q in step.program.named_parameters()}
        names_ref = {id(q): n for n, q in eager.program.named_parameters()}
        steps.append({
            "loss": float(loss), "loss_ref": float(loss_ref),
            "loss_err": abs(float(loss) - float(loss_ref)),
            "grad_err": errors(grads(step), grads(eager)),
            "param_err": errors(dict(step.program.named_parameters()),
                                dict(eager.program.named_parameters())),
            "state_err": errors(optimizer_tensors(step.optimizer, names),
                                optimizer_tensors(eager.optimizer, names_ref)),
            "state_keys": len(optimizer_tensors(step.optimizer, names)),
            # Under DDP every rank holds the all-reduced gradient: the test
            # compares these across ranks.
            "grad_sum": float(sum(g.double().sum() for g in grads(step).values())),
        })
    result["steps"] = steps
    result["source"] = step.source
    if a.ddp:
        from tests.integration.dist_harness import finish_rank

        finish_rank(result)
    print(json.dumps(result))


def inner_ddp_steps(client: object, resolved: dict[str, object], model: object,
                    reference: object) -> tuple[object, object]:
    """The guide's pattern with the farm's artifact: DDP around the compiled
    module, the loss and the optimizer outside; and the same uncompiled."""
    import torch
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    from farm.core.training import LossStep
    from farm.node.training import TrainStep, compiled_ddp_module

    def make_step(module: torch.nn.Module, ddp: torch.nn.Module, source: str) -> TrainStep:
        opt = torch.optim.SGD(module.parameters(), lr=0.05, momentum=0.9, foreach=True)
        return TrainStep(lambda x, y: F.mse_loss(ddp(x), y), opt,
                         program=LossStep(module, F.mse_loss, 1), source=source)

    compiled = compiled_ddp_module(client, resolved, model)
    return (make_step(model, compiled, "farm"),  # type: ignore[arg-type]
            make_step(reference, DistributedDataParallel(reference), "eager"))  # type: ignore[arg-type]


if __name__ == "__main__":
    main()
