"""Bring your own model, against the real services (PostgreSQL, Redis, moto's S3,
the API under uvicorn, Celery workers), with the build sandbox on
(``FARM_SANDBOX=on``: bubblewrap namespaces, the sandbox uid):

- a model in a temporary directory that is on no process's path is shipped
  by the Python client as a code pack, builds, is fetched and loads in a
  fresh process (which has its own copy of the code) and matches eager;
- a typo'd entrypoint fails in seconds, and the corrected resubmission of the
  same name@version builds;
- two classes with identical graphs get two builds (the class and the code are
  in the build key), each loads for its own class, and a node whose class is
  the other one falls back to JIT with the reason;
- a hostile model, in each stage (trace, compile, verify), tries to read
  every ``/proc/*/environ``, the builder's signing key and ``~/.aws``, to
  connect to PostgreSQL, Redis and S3 on 127.0.0.1, and to write outside its
  build directory: every attempt fails; secrets planted in the workers'
  environment and files appear in no job output, log, row or stored blob.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from sqlalchemy import MetaData, create_engine, select

from tests.fixtures.farm import ADMIN_TOKEN, ROOT, models_pack
from tests.fixtures.faults import FaultFarm, MakeFarm
from tests.fixtures.node import node_python
from tests.slowdown import scaled

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.xdist_group("byom")]

NODE = ROOT / "tests" / "integration" / "node_check.py"
PLANTED = {name: f"planted-{name.lower()}-{uuid.uuid4().hex}"
           for name in ("ENV", "AWS", "AWS_FILE", "INNOCENT")}

MODEL_SRC = '''
import torch
from torch import nn


class TinyMLP(nn.Module):
    def __init__(self, dim=24, hidden=40):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def make(dim=24, hidden=40):
    return TinyMLP(dim, hidden)
'''

TWINS_SRC = '''
from torch import nn


class TwinA(nn.Module):
    def __init__(self, dim=20):
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, x):
        return self.fc(x).tanh()


class TwinB(nn.Module):
    """The same graph as TwinA, another class."""

    def __init__(self, dim=20):
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, x):
        return self.fc(x).tanh()


def make_a(dim=20):
    return TwinA(dim)


def make_b(dim=20):
    return TwinB(dim)
'''


@pytest.fixture(scope="module")
def byom(make_farm: MakeFarm, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FaultFarm]:
    # The workers' own home holds "cloud credentials" a model must not read.
    user_home = tmp_path_factory.mktemp("worker-home")
    (user_home / ".aws").mkdir()
    (user_home / ".aws" / "credentials").write_text(
        f"[default]\naws_access_key_id = testing\naws_secret_access_key = {PLANTED['AWS_FILE']}\n")
    f = make_farm(
        "byom",
        env={"FARM_SANDBOX": "on", "HOME": str(user_home),
             # The S3 secret moto accepts (any), and secrets under names no
             # scrub rule knows: model code must see none of them.
             "AWS_SECRET_ACCESS_KEY": PLANTED["AWS"], "PLANTED_SECRET": PLANTED["ENV"],
             "LOOKS_HARMLESS": PLANTED["INNOCENT"],
             "TRACE_TIMEOUT_S": str(scaled(120)), "BUILD_TIMEOUT_S": str(scaled(400)),
             "BUILD_MEMORY_MB": "4000"},
    )
    f.env["TEST_USER_HOME"] = str(user_home)
    try:
        yield f
    finally:
        f.close()


def client(f: FaultFarm) -> Any:
    from farm.node.client import FarmClient

    return FarmClient(url=f.url, token=ADMIN_TOKEN)


def spec(name: str, version: str, entrypoint: str, inputs: list[str],
         kwargs: dict[str, Any] | None = None) -> Any:
    from farm.core.inputs import parse_inputs
    from farm.core.specs import JobSpec, ModelRef

    return JobSpec(name=name, version=version, model=ModelRef(entrypoint, kwargs or {}),
                   inputs=parse_inputs(inputs), targets=("cpu",))


def node(f: FaultFarm, code_dir: Path, *args: str) -> dict[str, Any]:
    """A fleet node in a fresh process: its own copy of the model's code on
    its path, nothing of the farm's server side in its environment."""
    env = {k: v for k, v in f.env.items() if k not in ("DATABASE_URL", "REDIS_URL",
                                                        "BLOB_STORE_URL")}
    env["PYTHONPATH"] = str(code_dir)
    out = subprocess.run([*node_python(), str(NODE), *args], env=env, cwd=code_dir,
                         capture_output=True, text=True, timeout=scaled(300))
    assert out.returncode == 0, out.stdout + out.stderr[-6000:]
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def settle_s(job: dict[str, Any]) -> float:
    from datetime import datetime

    return (datetime.fromisoformat(job["updated_at"])
            - datetime.fromisoformat(job["created_at"])).total_seconds()


def test_own_model_builds_after_a_typo_and_loads_on_a_node(byom: FaultFarm,
                                                           tmp_path: Path) -> None:
    src = tmp_path / "user-code"
    src.mkdir()
    (src / "mymodel.py").write_text(MODEL_SRC)
    c = client(byom)
    # A typo'd callable: the API does not import the code, the trace says so.
    typo = c.submit(spec("my-mlp", "1", "mymodel:mkae", ["float32[4,24]"]),
                    source=src / "mymodel.py")
    assert typo["code"]["uploaded"] is True
    job = byom.wait_job(typo["id"], timeout=240)
    assert job["state"] == "failed", job
    assert "has no attribute 'mkae'" in job["error"], job["error"][:2000]
    print(f"typo'd entrypoint failed {settle_s(job):.1f} s after submission")
    assert settle_s(job) < scaled(60), job  # a trace of no model: seconds, not a compile
    # The fix under the same name@version: the same code pack (not uploaded again).
    fixed = c.submit(spec("my-mlp", "1", "mymodel:make", ["float32[4,24]"]),
                     source=src / "mymodel.py")
    assert fixed["code"]["uploaded"] is False
    assert fixed["code"]["digest"] == typo["code"]["digest"]
    job = byom.wait_job(fixed["id"], timeout=900)
    assert job["state"] == "succeeded", json.dumps(job, indent=1)[:4000]
    (build,) = job["builds"]
    assert build["code_digest"] == fixed["code"]["digest"], build
    # This farm runs with FARM_AOTI=0 (tests.fixtures.faults): the inference
    # build has its aot_compile artifact only, and says why there is no package.
    assert [a["format"] for a in build["artifacts"]] == ["aot_compile"], build["artifacts"]
    assert "FARM_AOTI=0" in build["formats_skipped"]["aoti"], build["formats_skipped"]
    # The node has its own copy of the code, in a directory of its own.
    node_dir = tmp_path / "node-code"
    node_dir.mkdir()
    (node_dir / "mymodel.py").write_text(MODEL_SRC)
    res = node(byom, node_dir, "--model", "my-mlp", "--ref", "1", "--entrypoint",
               "mymodel:make", "--input", "float32[4,24]")
    assert res["max_abs_err"] <= 1e-4, res
    # A name bound by a build that succeeded cannot take other code any more.
    with byom.http() as h:
        r = h.post("/v1/jobs", json={**spec("my-mlp", "1", "mymodel:make",
                                            ["float32[4,24]"], {"dim": 8}).to_json(),
                                     "code_digest": fixed["code"]["digest"]})
    assert r.status_code == 409, r.text


def test_two_classes_with_one_graph_get_an_artifact_each(byom: FaultFarm,
                                                         tmp_path: Path) -> None:
    src = tmp_path / "twins-code"
    src.mkdir()
    (src / "twins.py").write_text(TWINS_SRC)
    c = client(byom)
    a = c.submit(spec("twin-a", "1", "twins:make_a", ["float32[3,20]"]), source=src)
    b = c.submit(spec("twin-b", "1", "twins:make_b", ["float32[3,20]"]), source=src)
    ja, jb = byom.wait_job(a["id"], timeout=900), byom.wait_job(b["id"], timeout=900)
    assert ja["state"] == jb["state"] == "succeeded", (ja, jb)
    (ba,), (bb,) = ja["builds"], jb["builds"]
    assert ba["state"] == bb["state"] == "succeeded"  # two compiles, not one reused
    assert ba["build_key"] != bb["build_key"]
    assert ja["fingerprint"] != jb["fingerprint"]
    assert {x["digest"] for x in ba["artifacts"]}.isdisjoint(x["digest"] for x in bb["artifacts"])
    for name, entry in (("twin-a", "twins:make_a"), ("twin-b", "twins:make_b")):
        res = node(byom, src, "--model", name, "--ref", "1", "--entrypoint", entry,
                   "--input", "float32[3,20]")
        assert res["max_abs_err"] <= 1e-4, (name, res)
    # A node whose class is the other twin runs JIT and says why.
    code = """
import json, torch
from farm.node.compiled import compiled
import twins
fn = compiled(twins.make_b(), model="twin-a", ref="1", example_inputs=["float32[3,20]"],
              overlap=False)
x = torch.randn(3, 20)
print(json.dumps({"source": fn.source, "reason": fn.reason}))
"""
    env = {**byom.env, "PYTHONPATH": str(src)}
    out = subprocess.run([*node_python(), "-c", code], env=env, cwd=src, capture_output=True,
                         text=True, timeout=scaled(300))
    assert out.returncode == 0, out.stderr[-4000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["source"] == "jit", got
    assert "was built from twins.TwinA" in got["reason"], got
    assert "twins.TwinB" in got["reason"], got


def test_hostile_model_reaches_nothing_in_any_stage(byom: FaultFarm, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    outside.chmod(0o777)  # writable by anyone on the host: only isolation stops it
    models = models_pack()
    code_dir = byom.home / "code" / models.digest
    pg_port = urlsplit(byom.db_url).port or 5432
    redis_port = urlsplit(byom.env["REDIS_URL"]).port
    s3_port = urlsplit(byom.env["S3_ENDPOINT_URL"]).port
    home = Path(byom.env["TEST_USER_HOME"])
    key = byom.home / "builder-key.pem"
    files = [str(key), str(home / ".aws" / "credentials"), str(byom.home / "name-key.pem")]
    write_dirs = [str(outside), str(byom.home), str(code_dir), str(code_dir / "tests"),
                  str(ROOT / "farm"), str(Path(sys.prefix))]
    kwargs = {"files": files, "ports": [pg_port, redis_port, s3_port],
              "write_dirs": write_dirs}
    jobs = {}
    for at, dim in (("trace", 5), ("compile", 6), ("verify", 7)):
        jobs[at] = byom.submit({
            "name": f"snoop-{at}", "version": "1", "targets": ["cpu"],
            "model": {"entrypoint": "tests.models.hostile:snoop",
                      "kwargs": {**kwargs, "at": at, "dim": dim}},
            "inputs": [f"float32[2,{dim}]"]})
    views = {at: byom.wait_job(j, timeout=900) for at, j in jobs.items()}
    for at, job in views.items():
        assert job["state"] == "failed", (at, json.dumps(job, indent=1)[:3000])
        (build,) = job["builds"]
        where = job["error"] if at == "trace" else build["error"]
        m = re.search(r"SNOOP (\{.*\})", where or "")
        assert m, (at, (where or "")[:3000])
        report = json.loads(m.group(1))
        assert report["stage"] == at, report
        # Not the worker's uid: a sandbox uid of its own (farm.build.uid_slots).
        assert report["uid"] in range(60100, 60100 + 64), report
        # Its own pid namespace: the sandbox's init, the zygote, the child, and
        # in the compile stage the child's graph-check fork (farm.build.graph_check).
        assert report["pids_visible"] <= (4 if at == "compile" else 3), report
        # A write leaks when its file is on the host. A child forked from a
        # build zygote (farm.build.zygote) may create the directory's path
        # in its sandbox's private /tmp, where the host's is not mounted
        # (a fresh sandbox has it as root's parent directories of a mount):
        # that file is the sandbox's own, and gone after the child.
        leaks = [(what, k, v) for what in ("environ", "files", "ports")
                 for k, v in report[what].items() if v["ok"]]
        leaks += [("writes", k, v) for k, v in report["writes"].items()
                  if v["ok"] and Path(v["path"]).exists()]
        assert not leaks, (at, leaks)
        assert set(report["files"]) == set(files) and len(report["ports"]) == 3
        seen = report["own_environ"]
        assert not any(n in seen for n in ("DATABASE_URL", "REDIS_URL", "AWS_SECRET_ACCESS_KEY",
                                           "PLANTED_SECRET", "LOOKS_HARMLESS", "FARM_HOME",
                                           "FARM_BUILDER_KEY", "FARM_ADMIN_TOKEN")), seen
        assert not list(outside.iterdir()), list(outside.iterdir())
    assert [p for p in byom.home.iterdir() if p.name.startswith("snoop-")] == []
    assert_no_planted_secret(byom, [*views.values()], extra=[key.read_text()])


def assert_no_planted_secret(f: FaultFarm, views: list[dict[str, Any]], *,
                             extra: list[str]) -> None:
    """No planted secret (nor the builder key's body) in job views, worker and
    API logs, any row of any table, or any blob in the farm's bucket."""
    key_lines = [ln for x in extra for ln in x.splitlines() if len(ln) > 40]
    needles = [*PLANTED.values(), *key_lines]
    assert needles
    haystacks: dict[str, str] = {}
    with f.http() as h:
        for v in views:
            haystacks[f"job {v['id']}"] = json.dumps(h.get(f"/v1/jobs/{v['id']}").json())
    for log in f.home.glob("*.log"):
        haystacks[f"log {log.name}"] = log.read_text(errors="replace")
    engine = create_engine(f.db_url)
    try:
        meta = MetaData()
        meta.reflect(engine)
        with engine.connect() as conn:
            for table in meta.sorted_tables:
                rows = conn.execute(select(table)).all()
                haystacks[f"table {table.name}"] = "\n".join(map(repr, rows))
    finally:
        engine.dispose()
    for obj in f.s3.list_objects_v2(Bucket=f.bucket).get("Contents", []):
        body = f.s3.get_object(Bucket=f.bucket, Key=obj["Key"])["Body"].read()
        haystacks[f"blob {obj['Key']}"] = body.decode("latin-1")
    assert any(k.startswith("blob ") for k in haystacks), "no blob checked"
    assert any(k.startswith("table jobs") for k in haystacks)
    found = [(where, n[:24]) for where, text in haystacks.items() for n in needles if n in text]
    assert not found, found
    # The workers held them (else the check proves nothing).
    assert f.env["PLANTED_SECRET"] == PLANTED["ENV"]
    assert Path(f.env["TEST_USER_HOME"], ".aws", "credentials").read_text().count(
        PLANTED["AWS_FILE"]) == 1
