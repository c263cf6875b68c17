"""Where a build child that died of a signal was: the phase it announced, the
last Python frame ``faulthandler`` printed, and a C++ exception's message.

A child that aborts (a C++ exception thrown inside an OpenMP region, a failed
native check) writes no result; its stderr is all that is left. The sandbox
child enables ``faulthandler`` (``farm.build.sandbox.child_main``), which
prints the Python stack of the crashing thread, and before each stretch of
native code the build announces what it is about to run (``native_phase``),
so the job's error says "crashed with SIGABRT while running the compiled
kernels once (warm-up), in .../compile.py:511 warm_up" instead of only the
signal. Pure functions on text, plus the announcing context manager.
"""

from __future__ import annotations

import contextlib
import re
import sys
from collections.abc import Iterator

PHASE_PREFIX = "torch-farm: native phase: "
_FRAME = re.compile(r'^\s+File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)')
_CURRENT = re.compile(r"^(Current thread|Thread) 0x[0-9a-f]+ .*most recent call first")
_WHAT = re.compile(r"^\s*what\(\):\s*(?P<what>.+)$")


@contextlib.contextmanager
def native_phase(what: str) -> Iterator[None]:
    """Say on stderr (flushed: a crash loses what is buffered) what native
    code the process is about to run, and that it came back."""
    print(f"{PHASE_PREFIX}{what}", file=sys.stderr, flush=True)
    yield
    print(f"{PHASE_PREFIX}{what}: done", file=sys.stderr, flush=True)


def _short(path: str) -> str:
    """A frame's file from its package on (``farm/build/compile.py``,
    ``torch/_inductor/...``), not the machine's install path."""
    for marker in ("/site-packages/", "/dist-packages/"):
        if marker in path:
            return path.rsplit(marker, 1)[1]
    m = re.search(r"/((?:farm|workers|registry|tests)/.+)$", path)
    return m.group(1) if m else path


def crash_site(stderr: str) -> str | None:
    """``"while <phase>, in <file>:<line> <func>"`` for the crash the child's
    stderr shows (with ``; C++: <what>`` when an exception's message is
    there); None when it shows nothing of the kind."""
    lines = stderr.splitlines()
    phase = None
    for line in lines:
        if line.startswith(PHASE_PREFIX):
            text = line[len(PHASE_PREFIX) :]
            phase = None if text.endswith(": done") else text
    frame = None
    for i, line in enumerate(lines):
        if line.startswith("Current thread") and _CURRENT.match(line):
            for nxt in lines[i + 1 :]:
                m = _FRAME.match(nxt)
                if m:
                    frame = f"{_short(m['file'])}:{m['line']} {m['func']}"
                    break
    what = next((m["what"].strip() for m in map(_WHAT.match, lines) if m), None)
    parts = []
    if phase:
        parts.append(f"while {phase}")
    if frame:
        parts.append(f"in {frame}")
    if not parts and not what:
        return None
    text = ", ".join(parts) if parts else "in native code"
    if what:
        text += f"; C++: {what[:300]}"
    return text


__all__ = ["PHASE_PREFIX", "crash_site", "native_phase"]
