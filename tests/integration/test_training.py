"""Training programs of the 004 guide through the farm as a user sends them
(HTTP submit, trace worker, CPU compile worker, PostgreSQL, Redis, S3), then
trained by fleet nodes in fresh processes:

- a training step (model kind ``training_step``: an MLP with an MSE loss and
  SGD with momentum): the farm verified loss, gradients, parameters and the
  optimizer's state over two steps against eager; a node runs three steps
  with the loaded artifact and they match eager from the same init;
- the same artifact as the module handed to DistributedDataParallel: two
  gloo ranks (``dist_harness``) each load it, train three steps on their own
  batches, and match uncompiled DDP; both ranks hold the same all-reduced
  gradients;
- a plain factory job built for training, loaded as the model's forward and
  handed to DDP, with the node's own loss and optimizer (the guide's
  ``model.compile()`` then ``DistributedDataParallel(model)``);
- one build with Inductor (AdamW): a real C++ compile, verified the same way.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.farm import ROOT, Farm
from tests.fixtures.node import node_python
from tests.integration.dist_harness import run_ranks
from tests.slowdown import scaled

pytestmark = [pytest.mark.integration, pytest.mark.xdist_group("training")]

NODE = Path(__file__).with_name("train_node.py")
INPUTS = ["float32[8,8]", "float32[8,1]"]  # x, then the loss's target
# float32 arithmetic of one program, compiled and eager: a few ulps.
TOL = 1e-5


def train_job(name: str, *, backend: str, optimizer: str,
              optimizer_kwargs: dict[str, Any]) -> dict[str, Any]:
    return {
        "name": name, "version": "1", "grad_mode": "training",
        "model": {"entrypoint": "tests.models.training:make", "kind": "training_step",
                  "train": {"loss": "torch.nn.functional:mse_loss", "targets": 1,
                            "optimizer": optimizer, "optimizer_kwargs": optimizer_kwargs}},
        "inputs": INPUTS, "options": {"backend": backend}, "targets": ["cpu"],
    }


def node_args(model: str, *extra: str) -> list[str]:
    args = ["--model", model, *extra]
    for spec in INPUTS:
        args += ["--input", spec]
    return args


def check_verified(job: dict[str, Any], optimizer: str) -> dict[str, Any]:
    assert job["state"] == "succeeded", json.dumps(job, indent=1)[:6000]
    (build,) = job["builds"]
    (art,) = build["artifacts"]
    meta = art["meta"]
    assert meta["train"]["optimizer"] == optimizer
    assert meta["optimizer_step"]["compiled"] is False and "graph" in meta["optimizer_step"]["why"]
    verify = meta["verify"]
    assert verify["train"]["steps"] == 2
    names = {o["output"] for o in verify["outputs"]}
    params = ["fc1.weight", "fc1.bias", "norm.weight", "norm.bias", "fc2.weight", "fc2.bias"]
    for k in (1, 2):
        assert f"step{k} loss" in names
        for p in params:
            assert f"step{k} grad model.{p}" in names
            assert f"step{k} param model.{p}" in names
    assert any(n.startswith("step2 optimizer model.") for n in names)
    assert all(o["ok"] and o["max_abs_err"] <= o["tol"] for o in verify["outputs"])
    return dict(art)


def check_steps(result: dict[str, Any]) -> None:
    assert result["source"] == "farm" and len(result["steps"]) == 3
    for s in result["steps"]:
        for key in ("loss_err", "grad_err", "param_err", "state_err"):
            assert s[key] <= TOL * max(1.0, abs(s["loss_ref"])), (key, s)
        assert s["state_keys"] > 0
    # It trains: the loss moves.
    assert result["steps"][0]["loss"] != result["steps"][-1]["loss"]


def test_training_step_through_the_farm_alone_and_under_ddp(farm: Farm) -> None:
    kwargs = {"lr": 0.05, "momentum": 0.9}
    job = farm.wait_job(farm.submit(train_job("train-sgd", backend="aot_eager",
                                              optimizer="SGD", optimizer_kwargs=kwargs)))
    art = check_verified(job, "SGD")
    assert art["options"]["backend"] == "aot_eager"

    # One node, a fresh process.
    env = {**farm.env, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([*node_python(), str(NODE), *node_args("train-sgd")], env=env,
                         cwd=ROOT, capture_output=True, text=True, timeout=scaled(300))
    assert out.returncode == 0, out.stdout + out.stderr
    single = json.loads(out.stdout.strip().splitlines()[-1])
    assert single["digest"] == art["digest"]
    check_steps(single)

    # Two gloo ranks: the artifact is the module DDP wraps.
    ranks = run_ranks(NODE, node_args("train-sgd", "--ddp"), world_size=2, env=farm.env)
    assert [r["rank"] for r in ranks] == [0, 1]
    for r in ranks:
        assert r["digest"] == art["digest"] and r["world_size"] == 2
        check_steps(r)
    for s0, s1 in zip(ranks[0]["steps"], ranks[1]["steps"], strict=True):
        # Different batches, one all-reduced gradient, so one model.
        assert s0["loss"] != s1["loss"]
        assert s0["grad_sum"] == pytest.approx(s1["grad_sum"], rel=1e-6, abs=1e-7)
    # And DDP's averaged gradient is not one rank's own.
    assert ranks[0]["steps"][0]["grad_sum"] != pytest.approx(single["steps"][0]["grad_sum"])


def test_the_compiled_module_handed_to_ddp(farm: Farm) -> None:
    """A plain factory job built for training: each rank loads its artifact as
    the module's forward and hands that module to DDP; the loss and SGD are
    the node's own (the guide's ``model.compile(); DistributedDataParallel(model)``)."""
    spec = {"name": "train-inner", "version": "1", "grad_mode": "training",
            "model": {"entrypoint": "tests.models.training:make"},
            "inputs": INPUTS[:1], "options": {"backend": "aot_eager"}, "targets": ["cpu"]}
    job = farm.wait_job(farm.submit(spec))
    assert job["state"] == "succeeded", json.dumps(job, indent=1)[:6000]
    (art,) = job["builds"][0]["artifacts"]
    assert art["meta"]["grad_mode"] == "training" and "train" not in art["meta"]
    args = ["--model", "train-inner", "--input", INPUTS[0], "--inner", INPUTS[1], "--ddp"]
    ranks = run_ranks(NODE, args, world_size=2, env=farm.env)
    for r in ranks:
        assert r["digest"] == art["digest"]
        check_steps(r)
    for s0, s1 in zip(ranks[0]["steps"], ranks[1]["steps"], strict=True):
        assert s0["loss"] != s1["loss"]
        assert s0["grad_sum"] == pytest.approx(s1["grad_sum"], rel=1e-6, abs=1e-7)


def test_training_step_with_inductor(farm: Farm) -> None:
    job = farm.wait_job(farm.submit(train_job("train-adamw", backend="inductor",
                                              optimizer="AdamW",
                                              optimizer_kwargs={"lr": 0.01})))
    art = check_verified(job, "AdamW")
    assert art["options"]["backend"] == "inductor"
    names = {o["output"] for o in art["meta"]["verify"]["outputs"]}
    assert {"step2 optimizer model.fc1.weight.exp_avg",
            "step2 optimizer model.fc1.weight.exp_avg_sq",
            "step2 optimizer model.fc1.weight.step"} <= names
    out = subprocess.run([*node_python(), str(NODE), *node_args("train-adamw")],
                         env={**farm.env, "PYTHONPATH": str(ROOT)}, cwd=ROOT,
                         capture_output=True, text=True, timeout=scaled(600))
    assert out.returncode == 0, out.stdout + out.stderr
    check_steps(json.loads(out.stdout.strip().splitlines()[-1]))
