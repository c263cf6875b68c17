"""The real check on this host: a tiny weight-free AOTI package is built in one
child process, then loaded, run and compared with eager in another."""

from __future__ import annotations

from pathlib import Path

import pytest

from farm.build import aoti_check

pytestmark = pytest.mark.integration


def test_aoti_packages_built_here_load_here(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FARM_AOTI_CHECK_CACHE", str(tmp_path / "aoti-check.json"))
    assert aoti_check.aoti_loads_here("cpu") == (True, "ok")
    assert (tmp_path / "aoti-check.json").exists()
