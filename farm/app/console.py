"""What `farm` prints: errors, JSON, sizes, job lines and build progress."""

from __future__ import annotations

import json
import logging
import re
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.progress import Progress as RichProgress
from rich.progress import SpinnerColumn, TaskID, TextColumn, TimeElapsedColumn
from rich.table import Table

from farm.core.target import Target, TargetError
from farm.core.text import first_line as _first_line
from farm.core.text import human_bytes, readable_tensors

log = logging.getLogger(__name__)

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2


class UsageError(Exception):
    """A bad command line found after parsing (exit 2)."""


class CommandFailed(Exception):
    """The command ran and did not succeed (exit 1); the message is the one line."""


def _json_text(value: Any) -> str:
    """A JSON file's text (a bundle, a trust list): indented, keys sorted."""
    return json.dumps(value, indent=1, sort_keys=True)


def _print_json(value: Any) -> None:
    json.dump(value, sys.stdout, indent=2, sort_keys=True, default=str)
    sys.stdout.write("\n")


def answer(args: Any, value: Any, lines: Callable[[Any], Iterable[str]]) -> int:
    """A command's result on stdout: ``value`` as one JSON document with
    ``--json``, else ``lines(value)`` for people, one a line; EXIT_OK."""
    if args.json:
        _print_json(value)
    else:
        for line in lines(value):
            print(line)
    return EXIT_OK


def _human_size(n: int | None) -> str:
    return human_bytes(n, missing="?")


def _short_target(text: str) -> str:
    """``cuda/gpu=NVIDIA%20H200/...`` -> ``cuda NVIDIA H200``; ``cpu/.../isa=avx2/...`` ->
    ``cpu avx2``: enough to tell a job's builds apart on one progress line."""
    try:
        t = Target.parse(text)
    except TargetError:
        return text
    if t.device == "cuda":
        return f"cuda {t.gpu_name}"
    return f"cpu {t.cpu_isa or ''}".strip() + (f" x{t.threads}" if t.threads else "")


def stages(view: dict[str, Any]) -> list[tuple[str, str]]:
    """``[(what, stage)]`` of a job view: the job's own row (queued, tracing,
    compiling, its end state), then one per build (queued, compiling,
    verifying FORMAT, storing FORMAT, its end state)."""
    job = f"job {str(view.get('id', ''))[:8]}"
    rows = [(job, str(view.get("state") or "queued"))]
    for b in view.get("builds") or []:
        state = str(b.get("state"))
        stage = str(b.get("stage") or state) if state == "running" else state
        rows.append((f"{job} {_short_target(str(b.get('target')))}", stage))
    return rows


_DONE = frozenset({"succeeded", "failed", "partial", "reused", "cancelled"})


class Progress:
    """Build progress on stderr, from the job views ``FarmClient.wait`` polls.

    On a terminal, a rich live display: a row per build with its stage and the
    time spent in that stage. Piped, one plain line per stage change (with the
    seconds since the wait began), so a log shows every stage once.
    """

    def __init__(self, stream: Any = None, *, console: Console | None = None) -> None:
        self.console = console or Console(file=stream or sys.stderr, highlight=False)
        self.tty = self.console.is_terminal
        self.start = time.monotonic()
        self.seen: dict[str, str] = {}
        self._bar: RichProgress | None = None
        self._rows: dict[str, TaskID] = {}

    def __call__(self, view: dict[str, Any]) -> None:
        for what, stage in stages(view):
            if self.seen.get(what) == stage:
                continue
            self.seen[what] = stage
            if self.tty:
                self._show(what, stage)
            else:
                elapsed = time.monotonic() - self.start
                self.console.print(f"{what}: {stage}  {elapsed:.0f}s", markup=False,
                                   highlight=False, soft_wrap=True)

    def _show(self, what: str, stage: str) -> None:
        if self._bar is None:
            self._bar = RichProgress(SpinnerColumn(), TextColumn("{task.fields[what]}"),
                                     TextColumn("[bold]{task.description}"),
                                     TimeElapsedColumn(), console=self.console)
            self._bar.start()
        row = self._rows.get(what)
        if row is None:
            self._rows[what] = row = self._bar.add_task(stage, what=what, total=None)
        else:
            # The clock shows the time in this stage: restart it.
            self._bar.reset(row, description=stage, total=None)
        if stage in _DONE:
            self._bar.update(row, total=1, completed=1)
            self._bar.stop_task(row)

    def finish(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


def print_table(columns: list[str], rows: list[list[str]], *, title: str | None = None) -> None:
    """A table on stdout: boxed on a terminal, plain columns when piped."""
    console = Console(highlight=False)
    table = Table(*columns, title=title, box=box.SIMPLE if console.is_terminal else None,
                  show_edge=False, pad_edge=False)
    for row in rows:
        table.add_row(*(escape(c) for c in row))
    console.print(table, soft_wrap=True)


# Where a build put the job's code pack: a sandbox's copy
# (/tmp/farm-slot-PID/run-X/code/N/) or the worker's unpacked pack
# (FARM_HOME/code/SHA256/). A user knows the file by its place in the pack.
_PACK_PATH = re.compile(
    r"(?:/[^\s'\"():]+)*/(?:farm-slot-\d+/run-[^/\s]+/code/\d+|code/[0-9a-f]{64})/")
_SHAPE_WORDS = ("reduction dim", "shapes cannot be multiplied", "size mismatch",
                "must match the size", "Expected size", "expected input")


def concise_error(text: Any) -> str:
    """A job's error as one readable line: a trace's shape error names each
    FakeTensor by its dtype and shape (``float32[8,63]``) instead of its repr
    (errors stored before the workers did so too), and says what to check."""
    line = _PACK_PATH.sub("./", _first_line(text))
    short = readable_tensors(line)
    # Torch's shape complaint while tracing on fake tensors: the input specs.
    if "fake tensor" in short and any(w in short for w in _SHAPE_WORDS):
        short += " (the --input specs do not fit what the model takes: check their shapes)"
    return short


def _job_lines(view: dict[str, Any], *, with_log: bool = False) -> list[str]:
    lines = [f"job {view.get('id')}  {view.get('model')}@{view.get('version')}  "
             f"{view.get('state')}"]
    if view.get("trace_s") is not None:
        lines.append(f"  traced in {view['trace_s']:.1f} s, {view.get('param_count') or 0:,} "
                     f"params")
    for hint in view.get("hints") or []:  # the server's advice (farm.core.hints)
        lines.append(f"  hint: {hint}")
    if view.get("error"):
        lines.append(f"  error: {concise_error(view['error'])}")
    for b in view.get("builds") or []:
        bits = [str(b.get("state"))]
        if b.get("state") == "running" and b.get("stage"):
            since = str(b.get("stage_at") or "")[11:19]
            bits = [f"running: {b['stage']}" + (f" (since {since} UTC)" if since else "")]
        if b.get("compile_s") is not None:
            bits.append(f"compiled in {b['compile_s']:.1f} s")
        if b.get("artifact_bytes"):
            bits.append(_human_size(b["artifact_bytes"]))
        if b.get("max_abs_err") is not None:
            bits.append(f"max abs err {b['max_abs_err']:.2g}")
        if b.get("first_call_compiles"):
            bits.append("FIRST CALL STILL COMPILES")
        for fmt, why in sorted((b.get("formats_failed") or {}).items()):
            bits.append(f"{fmt.upper()} FAILED at {why.get('stage')}: "
                        f"{concise_error(str(why.get('reason') or ''))[:200]}")
        lines.append(f"  {b.get('target')}: {', '.join(bits)}")
        for fmt, why in sorted((b.get("formats_skipped") or {}).items()):
            lines.append(f"    no {fmt}: {concise_error(str(why))[:200]}")
        error = _first_line(b.get("error") or "")
        if error and view.get("error") and error.startswith("trace failed"):
            # The job's own error line above says it once; each build only
            # repeated it (a shape error's whole FakeTensor dump, per target).
            lines.append("    not built: the trace failed")
        elif error:
            lines.append(f"    error: {concise_error(error)}")
        if with_log and b.get("log"):
            lines.extend("    | " + _PACK_PATH.sub("./", ln) for ln in str(b["log"]).splitlines())
    return lines
