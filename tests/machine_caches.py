"""The test session's per-machine caches: what a farm keeps once per host,
in one temporary directory of this session's own, never the user's
``~/.cache/torch-farm``. tests/conftest.py sets them for the whole run;
test_netns's "hosts" of this one machine keep them too, where they drop
every other ``FARM_`` setting."""

from __future__ import annotations

import os

# Setting -> its name in the session's directory.
MACHINE_CACHES = {
    # The CPU ISA pick (farm.core.cpu_isa): test-compiled once per session
    # rather than once per process.
    "FARM_ISA_CACHE": "cpu-isa.json",
    # farm.build.aoti_check's answer (a tiny AOTI build and load).
    "FARM_AOTI_CHECK_CACHE": "aoti-check.json",
    # The precompiled headers compile workers fill (farm.build.pch).
    "FARM_PCH_STORE": "pch",
    # A node's answer to which target it is (farm.node.local_target).
    "FARM_NODE_TARGET_CACHE": "node-target.json",
    # Compiled bytecode, where a worker's Python keeps none (farm.build.bytecode).
    "FARM_BYTECODE_CACHE": "pycache",
}


def set_defaults(directory: str) -> None:
    """Each cache under ``directory``, unless the environment names its own."""
    for name, leaf in MACHINE_CACHES.items():
        os.environ.setdefault(name, os.path.join(directory, leaf))
