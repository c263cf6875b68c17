"""Compiled Python bytecode for build children, where torch was installed
without it.

A Python that finds no bytecode compiles every module's source again in
every process. GPU images often run so (packages installed without their
`.pyc` files, and `PYTHONDONTWRITEBYTECODE=1`): on the lent H100 host, 0 of
torch's 2,141 modules had one, a node's first load spent 8.6 s of its
15.7 s in `compile()`, and a build zygote's imports took 11.7 s
(docs/benchmarks.md). Build children could never write one (the Python
installation is read-only to them), so each fresh child (every build, where
kernel limits are configured) pays it again.

So a worker compiles, once per machine, the standard library and the site
directories its children import from (and the farm's own package) into a
directory of this machine's (``FARM_BYTECODE_CACHE``, default
``~/.cache/torch-farm/pycache``) with ``compileall`` under
``PYTHONPYCACHEPREFIX``; later runs recompile only what changed (each
``.pyc`` records its source's mtime and size, and Python checks them at
import). Its children get ``PYTHONPYCACHEPREFIX`` pointing there, bound
read-only into the sandbox: they read that bytecode and never write any (a
planted ``.pyc`` would run in every later build, and ``compileall`` keeps
one whose header matches its source). Where torch carries its bytecode (a
normal install, this project's ``.venv``) nothing is done: a prefix would
only hide those files. ``FARM_BYTECODE_CACHE=off`` turns it off anywhere.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import sysconfig
import threading
import time
from pathlib import Path
from typing import Any

from farm.build import background

SETTING = "FARM_BYTECODE_CACHE"
# What a child reads it from: the interpreter's own setting.
CHILD_ENV = "PYTHONPYCACHEPREFIX"
# The packages a build child imports, by the site directory that holds them.
PACKAGES = ("torch", "triton")
# Once per machine it is minutes on 2 cores; on the lent 16-core host, seconds.
FILL_TIMEOUT_S = 1800.0



def keeps_none() -> bool:
    """Build children would compile torch's Python at every import here:
    Inductor's ``compile_fx``, which only build children import, has no
    ``.pyc`` beside it. Children never write one (the Python installation is
    read-only to them), so where it is missing they compile every module,
    whatever ``PYTHONDONTWRITEBYTECODE`` says; where it is there, a prefix
    would only hide it."""
    if os.environ.get(CHILD_ENV):  # the operator's own prefix: theirs to fill
        return False
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.origin:
        return False
    probe = Path(spec.origin).parent / "_inductor" / "compile_fx.py"
    return probe.exists() and not os.path.exists(importlib.util.cache_from_source(str(probe)))


def cache_dir() -> Path | None:
    """This machine's directory (``FARM_BYTECODE_CACHE``; "off": none), or
    None where this Python keeps bytecode of its own."""
    from farm.core.cpu_isa import cache_file

    where = cache_file(SETTING, "pycache")
    if where is None or not keeps_none():
        return None
    return where.resolve()  # children resolve a relative one elsewhere


def roots() -> list[Path]:
    """The directories to compile: the standard library and this Python's
    site directories (with a prefix set, Python reads bytecode from it only,
    so theirs must be there too), each site directory holding one of
    ``PACKAGES`` (a virtual environment's), and the farm's own package where
    it is not in one of them (a source checkout)."""
    paths = sysconfig.get_paths()
    out = [Path(paths[k]).resolve() for k in ("stdlib", "platstdlib", "purelib", "platlib")
           if Path(paths[k]).is_dir()]
    for name in PACKAGES:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.origin:
            out.append(Path(spec.origin).resolve().parent.parent)
    out.append(Path(__file__).resolve().parent.parent)  # the farm's package
    # compileall recurses: a directory under another one is compiled with it
    # (a virtual environment's site-packages under its platstdlib).
    return [d for d in dict.fromkeys(out) if not any(o in d.parents for o in out)]


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

    return background.fill_once(f"bytecode:{prefix}", "farm-bytecode-fill",
                                lambda: fill(prefix), f"bytecode for build children in {prefix}")


def fill_now() -> str:
    """What a compile worker starts at its start (``fill_in_background``),
    done before returning, for a benchmark whose builds must not time it;
    says what happened."""
    if not keeps_none():
        return "kept beside the sources (this Python keeps bytecode)"
    prefix = cache_dir()
    if prefix is None:
        return f"none ({SETTING}=off): children compile every module from source"
    t0 = time.monotonic()
    out = fill(prefix)
    state = out.get("error") or "filled or checked"
    return (f"compiled into {prefix} ({state} in {time.monotonic() - t0:.1f} s, before the "
            "builds; a worker does it in the background at its start)")


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
