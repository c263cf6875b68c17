"""The farm learns from its fleet: node reports, build on miss,
coverage and upgrade plans.

Two layers: the API in this process on PostgreSQL and SQLite (what each
endpoint stores, counts and answers, with hand-made artifacts), and the real
distributed farm (the session ``farm`` fixture: API, Celery workers, Redis,
PostgreSQL, S3) for the loop end to end: nodes miss a new shape under a
build-on-miss policy, exactly one build runs, and the next node start hits;
``farm plan`` for a new target lists what the nodes need.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import select

from registry import models as m
from registry import service
from tests.fixtures.farm import Farm
from tests.fixtures.node import node_python
from tests.integration.test_api import CPU, CPU_512, Api, _api, make_artifact
from tests.slowdown import scaled

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def api(db_url: str, tmp_path: Path) -> Iterator[Api]:
    # Build on miss at most once a minute per model (the default), so a
    # second shape within the test is rate-limited.
    yield from _api(db_url, tmp_path)


def _report(kind: str = "miss", *, inputs: tuple[str, ...] = ("int64[4,32]",),
            target: str = str(CPU), **kw: Any) -> dict[str, Any]:
    return {"kind": kind, "model": "tiny", "inputs": list(inputs), "grad_mode": "inference",
            "target": target, **kw}


def _post(api: Api, *reports: dict[str, Any], node: str = "node-a") -> httpx.Response:
    """POST the reports, then wait until the API's sink has written them and
    acted on them (build on miss): the pages wait only a second for it, which
    a loaded machine overran (a herd of 100 reports was still being written
    when the test looked for its build)."""
    r = api.post("/v1/reports", role="read", json={"node": node, "reports": list(reports)})
    assert cast(Any, api.client.app).state.farm.reports.flush(scaled(30)), "the sink is stuck"
    return r


def _metric(api: Api, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    text = api.get("/metrics").text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name:
                out[tuple(sorted(s.labels.items()))] = s.value
    return out


def _live_worker(api: Api, target: Any = CPU) -> None:
    service.record_heartbeat(api.db, worker_id=f"w:{target}", kind="compile",
                             queue=target.queue, target=str(target))


# --- reports ------------------------------------------------------------------


def test_reports_are_stored_counted_and_grouped(api: Api) -> None:
    make_artifact(api.db, api.store)
    r = _post(api, _report(code="inputs", version="1", reason="no artifact fits"),
              _report("guard_failure", inputs=("int64[2,16]",), version="1", code="guard"),
              _report("load", inputs=("int64[1,16]",), version="1", format="aoti",
                      digest="a" * 64, seconds=0.25))
    assert r.status_code == 202, r.text
    assert r.json() == {"accepted": 3, "dropped": 0}
    _post(api, _report(code="inputs", version="1"), node="node-b")

    body = api.get("/v1/misses", params={"model": "tiny"}).json()
    top = body["misses"][0]
    # Both nodes' misses of int64[4,32] are one row, counted twice; the load is not a miss.
    assert (top["kind"], top["inputs"], top["count"], top["nodes"]) == (
        "miss", "int64[4,32]", 2, 2)
    assert {x["kind"] for x in body["misses"]} == {"miss", "guard_failure"}
    counts = api.get("/v1/models/tiny/reports").json()["counts"]
    assert counts == {"miss": 2, "guard_failure": 1, "fallback": 0, "load": 1}
    with api.db.session() as s:
        loads = s.scalars(select(m.NodeReport).where(m.NodeReport.kind == "load")).all()
        assert [(x.node, x.format, x.seconds) for x in loads] == [("node-a", "aoti", 0.25)]

    got = _metric(api, "farm_node_reports_total")
    key = tuple(sorted({"model": "tiny", "target": str(CPU), "kind": "miss",
                        "reason": "inputs"}.items()))
    assert got[key] == 2.0


@pytest.mark.parametrize(("patch", "needle"), [
    ({"kind": "crashed"}, "kind"),
    ({"kind": {}}, "kind"),  # not even hashable: the plain-ASGI reader must not 500
    ({"seconds": "slow"}, "seconds"),
    ({"inputs": ["float32[8,"]}, "float32[8,"),
    ({"target": "cpu/python=3.11"}, "incomplete target"),
    ({"grad_mode": "sideways"}, "grad_mode"),
    # Refused at the request: written in bulk, it would take other nodes' rows with it.
    ({"model": "tiny\x00"}, "bad model name"),
    ({"version": "1\x00"}, "control character"),
    ({"reason": "a\x00b"}, "NUL"),
])
def test_a_bad_report_is_refused_saying_what(api: Api, patch: dict[str, Any],
                                             needle: str) -> None:
    r = _post(api, {**_report(), **patch})
    assert r.status_code == 422, r.text
    assert needle in r.text
    with api.db.session() as s:
        assert s.scalars(select(m.NodeReport)).all() == []


def test_reports_need_a_token(api: Api) -> None:
    r = api.client.post("/v1/reports", json={"reports": [_report()]})
    assert r.status_code == 401


# --- coverage -----------------------------------------------------------------


def test_coverage_lists_what_each_version_serves_and_what_nodes_lacked(api: Api) -> None:
    make_artifact(api.db, api.store, version="1", inputs=("int64[1,16]",))
    make_artifact(api.db, api.store, version="2", inputs=("int64[2..8,16]",),
                  fingerprint="e" * 64)
    service.set_alias(api.db, "tiny", "prod", "2")
    _post(api, _report(version="2", inputs=("int64[4,32]",)),
          _report("load", version="2", inputs=("int64[4,16]",)),
          _report(version="2", inputs=("int64[4,16]",), target=str(CPU_512)))

    body = api.get("/v1/models/tiny/coverage").json()
    by_version = {v["version"]: v for v in body["versions"]}
    v1, v2 = by_version["1"], by_version["2"]
    assert [(c["inputs"], c["dynamic"], c["target"]) for c in v1["covers"]] == [
        ("int64[1,16]", False, str(CPU))]
    assert [(c["inputs"], c["dynamic"]) for c in v2["covers"]] == [("int64[2..8,16]", True)]
    assert v2["aliases"] == ["prod"] and v2["grad_modes"] == ["inference"]
    # The dynamic build covers int64[4,16] on CPU (the load), not int64[4,32],
    # nor anything on the AVX-512 node.
    lacked = {(u["inputs"], u["target"]): u["codes"] for u in v2["uncovered"]}
    assert lacked == {("int64[4,32]", str(CPU)): ["inputs"],
                      ("int64[4,16]", str(CPU_512)): ["isa"]}
    assert v1["uncovered"] == []
    one = api.get("/v1/models/tiny/coverage", params={"version": "1"}).json()
    assert [v["version"] for v in one["versions"]] == ["1"]
    r = api.get("/v1/models/tiny/coverage", params={"version": "9"})
    assert r.status_code == 404 and "versions: 1, 2" in r.json()["detail"]


# --- policy and build on miss --------------------------------------------------


def test_policy_is_off_by_default_and_set_per_model(api: Api) -> None:
    make_artifact(api.db, api.store)
    assert api.get("/v1/models/tiny/policy").json()["build_on_miss"] is False
    r = api.put("/v1/models/tiny/policy", json={"build_on_miss": True, "min_interval_s": 30})
    assert r.status_code == 200, r.text
    assert (r.json()["build_on_miss"], r.json()["min_interval_s"]) == (True, 30)
    assert api.put("/v1/models/tiny/policy", role="read",
                   json={"build_on_miss": False}).status_code == 403
    r = api.put("/v1/models/nope/policy", json={"build_on_miss": True})
    assert r.status_code == 404 and "farm submit" in r.json()["detail"]


def test_a_herd_of_misses_starts_one_build_and_the_rate_limit_holds(api: Api) -> None:
    make_artifact(api.db, api.store, name_key=api.settings.farm_home / "name-key.pem")
    _live_worker(api)
    # Off: a miss is only recorded.
    _post(api, _report(version="1"))
    assert api.enqueued == []

    api.put("/v1/models/tiny/policy", json={"build_on_miss": True})
    herd = [_report(version="1") for _ in range(20)]
    for i in range(5):
        _post(api, *herd, node=f"node-{i}")
    # A miss for a target no live worker builds: nothing to start.
    _post(api, _report(version="1", target=str(CPU_512)))
    assert len(api.enqueued) == 1, api.enqueued
    job = service.job_view(api.db, api.enqueued[0])
    assert (job["model"], job["version"], job["submitted_by"]) == ("tiny", "1", "build-on-miss")
    assert job["spec"]["inputs"] == ["int64[4,32]"]
    assert [b["target"] for b in job["builds"]] == [str(CPU)]

    # Another shape within the model's interval: rate-limited, no second job.
    _post(api, _report(version="1", inputs=("int64[2,64]",)))
    assert len(api.enqueued) == 1
    policy = api.get("/v1/models/tiny/policy").json()
    assert [(b["inputs"], b["job_id"]) for b in policy["miss_builds"]] == [
        ("int64[4,32]", api.enqueued[0])]


# --- plans ----------------------------------------------------------------------


def test_plan_for_a_new_target_lists_what_the_fleet_uses(api: Api) -> None:
    make_artifact(api.db, api.store, name_key=api.settings.farm_home / "name-key.pem")
    service.set_alias(api.db, "tiny", "prod", "1")
    # Nodes asked for prod (int64[1,16], served) and a shape none has.
    _post(api, _report("load", ref="prod", version="1", inputs=("int64[1,16]",)),
          _report(ref="prod", version="1", inputs=("int64[2,16]",)))

    on_cpu = api.get("/v1/plan", params={"target": str(CPU)}).json()["builds"]
    assert [(b["inputs"], b["target"]) for b in on_cpu] == [(["int64[2,16]"], str(CPU))]

    new = api.get("/v1/plan", params={"target": str(CPU_512)}).json()["builds"]
    assert sorted((b["model"], b["version"], b["inputs"][0], b["target"]) for b in new) == [
        ("tiny", "1", "int64[1,16]", str(CPU_512)), ("tiny", "1", "int64[2,16]", str(CPU_512))]
    why = {b["inputs"][0]: b["why"] for b in new}
    assert why["int64[1,16]"] == ["alias prod", "reports (1)"]

    # A selector no live worker matches is planned as written.
    sel = "cpu/torch=2.14.0+cpu"
    planned = api.get("/v1/plan", params={"target": sel}).json()["builds"]
    assert {b["target"] for b in planned} == {sel} and len(planned) == 2

    r = api.post("/v1/plan", json={"target": str(CPU_512)})
    assert r.status_code == 201, r.text
    jobs = r.json()["jobs"]
    assert len(jobs) == 2 and all(j.get("job_id") for j in jobs), jobs
    assert len(api.enqueued) == 2
    views = [service.job_view(api.db, j) for j in api.enqueued]
    assert {v["builds"][0]["target"] for v in views} == {str(CPU_512)}
    assert api.get("/v1/plan", params={"target": "nonsense"}).status_code == 422


# --- end to end, on the real farm ------------------------------------------------

NAME = "ff-mlp"
NEW_SHAPE = "float32[16,64]"

# A fleet node's start, as on a fleet: a fresh process, the README's call, then
# its reports sent (a node that lives on sends them within FARM_REPORT_INTERVAL_S).
NODE = """
import json, torch
from farm.node import compiled
from farm.node.compiled import default_client
from farm.zoo.basic import mlp

torch.manual_seed(0)
model = mlp()
fast = compiled(model, model="ff-mlp", ref="1", example_inputs=[{shape!r}])
out = {{"source": fast.source, "reason": fast.reason}}
if fast.source == "farm":
    x = torch.randn(16, 64)
    with torch.no_grad():
        out["max_diff"] = float((fast(x) - model(x)).abs().max())
rep = default_client().reporter
out["flushed"] = rep.flush(120)
out["sent"], out["dropped"] = rep.sent, rep.dropped
print(json.dumps(out))
"""


def _cli(env: dict[str, str], *argv: str, ok: bool = True) -> subprocess.CompletedProcess[str]:
    r = subprocess.run([sys.executable, "-m", "farm.app.cli", *argv], env=env, cwd=ROOT,
                       capture_output=True, text=True, timeout=scaled(900))
    if ok:
        assert r.returncode == 0, (argv, r.stdout, r.stderr)
    return r


def _start_node(env: dict[str, str], shape: str = NEW_SHAPE) -> subprocess.Popen[str]:
    return subprocess.Popen([*node_python(), "-c", NODE.format(shape=shape)], env=env,
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _node_result(p: subprocess.Popen[str]) -> dict[str, Any]:
    out, err = p.communicate(timeout=scaled(600))
    assert p.returncode == 0, err[-4000:]
    return dict(json.loads(out.strip().splitlines()[-1]), log=err)


def _wait(check: Any, what: str, timeout: float) -> Any:
    deadline = time.monotonic() + scaled(timeout)
    while True:
        got = check()
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(1.0)


@pytest.fixture(scope="module")
def fleet(farm: Farm) -> dict[str, str]:
    """ff-mlp@1 built for float32[8,64] (backend eager: the loop, not Inductor,
    is under test) with the CLI; returns a node's environment."""
    env = {**farm.env, "FARM_REPORT_INTERVAL_S": "0.5"}
    _cli(env, "submit", "farm.zoo.basic:mlp", "--name", NAME, "--version", "1",
         "--input", "float32[8,64]", "--target", "cpu", "--backend", "eager", "--wait")
    return env


def _jobs(farm: Farm) -> list[dict[str, Any]]:
    with farm.http() as h:
        return list(h.get("/v1/jobs", params={"model": NAME, "limit": 50}).json()["jobs"])


def test_two_nodes_miss_a_new_shape_one_build_runs_and_the_next_start_hits(
        farm: Farm, fleet: dict[str, str]) -> None:
    env = fleet
    assert "build on miss off" in _cli(env, "policy", "show", NAME).stdout
    out = _cli(env, "policy", "set", NAME, "--build-on-miss").stdout
    assert "build on miss on" in out, out
    before = {j["id"] for j in _jobs(farm)}

    # Two nodes start at once and miss the shape no artifact has.
    nodes = [_start_node(env), _start_node(env)]
    results = [_node_result(p) for p in nodes]
    for r in results:
        assert r["source"] == "jit", r
        assert r["flushed"] and r["sent"] >= 1 and r["dropped"] == 0, r

    # Both misses are stored (reading them waits for build on miss to see them).
    def both_stored() -> bool:
        with farm.http() as h:
            rows = h.get("/v1/misses", params={"model": NAME}).json()["misses"]
        return any(x["inputs"] == NEW_SHAPE and x["kind"] == "miss" and x["count"] >= 2
                   for x in rows)
    _wait(both_stored, "both nodes' misses", 60)

    new_jobs = [j for j in _jobs(farm) if j["id"] not in before]
    assert len(new_jobs) == 1, new_jobs  # exactly one build for the herd
    job = farm.wait_job(new_jobs[0]["id"], timeout=scaled(600))
    assert job["state"] == "succeeded", job
    assert job["submitted_by"] == "build-on-miss"
    assert job["spec"]["inputs"] == [NEW_SHAPE]
    assert job["spec"]["options"]["backend"] == "eager"  # the version's own options
    assert len(job["builds"]) == 1
    # Still one, now that it is built (no later report started another).
    assert [j["id"] for j in _jobs(farm) if j["id"] not in before] == [job["id"]]

    # The next node start hits.
    hit = _node_result(_start_node(env))
    assert hit["source"] == "farm", hit
    assert hit["max_diff"] < 1e-4, hit

    misses = _cli(env, "misses", NAME).stdout
    assert NEW_SHAPE in misses and "miss" in misses, misses
    status = _cli(env, "status", NAME).stdout
    assert "build on miss: on" in status and "built on miss" in status, status
    assert "load 1" in status and "miss 2" in status, status
    cov = _cli(env, "coverage", f"{NAME}@1").stdout
    assert f"{NEW_SHAPE} (inference)" in cov and "float32[8,64] (inference)" in cov, cov
    assert "NOT COVERED" not in cov, cov  # what the nodes lacked is built now
    # Covered now is not served then: the two misses are still counted.
    assert "nodes reported 2 request(s) not served" in cov, cov
    with farm.http() as h:
        metrics = h.get("/metrics").text
    assert any(line.startswith("farm_node_reports_total{") and f'model="{NAME}"' in line
               and 'kind="miss"' in line and line.endswith(" 2.0")
               for line in metrics.splitlines()), metrics[-3000:]


def test_plan_for_a_new_target_lists_the_builds_the_nodes_need(
        farm: Farm, fleet: dict[str, str]) -> None:
    env = fleet
    # What nodes use: the shape a node just loaded (its report), and prod's builds.
    _node_result(_start_node(env, "float32[8,64]"))
    _cli(env, "alias", "set", NAME, "prod", "1")
    live = json.loads(_cli(env, "targets", "--json").stdout)
    target = next(str(t["target"] if isinstance(t, dict) else t) for t in
                  (live.get("targets", live) if isinstance(live, dict) else live))
    new_torch = "/".join("torch=9.9.0+cpu" if p.startswith("torch=") else p
                         for p in target.split("/"))

    out = _cli(env, "plan", "--target", new_torch).stdout
    assert f"{NAME}@1 float32[8,64] (inference)" in out, out
    assert "alias prod" in out and "reports" in out, out
    body = json.loads(_cli(env, "plan", "--target", new_torch, "--json").stdout)
    mine = {(b["inputs"][0], b["target"]) for b in body["builds"] if b["model"] == NAME}
    assert ("float32[8,64]", new_torch) in mine, body
    # On the live target, every build the nodes use exists already.
    assert not [b for b in json.loads(_cli(env, "plan", "--target", target, "--json").stdout)[
        "builds"] if b["model"] == NAME]
