"""This node's CPU target without importing torch, when nothing has changed.

``farm resolve --target auto`` and ``farm fetch`` took 2.0 s against 0.9 s
with the target given (measured here, 2 idle cores; 3-8.6 s on a loaded
machine): the difference is ``import torch``, which describing a CPU target
needs (the torch version, ``torch.get_num_threads()``, the CPU flags torch
reads). Every one of those is fixed by things a process can read in
milliseconds without torch: the torch installation on disk, the thread
settings in the environment, the CPUs this process may run on and their
flags. So the target is kept in a small per-machine file
(``FARM_NODE_TARGET_CACHE``, "off" disables it) under a key of exactly those;
only the first process after a change pays for the import.

A process that has imported torch already describes itself live (milliseconds,
and it sees a ``torch.set_num_threads`` the program made).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import platform
import sys
from pathlib import Path
from typing import Any

from farm.core.cpu_isa import _cpu_flags_digest, cache_file, read_json_object, write_cache_file
from farm.core.target import Target, TargetError, detect_local_target

CACHE_ENV = "FARM_NODE_TARGET_CACHE"
_MAX_ENTRIES = 32
# What torch's thread count and CPU dispatch read from the environment.
_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "ATEN_CPU_CAPABILITY", "CUDA_VISIBLE_DEVICES",
        "TORCHINDUCTOR_VEC_ISA_OK")


def _torch_install() -> dict[str, Any]:
    dist = importlib.metadata.distribution("torch")
    init = Path(str(dist.locate_file("torch/__init__.py")))
    st = init.stat()
    return {"version": dist.version, "path": str(init), "mtime_ns": st.st_mtime_ns,
            "size": st.st_size}


def _read(path: str) -> str:
    try:
        return Path(path).read_text(errors="replace").strip()
    except OSError:
        return ""


def cache_key() -> str:
    """Everything a CPU node's target depends on, hashed."""
    affinity = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    facts = {
        "python": [sys.executable, platform.python_version()],
        "torch": _torch_install(),
        "env": {k: os.environ.get(k) for k in _ENV},
        "cpus": [os.cpu_count(), affinity],
        "cpu_flags": _cpu_flags_digest(),
        # A CPU quota may lower what a program is given, and a GPU appearing
        # changes what "auto" means.
        "cgroup": _read("/sys/fs/cgroup/cpu.max"),
        "gpus": sorted(p.name for p in Path("/dev").glob("nvidia[0-9]*")),
    }
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()


def node_target(device: str | None = None) -> Target:
    """This machine as a fleet node sees itself for ``device`` (None: cuda if
    present), from the per-machine cache when torch is not imported yet."""
    if "torch" in sys.modules or device not in (None, "cpu"):
        return detect_local_target(device, check_compiler=False)
    path = cache_file(CACHE_ENV, "node-target.json")
    try:
        key = f"{device or 'auto'}:{cache_key()}"
    except Exception:  # no torch distribution metadata, say: describe it live
        path = None
    if path is None:
        return detect_local_target(device, check_compiler=False)
    entries = _entries(path)
    text = entries.get(key)
    if text is not None:
        try:
            return Target.parse(text)
        except TargetError:
            pass
    target = detect_local_target(device, check_compiler=False)
    if target.device == "cpu":
        entries.pop(key, None)
        entries[key] = str(target)
        while len(entries) > _MAX_ENTRIES:
            del entries[next(iter(entries))]
        write_cache_file(path, entries)
    return target


def _entries(path: Path) -> dict[str, str]:
    return {k: v for k, v in read_json_object(path).items()
            if isinstance(k, str) and isinstance(v, str)}
