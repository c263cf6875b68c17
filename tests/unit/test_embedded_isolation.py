"""The embedded farm decides once, before its workers start, whether builds
run isolated, and says so in its first line (farm.app.embedded.decide_isolation)."""

from __future__ import annotations

from pathlib import Path

import pytest

from farm.app.embedded import decide_isolation
from farm.build import sandbox


@pytest.fixture
def no_bwrap(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A machine without bubblewrap, as the GPU image ships."""
    monkeypatch.setenv("PATH", str(tmp_path))
    sandbox.isolation_unavailable.cache_clear()
    yield
    sandbox.isolation_unavailable.cache_clear()


def test_auto_without_bubblewrap_says_so_once_and_workers_build_unisolated(no_bwrap: None) -> None:
    env = {"FARM_SANDBOX": "auto"}
    line = decide_isolation(env)
    assert line.startswith("builds run model code UNISOLATED: ")
    assert "bubblewrap" in line and "FARM_SANDBOX=on" in line
    # The workers are told, so each build does not warn again.
    assert env["FARM_SANDBOX"] == "off"


def test_on_without_bubblewrap_refuses_to_start(no_bwrap: None) -> None:
    with pytest.raises(SystemExit, match="FARM_SANDBOX=on and this machine cannot isolate"):
        decide_isolation({"FARM_SANDBOX": "on"})


def test_off_says_unisolated_without_probing(no_bwrap: None) -> None:
    env = {"FARM_SANDBOX": "off"}
    assert "UNISOLATED (FARM_SANDBOX=off" in decide_isolation(env)
    assert env["FARM_SANDBOX"] == "off"


def test_a_bad_value_is_a_clear_error() -> None:
    with pytest.raises(SystemExit, match="FARM_SANDBOX='maybe' is not one of"):
        decide_isolation({"FARM_SANDBOX": "maybe"})
