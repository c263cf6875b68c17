"""Fake-weight builds on CPU (farm.build.fake_weights): what the H200 probe
showed for CUDA holds on CPU with this torch. The build's weights are
FakeTensors (no storage); the verifier, in its own process, holds the real
weights; a fresh node process loads the artifact with a real module and
matches eager, and the farm's own weight check refuses a module of another
shape before anything is loaded (the dropped guards no longer would)."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from farm.build.sandbox import build_isolation
from farm.build.verify import verify_artifact
from farm.core.specs import JobSpec
from farm.node.weight_check import MANIFEST_KEY
from tests.fixtures.builds import compile_in_child
from tests.fixtures.node import node_python
from tests.slowdown import scaled

pytestmark = [pytest.mark.integration, pytest.mark.slow]

HIDDEN = 64


def job(hidden: int = HIDDEN, *, weights: str = "fake") -> JobSpec:
    return JobSpec.from_json({
        "name": "fake-mlp", "version": "1",
        "model": {"entrypoint": "farm.zoo.basic:mlp",
                  "kwargs": {"d_in": 32, "hidden": hidden, "d_out": 32}},
        "inputs": ["float32[2..8,32]"], "grad_mode": "inference",
        "options": {"weights": weights},
    })


@pytest.fixture(scope="module")
def built(build_tmp_factory: Callable[[str], Path]) -> dict[str, Any]:
    out = build_tmp_factory("fake")
    # As a compile worker's child builds it, sandboxed (default formats: the
    # AOTI package is skipped for a fake build, and says why).
    res = compile_in_child(job(), out / "out", timeout_s=scaled(600), memory_mb=12000)
    assert res.ok, f"{res.describe()}\n{res.traceback}\n{res.stderr_tail[-3000:]}"
    (art,) = res.value["artifacts"]
    return {**art, "dir": out}


def test_the_fake_build_drops_only_weight_guards_and_records_the_manifest(
        built: dict[str, Any]) -> None:
    meta = built["meta"]
    assert built["format"] == "aot_compile"
    assert meta["weights"]["mode"] == "fake"
    assert "fake-weight" in meta["formats_skipped"]["aoti"]
    guards = meta["guards"]
    assert guards["weight_guards_dropped"] == 4  # fc1/fc2 weight and bias
    dropped = {d["name"] for d in guards["dropped"] if d["type"] == "TENSOR_MATCH"}
    assert "module._modules['fc1']._parameters['weight']" in dropped
    # The input's own tensor guard stays.
    assert [t["shape"] for t in guards["tensors"]] == [[2, 32]]
    assert [(e["name"], e["shape"]) for e in meta[MANIFEST_KEY]] == [
        ("fc1.weight", [HIDDEN, 32]), ("fc1.bias", [HIDDEN]), ("fc2.weight", [32, HIDDEN]),
        ("fc2.bias", [32])]


def test_the_verifier_holds_the_real_weights_and_checks_the_manifest(
        built: dict[str, Any]) -> None:
    manifest = built["meta"][MANIFEST_KEY]
    report = verify_artifact(job(), built["path"], "aot_compile", device="cpu",
                             timeout_s=scaled(900), weights_manifest=manifest,
                             isolation=build_isolation())
    assert report.ok, report.error
    assert report.model_init == "real"
    assert report.max_abs_err is not None and report.max_abs_err <= (report.tol or 0)
    assert len(report.sizes_checked) == 2  # the example batch and one more

    # A manifest the verifier's real module does not fit: refused by the check.
    wrong = [{**e, "shape": [128, 32]} if e["name"] == "fc1.weight" else e for e in manifest]
    bad = verify_artifact(job(), built["path"], "aot_compile", device="cpu",
                          timeout_s=scaled(900), weights_manifest=wrong,
                          isolation=build_isolation())
    assert not bad.ok
    assert "fc1.weight: shape [64,32], artifact built for [128,32]" in (bad.error or "")


def test_a_fresh_node_loads_it_with_real_weights_and_refuses_a_wrong_shape(
        built: dict[str, Any]) -> None:
    meta_path = Path(built["dir"]) / "meta.json"
    meta_path.write_text(json.dumps(built["meta"]))
    repo = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [*node_python(), str(Path(__file__).with_name("fake_weights_node.py")), built["path"],
         str(meta_path), str(HIDDEN), "128"],
        capture_output=True, text=True, timeout=scaled(900), cwd=repo,
        env={**os.environ, "PYTHONPATH": str(repo)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert all(e <= 1e-4 for e in result["errs"]), result
    assert result["refused"] == ("the module's weights do not fit the artifact: fc1.weight: "
                                 "shape [128,32], artifact built for [64,32]")
