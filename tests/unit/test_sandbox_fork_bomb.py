"""A fork bomb in one build beside another build on the same host: with a
uid of its own per running build (farm.build.uid_slots), the bomb meets its
own process limit (BUILD_MAX_PROCS) and the other build still starts the
processes it needs; with one uid for every build (FARM_SANDBOX_UIDS=0) the
same bomb starves it, which is what the slots are for."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from farm.build.isolation import Isolation
from farm.build.sandbox import SandboxResult, run_isolated
from farm.core.settings import get_settings
from tests.sandbox_required import require_sandbox

ATTACKERS = Path(__file__).parent / "attackers"
MAX_PROCS = 200

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0,
    reason="uid slots are a root worker's (an unprivileged "
    "worker's builds share its uid: cgroup pids.max)",
)


@pytest.fixture(autouse=True)
def _needs_sandbox() -> None:
    require_sandbox()


@pytest.fixture
def settings(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    monkeypatch.setenv("BUILD_MAX_PROCS", str(MAX_PROCS))
    get_settings.cache_clear()
    yield monkeypatch
    get_settings.cache_clear()


def _bomb_beside_a_build(tmp_path: Path) -> tuple[SandboxResult, SandboxResult]:
    bomb_dir = tmp_path / "bomb"
    bomb_dir.mkdir()
    out: dict[str, SandboxResult] = {}

    def bomb() -> None:
        out["bomb"] = run_isolated(
            "fork_attacks:fork_bomb",
            {"dir": str(bomb_dir)},
            timeout_s=600,
            memory_mb=4000,
            import_paths=[ATTACKERS],
            isolation=Isolation(writable=(str(bomb_dir),)),
            warm=False,
        )

    t = threading.Thread(target=bomb)
    t.start()
    try:
        while not (bomb_dir / "full").exists() and t.is_alive():
            time.sleep(0.1)
        assert (bomb_dir / "full").exists(), out
        build = run_isolated(
            "fork_attacks:needs_processes",
            {"count": 20},
            timeout_s=600,
            memory_mb=2000,
            import_paths=[ATTACKERS],
            isolation=Isolation(),
            warm=False,
        )
    finally:
        (bomb_dir / "stop").write_text("")
        t.join()
    return out["bomb"], build


def test_a_fork_bomb_beside_a_build_does_not_starve_it(
    settings: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    bomb, build = _bomb_beside_a_build(tmp_path)
    assert bomb.ok and MAX_PROCS - 20 <= bomb.value <= MAX_PROCS, bomb  # stopped at its limit
    assert build.ok and build.value == 20, (build.describe(), build.traceback)


def test_with_one_uid_for_every_build_the_same_bomb_starves_its_neighbour(
    settings: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    settings.setenv("FARM_SANDBOX_UIDS", "0")
    get_settings.cache_clear()
    bomb, build = _bomb_beside_a_build(tmp_path)
    assert bomb.ok, bomb
    assert not build.ok, build
    assert "Resource temporarily unavailable" in (build.error or "") + (build.traceback or ""), (
        build.describe(),
        build.traceback,
        build.stderr_tail[-1000:],
    )
