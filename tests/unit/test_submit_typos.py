"""`farm submit` with a typo'd factory is told at once, with a did-you-mean,
before anything is uploaded (no farm runs: FARM_URL points nowhere); and a
build's error names the user's file, not the sandbox's copy of it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from farm.app.console import concise_error

MODEL = """\
import torch
from torch import nn

from helpers import norm  # noqa


class TinyCNN(nn.Module):
    def forward(self, x):
        return x


def make():
    return TinyCNN()
"""


def _submit(cwd: Path, entrypoint: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "farm.app.cli",
            "--url",
            "http://127.0.0.1:9",
            "submit",
            entrypoint,
            "--name",
            "tiny",
            "--version",
            "1",
            "--input",
            "float32[1,3,8,8]",
        ],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    ("entrypoint", "suggestion"),
    [
        ("./tinycnn.py:mkae", "did you mean 'make'?"),
        ("tinycnn:TinyCNNN", "did you mean 'TinyCNN'?"),
        ("./tinycnn.py:build", "its functions and classes: TinyCNN, make"),
    ],
)
def test_a_typod_factory_gets_a_did_you_mean(
    tmp_path: Path, entrypoint: str, suggestion: str
) -> None:
    (tmp_path / "tinycnn.py").write_text(MODEL)
    r = _submit(tmp_path, entrypoint)
    assert r.returncode == 2, r.stderr
    assert suggestion in r.stderr
    assert "nothing answers" not in r.stderr  # told before the farm is asked


def test_a_name_the_module_imports_or_binds_is_not_refused(tmp_path: Path) -> None:
    (tmp_path / "tinycnn.py").write_text(MODEL + "alias_make = make\n")
    for entrypoint in ("./tinycnn.py:norm", "./tinycnn.py:alias_make", "./tinycnn.py:make"):
        r = _submit(tmp_path, entrypoint)
        # Past the check: the next thing is the farm, which is not there.
        assert r.returncode == 1 and "nothing answers" in r.stderr, (entrypoint, r.stderr)


def test_a_build_error_names_the_users_file_not_the_sandbox() -> None:
    digest = "ab" * 32
    text = (
        'trace failed: File "/tmp/farm-slot-24151/run-x1y2/code/0/tinycnn.py", line 13, in '
        f"forward; then /srv/farm/code/{digest}/pkg/layers.py:7"
    )
    line = concise_error(text)
    assert '"./tinycnn.py", line 13' in line and "./pkg/layers.py:7" in line
    assert "farm-slot" not in line and digest not in line
