"""A build's memory limit (farm.build.memory_budget, farm.build.watchdog):
the default that fits the machine, the compile pool sized from the limit,
PSS rather than a sum of resident sets (a parallel compile pool under a
limit that sum exceeds still builds), the sandbox's tmpfs counted (a burst
of files in /tmp is stopped), and an error that says what took the memory
and which setting raises the limit."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from farm.build import memory_budget
from farm.build.isolation import Isolation
from farm.build.sandbox import run_isolated
from tests.sandbox_required import require_sandbox

ATTACKERS = Path(__file__).parent / "attackers"


def test_the_default_limit_is_half_the_machine_and_at_least_8_gb() -> None:
    assert memory_budget.default_limit_mb(128 * 1024) == 64 * 1024  # a 16-core GPU host
    assert memory_budget.default_limit_mb(6000) == 8192
    assert memory_budget.build_limit_mb(3000) == 3000
    assert memory_budget.build_limit_mb(0) == memory_budget.default_limit_mb()


def test_the_compile_pool_is_sized_from_the_limit_and_the_cores() -> None:
    assert memory_budget.compile_threads(64 * 1024, cores=16) == 16
    assert memory_budget.compile_threads(8192, cores=32) == 16
    assert memory_budget.compile_threads(1450, cores=2) == 2
    assert memory_budget.compile_threads(300, cores=8) == 1


def _run(target: str, memory_mb: float, **kw: object) -> object:
    require_sandbox()
    return run_isolated(
        f"memory_attacks:{target}",
        {},
        timeout_s=900,
        memory_mb=memory_mb,
        import_paths=[ATTACKERS],
        isolation=Isolation(),
        warm=False,
        **kw,
    )


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="a pool needs two cores")
def test_a_parallel_compile_pool_builds_under_a_limit_its_rss_sum_exceeds() -> None:
    limit = 1450
    res = _run("pool_compile", limit)
    assert res.ok, (res.describe(), res.traceback, res.stderr_tail[-3000:])
    v = res.value
    # Two compile workers (sized from the limit) beside the pool's sidecar.
    assert v["compile_threads"] == 2 and v["pool_processes"] >= 3 and v["ok"], v
    # Counted as resident sets the pool's shared torch pages count once per
    # process and the old watchdog killed this build; counted as PSS it fits.
    assert res.peak_rss_sum_mb > limit, res.peak_rss_sum_mb
    assert 0 < res.peak_rss_mb <= limit, res.peak_rss_mb


def test_a_tmpfs_burst_is_stopped_and_the_error_says_what_took_the_memory() -> None:
    limit = 1000
    res = _run("tmpfs_burst", limit)
    assert res.oom and not res.ok, res
    # Files, not process memory: a resident-set watchdog never saw them.
    assert res.peak_rss_sum_mb < limit / 2, res.peak_rss_sum_mb
    assert res.peak_rss_mb > limit, res.peak_rss_mb
    msg = res.describe()
    assert "files in /tmp" in msg and "BUILD_MEMORY_MB" in msg, msg


def test_a_memory_hog_is_stopped_and_named() -> None:
    res = _run("hog", 600)
    assert res.oom and not res.ok, res
    msg = res.describe()
    assert "farm.build.sandbox memory_attacks:hog" in msg and "BUILD_MEMORY_MB" in msg, msg
