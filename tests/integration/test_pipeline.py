"""The build pipeline end to end against real services and real worker
processes: submit over HTTP, trace on the trace worker, compile on the CPU
compile worker, artifact in S3 and a row in PostgreSQL, then a fresh process
loads the artifact and gets eager's output."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select

from registry import models as m
from registry.db import Database
from tests.fixtures.client_install import SERVER_SIDE, client_only_site
from tests.fixtures.farm import ROOT, Farm
from tests.slowdown import scaled

pytestmark = pytest.mark.integration
# Each xdist worker that runs one of these starts its own farm (the session
# fixture); the tests of one build share a worker, so it is built once.
SAME_MLP_BUILD = pytest.mark.xdist_group("pipeline-mlp")

NODE = Path(__file__).with_name("node_check.py")


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
    """A fleet node in a fresh process: resolve, fetch, verify, load, compare."""
    out = subprocess.run(
        [sys.executable, str(NODE), *args],
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


@SAME_MLP_BUILD
def test_inference_job_builds_stores_and_loads(farm: Farm) -> None:
    job_id = farm.submit(job_spec("mlp", "1", "farm.zoo.basic:mlp", inputs=["float32[4,64]"]))
    job = farm.wait_job(job_id)
    assert job["state"] == "succeeded", json.dumps(job, indent=1)[:6000]
    (build,) = job["builds"]
    assert build["verified"] is True
    assert build["compile_s"] > 0 and build["artifact_bytes"] > 0
    formats = {a["format"] for a in build["artifacts"]}
    assert "aot_compile" in formats
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


@SAME_MLP_BUILD
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


def test_broken_models_fail_with_reasons_and_worker_keeps_serving(farm: Farm) -> None:
    gb = farm.submit(
        job_spec("gb", "1", "tests.models.broken:graph_break_model", inputs=["float32[4,16]"])
    )
    raising = farm.submit(
        job_spec("raising", "1", "tests.models.broken:raising_factory", inputs=["float32[4,16]"])
    )
    job = farm.wait_job(gb)
    assert job["state"] == "failed"
    assert "graph break" in job["error"].lower(), job["error"]
    assert "broken.py:" in (job["error"] + (job["log"] or "")), job
    job = farm.wait_job(raising)
    assert job["state"] == "failed"
    assert "Traceback" in (job["log"] or ""), job
    assert "raising_factory" in (job["log"] or "")
    # The same workers still build a good model.
    ok = farm.wait_job(
        farm.submit(job_spec("after-broken", "1", "farm.zoo.basic:mlp", inputs=["float32[2,64]"]))
    )
    assert ok["state"] == "succeeded", ok


def test_dedupe_identical_jobs_compile_once(farm: Farm) -> None:
    spec = job_spec(
        "dedupe", "1", "farm.zoo.basic:mlp", inputs=["float32[3,64]"], kwargs={"hidden": 96}
    )
    a = farm.submit(spec)
    b = farm.submit({**spec, "version": "2"})
    ja, jb = farm.wait_job(a), farm.wait_job(b)
    assert ja["state"] == jb["state"] == "succeeded"
    key = ja["builds"][0]["build_key"]
    assert key == jb["builds"][0]["build_key"]
    # One compile: one claim taken once, one artifact per format.
    db = Database(farm.env["DATABASE_URL"])
    try:
        with db.session() as s:
            claim = s.get(m.CompileClaim, key)
            assert claim is not None and claim.attempts == 1
    finally:
        db.dispose()
    formats = {x["format"] for x in ja["builds"][0]["artifacts"]}
    assert count(farm, m.Artifact, m.Artifact.build_key == key) == len(formats)
    # A later identical job reuses the artifact without compiling.
    c = farm.wait_job(farm.submit({**spec, "version": "3"}))
    assert c["builds"][0]["state"] == "reused"


@pytest.mark.slow
def test_kill_9_compile_worker_mid_job_redelivers(farm: Farm) -> None:
    spare = farm.start_worker("compile-spare", "compile")
    try:
        farm.wait_for_targets(2)
        job_id = farm.submit(
            job_spec(
                "killme", "1", "farm.zoo.basic:mlp", inputs=["float32[5,64]"], kwargs={"hidden": 80}
            )
        )
        deadline = time.monotonic() + 180
        victim = None
        with farm.http() as c:
            while time.monotonic() < deadline:
                b = c.get(f"/v1/jobs/{job_id}").json()["builds"][0]
                if b["state"] == "running" and b["worker"]:
                    victim = int(b["worker"].rsplit(":", 1)[1])
                    break
                time.sleep(0.2)
        assert victim is not None, "build never started"
        time.sleep(2)  # mid-compile
        name = next(n for n, p in farm.procs.items() if p.pid == victim)
        farm.stop(name, signal.SIGKILL)
        job = farm.wait_job(job_id, timeout=600)
        assert job["state"] == "succeeded", job
        key = job["builds"][0]["build_key"]
        formats = {x["format"] for x in job["builds"][0]["artifacts"]}
        assert count(farm, m.Artifact, m.Artifact.build_key == key) == len(formats)
        assert job["builds"][0]["attempts"] >= 2
    finally:
        # Keep one compile worker for later tests.
        if "compile" not in farm.procs:
            farm.procs["compile"] = farm.procs.pop("compile-spare", spare)
        elif "compile-spare" in farm.procs:
            farm.stop("compile-spare")
