"""Programs of the aot_compile guide through the farm as a user sends them
(HTTP submit, trace worker, CPU compile worker, PostgreSQL, Redis, S3), each
loaded by a fleet node in a fresh process:

- two free functions with one graph (``x + y``, and ``Boxed(x + y, 2.0)``)
  get two artifacts, and each returns its own type on the node;
- the backend (eager) and ``disable_guard_check`` are recorded, shown by
  resolve, asked for by the node, and honoured at load;
- a format that is not built is said so in the job view, its CLI lines and
  the resolver's rejection.

The builds use the eager backend (no C++ compile on this 2-core machine):
deduplication is keyed the same way whatever the backend.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest

from farm.app.console import _job_lines
from farm.core.target import detect_local_target
from tests.fixtures.farm import ROOT, Farm
from tests.fixtures.node import node_python

pytestmark = [pytest.mark.integration, pytest.mark.xdist_group("programs")]

NODE = Path(__file__).with_name("program_node.py")
INPUTS = ["float32[4,8]", "float32[4,8]"]
CPU = str(detect_local_target("cpu"))


def function_job(name: str, entrypoint: str, **options: Any) -> dict[str, Any]:
    return {
        "name": name,
        "version": "1",
        "model": {"entrypoint": entrypoint, "kind": "function"},
        "inputs": INPUTS,
        "options": {"backend": "eager", **options},
        "targets": ["cpu"],
    }


def node(farm: Farm, model: str, entrypoint: str, *extra: str) -> dict[str, Any]:
    args = [*node_python(), str(NODE), "--model", model, "--entrypoint", entrypoint]
    for spec in INPUTS:
        args += ["--input", spec]
    # The node imports the program from the checkout, as a user's node has
    # its own code installed.
    env = {**farm.env, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([*args, *extra], env=env, cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def test_one_graph_two_programs_two_artifacts_each_returns_its_type(farm: Farm) -> None:
    plain_id = farm.submit(function_job("prog-add", "tests.models.programs:add"))
    boxed_id = farm.submit(function_job("prog-boxed", "tests.models.programs:add_boxed"))
    plain, boxed = farm.wait_job(plain_id), farm.wait_job(boxed_id)
    for job in (plain, boxed):
        assert job["state"] == "succeeded", json.dumps(job, indent=1)[:6000]
    # One graph (the trace's graph hash), two programs: two keys, two blobs.
    assert json.loads(plain["log"])["graph_hash"] == json.loads(boxed["log"])["graph_hash"]
    assert plain["fingerprint"] != boxed["fingerprint"]
    (pb,), (bb,) = plain["builds"], boxed["builds"]
    assert pb["state"] == bb["state"] == "succeeded"
    assert pb["build_key"] != bb["build_key"]
    assert {a["digest"] for a in pb["artifacts"]}.isdisjoint(a["digest"] for a in bb["artifacts"])
    assert json.loads(boxed["log"])["returns"] == (
        "tests.models.programs.Boxed(scale=float,value=Tensor:float32/2)")
    # The verifier compared Boxed by value: its one tensor leaf, within tolerance.
    (art,) = bb["artifacts"]
    outputs = art["meta"]["verify"]["outputs"]
    assert [o["output"] for o in outputs] == ["output.value"]
    assert outputs[0]["ok"] and outputs[0]["max_abs_err"] <= outputs[0]["tol"]
    assert art["options"] == {"backend": "eager", "guard_filter": "drop-unserializable",
                              "mode": "default"}

    got_plain = node(farm, "prog-add", "tests.models.programs:add")
    got_boxed = node(farm, "prog-boxed", "tests.models.programs:add_boxed")
    assert got_plain["type"] == got_plain["eager_type"] == "torch.Tensor"
    assert got_boxed["type"] == got_boxed["eager_type"] == "tests.models.programs.Boxed"
    assert got_boxed["attrs"] == ["scale", "value"]
    assert got_plain["max_abs_err"] == 0.0 and got_boxed["max_abs_err"] == 0.0
    assert got_plain["digest"] != got_boxed["digest"]

    # No AOTI package for an eager build, and every view says why.
    why = "AOTI packages are Inductor builds; backend 'eager' generates no code"
    assert why in bb["formats_skipped"]["aoti"] and bb["formats_failed"] == {}
    assert any(line.strip().startswith(f"no aoti: {why}") for line in _job_lines(boxed))
    assert f"no aoti: {why}" in bb["log"]
    with httpx.Client(base_url=farm.url, headers=farm.headers) as c:
        r = c.get("/v1/resolve", params={"model": "prog-boxed", "input": INPUTS,
                                         "format": "aoti", "target": CPU})
    assert r.status_code == 404, r.text
    (rej,) = r.json()["rejections"]
    assert rej["code"] == "format" and f"its build has no aoti: {why}" in rej["reason"]


def test_backend_and_disable_guard_check_are_recorded_asked_for_and_honoured(
    farm: Farm,
) -> None:
    entry = "tests.models.programs:add"
    guarded = farm.wait_job(farm.submit(function_job("prog-guards", entry)))
    assert guarded["state"] == "succeeded", json.dumps(guarded, indent=1)[:4000]
    # A second version of the same model: the same program with its guard
    # check disabled, a build of its own.
    spec = function_job("prog-guards", entry, disable_guard_check=True)
    spec["version"] = "2"
    unguarded = farm.wait_job(farm.submit(spec))
    assert unguarded["state"] == "succeeded", json.dumps(unguarded, indent=1)[:4000]
    assert unguarded["builds"][0]["build_key"] != guarded["builds"][0]["build_key"]
    (art,) = unguarded["builds"][0]["artifacts"]
    assert art["options"]["disable_guard_check"] is True

    # Asking for version 2's options gets it, shown in the answer; a call
    # off the artifact's shapes is then not refused.
    asked = json.dumps({"backend": "eager", "disable_guard_check": True})
    got = node(farm, "prog-guards", entry, "--options", asked, "--call-shape", "6,8")
    assert got["options"]["disable_guard_check"] is True, got
    assert "call_error" not in got and got["max_abs_err"] == 0.0, got
    # The guarded build: the same off-shape call is refused by its guards.
    asked = json.dumps({"backend": "eager"})
    got = node(farm, "prog-guards", entry, "--ref", "1", "--options", asked,
               "--call-shape", "6,8")
    assert "disable_guard_check" not in got["options"], got
    assert "GuardManager check failed" in got.get("call_error", ""), got
    with httpx.Client(base_url=farm.url, headers=farm.headers) as c:
        r = c.get("/v1/resolve", params={"model": "prog-guards", "ref": "1", "target": CPU,
                                         "input": INPUTS, "options": asked})
    assert r.status_code == 200, r.text
    assert r.json()["artifact"]["options"] == {
        "backend": "eager", "guard_filter": "drop-unserializable", "mode": "default"}
    with httpx.Client(base_url=farm.url, headers=farm.headers) as c:
        r = c.get("/v1/resolve", params={"model": "prog-guards", "ref": "1", "input": INPUTS,
                                         "target": CPU,
                                         "options": json.dumps({"backend": "inductor"})})
    assert r.status_code == 404
    assert r.json()["rejections"][0]["code"] == "options"


def factory_job(name: str, entrypoint: str, inputs: list[str]) -> dict[str, Any]:
    return {"name": name, "version": "1", "model": {"entrypoint": entrypoint},
            "inputs": inputs, "options": {"backend": "eager"}, "targets": ["cpu"]}


# Four builds, one after another on one compile worker of a shared 2-core machine.
def test_verification_runs_on_realistic_inputs_and_real_buffers(farm: Farm) -> None:
    # Submitted together: the farm traces and builds them while we wait.
    ids = [farm.submit(factory_job(name, f"tests.models.programs:{entry}", inputs))
           for name, entry, inputs in [
               ("prog-tokens", "token_model", ["int64[2,16]"]),
               ("prog-tokens-ranged", "token_model", ["int64[2,16]{5..9}"]),
               ("prog-rotary", "rotary", ["float32[2,8,16]"]),
               ("prog-tokens-wide", "token_model", ["int64[2,16]{0..97}"])]]
    tokens, ranged, rotary, too_wide = (farm.wait_job(i, timeout=900) for i in ids)
    for job in (tokens, ranged, rotary):
        assert job["state"] == "succeeded", json.dumps(job, indent=1)[:6000]

    def report(job: dict[str, Any]) -> dict[str, Any]:
        (art,) = job["builds"][0]["artifacts"]
        return dict(art["meta"]["verify"])

    # No range declared: token ids below the model's 97-entry embedding.
    assert report(tokens)["input_values"] == [
        "int64[2,16]: uniform in 0..96 (nn.Embedding embed: 97 entries)"]
    assert report(ranged)["input_values"] == ["int64[2,16]{5..9}: uniform in 5..9 (declared)"]
    # The range is part of the build: not deduplicated with the unranged one.
    assert tokens["builds"][0]["build_key"] != ranged["builds"][0]["build_key"]
    # Built for real: the rotary table is what __init__ computes, not zeros.
    for job in (tokens, rotary):
        rep = report(job)
        assert rep["model_init"] == "real"
        (out,) = rep["outputs"]
        assert out["output"] == "output" and out["ok"] and out["max_abs_err"] <= out["tol"]
        assert out["tol"] > 0 and out["dtype"] == "float32"
    # A declared range the embedding cannot index fails at trace, in words.
    assert too_wide["state"] == "failed"
    error = too_wide["error"]
    assert "has 97 entries (ids 0..96); the range is inclusive: declare {0..96}" in error, error


def test_a_function_with_a_captured_module_declares_it_as_external_data(farm: Farm) -> None:
    entry = "tests.models.programs:use_captured"
    undeclared = farm.wait_job(farm.submit({**function_job("prog-captured", entry),
                                            "inputs": ["float32[4,8]"]}))
    assert undeclared["state"] == "failed"
    assert "declare it with external_data" in undeclared["error"], undeclared["error"]
    spec = {**function_job("prog-captured", entry), "inputs": ["float32[4,8]"], "version": "2"}
    spec["model"] = {**spec["model"], "external_data": ["captured"]}
    job = farm.wait_job(farm.submit(spec))
    assert job["state"] == "succeeded", json.dumps(job, indent=1)[:6000]
    assert job["spec"]["model"]["external_data"] == ["captured"]
    (art,) = job["builds"][0]["artifacts"]
    assert art["meta"]["external_data"] == ["captured"]
    assert "external_data" in job["builds"][0]["formats_skipped"]["aoti"]
    # A fresh node supplies its own module (the same seeded weights) at load.
    args = [*node_python(), str(NODE), "--model", "prog-captured", "--entrypoint", entry,
            "--input", "float32[4,8]", "--external-data", "captured"]
    out = subprocess.run(args, env={**farm.env, "PYTHONPATH": str(ROOT)}, cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["type"] == "torch.Tensor" and got["max_abs_err"] == 0.0, got
    # Without it, torch refuses to load, saying what is missing.
    out = subprocess.run(args[:-2], env={**farm.env, "PYTHONPATH": str(ROOT)}, cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode != 0 and "external" in out.stderr.lower(), out.stderr[-2000:]
