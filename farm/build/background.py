"""A worker's once-per-process work in the background: filling this machine's
stores (precompiled headers, ``farm.build.pch``; compiled bytecode,
``farm.build.bytecode``) beside the first builds, which do without until
they are there."""

from __future__ import annotations

import threading
from collections.abc import Callable

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
