"""Inductor's precompiled C++ headers, taken from a read-only store or not at
all: the process-side hook of ``farm.build.pch`` (which explains the store),
used by build children, their verification and fleet nodes alike.

``install`` wraps ``torch._inductor.codecache._precompile_header``, the one
function through which Inductor gets a precompiled header for a kernel's
compile: a header in the store is used; one that is not is skipped (the
kernel compiles reading the header itself, as with the setting off), unless
``fill`` builds it with torch's own function and copies it in. torch's own
function is never reached otherwise, so no build or node ever spends the
150 MB and 30 s it takes, nor writes a header another build will read.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import sys
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# What a build child reads: the store, bound read-only. (TORCH_...: an
# import-time variable, so a build zygote is keyed by it, farm.core.import_env.)
CHILD_ENV = "TORCH_FARM_PCH_STORE"
_STORE_VERSION = 1

_installed: dict[str, Any] = {}
_lock = threading.Lock()
# Kernel compiles in this process that found their header in the store, and
# that compiled without one (a build's log says how many).
counts = {"used": 0, "missing": 0}


def header_key(header: str, cmd_line: str, options: Mapping[str, Any]) -> str:
    """The store's name for the header torch would precompile from these
    arguments: the command line names the compiler, its flags, the ISA and
    the include directories (so the torch installation); torch's version and
    path name the header's contents."""
    import torch

    parts = {"v": _STORE_VERSION, "torch": torch.__version__,
             "torch_dir": os.path.dirname(torch.__file__), "python": sys.version,
             "header": header, "cmd": cmd_line,
             # str, not repr: an ISA's repr names a function's address.
             "options": {k: str(v) for k, v in sorted(options.items())}}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:40]


def install(store: str | Path | None, *, fill: bool = False) -> bool:
    """Turn Inductor's precompiled headers on in this process, served from
    ``store`` only (None: never any; a node). ``fill``: build what is
    missing and copy it in (``build_store`` alone does). Returns False, with
    the setting off, where this torch has no such hook."""
    from torch._inductor import codecache
    from torch._inductor import config as inductor_config

    original = getattr(codecache, "_precompile_header", None)
    with _lock:
        if "original" in _installed:
            original = _installed["original"]
        elif original is None or not callable(original):
            log.info("torch has no codecache._precompile_header: no precompiled headers")
            inductor_config.cpp_cache_precompile_headers = False
            return False
        found: dict[str, str] = {}
        root = Path(store) if store is not None else None

        def precompile_header(header: str, hashable_cmd_line: str, **options: Any) -> str | None:
            if root is None:
                return None
            key = header_key(header, hashable_cmd_line, options)
            if key not in found:
                path = root / f"{key}.h"
                if not (path.is_file() and Path(f"{path}.gch").is_file()):
                    if not fill:
                        counts["missing"] += 1
                        return None  # compiled without, as with the setting off
                    _fill_one(original, root, path, header, hashable_cmd_line, options)
                found[key] = str(path)
            counts["used"] += 1
            return found[key]

        _installed.update(original=original, store=root)
        codecache._precompile_header = precompile_header
        inductor_config.cpp_cache_precompile_headers = True
    return True


# Written into the store by farm.build.pch's fill once an AOTI package was
# compiled there with the header precompile on, one file per compiler
# (``aoti_marker``): the store then holds the headers AOTI wrappers compiled
# by that compiler ask for. One file per compiler, not one for the store:
# two workers of one machine that chose different compilers (a CPU and a
# GPU worker) would otherwise take the mark from each other, and a build
# whose compiler lost it compiles without a header.
AOTI_MARKER = "aoti-headers"


def aoti_marker(root: str | Path, compiler: str) -> Path:
    """The file in store ``root`` that says its AOTI headers are there for
    ``compiler`` (the file holds the compiler's command)."""
    digest = hashlib.sha256(compiler.encode()).hexdigest()[:16]
    return Path(root) / f"{AOTI_MARKER}-{digest}"


def aoti_store(compiler: str) -> str | None:
    """The store this process's hook serves from, where it holds AOTI's
    headers for ``compiler`` (the fill marked it, ``aoti_marker``); None:
    AOTI packages compile without a header. A header precompiled with
    another compiler command has another key, and a package compiled with
    the setting on and its header missing was slower than one with it off
    (docs/benchmarks.md), so the mark must name this very compiler."""
    root = _installed.get("store")
    if root is None:
        return None
    try:
        filled_for = aoti_marker(root, compiler).read_text().strip()
    except OSError:
        return None
    return str(root) if filled_for == compiler else None


def install_from_env(env: Mapping[str, str] | None = None) -> bool:
    """``install`` with the store a worker gave this build child
    (``TORCH_FARM_PCH_STORE``); nothing where it gave none."""
    store = (os.environ if env is None else env).get(CHILD_ENV)
    if not store:
        return False
    return install(store)


def _fill_one(original: Any, root: Path, path: Path, header: str, cmd: str,
              options: Mapping[str, Any]) -> None:
    built = Path(original(header, cmd, **options))
    tmp = root / f".{path.name}.{os.getpid()}"
    # The header first, then its name: a reader never sees a name without it.
    shutil.copyfile(f"{built}.gch", f"{tmp}.gch")
    os.replace(f"{tmp}.gch", f"{path}.gch")
    tmp.write_text(f"#include <{header}>\n")
    os.replace(tmp, path)
