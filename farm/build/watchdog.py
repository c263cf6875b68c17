"""The time and memory limits of a sandboxed child: ``watch`` waits for it,
sampling the resident set of its whole process tree, and kills the tree on
time-out (SIGTERM, then SIGKILL) or memory-out (SIGKILL)."""

from __future__ import annotations

import contextlib
import os
import signal as signal_mod
import subprocess
import time
from dataclasses import dataclass
from typing import Protocol

import psutil

_POLL_S = 0.05
# Samples between two look-ups of the child's process tree (_Tree).
_RESCAN_EVERY = 10
_TERM_GRACE_S = 2.0


class Child(Protocol):
    """A ``subprocess.Popen``, or a zygote's forked child (``farm.build.zygote``)."""

    @property
    def pid(self) -> int: ...

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...


@dataclass
class Watch:
    timed_out: bool = False
    oom: bool = False
    peak_rss_mb: float = 0.0


def watch(proc: Child, *, timeout_s: float, memory_mb: float) -> Watch:
    """Wait for ``proc``; kill its group on time-out or memory-out."""
    w = Watch()
    deadline = time.monotonic() + timeout_s
    try:
        tree = _Tree(psutil.Process(proc.pid))
    except psutil.Error:  # already gone
        proc.wait()
        return w
    while proc.poll() is None:
        rss = tree.rss_mb()
        w.peak_rss_mb = max(w.peak_rss_mb, rss)
        if rss > memory_mb:
            w.oom = True
            _kill_tree(proc, tree.root, grace_s=0.0)
            break
        if time.monotonic() > deadline:
            w.timed_out = True
            _kill_tree(proc, tree.root, grace_s=_TERM_GRACE_S)
            break
        time.sleep(_POLL_S)
    proc.wait()
    return w


class _Tree:
    """The child and its descendants, for the memory watchdog.

    Finding descendants reads every ``/proc/<pid>/stat`` on the machine
    (psutil's parent map; Linux without CONFIG_PROC_CHILDREN has no cheaper
    way). Done at every 50 ms sample, that cost the worker 14% of a core per
    running child beside 230 processes and 18% beside 380
    (bench/watchdog_cost.py), on every build. So the tree is looked up again
    every ``_RESCAN_EVERY`` samples, or when a known member has exited, and
    the known members' resident sets are read at every sample: a process
    that joins the tree (the model's own Python behind bubblewrap, a g++) is
    counted within half a second of starting, and from then on at every
    sample. (The model's process spends its first seconds importing torch,
    before any model code runs.)"""

    def __init__(self, root: psutil.Process) -> None:
        self.root = root
        self.members: list[psutil.Process] = [root]
        self._samples = 0

    def _rescan(self) -> None:
        with contextlib.suppress(psutil.Error):
            self.members = [self.root, *self.root.children(recursive=True)]

    def rss_mb(self) -> float:
        if self._samples % _RESCAN_EVERY == 0:
            self._rescan()
        self._samples += 1
        total = 0
        gone = False
        for p in self.members:
            try:
                total += p.memory_info().rss
            except psutil.Error:
                gone = True
        if gone:  # the tree changed: look again at the next sample
            self._samples = 0
        return total / 2**20


def _kill_tree(proc: Child, root: psutil.Process, *, grace_s: float) -> None:
    """SIGTERM (after ``grace_s``: SIGKILL) to the child's process group, and to
    any descendant that left the group (a compile worker with its own session)."""
    try:
        stray = root.children(recursive=True)
    except psutil.Error:
        stray = []
    pgid = proc.pid  # start_new_session: the child leads its own group
    if grace_s > 0:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal_mod.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace_s)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal_mod.SIGKILL)
    for p in stray:
        with contextlib.suppress(psutil.Error):
            p.kill()
