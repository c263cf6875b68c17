"""A worker's once-per-process work in the background: filling this machine's
stores (precompiled headers, ``farm.build.pch``; compiled bytecode,
``farm.build.bytecode``) beside the first builds, which do without until
they are there."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

_lock = threading.Lock()
_started: dict[str, threading.Thread] = {}


def once(key: str, name: str, work: Callable[[], None]) -> threading.Thread:
    """``work`` on a daemon thread called ``name``, the first time ``key`` is
    asked for in this process; later asks get that thread."""
    with _lock:
        t = _started.get(key)
        if t is None:
            t = threading.Thread(target=work, name=name, daemon=True)
            _started[key] = t
            t.start()
    return t


def fill_once(key: str, name: str, fill: Callable[[], dict[str, Any]],
              what: str) -> threading.Thread:
    """``once``: ``fill()``, logging its outcome as ``what`` (a warning when it
    reports an ``error``)."""
    def work() -> None:
        out = fill()
        log.log(logging.WARNING if "error" in out else logging.INFO, "%s: %s", what, out)

    return once(key, name, work)
