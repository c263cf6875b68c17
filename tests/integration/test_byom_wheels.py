"""Bring your own model as a wheel, end to end on the session farm (PostgreSQL,
Redis, moto's S3, the API, real Celery workers, the build sandbox): a wheel
built here, whose module is on no process's path, goes with `farm submit
--wheel` through the CLI (a process of its own, as a user runs it); the trace
worker installs it once per pack digest (pip --no-deps, no index) into a
directory the sandboxed children get read-only; the eager build succeeds and
a fleet node that installed the same wheel loads the artifact and matches
eager. A wheel whose module imports a dependency it was shipped without fails
its trace, saying that wheels' dependencies are not installed."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.farm import Farm
from tests.fixtures.node import node_python
from tests.fixtures.wheels import build_wheel
from tests.slowdown import scaled

pytestmark = pytest.mark.integration

NODE = Path(__file__).parent / "node_check.py"
SERVER_ONLY = ("DATABASE_URL", "REDIS_URL", "BLOB_STORE_URL")

MODULE = '''
import torch
from torch import nn


class WheelNet(nn.Module):
    def __init__(self, dim=16):
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, x):
        return torch.sigmoid(self.fc(x)) * 2


def make(dim=16):
    return WheelNet(dim)
'''


def farm_cli(farm: Farm, cwd: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    """``farm ARGV`` as a user runs it: its own process, in ``cwd``, with only
    the client's settings (the farm's URL and token) from the farm's env."""
    env = {k: v for k, v in farm.env.items() if k not in SERVER_ONLY and k != "PYTHONPATH"}
    return subprocess.run([sys.executable, "-m", "farm.app.cli", *argv], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=scaled(900))


def submit_wheel(farm: Farm, cwd: Path, wheel: Path, name: str) -> subprocess.CompletedProcess[str]:
    return farm_cli(farm, cwd, "submit", "wheelnets.model:make", "--wheel", str(wheel),
                    "--name", name, "--version", "1", "--input", "float32[4,16]",
                    "--target", "cpu", "--backend", "eager", "--wait",
                    "--timeout", str(scaled(600)), "--json")


def test_a_wheel_ships_with_the_job_builds_and_loads_on_a_node(farm: Farm,
                                                                tmp_path: Path) -> None:
    tag = uuid.uuid4().hex[:8]
    wheel = build_wheel(tmp_path / "build", "wheelnets", "1.0",
                        {"wheelnets/__init__.py": "", "wheelnets/model.py": MODULE})
    user = tmp_path / "user"  # an empty directory: the code is in the wheel only
    user.mkdir()
    out = submit_wheel(farm, user, wheel, f"wheelnet-{tag}")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    view: dict[str, Any] = json.loads(out.stdout)
    assert view["state"] == "succeeded", json.dumps(view, indent=1)[:4000]
    (build,) = view["builds"]
    digest = build["code_digest"]
    assert digest, build
    # Installed once for that digest, by the worker, read-only.
    site = farm.home / "code-env" / digest
    assert (site / "wheelnets" / "model.py").is_file()
    assert not (site / "wheelnets" / "model.py").stat().st_mode & 0o222
    # A node with the same wheel installed in a directory of its own.
    node_site = tmp_path / "node-site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q",
                    "--disable-pip-version-check", "--target", str(node_site), str(wheel)],
                   check=True, capture_output=True, timeout=scaled(300))
    env = {k: v for k, v in farm.env.items() if k not in SERVER_ONLY}
    env["PYTHONPATH"] = str(node_site)
    res = subprocess.run([*node_python(), str(NODE), "--model", f"wheelnet-{tag}", "--ref", "1",
                          "--entrypoint", "wheelnets.model:make", "--input", "float32[4,16]"],
                         env=env, cwd=user, capture_output=True, text=True,
                         timeout=scaled(300))
    assert res.returncode == 0, res.stdout + res.stderr[-6000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got["max_abs_err"] <= 1e-5, got


def test_a_wheel_without_its_dependency_fails_its_trace_and_says_why(farm: Farm,
                                                                     tmp_path: Path) -> None:
    tag = uuid.uuid4().hex[:8]
    wheel = build_wheel(tmp_path / "build", "wheelnets", "2.0",
                        {"wheelnets/__init__.py": "",
                         "wheelnets/model.py": "import helperlib_not_shipped\n" + MODULE})
    out = submit_wheel(farm, tmp_path, wheel, f"wheelnet-nodep-{tag}")
    assert out.returncode != 0, out.stdout[-3000:]
    view = json.loads(out.stdout)
    assert view["state"] == "failed", view
    assert "helperlib_not_shipped" in view["error"], view["error"][:3000]
    assert "without their dependencies (pip --no-deps)" in view["error"], view["error"][:3000]
