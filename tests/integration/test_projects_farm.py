"""A project's model end to end on the real farm (API, Celery workers,
PostgreSQL, Redis, S3, a real build): a maintainer of project ``team-b``
submits with ``farm submit --project``, the worker builds it, the build
statement it signs names the project (the build key holds it), and a fleet
node with a plain read token loads the artifact, checking every statement
against the root key."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from registry import models as m
from registry.db import Database
from tests.fixtures.farm import Farm
from tests.fixtures.node import node_python

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
NAME = "team-b-mlp"

SNIPPET = """
import json, torch
from farm.node import compiled
from farm.zoo.basic import mlp
torch.manual_seed(0)
model = mlp()
x = torch.randn(8, 64)
fast = compiled(model, model="team-b-mlp", ref="prod", example_inputs=[x])
y = fast(x)
print(json.dumps({"source": fast.source, "reason": fast.reason,
                  "max_diff": float((y - model(x)).abs().max())}))
"""


def _cli(env: dict[str, str], *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "farm.app.cli", *argv],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )


def _token(env: dict[str, str], *argv: str) -> str:
    r = _cli(env, "token", "create", *argv, "--json")
    assert r.returncode == 0, r.stderr
    return str(json.loads(r.stdout)["token"])


def test_a_projects_build_is_signed_with_its_project_and_loads_on_a_node(
    farm: Farm, tmp_path: Path
) -> None:
    admin = {**farm.env}
    r = _cli(admin, "project", "create", "team-b")
    assert r.returncode == 0, r.stderr
    maintainer = {
        **admin,
        "FARM_TOKEN": _token(admin, "team-b-ci", "--project", "team-b=maintainer"),
    }
    r = _cli(
        maintainer,
        "submit",
        "farm.zoo.basic:mlp",
        "--project",
        "team-b",
        "--name",
        NAME,
        "--version",
        "1",
        "--input",
        "float32[8,64]",
        "--target",
        "cpu",
        "--wait",
        "--json",
    )
    assert r.returncode == 0, r.stdout + r.stderr
    r = _cli(maintainer, "alias", "set", NAME, "prod", "1")
    assert r.returncode == 0, r.stderr

    with farm.http() as c:
        body: dict[str, Any] = c.get(f"/v1/models/{NAME}").json()
    assert body["project"] == "team-b"
    (art,) = body["versions"][0]["artifacts"]
    db = Database(farm.env["DATABASE_URL"])
    try:
        with db.session() as s:
            envelope = s.scalar(
                select(m.Artifact.attestation).where(m.Artifact.digest == art["digest"])
            )
    finally:
        db.dispose()
    assert envelope is not None
    stmt = json.loads(base64.b64decode(json.loads(envelope)["payload"]))
    assert stmt["predicate"]["project"] == "team-b"
    assert stmt["predicate"]["build_key"] == art["build_key"]

    fleet = {
        **admin,
        "FARM_TOKEN": _token(admin, "team-b-fleet", "--role", "read"),
        "CLIENT_CACHE_DIR": str(tmp_path / "cache"),
    }
    node = subprocess.run(
        [*node_python(), "-c", SNIPPET],
        env=fleet,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert node.returncode == 0, node.stderr[-4000:]
    out = json.loads(node.stdout.strip().splitlines()[-1])
    assert out["source"] == "farm", (out, node.stderr[-3000:])
    assert out["max_diff"] < 1e-4
