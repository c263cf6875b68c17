"""A fleet node's everyday use against a real farm (PostgreSQL, Redis, S3,
the API and Celery workers in their own processes, a real build): the
README's snippet as written gets the farm's artifact, a node whose farm is
down runs what it prefetched, and ``fallback=False`` says why nothing fits.

Each node is a fresh Python process, as on a fleet.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.farm import Farm
from tests.fixtures.faults import TcpProxy
from tests.fixtures.node import node_python

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
NAME = "node-mlp"

# The README's fleet snippet, as a user copies it (grad mode on, the module
# fresh from its constructor, so in training mode).
SNIPPET = """
import json, sys, torch
from farm.node import compiled
from farm.zoo.basic import mlp

torch.manual_seed(0)
model = mlp()
x = torch.randn(8, 64)
fast = compiled(model, model="node-mlp", ref="prod", example_inputs=[x]{extra})
y = fast(x)
with torch.no_grad():
    want = model(x)
print(json.dumps({{"source": fast.source, "reason": fast.reason,
                  "offline": bool(fast.prefetched and fast.prefetched.offline),
                  "format": fast.artifact and fast.artifact["format"],
                  "grad_enabled": torch.is_grad_enabled(),
                  "max_diff": float((y - want).abs().max())}}))
"""


def _node(env: dict[str, str], extra: str = "") -> dict[str, Any]:
    r = subprocess.run([*node_python(), "-c", SNIPPET.format(extra=extra)], env=env, cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    return dict(json.loads(r.stdout.strip().splitlines()[-1]), log=r.stderr)


def _farm_cli(env: dict[str, str], *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "farm.app.cli", *argv], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def built(farm: Farm) -> dict[str, str]:
    """node-mlp@1 built by the farm (inference, the default), aliased prod,
    with the CLI as a user runs it; returns a node's environment."""
    env = {**farm.env}
    r = _farm_cli(env, "submit", "farm.zoo.basic:mlp", "--name", NAME, "--version", "1",
                  "--input", "float32[8,64]", "--target", "cpu", "--wait")
    assert r.returncode == 0, r.stdout + r.stderr
    r = _farm_cli(env, "alias", "set", NAME, "prod", "1")
    assert r.returncode == 0, r.stderr
    return env


def test_readme_snippet_as_written_gets_the_farms_artifact(built: dict[str, str],
                                                           tmp_path: Path) -> None:
    env = {**built, "CLIENT_CACHE_DIR": str(tmp_path / "cache")}
    out = _node(env)
    assert out["source"] == "farm", out["log"][-3000:]
    # The reason names what runs: the artifact, its format, the version.
    assert out["reason"].startswith("farm artifact ") and "of node-mlp@1 for cpu/" in out["reason"]
    assert out["format"] in out["reason"]
    assert out["max_diff"] < 1e-4
    # The caller's grad mode is left as it was; only the artifact's call ran without grad.
    assert out["grad_enabled"] is True


def test_cuda_graphs_on_a_cpu_node_say_why_they_do_not_apply(built: dict[str, str],
                                                             tmp_path: Path) -> None:
    """``cuda_graphs=True`` where the artifact is for the CPU: the artifact
    runs as it is, and the log says why no graph replays it."""
    env = {**built, "CLIENT_CACHE_DIR": str(tmp_path / "cache")}
    out = _node(env, extra=", cuda_graphs=True")
    assert out["source"] == "farm", out["log"][-3000:]
    assert out["max_diff"] < 1e-4
    assert "cuda_graphs=True ignored: the artifact is for cpu" in out["log"], out["log"][-3000:]


def test_a_node_runs_its_prefetched_artifact_while_the_farm_is_down(
        built: dict[str, str], tmp_path: Path, farm: Farm) -> None:
    env = {**built, "CLIENT_CACHE_DIR": str(tmp_path / "cache")}
    host, _, port = farm.url.removeprefix("http://").partition(":")
    # The farm goes away: a proxy that refuses every connection stands for it.
    down = TcpProxy((host, int(port)))
    try:
        offline = {**env, "FARM_URL": f"http://127.0.0.1:{down.port}"}
        # The kept answer is per farm URL: this node prefetches through its own.
        r = _farm_cli(offline, "prefetch", f"{NAME}@prod", "-i", "float32[8,64]")
        assert r.returncode == 0, r.stderr
        down.cut()
        out = _node(offline)
        assert out["source"] == "farm", out["log"][-3000:]
        assert out["offline"] is True
        assert "cannot be reached" in out["log"]
        # A node that never prefetched has nothing to run: JIT, with the reason.
        cold = {**offline, "CLIENT_CACHE_DIR": str(tmp_path / "cold-cache")}
        out = _node(cold)
        assert out["source"] == "jit"
        assert "cannot reach the farm" in (out["reason"] or ""), out
    finally:
        down.close()


def test_fallback_false_raises_with_each_candidates_reason(built: dict[str, str],
                                                           tmp_path: Path) -> None:
    env = {**built, "CLIENT_CACHE_DIR": str(tmp_path / "cache")}
    script = """
import torch
from farm.node import compiled, NotFoundError
from farm.zoo.basic import mlp
try:
    compiled(mlp(), model="node-mlp", ref="prod", example_inputs=["float32[16,64]"],
             fallback=False)
except NotFoundError as exc:
    print(str(exc))
else:
    raise SystemExit("no error")
"""
    r = subprocess.run([*node_python(), "-c", script], env=env, cwd=ROOT, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    text = r.stdout
    assert "each candidate and why" in text
    assert "do not cover the requested float32[16,64]" in text
    # The shape miss says which dynamic build would serve both.
    assert "float32[8..16,64]" in text


TINY_CNN = """
import torch
from torch import nn


class TinyCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.head = nn.Linear(8, 10)

    def forward(self, x):
        return self.head(self.conv(x).mean((2, 3)))


def make():
    return TinyCNN()
"""


def test_a_model_that_fails_on_fake_tensors_gets_a_readable_error(
        built: dict[str, str], tmp_path: Path) -> None:
    """One channel where the model takes three: the trace (on fake tensors)
    fails in conv2d. The user reads the op and each argument's dtype and
    shape, not torch's repr of every fake tensor; the log keeps it whole."""
    (tmp_path / "tinycnn.py").write_text(TINY_CNN)
    r = subprocess.run([sys.executable, "-m", "farm.app.cli", "submit", "./tinycnn.py:make",
                        "--name", "cnn-fake", "--version", "1", "--input", "float32[2,1,28,28]",
                        "--target", "cpu", "--wait"],
                       env=built, cwd=tmp_path, capture_output=True, text=True, timeout=900)
    out = r.stdout + r.stderr
    assert r.returncode == 1, out
    assert "FakeTensor(" not in out, out
    assert "conv2d" in out and "(*(float32[2,1,28,28], param float32[8,3,3,3], " in out, out
    assert "check their shapes" in out, out
    failed = re.search(r"job ([0-9a-f-]{36}) failed", r.stderr)
    assert failed is not None, r.stderr
    job = json.loads(_farm_cli(built, "status", failed.group(1), "--json").stdout)
    # The API's answer (and the dashboard) carry the readable error; the log
    # keeps torch's message as it was, for whoever debugs torch itself.
    assert "FakeTensor(" not in job["error"] and "float32[2,1,28,28]" in job["error"]
    assert "./tinycnn.py" in out or "tinycnn.py" in job["error"]
    assert "FakeTensor(" in (job["log"] or ""), job["log"]
