"""A fork bomb, and a build beside it that needs processes of its own."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from typing import Any


def fork_bomb(payload: dict[str, Any]) -> int:
    """Forks until the kernel refuses, says so in ``full``, then holds every
    process until the test writes ``stop``."""
    here = Path(payload["dir"])
    n = 0
    while True:
        try:
            pid = os.fork()
        except OSError:
            break
        if pid == 0:
            while True:
                time.sleep(60)
        n += 1
    (here / "full").write_text(str(n))
    while not (here / "stop").exists():
        time.sleep(0.1)
    return n


def needs_processes(payload: dict[str, Any]) -> int:
    """What a compile does: starts processes (a compiler, a pool)."""
    for _ in range(int(payload.get("count", 20))):
        subprocess.run(["true"], check=True)
    return int(payload.get("count", 20))
