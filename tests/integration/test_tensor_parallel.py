"""One artifact for every rank. The aot_compile guide's tensor-parallel
FeedForward (section 7.1: linear1 ColwiseParallel, linear2 RowwiseParallel,
a 1-D mesh) goes through the farm as a user sends it, with options.parallel:
the trace and compile workers build it once, as rank 0 of a fake process
group, under compile_on_one_rank; the artifact records its world size and
mesh. Two gloo CPU ranks (``dist_harness``) each resolve and load that one
artifact into the model parallelized on a real DTensor CPU mesh and run the
guide's training loop (Adam, loss = out.sum()) beside the uncompiled model;
losses and gradients match on both ranks. A node stating another world size
is refused, with the reason.

Backends eager and inductor. An Inductor artifact reloads without the mesh
its graph asks for its process group (torch 2.13: "'NoneType' object has no
attribute 'get_group'"); the node hands it its own (FarmClient.load(mesh=),
farm.core.parallel.bind_mesh). aot_eager cannot save a compile_on_one_rank
graph at all (bench/results/tp_compile_on_one_rank-*.json says what torch does).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.farm import Farm
from tests.integration.dist_harness import run_ranks

pytestmark = [pytest.mark.integration, pytest.mark.xdist_group("tensor_parallel")]

NODE = Path(__file__).with_name("tp_node.py")
INPUT = "float32[4,64]"
LAYOUT = {"world_size": 2, "mesh_shape": [2], "mesh_dim_names": ["tp"],
          "plan": {"linear1": "colwise", "linear2": "rowwise"}}
# One program, compiled and eager, in float32: a few ulps.
TOL = 1e-5


def tp_job(name: str, backend: str) -> dict[str, Any]:
    return {"name": name, "version": "1", "grad_mode": "training",
            "model": {"entrypoint": "tests.models.tp:feed_forward"},
            "inputs": [INPUT], "options": {"backend": backend, "parallel": LAYOUT},
            "targets": ["cpu"]}


def build_once_train_on_both_ranks(farm: Farm, name: str, backend: str) -> None:
    job = farm.wait_job(farm.submit(tp_job(name, backend)))
    assert job["state"] == "succeeded", json.dumps(job, indent=1)[:6000]
    (build,) = job["builds"]
    (art,) = build["artifacts"]  # one artifact for the two ranks (no AOTI: training)
    assert art["format"] == "aot_compile"
    assert art["options"]["parallel"] == LAYOUT
    meta = art["meta"]
    assert meta["parallel"]["compile_on_one_rank"] is True
    assert meta["parallel"]["world_size"] == 2 and meta["parallel"]["mesh_shape"] == [2]
    assert meta["verify"]["ok"] is True

    ranks = run_ranks(NODE, ["--model", name, "--input", INPUT], world_size=2, env=farm.env)
    assert [r["rank"] for r in ranks] == [0, 1]
    for r in ranks:
        assert r["digest"] == art["digest"]
        assert r["shard"] == [64, 64]  # linear1's 128 rows split over 2 ranks
        assert len(r["steps"]) == 5
        for s in r["steps"]:
            assert abs(s["loss"] - s["loss_ref"]) <= TOL * max(1.0, abs(s["loss_ref"])), s
            assert s["grad_err"] <= TOL, s
        # It trains: the loss moves.
        assert r["steps"][0]["loss"] != r["steps"][-1]["loss"]
    # Row-wise output is all-reduced: both ranks see the one loss; their
    # gradient shards are their own.
    for s0, s1 in zip(ranks[0]["steps"], ranks[1]["steps"], strict=True):
        assert s0["loss"] == pytest.approx(s1["loss"], rel=1e-6)
        assert s0["grad_sum"] != s1["grad_sum"]


def test_one_tp_artifact_trains_on_both_ranks(farm: Farm) -> None:
    build_once_train_on_both_ranks(farm, "tp-ff", "eager")
    refused = run_ranks(NODE, ["--model", "tp-ff", "--input", INPUT, "--wrong-world-size", "4"],
                        world_size=2, env=farm.env)
    for r in refused:
        reasons = [x["reason"] for x in r["rejections"] or []]
        assert any("built for world 2, mesh [tp:2], the node runs world 4, mesh [tp:4]" in x
                   for x in reasons), r
        assert {x["code"] for x in r["rejections"]} == {"layout"}


def test_one_inductor_tp_artifact_trains_on_both_ranks(farm: Farm) -> None:
    build_once_train_on_both_ranks(farm, "tp-ff-inductor", "inductor")
