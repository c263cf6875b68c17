"""The compile child's graph check in a fork beside the compile
(farm.build.graph_check): its verdict, whatever it is, is the one the child
acts on, and a fork that dies without one fails the build."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import pytest

from farm.build.graph_check import GraphCheck, GraphCheckLost
from farm.core.inputs import parse_inputs
from farm.core.specs import JobSpec, ModelRef

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


def test_the_check_runs_in_a_fork_and_its_answer_comes_back() -> None:
    check = GraphCheck.start(_answers, SPEC, "abc")
    assert check.forked
    out = check.verdict()
    assert out["expected"] == "abc" and out["pid"] != os.getpid()


def test_a_refusal_is_raised_as_the_fork_raised_it() -> None:
    with pytest.raises(ValueError, match="not abc"):
        GraphCheck.start(_refuses, SPEC, "abc").verdict()
    # One whose class cannot be rebuilt still comes back, as a failure with its text.
    with pytest.raises(RuntimeError, match="graph check failed: Odd: odd at here"):
        GraphCheck.start(_odd, SPEC, "abc").verdict()


def test_a_fork_that_dies_without_an_answer_fails_the_build() -> None:
    with pytest.raises(GraphCheckLost, match="without an answer"):
        GraphCheck.start(_dies, SPEC, "abc").verdict()


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
