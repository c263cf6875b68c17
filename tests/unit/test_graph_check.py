"""The compile child's graph check in a fork beside the compile
(farm.build.graph_check): its verdict, whatever it is, is the one the child
acts on, and a fork that dies without one fails the build."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from farm.build.graph_check import GraphCheck
from farm.core.inputs import parse_inputs
from farm.core.specs import JobSpec, ModelRef
from tests.slowdown import scaled

ROOT = Path(__file__).resolve().parents[2]

SPEC = JobSpec(name="m", version="1",
               model=ModelRef("farm.zoo.basic:mlp", {"d_in": 4, "hidden": 8, "d_out": 4}),
               inputs=parse_inputs(["float32[2,4]"]))


def _answers(spec: JobSpec, expected: str) -> dict[str, Any]:
    return {"pid": os.getpid(), "expected": expected}


class Odd(Exception):
    def __init__(self, what: str, *, where: str) -> None:  # not rebuilt from its args
        super().__init__(f"{what} at {where}")


def _refuses(spec: JobSpec, expected: str) -> dict[str, Any]:
    raise ValueError(f"not {expected}")


def _odd(spec: JobSpec, expected: str) -> dict[str, Any]:
    raise Odd("odd", where="here")


def _dies(spec: JobSpec, expected: str) -> dict[str, Any]:
    os._exit(3)


def scenarios() -> dict[str, Any]:
    """Run in a fresh process (``_in_a_fresh_process``): a test process has
    threads of its own (xdist's), where the check rightly never forks."""
    out: dict[str, Any] = {}
    check = GraphCheck.start(_answers, SPEC, "abc")
    answer = check.verdict()
    out["answer"] = {"forked": check.forked, "expected": answer["expected"],
                     "other_pid": answer["pid"] != os.getpid()}
    for name, fn in (("refusal", _refuses), ("odd", _odd), ("dies", _dies)):
        try:
            GraphCheck.start(fn, SPEC, "abc").verdict()
            out[name] = "no error"
        except Exception as exc:
            out[name] = f"{type(exc).__name__}: {exc}"
    return out


def _in_a_fresh_process() -> dict[str, Any]:
    code = ("import json; from tests.unit.test_graph_check import scenarios; "
            "print(json.dumps(scenarios()))")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       timeout=scaled(120), env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr[-3000:]
    return dict(json.loads(r.stdout.strip().splitlines()[-1]))


def test_the_check_runs_in_a_fork_and_every_outcome_comes_back() -> None:
    out = _in_a_fresh_process()
    # Forked, and the fork's answer is the verdict.
    assert out["answer"] == {"forked": True, "expected": "abc", "other_pid": True}, out
    # A refusal is raised as the fork raised it; one whose class cannot be
    # rebuilt comes back as a failure with its text.
    assert out["refusal"] == "ValueError: not abc", out
    assert out["odd"] == "RuntimeError: the graph check failed: Odd: odd at here", out
    # A fork that dies without an answer fails the build.
    assert out["dies"].startswith("GraphCheckLost: the graph check's process ended without "
                                  "an answer"), out


def test_with_a_second_thread_the_check_runs_first_in_the_caller() -> None:
    stop = threading.Event()
    t = threading.Thread(target=stop.wait)
    t.start()
    try:
        check = GraphCheck.start(_answers, SPEC, "abc")
    finally:
        stop.set()
        t.join()
    assert not check.forked and check.verdict()["pid"] == os.getpid()


def _payload(tmp_path: Path, fingerprint: str) -> dict[str, Any]:
    return {"spec": SPEC.to_json(), "device": "cpu", "out_dir": str(tmp_path),
            "fingerprint": fingerprint, "aoti_unavailable": "test: aot_compile only"}


def test_compile_step_returns_artifacts_only_for_the_traced_graph(tmp_path: Path) -> None:
    from farm.build.steps import GraphMismatch, compile_step
    from farm.build.trace import trace

    traced = trace(SPEC)
    out = compile_step(_payload(tmp_path / "a", traced.fingerprint))
    (art,) = out["artifacts"]
    assert art["meta"]["graph_checked"] and art["meta"]["graph_hash"] == traced.graph_hash
    with pytest.raises(GraphMismatch, match="not the graph the trace fingerprinted"):
        compile_step(_payload(tmp_path / "b", "0" * 64))
