"""Kernel memory and process limits per build (farm.build.cgroup_limits):
a FARM_BUILD_CGROUP that cannot hold build cgroups stops the worker's start
with what to do; where the host delegates a cgroup v2 directory with the
memory and pids controllers (FARM_TEST_BUILD_CGROUP names one, or a root
test run on a cgroup2 host makes one), a tmpfs burst and a fork bomb meet
the kernel's limits and the result says the kernel's limit applied."""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from farm.build import cgroup_limits
from farm.build.isolation import Isolation, SandboxUnavailable
from farm.build.sandbox import check_worker_can_isolate, isolation_unavailable, run_isolated
from farm.core.settings import get_settings
from tests.sandbox_required import require_sandbox

ATTACKERS = Path(__file__).parent / "attackers"
CG2 = Path("/sys/fs/cgroup")


@pytest.fixture
def cgroup_setting(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    yield monkeypatch
    monkeypatch.delenv("FARM_BUILD_CGROUP", raising=False)
    get_settings.cache_clear()


def _use(monkeypatch: pytest.MonkeyPatch, path: Path) -> None:
    monkeypatch.setenv("FARM_BUILD_CGROUP", str(path))
    get_settings.cache_clear()


def test_a_directory_that_is_not_a_cgroup_is_refused_with_what_to_do(tmp_path: Path) -> None:
    why = cgroup_limits.check(tmp_path)
    assert why and "not a cgroup v2 directory" in why and "mkdir /sys/fs/cgroup/" in why
    with pytest.raises(cgroup_limits.CgroupUnavailable):
        cgroup_limits.create(tmp_path, memory_mb=100, max_procs=10)


def test_controllers_missing_from_the_subtree_are_named(tmp_path: Path) -> None:
    (tmp_path / "cgroup.controllers").write_text("cpu memory pids\n")
    (tmp_path / "cgroup.subtree_control").write_text("cpu\n")
    why = cgroup_limits.check(tmp_path)
    assert why and "echo +memory +pids > " in why, why


def test_a_worker_with_an_unusable_cgroup_refuses_to_start(
    cgroup_setting: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    require_sandbox()
    _use(cgroup_setting, tmp_path)
    for mode in ("on", "auto", "off"):
        with pytest.raises(SandboxUnavailable, match="not a cgroup v2 directory"):
            check_worker_can_isolate(mode)


def _delegated() -> Path | None:
    """A cgroup v2 directory with memory and pids for its children, or None."""
    named = os.environ.get("FARM_TEST_BUILD_CGROUP")
    if named:
        return Path(named)
    if os.geteuid() != 0 or not (CG2 / "cgroup.controllers").is_file():
        return None
    # Only where the host already hands memory and pids down (never changed here).
    if not {"memory", "pids"} <= set((CG2 / "cgroup.subtree_control").read_text().split()):
        return None
    d = CG2 / f"farm-test-{uuid.uuid4().hex[:8]}"
    try:
        d.mkdir()
        (d / "cgroup.subtree_control").write_text("+memory +pids")
    except OSError:
        with contextlib.suppress(OSError):
            d.rmdir()
        return None
    return d


@pytest.fixture
def delegated(cgroup_setting: pytest.MonkeyPatch) -> Iterator[Path]:
    require_sandbox()
    d = _delegated()
    if d is None:
        pytest.skip(
            "no delegated cgroup v2 directory with memory and pids here "
            "(FARM_TEST_BUILD_CGROUP names one)"
        )
    _use(cgroup_setting, d)
    try:
        yield d
    finally:
        if not os.environ.get("FARM_TEST_BUILD_CGROUP"):
            with contextlib.suppress(OSError):
                d.rmdir()


def test_the_kernel_stops_a_tmpfs_burst_and_a_fork_bomb(delegated: Path, tmp_path: Path) -> None:
    assert isolation_unavailable() is None
    res = run_isolated(
        "memory_attacks:tmpfs_burst",
        {},
        timeout_s=600,
        memory_mb=600,
        import_paths=[ATTACKERS],
        isolation=Isolation(),
        warm=False,
    )
    assert res.oom and not res.ok, res
    assert res.limits.startswith("kernel: cgroup") and "memory.max 600 MB" in res.limits, res
    bomb_dir = tmp_path / "bomb"
    bomb_dir.mkdir()
    (bomb_dir / "stop").write_text("")  # report at once once full
    get_settings.cache_clear()
    os.environ["BUILD_MAX_PROCS"] = "100"
    try:
        res = run_isolated(
            "fork_attacks:fork_bomb",
            {"dir": str(bomb_dir)},
            timeout_s=600,
            memory_mb=2000,
            import_paths=[ATTACKERS],
            isolation=Isolation(writable=(str(bomb_dir),)),
            warm=False,
        )
    finally:
        del os.environ["BUILD_MAX_PROCS"]
        get_settings.cache_clear()
    assert res.ok and res.value < 100, res  # pids.max counts bubblewrap's too
    assert list(delegated.glob("build-*")) == []  # every build's cgroup removed
