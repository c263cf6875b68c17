"""One rank of a tensor-parallel fleet node (run by ``dist_harness.run_ranks``):
resolve the farm's one TP artifact for this rank's layout, fetch and verify
it, load it into the guide's FeedForward parallelized on a real gloo CPU
mesh, and run the guide's training loop (section 7.1: Adam, 5 steps, loss =
out.sum()) beside the same model uncompiled from the same init. Prints one
JSON line: per step the loss of both and the worst gradient difference of
this rank's shards.
"""

from __future__ import annotations

import argparse
import json


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--input", required=True)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--wrong-world-size", type=int, default=None,
                   help="state this world size instead: the farm must refuse")
    a = p.parse_args()

    import torch

    from farm.core.inputs import parse_inputs
    from farm.core.parallel import local, make_mesh, parallelize, replicate, running_layout
    from farm.core.specs import GradMode, MeshLayout
    from farm.core.target import detect_local_target
    from farm.node.client import FarmClient
    from farm.node.errors import NotFoundError
    from tests.integration.dist_harness import init_gloo
    from tests.models.tp import feed_forward

    rank, world = init_gloo()
    layout = MeshLayout(world_size=world, mesh_shape=(world,), mesh_dim_names=("tp",))
    client = FarmClient()
    (spec,) = parse_inputs([a.input])
    if a.wrong_world_size is not None:
        wrong = MeshLayout(world_size=a.wrong_world_size, mesh_shape=(a.wrong_world_size,),
                           mesh_dim_names=("tp",))
        try:
            client.resolve(a.model, None, [a.input], GradMode.TRAINING,
                           detect_local_target("cpu"), layout=wrong.to_json(), rank=rank)
        except NotFoundError as exc:
            print(json.dumps({"rank": rank, "refused": str(exc),
                              "rejections": getattr(exc, "rejections", None)}))
            return
        raise SystemExit("the farm answered a layout it was not built for")

    resolved = client.resolve(a.model, None, [a.input], GradMode.TRAINING,
                              detect_local_target("cpu"), layout=layout.to_json(), rank=rank)
    artifact = resolved["artifact"]
    from farm.core.specs import ParallelLayout

    parallel = ParallelLayout.from_json(artifact["options"]["parallel"])
    running_layout(parallel.mesh)
    mesh = make_mesh(parallel.mesh, "cpu")

    def build() -> torch.nn.Module:
        torch.manual_seed(0)  # every rank the same full weights; each keeps its shard
        return parallelize(feed_forward(), parallel, mesh)

    model, reference = build(), build()
    fn = client.load(resolved, module=model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    opt_ref = torch.optim.Adam(reference.parameters(), lr=1e-3)
    steps = []
    for k in range(a.steps):
        gen = torch.Generator().manual_seed(100 + k)  # the same batch on every rank
        (x,) = replicate([torch.randn(spec.shape, generator=gen)], mesh)
        opt.zero_grad()
        opt_ref.zero_grad()
        loss = local(fn(x)).sum()
        loss.backward()
        loss_ref = local(reference(x)).sum()
        loss_ref.backward()
        grad_err = max(float((local(q.grad) - local(r.grad)).abs().max())
                       for q, r in zip(model.parameters(), reference.parameters(), strict=True))
        grad_sum = float(sum(local(q.grad).double().sum() for q in model.parameters()))
        opt.step()
        opt_ref.step()
        steps.append({"loss": float(loss), "loss_ref": float(loss_ref), "grad_err": grad_err,
                      "grad_sum": grad_sum})
    shard = tuple(local(model.linear1.weight).shape)
    from tests.integration.dist_harness import finish_rank

    finish_rank({"rank": rank, "world_size": world, "digest": artifact["digest"],
                 "shard": list(shard), "meta_parallel": artifact["meta"].get("parallel"),
                 "steps": steps})


if __name__ == "__main__":
    main()
