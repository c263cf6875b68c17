"""The pure parts of fleet feedback: the node's report sender, the build-on-miss
decision and its rate gate, coverage and upgrade plans."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import httpx
import pytest

from farm.core.inputs import parse_inputs
from farm.core.specs import CompileOptions, GradMode
from farm.core.target import Target, TargetSelector
from farm.node.reports import Report, Reporter
from registry.entities import ArtifactRecord
from registry.service.coverage import Need, plan_builds, summarize, target_serves, uncovered
from registry.service.miss_builds import RateGate, decide
from tests.slowdown import scaled

CPU = Target.parse("cpu/python=3.11.7/torch=2.13.0+cpu/isa=avx2/threads=2")
CPU_512 = Target.parse("cpu/python=3.11.7/torch=2.13.0+cpu/isa=avx512/threads=2")
NEW_TORCH = Target.parse("cpu/python=3.11.7/torch=2.14.0+cpu/isa=avx2/threads=2")


def _record(inputs: str = "float32[8,64]", *, target: Target = CPU, rid: int = 1,
            grad_mode: GradMode = GradMode.INFERENCE, fmt: str = "aot_compile",
            options: CompileOptions | None = None) -> ArtifactRecord:
    return ArtifactRecord(id=rid, digest=f"{rid:064x}", size=10, format=fmt, fingerprint="f",
                          build_key=f"k{rid}", inputs=parse_inputs(inputs.split(";")),
                          grad_mode=grad_mode, options=options or CompileOptions(),
                          target=target)


def _report(**kw: Any) -> Report:
    return Report(**{"kind": "miss", "model": "m", "inputs": ["float32[8,64]"],
                     "grad_mode": "inference", "target": str(CPU), **kw})


# --- the node's reporter ------------------------------------------------------


def test_reports_go_in_one_batch_with_the_node_id() -> None:
    got: list[dict[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        got.append(json.loads(request.content))
        return httpx.Response(202, json={"accepted": 1})

    http = httpx.Client(base_url="http://farm", transport=httpx.MockTransport(handler))
    rep = Reporter(http, interval_s=60, node="host:1")
    for i in range(3):
        rep.add(_report(reason=f"r{i}"))
    assert rep.flush(scaled(10))
    assert len(got) == 1 and got[0]["node"] == "host:1"
    assert [r["reason"] for r in got[0]["reports"]] == ["r0", "r1", "r2"]
    assert (rep.sent, rep.dropped) == (3, 0)


def test_add_never_waits_on_a_slow_farm_and_drops_when_it_is_down() -> None:
    release = threading.Event()

    def handler(request: httpx.Request) -> httpx.Response:
        release.wait(scaled(10))
        raise httpx.ConnectError("connection refused")

    http = httpx.Client(base_url="http://farm", transport=httpx.MockTransport(handler))
    rep = Reporter(http, interval_s=0.05, max_queue=5)
    rep.add(_report())
    time.sleep(0.3)  # the thread is now inside the hanging send
    # Queued while the send hangs: had add() waited on it, these would not
    # finish before the send is released below.
    def add_ten() -> None:
        for _ in range(10):
            rep.add(_report())

    adder = threading.Thread(target=add_ten)
    adder.start()
    adder.join(scaled(10))
    finished_before_release = not adder.is_alive()
    release.set()
    assert rep.flush(scaled(10))
    # The first batch (1) and what the queue held (5) failed; 5 never fitted.
    assert (rep.sent, rep.dropped) == (0, 11)
    assert finished_before_release


def test_a_report_kind_is_checked() -> None:
    with pytest.raises(ValueError, match="not one of"):
        _report(kind="crash")


def test_a_closed_reporter_takes_nothing() -> None:
    http = httpx.Client(base_url="http://farm",
                        transport=httpx.MockTransport(lambda r: httpx.Response(202)))
    rep = Reporter(http, interval_s=60)
    rep.close()
    rep.add(_report())
    assert rep.pending() == 0


# --- build on miss ----------------------------------------------------------------


def test_rate_gate_passes_one_per_interval_per_key() -> None:
    now = [100.0]
    gate = RateGate(60, clock=lambda: now[0])
    assert gate.allow("a") and not gate.allow("a") and gate.allow("b")
    now[0] += 59.9
    assert not gate.allow("a")
    now[0] += 0.2
    assert gate.allow("a")
    assert gate.allow("a", interval_s=0) and not gate.allow("a", interval_s=10)


def test_decide_builds_a_new_shape_on_a_live_target_that_loads_on_the_node() -> None:
    recs = [_record("float32[8,64]")]
    new = parse_inputs(["float32[16,64]"])
    build, why = decide(model="m", version="1", inputs=new, grad_mode=GradMode.INFERENCE,
                        node=CPU, records=recs, live=[CPU_512, CPU])
    assert build is not None and why == "missing"
    assert (build.target, build.inputs) == (CPU, new)
    # Served already (a build finished since): nothing.
    build, why = decide(model="m", version="1", inputs=parse_inputs(["float32[8,64]"]),
                        grad_mode=GradMode.INFERENCE, node=CPU, records=recs, live=[CPU])
    assert build is None and "already served" in why
    # No worker whose artifacts load on this node, or no known version.
    assert decide(model="m", version="1", inputs=new, grad_mode=GradMode.INFERENCE,
                  node=NEW_TORCH, records=recs, live=[CPU])[0] is None
    assert decide(model="m", version=None, inputs=new, grad_mode=GradMode.INFERENCE,
                  node=CPU, records=recs, live=[CPU])[1] == "not a known version"


def test_decide_builds_a_known_shape_for_a_node_target_nothing_serves() -> None:
    build, _ = decide(model="m", version="1", inputs=parse_inputs(["float32[8,64]"]),
                      grad_mode=GradMode.INFERENCE, node=CPU_512,
                      records=[_record(target=CPU)], live=[CPU, CPU_512])
    assert build is not None and build.target == CPU_512


# --- coverage ---------------------------------------------------------------------


def test_target_serves_follows_the_resolver() -> None:
    assert target_serves(CPU, CPU)
    assert not target_serves(CPU, CPU_512)  # another ISA
    assert not target_serves(CPU, NEW_TORCH)  # torch refuses another version


def test_summarize_groups_formats_and_flags_dynamic_ranges() -> None:
    recs = [_record("float32[2..64,128]", rid=1), _record("float32[2..64,128]", rid=2,
                                                          fmt="aoti"),
            _record("float32[8,64]", rid=3, grad_mode=GradMode.TRAINING, target=CPU_512)]
    got = summarize(recs)
    assert [(g["inputs"], g["dynamic"], g["formats"], g["grad_mode"]) for g in got] == [
        ("float32[2..64,128]", True, ["aot_compile", "aoti"], "inference"),
        ("float32[8,64]", False, ["aot_compile"], "training")]


def test_uncovered_uses_the_resolvers_rules_with_its_codes() -> None:
    recs = [_record("float32[2..64,128]")]
    needs = [Need("m", "1", parse_inputs(["float32[32,128]"]), GradMode.INFERENCE, CPU, count=9),
             Need("m", "1", parse_inputs(["float32[32,256]"]), GradMode.INFERENCE, CPU, count=3),
             Need("m", "1", parse_inputs(["float32[32,128]"]), GradMode.INFERENCE, CPU_512),
             Need("m", "1", parse_inputs(["float32[32,128]"]), GradMode.TRAINING, CPU)]
    got = uncovered(recs, needs)
    assert [(u["inputs"], u["target"] == str(CPU), u["codes"]) for u in got] == [
        ("float32[32,256]", True, ["inputs"]),
        ("float32[32,128]", True, ["grad_mode"]),
        ("float32[32,128]", False, ["isa"])]


# --- upgrade plans --------------------------------------------------------------------


def test_plan_for_a_new_torch_lists_every_need_once_with_why() -> None:
    recs = {("m", "1"): [_record("float32[8,64]")], ("n", "2"): [_record("int64[1,16]")]}
    needs = [Need("m", "1", parse_inputs(["float32[8,64]"]), GradMode.INFERENCE,
                  options=CompileOptions(), count=5),
             Need("m", "1", parse_inputs(["float32[8,64]"]), GradMode.INFERENCE,
                  options=CompileOptions(), source="alias prod"),
             Need("n", "2", parse_inputs(["int64[1,16]"]), GradMode.INFERENCE,
                  options=CompileOptions(), source="alias prod")]
    plan = plan_builds(NEW_TORCH, needs, recs)
    assert [(b.model, b.target, b.why) for b in plan] == [
        ("m", str(NEW_TORCH), ("alias prod", "reports (5)")),
        ("n", str(NEW_TORCH), ("alias prod",))]
    # On the target they were built for, nothing is needed.
    assert plan_builds(CPU, needs, recs) == []


def test_plan_expands_a_selector_to_live_targets_or_keeps_it_as_written() -> None:
    recs = {("m", "1"): [_record("float32[8,64]")]}
    need = [Need("m", "1", parse_inputs(["float32[8,64]"]), GradMode.INFERENCE,
                 options=CompileOptions())]
    sel = TargetSelector.parse("cpu/isa=avx512")
    assert [b.target for b in plan_builds(sel, need, recs, live=[CPU, CPU_512])] == [
        str(CPU_512)]
    assert [b.target for b in plan_builds(sel, need, recs, live=[CPU])] == [str(sel)]
    # A selector the existing build already matches needs nothing.
    assert plan_builds(TargetSelector.parse("cpu/isa=avx2"), need, recs, live=[CPU]) == []


def test_plan_keeps_options_apart() -> None:
    eager = CompileOptions(backend="eager")
    recs = {("m", "1"): [_record("float32[8,64]", target=NEW_TORCH)]}
    need = [Need("m", "1", parse_inputs(["float32[8,64]"]), GradMode.INFERENCE, options=eager)]
    plan = plan_builds(NEW_TORCH, need, recs)
    assert len(plan) == 1 and plan[0].options == eager
