"""farm.build.aoti_check: whether AOTI packages built on this host load here, once per machine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from farm.build import aoti_check

_calls: list[str] = []


def calls() -> list[str]:
    """The devices probed so far in this test."""
    return _calls


@pytest.fixture
def probes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, bool]]:
    """Answers the next probes give (popped in order); the test's own cache file."""
    monkeypatch.setenv("FARM_AOTI_CHECK_CACHE", str(tmp_path / "aoti-check.json"))
    answers: list[tuple[str, bool]] = []
    _calls.clear()

    def fake_probe(device: str) -> tuple[str, bool]:
        _calls.append(device)
        return answers.pop(0)

    monkeypatch.setattr(aoti_check, "_probe", fake_probe)
    return answers


def test_a_good_answer_is_probed_once_per_machine(probes: list[tuple[str, bool]]) -> None:
    probes.append(("ok", True))
    assert aoti_check.aoti_loads_here("cpu") == (True, "ok")
    assert aoti_check.aoti_loads_here("cpu") == (True, "ok")
    assert calls() == ["cpu"]


def test_a_load_crash_is_remembered(probes: list[tuple[str, bool]], tmp_path: Path) -> None:
    probes.append(("load crashed sigsegv", True))
    assert aoti_check.aoti_loads_here("cuda:0") == (False, "load crashed sigsegv")
    assert aoti_check.aoti_loads_here("cuda") == (False, "load crashed sigsegv")
    assert calls() == ["cuda"]
    assert list(json.loads((tmp_path / "aoti-check.json").read_text()).values()) == [
        "load crashed sigsegv"]


def test_a_failed_build_is_asked_again(probes: list[tuple[str, bool]]) -> None:
    probes += [("build failed", False), ("ok", True)]
    assert aoti_check.aoti_loads_here("cpu") == (False, "build failed")
    assert aoti_check.aoti_loads_here("cpu") == (True, "ok")
    assert calls() == ["cpu", "cpu"]


def test_devices_are_checked_apart(probes: list[tuple[str, bool]]) -> None:
    probes += [("ok", True), ("load crashed sigsegv", True)]
    assert aoti_check.aoti_loads_here("cpu")[0]
    assert not aoti_check.aoti_loads_here("cuda")[0]
    assert aoti_check.aoti_loads_here("cpu")[0]
    assert calls() == ["cpu", "cuda"]


def test_off_never_caches(probes: list[tuple[str, bool]], monkeypatch: pytest.MonkeyPatch,
                          tmp_path: Path) -> None:
    monkeypatch.setenv("FARM_AOTI_CHECK_CACHE", "off")
    probes += [("ok", True), ("ok", True)]
    aoti_check.aoti_loads_here("cpu")
    aoti_check.aoti_loads_here("cpu")
    assert calls() == ["cpu", "cpu"]
    assert not (tmp_path / "aoti-check.json").exists()


def test_a_crashing_child_is_named_by_its_signal(monkeypatch: pytest.MonkeyPatch) -> None:
    import subprocess

    class Done:
        def __init__(self, rc: int) -> None:
            self.returncode, self.stdout, self.stderr = rc, "", "boom"

    codes = iter([0, -11])
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: Done(next(codes)))
    assert aoti_check._probe("cpu") == ("load crashed sigsegv", True)
    codes = iter([1])
    assert aoti_check._probe("cpu") == ("build failed", False)
