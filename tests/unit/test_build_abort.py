"""A build child that aborts says where (farm.build.crash_site): the native
phase it announced, faulthandler's last Python frame and a C++ exception's
message reach the job's error, not only the signal's name."""

from __future__ import annotations

import os
import sys
from typing import Any

from farm.build.crash_site import crash_site, native_phase
from farm.build.sandbox import run_isolated
from tests.slowdown import scaled


def aborting_step(payload: dict[str, Any]) -> None:
    """A build step whose native code aborts the process (what a C++
    exception escaping an OpenMP region does)."""
    with native_phase("running the compiled kernels once (CPU warm-up)"):
        if payload.get("what"):
            print("terminate called after throwing an instance of 'c10::Error'", file=sys.stderr)
            print(f"  what():  {payload['what']}", file=sys.stderr, flush=True)
        os.abort()


def finished_phase_then_abort(payload: dict[str, Any]) -> None:
    with native_phase("tracing and lowering the model (torch aot_compile)"):
        pass
    os.abort()


def _abort_line(fn: Any) -> int:
    """The line of ``os.abort()`` in ``fn``: the frame faulthandler names."""
    import inspect

    lines, first = inspect.getsourcelines(fn)
    return first + next(i for i, ln in enumerate(lines) if "os.abort()" in ln)


def _run(target: str, payload: dict[str, Any] | None = None) -> Any:
    return run_isolated(
        f"tests.unit.test_build_abort:{target}", payload or {}, timeout_s=scaled(60), memory_mb=2048
    )


def test_an_aborting_child_is_reported_with_its_phase_and_frame() -> None:
    from workers.tasks import _sandbox_error

    res = _run("aborting_step", {"what": "index out of bounds: 0 <= tmp7 < 64L"})
    assert not res.ok and res.signal == "SIGABRT"
    where = res.crash_site()
    assert where == (
        "while running the compiled kernels once (CPU warm-up), in "
        f"tests/unit/test_build_abort.py:{_abort_line(aborting_step)} aborting_step; C++: "
        "index out of bounds: "
        "0 <= tmp7 < 64L"
    )
    assert res.describe() == f"crashed with SIGABRT {where}"
    head, log = _sandbox_error(res)
    assert head == f"crashed with signal SIGABRT {where}"
    assert "Fatal Python error: Aborted" in log  # faulthandler's stack is in the job log


def test_a_phase_that_came_back_is_not_blamed() -> None:
    res = _run("finished_phase_then_abort")
    assert res.signal == "SIGABRT"
    line = _abort_line(finished_phase_then_abort)
    assert res.crash_site() == f"in tests/unit/test_build_abort.py:{line} finished_phase_then_abort"


def test_crash_site_reads_faulthandlers_current_thread_not_the_others() -> None:
    stderr = "\n".join(
        [
            "torch-farm: native phase: compiling the AOTInductor package",
            "Fatal Python error: Segmentation fault",
            "",
            "Thread 0x00007f0000000001 (most recent call first):",
            '  File "/usr/lib/python3.11/threading.py", line 324 in wait',
            "",
            "Current thread 0x00007f0000000002 (most recent call first):",
            '  File "/venv/lib/python3.11/site-packages/torch/_inductor/graph.py", line 9 in run',
            '  File "/srv/farm/build/aoti_compile.py", line 140 in compile_aoti',
        ]
    )
    assert crash_site(stderr) == (
        "while compiling the AOTInductor package, in torch/_inductor/graph.py:9 run"
    )
    assert crash_site("Killed\n") is None
