"""Where a build's seconds went (farm.build.stage_times): torch's nested timers
split into exclusive stages, and the worker keeping only what it can check of
a child's account (a real child process that lies about its timings)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from farm.build import stage_times as st
from farm.build.sandbox import run_isolated


def test_a_cold_compile_splits_into_exclusive_stages() -> None:
    # Sums of torch's dynamo_timed timers from a cold CPU aot_compile
    # (bench/build_cost.py's stack model): they nest, and compile_file is
    # added up by the kernel pool's threads past the wall time.
    metrics = {
        "fullgraph_capture": 26.3,
        "bytecode_tracing": 0.14,
        "create_aot_dispatcher_function": 25.85,
        "compile_fx.<locals>.fw_compiler_base": 25.72,
        "GraphLowering.run": 0.09,
        "GraphLowering.codegen": 10.99,
        "PyCodeCache.load_by_key_path": 14.27,
        "async_compile.wait": 2.6,
        "compile_file": 40.0,
    }
    split = st.split_phases(metrics)
    assert split[st.DYNAMO] == pytest.approx(26.3 - 25.85)
    assert split[st.AOT_AUTOGRAD] == pytest.approx(25.85 - 25.72)
    assert split[st.CODEGEN] == pytest.approx(10.99)
    assert split[st.KERNEL_COMPILE] == pytest.approx(14.27)
    assert split[st.LOWERING] == pytest.approx(25.72 - 10.99 - 14.27)
    # Exclusive: together they are the capture's wall time, not more.
    assert sum(split.values()) == pytest.approx(26.3)


def test_an_aotautograd_cache_hit_is_a_load_not_a_compile() -> None:
    metrics = {
        "fullgraph_capture": 2.71,
        "bytecode_tracing": 0.33,
        "AOTAutogradCache.inductor_load": 1.88,
        "PyCodeCache.load_by_key_path": 1.88,
        "compile_file": 0.22,
    }
    split = st.split_phases(metrics)
    assert split[st.KERNEL_COMPILE] == pytest.approx(1.88)
    assert split[st.CODEGEN] == 0 and split[st.LOWERING] == 0 and split[st.AOT_AUTOGRAD] == 0
    assert split[st.DYNAMO] == pytest.approx(2.71 - 1.88)


def test_an_aoti_package_splits_into_lowering_codegen_and_its_cxx_compile() -> None:
    # Sums of torch's timers from a cold CPU AOTI package of bench/build_cost.py's
    # 16-layer stack (torch 2.13): the C++ compile and link sits beside codegen,
    # both inside Inductor's forward compiler.
    metrics = {
        "compile_fx.<locals>.fw_compiler_base": 9.89,
        "GraphLowering.compile_to_fn": 9.41,
        "GraphLowering.codegen": 5.00,
        "AotCodeCompiler.compile": 4.41,
        "compile_file": 8.49,
    }
    split = st.split_aoti_phases(metrics)
    assert split == pytest.approx({st.AOTI_LOWERING: 9.89 - 5.00 - 4.41,
                                   st.AOTI_CODEGEN: 5.00, st.AOTI_CXX: 4.41})
    # A package from the farm's cache compiles nothing.
    assert set(st.split_aoti_phases({}).values()) == {0.0}


def test_the_package_stages_add_up_to_its_wall_time() -> None:
    import time

    st.reset()
    t0 = time.perf_counter()
    with st.aoti_package():
        st.add(st.AOTI_EXPORT, 0.02)
        st.add(st.AOTI_CXX, 0.03)
        time.sleep(0.08)
    wall = time.perf_counter() - t0
    got = st.snapshot()
    assert got[st.AOTI] == pytest.approx(wall - 0.05, abs=0.005)
    assert sum(got.values()) == pytest.approx(wall, abs=0.005)
    st.reset()


def test_the_worker_keeps_known_stages_in_range_and_adds_other() -> None:
    kept = st.from_child(
        {
            "Dynamo": 1.5,
            "imports": 0.25,
            "<img src=x>": 1.0,
            "save": -1.0,
            "warm-up": True,
            "AOTAutograd": math.nan,
            "C++/Triton compile": 1e9,
            "graph check": "2",
        },
        wall_s=10.0,
    )
    assert kept == {"imports": 0.25, "Dynamo": 1.5, "other": 8.25}
    assert st.from_child("not a dict", wall_s=3.0) == {}
    assert st.from_child(None, wall_s=3.0) == {}


LIAR = """
from farm.build import stage_times

def lie(payload):
    stage_times.add("warm-up", 0.01)
    stage_times._stages.update({"<script>alert(1)</script>": 1.0, "Dynamo": 1e12,
                                "AOTAutograd": float("inf"), "save": -5.0})
    return {"ok": True}
"""


def test_a_child_lying_about_its_seconds_gets_only_what_the_worker_can_check(
    tmp_path: Path,
) -> None:
    code = tmp_path / "code"
    code.mkdir()
    (code / "liar.py").write_text(LIAR)
    res = run_isolated("liar:lie", {}, timeout_s=120, memory_mb=2000, import_paths=[code])
    assert res.ok, (res.error, res.stderr_tail)
    assert set(res.stages) <= {*st.CHILD_STAGES, st.OTHER}, res.stages
    assert "Dynamo" not in res.stages and "AOTAutograd" not in res.stages
    assert "save" not in res.stages
    # A plausible claim stays (it may be a lie: nothing depends on it).
    assert res.stages["warm-up"] >= 0.01, res.stages
    # Its start is the worker's measurement against the child's first clock
    # reading; everything stays within the wall time the worker measured.
    assert 0 <= res.stages["child start"] <= res.wall_s
    assert sum(res.stages.values()) == pytest.approx(res.wall_s, abs=0.01)
