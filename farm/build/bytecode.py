"""Compiled Python bytecode for build children, where this machine's Python
keeps none.

A Python that keeps no bytecode compiles every module's source again in
every process. GPU images often run so (`PYTHONDONTWRITEBYTECODE=1`, and
packages installed without their `.pyc` files): on the lent H100 host, 0 of
torch's 2,141 modules had one, a node's first load spent 8.6 s of its
15.7 s in `compile()`, and a build zygote's imports took 11.7 s
(docs/benchmarks.md). Each build child started fresh (every build, where
kernel limits are configured) pays that again.

So a worker compiles, once per machine, the packages its children import
(the site directories that hold torch and Triton, and the farm's own) into a
directory of this machine's (``FARM_BYTECODE_CACHE``, default
``~/.cache/torch-farm/pycache``) with ``compileall`` under
``PYTHONPYCACHEPREFIX``; later runs recompile only what changed (each
``.pyc`` records its source's mtime and size, and Python checks them at
import). Its children get ``PYTHONPYCACHEPREFIX`` pointing there, bound
read-only into the sandbox: they read that bytecode and never write any (a
planted ``.pyc`` would run in every later build). Where this Python keeps
bytecode already (a normal install, this project's ``.venv``) nothing is
done; ``FARM_BYTECODE_CACHE=off`` turns it off anywhere.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

SETTING = "FARM_BYTECODE_CACHE"
# What a child reads it from: the interpreter's own setting.
CHILD_ENV = "PYTHONPYCACHEPREFIX"
# The packages a build child imports, by the site directory that holds them.
PACKAGES = ("torch", "triton")
# Once per machine it is minutes on 2 cores; on the lent 16-core host, seconds.
FILL_TIMEOUT_S = 1800.0

_lock = threading.Lock()
_FILLING: dict[str, threading.Thread] = {}


def keeps_none(package: str = "torch") -> bool:
    """This Python compiles ``package``'s source at every import: it writes
    no bytecode (``PYTHONDONTWRITEBYTECODE``), or the package's own
    ``__init__`` has none beside it and this process may not write one."""
    if os.environ.get(CHILD_ENV):  # the operator's own prefix: theirs to fill
        return False
    if sys.flags.dont_write_bytecode:
        return True
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return False
    cached = importlib.util.cache_from_source(spec.origin)
    return not os.path.exists(cached) and not os.access(os.path.dirname(spec.origin), os.W_OK)


def cache_dir() -> Path | None:
    """This machine's directory (``FARM_BYTECODE_CACHE``; "off": none), or
    None where this Python keeps bytecode of its own."""
    from farm.core.cpu_isa import cache_file

    where = cache_file(SETTING, "pycache")
    if where is None or not keeps_none():
        return None
    return where


def roots() -> list[Path]:
    """The directories to compile: each site directory holding one of
    ``PACKAGES`` (their dependencies live there too), and the farm's own
    package where it is not in one of them (a source checkout)."""
    out: list[Path] = []
    for name in PACKAGES:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.origin:
            out.append(Path(spec.origin).resolve().parent.parent)
    farm = Path(__file__).resolve().parent.parent
    if not any(d in farm.parents for d in out):
        out.append(farm)
    return list(dict.fromkeys(out))


def fill(prefix: Path, dirs: list[Path] | None = None, *,
         timeout_s: float = FILL_TIMEOUT_S) -> dict[str, Any]:
    """Compile ``dirs`` (default ``roots()``) into ``prefix``, under a
    machine lock; returns what happened (``error`` on failure)."""
    from filelock import FileLock

    dirs = roots() if dirs is None else dirs
    prefix.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env[CHILD_ENV] = str(prefix)
    argv = [sys.executable, "-m", "compileall", "-q", "-j", "0", *map(str, dirs)]
    t0 = time.monotonic()
    try:
        with FileLock(str(prefix.parent / f".{prefix.name}.lock")):
            r = subprocess.run(argv, env=env, capture_output=True, text=True,
                               timeout=timeout_s, check=False)
    except (OSError, subprocess.SubprocessError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}", "dirs": [str(d) for d in dirs]}
    out: dict[str, Any] = {"s": round(time.monotonic() - t0, 1), "dirs": [str(d) for d in dirs]}
    # compileall exits 1 when a file does not compile (packages ship such
    # files: templates, Python-2 leftovers); the rest is compiled all the same.
    if r.returncode not in (0, 1):
        out["error"] = f"compileall exited {r.returncode}: {(r.stderr or r.stdout)[-500:]}"
    return out


def fill_in_background(prefix: Path | None = None) -> threading.Thread | None:
    """``fill`` on a daemon thread, once per directory in this process;
    children started meanwhile compile what is not there yet, as before."""
    prefix = prefix if prefix is not None else cache_dir()
    if prefix is None:
        return None
    with _lock:
        t = _FILLING.get(str(prefix))
        if t is None:
            def run() -> None:
                out = fill(prefix)
                level = logging.WARNING if "error" in out else logging.INFO
                log.log(level, "Python bytecode for build children in %s: %s", prefix, out)

            t = threading.Thread(target=run, name="farm-bytecode-fill", daemon=True)
            _FILLING[str(prefix)] = t
            t.start()
    return t


def child_env() -> dict[str, str]:
    """What a build child gets: the directory, where this machine keeps one."""
    prefix = cache_dir()
    if prefix is None:
        return {}
    try:
        prefix.mkdir(parents=True, exist_ok=True)
    except OSError:
        return {}
    return {CHILD_ENV: str(prefix)}
