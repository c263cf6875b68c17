"""The time and memory limits of a sandboxed child: ``watch`` waits for it,
sampling the memory of its whole process tree, and kills the tree on
time-out (SIGTERM, then SIGKILL) or memory-out (SIGKILL).

What counts against the memory limit: the proportional set size (PSS,
``/proc/PID/smaps_rollup``) of every process in the tree, so pages shared
by Inductor's compile workers (torch itself, forked from one parent) count
once in all rather than once per worker as a sum of resident sets would,
plus what the sandbox's private ``/tmp`` and ``/dev/shm`` hold (tmpfs is
memory no process maps). The cheap resident-set sum is read at every
sample; PSS only every ``_RESCAN_EVERY`` samples and whenever that sum
crosses the limit (the sum is never below PSS, so nothing is missed).
Where a kernel limit applies (a cgroup, ``farm.build.cgroup_limits``) this
is the fallback that also reports the peak."""

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
    # The peak of what counts against the limit: PSS of the tree plus its tmpfs.
    peak_rss_mb: float = 0.0
    # The peak of the plain resident-set sum (shared pages once per process).
    peak_rss_sum_mb: float = 0.0
    # At a memory-out: what took the memory, largest first.
    culprits: str = ""


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
        used = tree.used_mb(memory_mb)
        w.peak_rss_mb = max(w.peak_rss_mb, used)
        w.peak_rss_sum_mb = max(w.peak_rss_sum_mb, tree.last_rss_sum_mb)
        if used > memory_mb:
            w.oom = True
            w.culprits = tree.culprits()
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
        self.tmpfs: list[str] = []  # the sandbox's /tmp and /dev/shm, seen from here
        self.last_rss_sum_mb = 0.0
        self._pss: dict[int, float] = {}
        self._last_pss = 0.0
        self._pss_due = 0.0

    def _rescan(self) -> None:
        with contextlib.suppress(psutil.Error):
            self.members = [self.root, *self.root.children(recursive=True)]
        self.tmpfs = _sandbox_tmpfs(self.members)

    def used_mb(self, limit_mb: float) -> float:
        """What counts against the limit now (MB): PSS plus tmpfs, or the
        resident-set sum plus tmpfs while that is below both the limit and
        the time for the next PSS look."""
        look = self._samples % _RESCAN_EVERY == 0
        if look:
            self._rescan()
        self._samples += 1
        rss = 0
        gone = False
        for p in self.members:
            try:
                rss += p.memory_info().rss
            except psutil.Error:
                gone = True
        if gone:  # the tree changed: look again at the next sample
            self._samples = 0
        tmp = self.tmpfs_mb()
        self.last_rss_sum_mb = rss / 2**20
        if not look and self.last_rss_sum_mb + tmp <= limit_mb:
            return 0.0  # under the limit for sure; the peak is read at PSS looks
        if time.monotonic() < self._pss_due:
            # Hundreds of processes (a fork bomb) make a PSS look costly: the
            # last one stands until a look is due again.
            return self._last_pss + tmp
        return self.pss_mb() + tmp

    def pss_mb(self) -> float:
        t0 = time.monotonic()
        self._pss = {}
        for p in self.members:
            with contextlib.suppress(psutil.Error, OSError):
                self._pss[p.pid] = _pss_mb(p)
        self._last_pss = sum(self._pss.values())
        # At most a fifth of the watchdog's time on PSS looks.
        cost = time.monotonic() - t0
        self._pss_due = time.monotonic() + 4 * cost if cost > _POLL_S else 0.0
        return self._last_pss

    def tmpfs_mb(self) -> float:
        total = 0.0
        for path in self.tmpfs:
            with contextlib.suppress(OSError):
                st = os.statvfs(path)
                total += (st.f_blocks - st.f_bfree) * st.f_frsize / 2**20
        return total

    def culprits(self) -> str:
        """The largest processes (PSS) and what the tmpfs holds, for the error."""
        if not self._pss:
            self.pss_mb()
        parts = []
        by_size = sorted(self._pss.items(), key=lambda kv: -kv[1])
        names = {p.pid: p for p in self.members}
        for pid, mb in by_size[:4]:
            if mb >= 1:
                parts.append(f"{_describe(names[pid])} {mb:.0f} MB")
        for path in self.tmpfs:
            with contextlib.suppress(OSError):
                st = os.statvfs(path)
                used = (st.f_blocks - st.f_bfree) * st.f_frsize / 2**20
                if used >= 1:
                    parts.append(f"files in {path.split('/root', 1)[-1]} {used:.0f} MB")
        return ", ".join(parts)


def _pss_mb(p: psutil.Process) -> float:
    """A process's proportional set size (MB); its resident set where the
    kernel has no ``smaps_rollup`` (before 4.14)."""
    try:
        with open(f"/proc/{p.pid}/smaps_rollup", "rb") as f:
            for line in f:
                if line.startswith(b"Pss:"):
                    return int(line.split()[1]) / 1024
    except FileNotFoundError:
        if not psutil.pid_exists(p.pid):
            raise
    return float(p.memory_info().rss) / 2**20


def _sandbox_tmpfs(members: list[psutil.Process]) -> list[str]:
    """The private ``/tmp`` and ``/dev/shm`` of the first member in a mount
    namespace other than this process's (the sandboxed child), reached
    through ``/proc/PID/root``; none for an unisolated child (the host's
    /tmp is not the build's)."""
    try:
        mine = os.readlink("/proc/self/ns/mnt")
        top = os.stat("/")
    except OSError:
        return []
    for p in members:
        try:
            if os.readlink(f"/proc/{p.pid}/ns/mnt") == mine:
                continue
            # Until bubblewrap has switched to the sandbox's root, /tmp
            # there is still the host's.
            root = os.stat(f"/proc/{p.pid}/root")
        except OSError:
            continue
        if (root.st_dev, root.st_ino) != (top.st_dev, top.st_ino):
            return [f"/proc/{p.pid}/root/tmp", f"/proc/{p.pid}/root/dev/shm"]
    return []


def _describe(p: psutil.Process) -> str:
    try:
        argv = p.cmdline()
        cmd = " ".join([os.path.basename(argv[0]), *argv[1:4]]) if argv else p.name()
    except psutil.Error:
        cmd = "?"
    return f"{cmd[:100]} (pid {p.pid})"


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
