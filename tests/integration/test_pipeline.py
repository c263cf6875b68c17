"""The build pipeline end to end against real services and real worker
processes: submit over HTTP, trace on the trace worker, compile on the CPU
compile worker, artifact in S3 and a row in PostgreSQL, then a fresh process
loads the artifact and gets eager's output."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select

from registry.db import Database
from tests.fixtures.client_install import SERVER_SIDE, client_only_site
from tests.fixtures.farm import ROOT, Farm
from tests.fixtures.faults import FaultFarm
from tests.fixtures.node import node_python
from tests.slowdown import scaled

# One xdist worker runs a file (--dist loadfile): these tests share one farm
# and one mlp build. The failure and recovery tests of the same pipeline are
# in test_pipeline_recovery.py, so the two halves run at once.
pytestmark = pytest.mark.integration

NODE = Path(__file__).with_name("node_check.py")


@pytest.fixture(scope="module")
def farm(aoti_farm: FaultFarm) -> FaultFarm:
    """A farm as deployed by default, both formats (tests/fixtures/faults.py)."""
    return aoti_farm


def job_spec(
    name: str,
    version: str,
    entrypoint: str,
    *,
    inputs: list[str],
    kwargs: dict[str, Any] | None = None,
    grad_mode: str = "inference",
) -> dict[str, Any]:
    return {
        "name": name,
        "version": version,
        "model": {"entrypoint": entrypoint, "kwargs": kwargs or {}},
        "inputs": inputs,
        "grad_mode": grad_mode,
        "targets": ["cpu"],
    }


def run_node(farm: Farm, *args: str) -> dict[str, Any]:
    """A fleet node in a process of its own (forked from the node agent,
    tests/fixtures/node.py): resolve, fetch, verify, load, compare."""
    out = subprocess.run(
        [*node_python(), str(NODE), *args],
        env=farm.env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def count(farm: Farm, model: type[Any], *where: Any) -> int:
    db = Database(farm.env["DATABASE_URL"])
    try:
        with db.session() as s:
            return int(s.scalar(select(func.count()).select_from(model).where(*where)) or 0)
    finally:
        db.dispose()


def test_inference_job_builds_stores_and_loads(farm: Farm) -> None:
    job_id = farm.submit(job_spec("mlp", "1", "farm.zoo.basic:mlp", inputs=["float32[4,64]"]))
    job = farm.wait_job(job_id)
    assert job["state"] == "succeeded", json.dumps(job, indent=1)[:6000]
    (build,) = job["builds"]
    assert build["verified"] is True
    assert build["compile_s"] > 0 and build["artifact_bytes"] > 0
    formats = {a["format"] for a in build["artifacts"]}
    assert formats == {"aot_compile", "aoti"}, build  # the default farm: both formats
    assert job["fingerprint"] and job["param_count"] > 0 and job["flops"] > 0
    # The bytes are in S3 under their digest.
    import boto3

    s3 = boto3.client("s3", endpoint_url=farm.env["S3_ENDPOINT_URL"], region_name="us-east-1")
    bucket = farm.env["BLOB_STORE_URL"].removeprefix("s3://").split("/")[0]
    for a in build["artifacts"]:
        head = s3.head_object(Bucket=bucket, Key=f"artifacts/sha256/{a['digest']}")
        assert head["ContentLength"] == a["size"]
    for fmt in sorted(formats):
        result = run_node(
            farm,
            "--model",
            "mlp",
            "--ref",
            "1",
            "--entrypoint",
            "farm.zoo.basic:mlp",
            "--input",
            "float32[4,64]",
            "--format",
            fmt,
        )
        assert result["format"] == fmt
        assert result["max_abs_err"] <= 1e-4, result


def test_a_node_installed_without_the_server_set_loads_an_artifact(
    farm: Farm, tmp_path: Path
) -> None:
    """`pip install torch-farm` (no extras) is a fleet node: torch-farm with
    --no-deps beside only its base dependencies, in a process that cannot
    import SQLAlchemy, Celery, FastAPI or boto3, resolves, verifies, fetches
    and loads the artifact the farm built (the same build as the first test's)."""
    job = farm.wait_job(farm.submit(job_spec("mlp-node", "1", "farm.zoo.basic:mlp",
                                             inputs=["float32[4,64]"])))
    assert job["state"] == "succeeded", json.dumps(job, indent=1)[:4000]
    paths = client_only_site(tmp_path)
    args = ["--model", "mlp-node", "--ref", "1", "--entrypoint", "farm.zoo.basic:mlp",
            "--input", "float32[4,64]", "--format", "aoti"]
    code = f"""
import importlib.util, runpy, sys
sys.path[:0] = {paths!r}
present = [m for m in {SERVER_SIDE!r} if importlib.util.find_spec(m) is not None]
assert not present, f"server-side packages are importable: {{present}}"
import farm
assert farm.__file__.startswith({paths[0]!r}), farm.__file__
sys.argv = [{str(NODE)!r}, *{args!r}]
runpy.run_path({str(NODE)!r}, run_name="__main__")
"""
    env = {k: v for k, v in farm.env.items() if k != "PYTHONPATH"}
    # -S: none of this environment's site-packages, only the two directories.
    out = subprocess.run([sys.executable, "-S", "-c", code], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=scaled(300))
    assert out.returncode == 0, out.stdout + out.stderr[-6000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["format"] == "aoti" and result["max_abs_err"] <= 1e-4, result


def test_training_artifact_gives_eager_gradients(farm: Farm) -> None:
    job_id = farm.submit(
        job_spec(
            "mlp-train", "1", "farm.zoo.basic:mlp", inputs=["float32[4,64]"], grad_mode="training"
        )
    )
    job = farm.wait_job(job_id)
    assert job["state"] == "succeeded", json.dumps(job, indent=1)[:6000]
    result = run_node(
        farm,
        "--model",
        "mlp-train",
        "--ref",
        "1",
        "--entrypoint",
        "farm.zoo.basic:mlp",
        "--input",
        "float32[4,64]",
        "--train",
    )
    assert result["max_abs_err"] <= 1e-4, result
    assert result["max_grad_err"] <= 1e-4, result


def farm_cli(farm: Farm, *argv: str) -> subprocess.CompletedProcess[str]:
    """``farm ARGV`` as a user runs it, in a process of its own, against this farm."""
    return subprocess.run([sys.executable, "-m", "farm.app.cli", *argv], env=farm.env, cwd=ROOT,
                          capture_output=True, text=True, timeout=scaled(900))


def test_a_deleted_format_is_rebuilt_and_rebuild_builds_anew(farm: Farm, tmp_path: Path) -> None:
    """Deleting one format's artifact leaves the other under the same build
    key: a resubmission builds the missing format (not "reused"), keeps the
    other, and `farm fetch --format` gets it again. `farm submit --rebuild`
    compiles even though nothing is missing, and the new artifacts take the
    old rows' places. Without either, the build is reused."""
    submit = ["submit", "farm.zoo.basic:mlp", "--name", "mlp", "--version", "1",
              "--input", "float32[4,64]", "--target", "cpu", "--wait", "--json"]

    def build_of(r: subprocess.CompletedProcess[str]) -> dict[str, Any]:
        assert r.returncode == 0, r.stdout + r.stderr[-4000:]
        (build,) = json.loads(r.stdout)["builds"]
        return dict(build)

    # The first test's build (or, run alone, a fresh one).
    before = {a["format"]: a for a in build_of(farm_cli(farm, *submit))["artifacts"]}
    assert set(before) == {"aot_compile", "aoti"}
    r = farm_cli(farm, "delete", "artifact", before["aoti"]["digest"][:8])
    assert r.returncode == 0, r.stderr
    fetch = ["fetch", "mlp@1", "--input", "float32[4,64]", "--format", "aoti"]
    r = farm_cli(farm, *fetch, "-o", str(tmp_path / "gone.pt2"))
    assert r.returncode == 1 and "rejected (format)" in r.stderr, r.stderr

    again = build_of(farm_cli(farm, *submit))
    assert again["state"] == "succeeded", again  # compiled, not "reused"
    after = {a["format"]: a for a in again["artifacts"]}
    assert set(after) == {"aot_compile", "aoti"}
    # The format that was there is kept as it was: nodes that have it keep it.
    assert after["aot_compile"]["digest"] == before["aot_compile"]["digest"]
    r = farm_cli(farm, *fetch, "-o", str(tmp_path / "back.pt2"))
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "back.pt2").stat().st_size == after["aoti"]["size"]

    # Nothing missing: reused, no compile.
    assert build_of(farm_cli(farm, *submit))["state"] == "reused"

    forced = build_of(farm_cli(farm, *submit[:-2], "--rebuild", "--wait", "--json"))
    assert forced["state"] == "succeeded" and forced["compile_s"] > 0, forced
    rebuilt = {a["format"]: a for a in forced["artifacts"]}
    assert set(rebuilt) == {"aot_compile", "aoti"}
    # The same rows (a version's links stay), each with the new build's
    # statement; a blob no row names any more is gone from the store.
    for fmt, art in rebuilt.items():
        assert art["id"] == after[fmt]["id"]
        assert art["created_at"] > after[fmt]["created_at"]
    with farm.http() as c:
        for fmt, art in after.items():
            if rebuilt[fmt]["digest"] != art["digest"]:
                # On S3 the API may still redirect a digest it knew a moment
                # ago (it caches that for a minute): the store answers 404.
                gone = c.get(f"/v1/artifacts/{art['digest']}/blob", follow_redirects=True)
                assert gone.status_code == 404
    r = farm_cli(farm, *fetch, "-o", str(tmp_path / "rebuilt.pt2"))
    assert r.returncode == 0, r.stderr
