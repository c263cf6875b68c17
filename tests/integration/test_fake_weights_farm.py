"""A fake-weight build through the real farm (API, Celery workers, the
sandboxed compile child and verifier): the compile worker's child builds with
FakeTensor weights, the verifier holds the real ones, and fresh node processes
get the artifact with a module that fits its weights manifest, and JIT, with
the farm's reason naming the weight, with one that does not."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.farm import Farm
from tests.fixtures.node import node_python
from tests.slowdown import scaled

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
NAME = "fake-weights-mlp"

NODE = """
import json, torch
from farm.node import compiled
from farm.zoo.basic import mlp

torch.manual_seed(0)
model = mlp(hidden={hidden}).eval()
x = torch.randn(8, 64)
fast = compiled(model, model="fake-weights-mlp", ref="1", example_inputs=[x])
with torch.no_grad():
    y = fast(x)
    want = model(x)
meta = (fast.artifact or {{}}).get("meta") or {{}}
# The verification report is in the signed build statement (not the answer).
verify = (fast.prefetched.verified.build or {{}}).get("verification") or {{}}
print(json.dumps({{"source": fast.source, "reason": fast.reason,
                  "weights": meta.get("weights"), "verify_ok": verify.get("ok"),
                  "max_diff": float((y - want).abs().max())}}))
"""


def _node(env: dict[str, str], hidden: int) -> dict[str, Any]:
    r = subprocess.run([*node_python(), "-c", NODE.format(hidden=hidden)], env=env, cwd=ROOT,
                       capture_output=True, text=True, timeout=scaled(600))
    assert r.returncode == 0, r.stderr[-4000:]
    return dict(json.loads(r.stdout.strip().splitlines()[-1]), log=r.stderr)


@pytest.fixture(scope="module")
def built(farm: Farm) -> dict[str, str]:
    env = {**farm.env}
    r = subprocess.run([sys.executable, "-m", "farm.app.cli", "submit", "farm.zoo.basic:mlp",
                        "--name", NAME, "--version", "1", "--input", "float32[8,64]",
                        "--target", "cpu", "--backend", "eager", "--weights", "fake", "--wait"],
                       env=env, cwd=ROOT, capture_output=True, text=True, timeout=scaled(900))
    assert r.returncode == 0, r.stdout + r.stderr
    return env


def test_a_node_whose_module_fits_runs_the_fake_weight_artifact(built: dict[str, str],
                                                                 tmp_path: Path) -> None:
    out = _node({**built, "CLIENT_CACHE_DIR": str(tmp_path / "cache")}, hidden=128)
    assert out["source"] == "farm", out["log"][-3000:]
    assert out["weights"] == {"mode": "fake", "why": "asked for (options.weights fake)"}
    assert out["verify_ok"] is True
    assert out["max_diff"] < 1e-4


def test_a_node_whose_weights_differ_is_refused_by_the_farms_check(built: dict[str, str],
                                                                   tmp_path: Path) -> None:
    out = _node({**built, "CLIENT_CACHE_DIR": str(tmp_path / "cache")}, hidden=96)
    assert out["source"] == "jit"
    assert "the module's weights do not fit the artifact: fc1.weight: shape [96,64], " \
           "artifact built for [128,64]" in (out["reason"] or ""), out["log"][-3000:]
    assert out["max_diff"] < 1e-4  # JIT runs the node's own module
