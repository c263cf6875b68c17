"""One artifact for every rank (issue 19): build cost and correctness of the
aot_compile guide's tensor-parallel FeedForward (section 7.1) compiled once
with ``torch.distributed.config.compile_on_one_rank`` against once per rank
without it.

Every build runs in a fresh process as the farm's build worker does: one
process, a fake process group (``FakeStore``) playing rank R of the world
size, a cold Inductor cache of its own. Every load check runs the artifact
on 2 real gloo CPU ranks (``torch.multiprocessing``) against the uncompiled
model (loss and every gradient shard, 3 forward+backward steps).

Two plans over a 1-D mesh:
  guide   linear1 ColwiseParallel, linear2 RowwiseParallel (the guide's)
  gather  linear1 Colwise(output Replicate), linear2 Rowwise(input Replicate):
          each rank cuts its own chunk of a replicated activation, the case
          where a graph depends on the rank's mesh coordinate

    .venv/bin/python bench/tp_compile_on_one_rank.py            # about 3 min on 2 loaded cores
    .venv/bin/python bench/tp_compile_on_one_rank.py --backends eager --plans guide

Writes bench/results/tp_compile_on_one_rank-<date>.json and a table on stdout.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DIM, HIDDEN, BATCH = 64, 128, 4


def _plan(name: str) -> dict[str, Any]:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if name == "guide":
        return {"linear1": ColwiseParallel(), "linear2": RowwiseParallel()}
    return {"linear1": ColwiseParallel(output_layouts=Replicate()),
            "linear2": RowwiseParallel(input_layouts=Replicate())}


def _model(mesh: Any, plan: str) -> Any:
    import torch
    from torch.distributed.tensor.parallel import parallelize_module

    from tests.models.tp import feed_forward

    torch.manual_seed(0)
    return parallelize_module(feed_forward(DIM, HIDDEN), mesh, _plan(plan), src_data_rank=None)


def _first_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"


def build_one(args: argparse.Namespace) -> None:
    """Child: build as rank ``--rank`` of a fake group, save to ``--out``, print JSON."""
    import torch
    import torch.distributed as dist
    import torch.distributed.config as dist_config
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=args.rank, world_size=args.world)
    mesh = init_device_mesh("cpu", (args.world,))
    model = _model(mesh, args.plan)
    x = DTensor.from_local(torch.randn(BATCH, DIM), mesh, [Replicate()], run_check=False)
    t0 = time.perf_counter()
    result: dict[str, Any] = {}
    try:
        with dist_config.patch(compile_on_one_rank=args.flag):
            fn = torch.compile(model, fullgraph=True, backend=args.backend
                               ).forward.aot_compile(((x,), {}))
        fn.save_compiled_function(args.out)
        result["ok"] = True
    except Exception as exc:
        result.update(ok=False, error=_first_line(exc))
    result["build_s"] = round(time.perf_counter() - t0, 3)
    dist.destroy_process_group()
    print(json.dumps(result))


def _rank_check(rank: int, path: str, plan: str, port: int, out: str, bind: bool) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))

    def local(t: Any) -> Any:
        return t.to_local() if isinstance(t, DTensor) else t

    res: dict[str, Any] = {"rank": rank}
    try:
        model, ref = _model(mesh, plan), _model(mesh, plan)
        with open(path, "rb") as f:
            fn = torch.compiler.load_compiled_function(f)
        if bind:
            from farm.core.parallel import bind_mesh

            res["mesh_refs_bound"] = bind_mesh(mesh)
        loss_err = grad_err = 0.0
        for k in range(3):
            gen = torch.Generator().manual_seed(100 + k)
            x = DTensor.from_local(torch.randn(BATCH, DIM, generator=gen), mesh, [Replicate()],
                                   run_check=False)
            loss = local(fn(model, x)).sum()
            loss.backward()
            loss_ref = local(ref(x)).sum()
            loss_ref.backward()
            loss_err = max(loss_err, abs(float(loss) - float(loss_ref)))
            grad_err = max(grad_err, *(float((local(p.grad) - local(q.grad)).abs().max())
                                       for p, q in zip(model.parameters(), ref.parameters(),
                                                       strict=True)))
        res.update(ok=True, loss_err=loss_err, grad_err=grad_err)
    except Exception as exc:
        res.update(ok=False, error=_first_line(exc))
    Path(f"{out}.{rank}").write_text(json.dumps(res))
    dist.destroy_process_group()


def load_check(path: str, plan: str, *, bind: bool = False) -> list[dict[str, Any]]:
    import torch.multiprocessing as mp

    from farm.core.net import free_port

    with tempfile.TemporaryDirectory() as d:
        out = str(Path(d) / "r")
        mp.spawn(_rank_check, args=(path, plan, free_port(), out, bind), nprocs=2)
        return [json.loads(Path(f"{out}.{r}").read_text()) for r in range(2)]


def build(backend: str, plan: str, world: int, rank: int, flag: bool, out: str) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(ROOT),
           # A cold Inductor cache per build: a per-rank build must not hit
           # rank 0's cache entry, a farm's build workers share none.
           "TORCHINDUCTOR_CACHE_DIR": tempfile.mkdtemp(prefix="tp-bench-inductor-")}
    argv = [sys.executable, __file__, "--child", "--backend", backend, "--plan", plan,
            "--world", str(world), "--rank", str(rank), "--out", out]
    if flag:
        argv.append("--flag")
    t0 = time.perf_counter()
    p = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=900)
    wall = round(time.perf_counter() - t0, 3)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    res = json.loads(lines[-1]) if lines else {"ok": False, "error": p.stderr[-300:]}
    res["process_s"] = wall
    if res.get("ok"):
        res["sha256"] = hashlib.sha256(Path(out).read_bytes()).hexdigest()[:16]
        res["size"] = Path(out).stat().st_size
    return res


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--child", action="store_true")
    p.add_argument("--backend", default="eager")
    p.add_argument("--plan", default="guide")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--flag", action="store_true")
    p.add_argument("--out")
    p.add_argument("--backends", default="eager,aot_eager,inductor")
    p.add_argument("--plans", default="guide,gather")
    p.add_argument("--worlds", default="2,4", help="world sizes to build for (load checks: 2)")
    a = p.parse_args()
    if a.child:
        build_one(a)
        return
    rows: list[dict[str, Any]] = []
    work = Path(tempfile.mkdtemp(prefix="tp-bench-"))
    for backend in a.backends.split(","):
        for plan in a.plans.split(","):
            for world in (int(w) for w in a.worlds.split(",")):
                one = build(backend, plan, world, 0, True,
                            str(work / f"{backend}-{plan}-{world}-one"))
                per = [build(backend, plan, world, r, False,
                             str(work / f"{backend}-{plan}-{world}-r{r}")) for r in range(world)]
                row: dict[str, Any] = {
                    "backend": backend, "plan": plan, "world_size": world,
                    "one_rank": {"artifacts": 1 if one.get("ok") else 0,
                                 "build_s": one["build_s"], "process_s": one["process_s"],
                                 **({"error": one["error"]} if not one.get("ok") else {})},
                    "per_rank": {"artifacts": sum(1 for r in per if r.get("ok")),
                                 "build_s": round(sum(r["build_s"] for r in per), 3),
                                 "process_s": round(sum(r["process_s"] for r in per), 3),
                                 "distinct_bytes": len({r.get("sha256") for r in per
                                                        if r.get("ok")})},
                }
                if world == 2:
                    if one.get("ok"):
                        path = str(work / f"{backend}-{plan}-{world}-one")
                        row["one_rank"]["load_on_2_gloo_ranks"] = load_check(path, plan)
                        # What FarmClient.load(mesh=) does (farm.core.parallel.bind_mesh).
                        row["one_rank"]["load_with_bind_mesh"] = load_check(path, plan,
                                                                            bind=True)
                    if per[0].get("ok"):
                        # Rank 0's own per-rank artifact on both ranks: why
                        # a rank-dependent graph needs one artifact per rank.
                        row["per_rank"]["rank0_artifact_on_2_gloo_ranks"] = load_check(
                            str(work / f"{backend}-{plan}-{world}-r0"), plan)
                rows.append(row)
                print(_line(row), flush=True)
    import torch

    stamp = time.strftime("%Y-%m-%d")
    out = (ROOT / "bench" / "results"
           / f"tp_compile_on_one_rank-{stamp}-{a.backends.replace(',', '+')}.json")
    out.write_text(json.dumps({"torch": torch.__version__, "host": os.uname().nodename,
                               "cpus": os.cpu_count(), "rows": rows}, indent=1) + "\n")
    print(f"wrote {out.relative_to(ROOT)}")


def _verdict(checks: list[dict[str, Any]] | None) -> str:
    if not checks:
        return "-"
    if not all(c["ok"] for c in checks):
        return "load fails: " + next(c["error"] for c in checks if not c["ok"])[:70]
    worst = max(max(c["loss_err"], c["grad_err"]) for c in checks)
    return "matches" if worst <= 1e-5 else f"WRONG (max err {worst:.3g})"


def _line(row: dict[str, Any]) -> str:
    one, per = row["one_rank"], row["per_rank"]
    one_txt = (f"{one['artifacts']} artifact {one['build_s']:.2f} s"
               if one["artifacts"] else f"build fails: {one['error'][:60]}")
    return (f"{row['backend']:9} {row['plan']:6} W={row['world_size']}  "
            f"flag: {one_txt}, {_verdict(one.get('load_on_2_gloo_ranks'))}, with bind_mesh "
            f"{_verdict(one.get('load_with_bind_mesh'))} | "
            f"per rank: {per['artifacts']} artifacts {per['build_s']:.2f} s "
            f"({per['distinct_bytes']} distinct), rank 0's on both: "
            f"{_verdict(per.get('rank0_artifact_on_2_gloo_ranks'))}")


if __name__ == "__main__":
    main()
