"""The README's code, as data: its fenced blocks, the ones marked to run,
and every ``farm`` command it shows.

A block runs in the tests when the line before its opening fence is an HTML
comment ``<!-- test -->``; the comment may say more:

- ``<!-- test file=node.py -->``: the block is not run but written to that
  file (the README says "save this as node.py"), for a later block to run;
- ``<!-- test stdout="farm" -->``: it runs, and every line it prints on
  stdout must start with that word (at least one line).

Marked blocks run in README order, each as its own process (``bash -euo
pipefail -c`` for bash, ``python -`` for python), in one working directory.
"""

from __future__ import annotations

import argparse
import re
import shlex
import subprocess
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"

_FENCE = re.compile(r"^```(\w*)\s*$")
_MARKER = re.compile(r"^<!--\s*test\b(.*?)-->\s*$")
_MARKER_ARG = re.compile(r'(\w+)=("([^"]*)"|\S+)')
_HEREDOC = re.compile(r"<<-?\s*'?\"?(\w+)'?\"?")
_OPTION = re.compile(r"^\[?(--[a-z][a-z0-9-]*)")
_INLINE = re.compile(r"`(farm [^`]+)`")


@dataclass(frozen=True)
class Block:
    lang: str
    text: str
    line: int  # of the opening fence, 1-based
    marker: Mapping[str, str] | None = None  # None: not marked to run

    @property
    def marked(self) -> bool:
        return self.marker is not None


def blocks(text: str) -> list[Block]:
    """Every fenced block, with the ``<!-- test ... -->`` marker before it."""
    out: list[Block] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start, lang = i, m.group(1)
        body: list[str] = []
        i += 1
        while i < len(lines) and lines[i].rstrip() != "```":
            body.append(lines[i])
            i += 1
        marker = None
        prev = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        mm = _MARKER.match(prev.strip())
        if mm:
            marker = {
                k: (q if q is not None and v.startswith('"') else v)
                for k, v, q in _MARKER_ARG.findall(mm.group(1))
            }
        out.append(Block(lang, "\n".join(body) + "\n", start + 1, marker))
        i += 1
    return out


def marked_blocks(text: str) -> list[Block]:
    return [b for b in blocks(text) if b.marked]


@dataclass(frozen=True)
class Command:
    """One ``farm`` command line: its words after ``farm`` (the subcommand
    path may hold ``a|b`` alternatives, as the CLI summary writes them)."""

    words: tuple[str, ...]
    where: str  # for messages: "README.md:LINE"
    options: tuple[str, ...] = field(default=())


def _logical_lines(block: Block) -> Iterator[tuple[int, str]]:
    """Lines with their continuations joined, heredoc bodies left out."""
    lines = block.text.splitlines()
    i, heredoc = 0, None
    while i < len(lines):
        line, n = lines[i], block.line + 1 + i
        i += 1
        if heredoc is not None:
            if line.strip() == heredoc:
                heredoc = None
            continue
        while line.endswith("\\") and i < len(lines):
            line = line[:-1] + " " + lines[i]
            i += 1
        m = _HEREDOC.search(line)
        if m:
            heredoc = m.group(1)
        yield n, line


def _segments(words: list[str]) -> Iterator[list[str]]:
    """The words after each ``farm`` in command position."""
    current: list[str] | None = None
    at_start = True
    for w in words:
        if at_start and (w == "farm" or w.endswith("/farm")):
            if current is not None:
                yield current
            current, at_start = [], False
            continue
        if w in ("&&", "||", ";", "|", "&"):
            if current is not None:
                yield current
            current, at_start = None, True
            continue
        if at_start and "=" in w and not w.startswith("-"):
            continue  # VAR=value before the command
        if current is not None:
            current.append(w)
        else:
            at_start = False
    if current is not None:
        yield current


def _command(words: list[str], where: str) -> Command:
    if "--" in words:  # farm run -- python SCRIPT --its-own-options
        words = words[: words.index("--")]
    options = tuple(m.group(1) for w in words if (m := _OPTION.match(w)))
    return Command(tuple(words), where, options)


def farm_commands(text: str, name: str = "README.md") -> list[Command]:
    """Every ``farm`` command in the README's bash and text blocks and its
    inline code spans."""
    found: list[Command] = []
    for b in blocks(text):
        if b.lang not in ("bash", "sh", "text", ""):
            continue
        for n, line in _logical_lines(b):
            if b.lang == "text":
                # The CLI summary: commands side by side, no shell syntax.
                # Each "farm" starts a command; "|" between two is prose.
                words = [
                    w2
                    for w in line.split()
                    if w != "|"
                    for w2 in ((";", w) if w == "farm" else (w,))
                ]
            else:
                try:
                    words = shlex.split(line, comments=True)
                except ValueError:
                    continue
            for seg in _segments(words):
                found.append(_command(seg, f"{name}:{n}"))
    for n, line in enumerate(text.splitlines(), 1):
        for m in _INLINE.finditer(line):
            try:
                words = shlex.split(m.group(1))
            except ValueError:
                continue
            for seg in _segments(words):
                found.append(_command(seg, f"{name}:{n}"))
    return found


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser] | None:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return None


def check_command(parser: argparse.ArgumentParser, cmd: Command) -> list[str]:
    """What is wrong with ``cmd`` against the CLI's parser: an unknown
    subcommand, an option no parser on its path takes. Empty when fine."""
    problems: list[str] = []
    leaves = [parser]
    words = list(cmd.words)
    # Global options before the subcommand (farm --url U submit ...).
    while words and words[0].startswith("-"):
        w = words.pop(0)
        if w not in parser._option_string_actions:
            problems.append(f"{cmd.where}: farm has no option {w}")
        elif parser._option_string_actions[w].nargs != 0 and words:
            words.pop(0)
    depth = 0
    while words:
        subs = [_subparsers(p) for p in leaves]
        if any(s is None for s in subs):
            break
        names = words[0].split("|")
        nxt: list[argparse.ArgumentParser] = []
        for s in subs:
            assert s is not None
            for name in names:
                if name not in s:
                    path = " ".join(["farm", *cmd.words[:depth], name])
                    problems.append(f"{cmd.where}: no command '{path}'")
                else:
                    nxt.append(s[name])
        if problems:
            return problems
        leaves, words, depth = nxt, words[1:], depth + 1
    if depth == 0:
        return [f"{cmd.where}: 'farm' without a command"]
    for leaf in leaves:
        if leaf.prog.endswith(" demo"):
            continue  # its options belong to farm.app.demo's own parser
        for opt in cmd.options:
            if opt not in leaf._option_string_actions and opt not in parser._option_string_actions:
                problems.append(f"{cmd.where}: '{leaf.prog}' has no option {opt}")
    return problems


def run_block(
    block: Block, cwd: Path, env: Mapping[str, str], *, python: str, timeout: float
) -> subprocess.CompletedProcess[str] | None:
    """Run one marked block as the README says (or write it, ``file=``);
    raises AssertionError with its output when it fails."""
    assert block.marker is not None
    target = block.marker.get("file")
    if target:
        (cwd / target).write_text(block.text)
        return None
    if block.lang == "bash":
        argv = ["bash", "-euo", "pipefail", "-c", block.text]
        stdin = None
    elif block.lang == "python":
        argv, stdin = [python, "-"], block.text
    else:
        raise AssertionError(f"README.md:{block.line}: cannot run a {block.lang!r} block")
    r = subprocess.run(
        argv, cwd=cwd, env=dict(env), input=stdin, capture_output=True, text=True, timeout=timeout
    )
    shown = (
        f"README.md:{block.line} ({block.lang}):\n{block.text}\n--- stdout\n{r.stdout}"
        f"\n--- stderr\n{r.stderr[-6000:]}"
    )
    assert r.returncode == 0, f"exit {r.returncode}: {shown}"
    want = block.marker.get("stdout")
    if want:
        lines = [ln for ln in r.stdout.splitlines() if ln.strip()]
        assert lines and all(ln.split()[0] == want for ln in lines), (
            f"every stdout line should start with {want!r}: {shown}"
        )
    return r
