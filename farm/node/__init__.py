"""The fleet node: resolve, fetch, verify and load the farm's artifacts.

It imports nothing of the server side (registry, workers), so a node installs
only ``torch-farm[client]``. The public names are loaded on first use, so that
``farm.node.loader`` alone (what a build child loads artifacts with) does not
pull in the HTTP client.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "FarmClient": "farm.node.client",
    "compiled": "farm.node.compiled",
    "prefetch_compiled": "farm.node.compiled",
    "FarmError": "farm.node.errors",
    "NotFoundError": "farm.node.errors",
    "IntegrityError": "farm.node.errors",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'farm.node' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    # Kept, so the next lookup is plain. And needed for ``compiled``: importing
    # farm.node.compiled sets this package's attribute of that name to the
    # submodule, which ``from farm.node import compiled`` would then return.
    globals()[name] = value
    return value
