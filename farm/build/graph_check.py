"""The compile child's graph check, run in a fork beside the compile.

The compile stage traces the model again where it compiles it and compares
the fingerprint with the trace stage's (``farm.build.steps.check_graph``):
an artifact of any other graph must not be stored under the build key. That
trace (a model build on meta and a Dynamo capture, 0.1 s for a small MLP,
0.9 s for a 16-layer Llama on 2 cores) used to run before the compile, in
series. It needs nothing of the compile and the compile nothing of it, so
the child forks before compiling: the fork checks, the child compiles, and
the child returns its artifacts only with the fork's verdict, which it waits
for whether the compile succeeded or not. Where a fork is not safe (a second
thread, CUDA already started) the check runs first, as before.

The fork runs the same model code as the child, in the same sandbox and
under its limits (it is in the child's process group; its pages are the
child's until written, and the limit counts proportional set size), so its
answer is trusted exactly as far as the child's own.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import sys
import threading
from collections.abc import Callable
from typing import Any

from farm.core.specs import JobSpec


class GraphCheckLost(RuntimeError):
    """The fork that checked the graph ended without an answer."""


class GraphCheck:
    """``GraphCheck.start(check, spec, expected)``; later ``verdict()``
    returns what ``check(spec, expected)`` returned, or raises what it
    raised. ``forked`` says whether it ran beside the caller."""

    def __init__(self) -> None:
        self.forked = False
        self._pid = 0
        self._fd = -1
        self._inline: tuple[bool, Any] | None = None

    @classmethod
    def start(cls, check: Callable[[JobSpec, str], dict[str, Any]], spec: JobSpec,
              expected: str) -> GraphCheck:
        self = cls()
        if not _fork_safe():
            self._inline = _outcome(check, spec, expected)
            return self
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the fork: check, answer, and leave without running the parent's code
            code = 0
            try:
                os.close(r)
                ok, value = _outcome(check, spec, expected)
                with os.fdopen(w, "wb") as out:
                    out.write(_dumps(ok, value))
            except BaseException:
                code = 1
            finally:
                with contextlib.suppress(Exception):
                    sys.stdout.flush()
                    sys.stderr.flush()
                os._exit(code)
        os.close(w)
        self.forked, self._pid, self._fd = True, pid, r
        return self

    def verdict(self) -> dict[str, Any]:
        if self._inline is not None:
            ok, value = self._inline
        else:
            with os.fdopen(self._fd, "rb") as f:
                data = f.read()
            _, status = os.waitpid(self._pid, 0)
            if not data:
                raise GraphCheckLost(
                    f"the graph check's process ended without an answer (wait status {status}); "
                    "the artifact is not stored")
            ok, value = pickle.loads(data)
        if not ok:
            raise value
        return dict(value)


def _outcome(check: Callable[[JobSpec, str], dict[str, Any]], spec: JobSpec,
             expected: str) -> tuple[bool, Any]:
    try:
        return True, check(spec, expected)
    except Exception as exc:
        return False, exc


def _dumps(ok: bool, value: Any) -> bytes:
    try:
        data = pickle.dumps((ok, value))
        pickle.loads(data)  # an exception whose class cannot be rebuilt from its args
        return data
    except Exception:
        text = f"{type(value).__name__}: {value}" if not ok else repr(value)
        return pickle.dumps((False, RuntimeError(f"the graph check failed: {text}")))


def _fork_safe() -> bool:
    """One thread (a fork copies only the caller), and no CUDA context (a
    fork of a process that started CUDA cannot use it, and the check runs
    on meta anyway)."""
    if not hasattr(os, "fork") or threading.active_count() != 1:
        return False
    torch = sys.modules.get("torch")
    return not (torch is not None and torch.cuda.is_initialized())
