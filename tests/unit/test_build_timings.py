"""workers.build_timings: a build's seconds as its log and job page show them."""

from __future__ import annotations

from workers.build_timings import COMPILE_CHILD, ZYGOTE_START, BuildTimings


def test_a_build_that_waited_for_the_zygotes_start_says_so_and_where_it_went() -> None:
    clock = BuildTimings()
    clock.child_ran(5.5, {"Dynamo": 1.4}, warm=True,
                    zygote_start={"total": 11.8, "imports": 11.7, "CUDA fork check": 0.0})
    assert clock.worker == {ZYGOTE_START: 11.8, COMPILE_CHILD: 5.5}
    assert clock.to_json()["zygote"] == {"imports": 11.7, "CUDA fork check": 0.0}
    lines = clock.log_lines()
    assert lines[0] == "seconds, worker: build zygote start 11.8 s, compile child 5.5 s"
    assert lines[1].startswith("seconds, build zygote start (") and "imports 11.7 s" in lines[1]
    assert lines[2] == "seconds, compile child (forked warm; its own account): Dynamo 1.4 s"


def test_a_build_on_a_warm_zygote_has_no_start_to_tell() -> None:
    clock = BuildTimings()
    clock.child_ran(1.6, {"Dynamo": 1.1}, warm=True, zygote_start={})
    assert ZYGOTE_START not in clock.worker and clock.to_json()["zygote"] == {}
    assert len(clock.log_lines()) == 2


def test_a_verification_that_waited_for_its_own_zygote_tells_it_apart() -> None:
    """A CPU AOTI package's verifier forks from a zygote of its own (no
    compiler on its path): its start is not the verification's seconds."""
    clock = BuildTimings()
    clock.child_ran(5.5, {"Dynamo": 1.4}, warm=True, zygote_start={"total": 3.0, "imports": 2.5})
    clock.add("verify aoti", 9.0)
    clock.zygote_started_during("verify aoti", {"total": 6.5, "imports": 4.0, "ISA pick": 1.0})
    assert clock.worker == {ZYGOTE_START: 9.5, COMPILE_CHILD: 5.5, "verify aoti": 2.5}
    # Both zygotes' splits, added up as their seconds are.
    assert clock.to_json()["zygote"] == {"imports": 6.5, "ISA pick": 1.0}
    # Never more than the stage measured, and nothing when it did not wait.
    clock.add("verify aot_compile", 1.0)
    clock.zygote_started_during("verify aot_compile", {"total": 50.0})
    clock.zygote_started_during("verify aot_compile", {})
    assert clock.worker["verify aot_compile"] == 0.0 and clock.worker[ZYGOTE_START] == 10.5
