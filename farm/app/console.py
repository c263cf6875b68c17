"""What `farm` prints: errors, JSON, sizes, job lines and build progress."""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

from farm.core.target import Target, TargetError

log = logging.getLogger(__name__)

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2


class UsageError(Exception):
    """A bad command line found after parsing (exit 2)."""


class CommandFailed(Exception):
    """The command ran and did not succeed (exit 1); the message is the one line."""





def _print_json(value: Any) -> None:
    json.dump(value, sys.stdout, indent=2, sort_keys=True, default=str)
    sys.stdout.write("\n")


def _human_size(n: int | None) -> str:
    if n is None:
        return "?"
    size = float(n)
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1024 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"  # pragma: no cover


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


class Progress:
    """Job progress on stderr: one updating line on a terminal, else a line per change."""

    def __init__(self, stream: Any = None) -> None:
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.start = time.monotonic()
        self.last = ""
        self.width = 0

    def __call__(self, view: dict[str, Any]) -> None:
        builds = view.get("builds") or []
        per = ", ".join(f"{_short_target(str(b.get('target')))}: {b.get('state')}"
                        for b in builds) or "tracing"
        summary = f"job {str(view.get('id', ''))[:8]} {view.get('state')}  [{per}]"
        elapsed = time.monotonic() - self.start
        if self.tty:
            line = f"{summary}  {elapsed:.0f}s"
            pad = max(0, self.width - len(line))
            self.stream.write(f"\r{line}{' ' * pad}")
            self.width = len(line)
            self.stream.flush()
        elif summary != self.last:
            self.stream.write(f"{summary}  {elapsed:.0f}s\n")
            self.stream.flush()
        self.last = summary

    def finish(self) -> None:
        if self.tty and self.width:
            self.stream.write("\n")
            self.stream.flush()


def _job_lines(view: dict[str, Any], *, with_log: bool = False) -> list[str]:
    lines = [f"job {view.get('id')}  {view.get('model')}@{view.get('version')}  "
             f"{view.get('state')}"]
    if view.get("trace_s") is not None:
        lines.append(f"  traced in {view['trace_s']:.1f} s, {view.get('param_count') or 0:,} "
                     f"params")
    if view.get("error"):
        lines.append(f"  error: {_first_line(view['error'])}")
    for b in view.get("builds") or []:
        bits = [str(b.get("state"))]
        if b.get("compile_s") is not None:
            bits.append(f"compiled in {b['compile_s']:.1f} s")
        if b.get("artifact_bytes"):
            bits.append(_human_size(b["artifact_bytes"]))
        if b.get("max_abs_err") is not None:
            bits.append(f"max abs err {b['max_abs_err']:.2g}")
        if b.get("first_call_compiles"):
            bits.append("FIRST CALL STILL COMPILES")
        lines.append(f"  {b.get('target')}: {', '.join(bits)}")
        if b.get("error"):
            lines.append(f"    error: {_first_line(b['error'])}")
        if with_log and b.get("log"):
            lines.extend("    | " + ln for ln in str(b["log"]).splitlines())
    return lines


def _first_line(text: Any) -> str:
    lines = str(text).strip().splitlines()
    return lines[0] if lines else ""


