"""Every option of every `farm` command says what it does, and a default
that is not off or empty is named in its help (no farm needed)."""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Iterator

from farm.app.cli import build_parser


def _options(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ("farm",)
) -> Iterator[tuple[str, argparse.Action]]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _options(sub, (*path, name))
        elif action.option_strings and not isinstance(action, argparse._HelpAction):
            yield " ".join(path), action


def test_every_option_has_help() -> None:
    missing = [
        f"{cmd} {'/'.join(a.option_strings)}" for cmd, a in _options(build_parser()) if not a.help
    ]
    assert not missing, "options without help: " + ", ".join(missing)


def test_every_option_names_its_default() -> None:
    unnamed = [
        f"{cmd} {'/'.join(a.option_strings)} (default {a.default!r})"
        for cmd, a in _options(build_parser())
        if isinstance(a.default, (int, float, str))
        and not isinstance(a.default, bool)
        and a.default != ""
        and "default" not in (a.help or "")
    ]
    assert not unnamed, "help that does not say the default: " + ", ".join(unnamed)


def test_the_walk_sees_every_command() -> None:
    commands = {cmd for cmd, _ in _options(build_parser())}
    assert {"farm", "farm submit", "farm serve", "farm trust reset", "farm keys enroll"} <= commands


def test_submit_help_as_a_user_reads_it() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "farm.app.cli", "submit", "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    flat = " ".join(out.split())
    for text in (
        "--name NAME the model's name",
        "--version VERSION the version",
        "'auto' is this machine's own target",
    ):
        assert text in flat, text
    out = subprocess.run(
        [sys.executable, "-m", "farm.app.cli", "serve", "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "(default: 8000)" in " ".join(out.split())
