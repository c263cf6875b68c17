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
