"""Kernel-enforced memory and process limits for a build child, where the
host delegates a cgroup v2 directory to the farm (``FARM_BUILD_CGROUP``).

Each child gets a cgroup of its own under that directory with
``memory.max`` (the build's memory limit: every page its processes touch and
every file in its tmpfs, charged by the kernel, with no sampling gap),
``memory.swap.max`` 0 where swap accounting exists, and ``pids.max``
(``BUILD_MAX_PROCS``). The child enters it before bubblewrap starts (a
shell writes its own pid to ``cgroup.procs``, then execs bubblewrap), so
nothing it starts is outside. The PSS watchdog (``farm.build.watchdog``)
still runs a little above the kernel's limit, as the backstop and for the
peak it reports; without a cgroup it is the limit. The build log says which
applied (``SandboxResult.limits``).

Setting a host up (root; the ``cgroup2`` file system at /sys/fs/cgroup)::

    mkdir /sys/fs/cgroup/farm-builds
    echo +memory +pids > /sys/fs/cgroup/cgroup.subtree_control
    echo +memory +pids > /sys/fs/cgroup/farm-builds/cgroup.subtree_control
    FARM_BUILD_CGROUP=/sys/fs/cgroup/farm-builds farm worker compile

The worker itself must not run inside ``farm-builds`` (cgroup v2 puts
processes only in leaves of a tree with controllers on). An unprivileged
worker needs the directory delegated to it (systemd: ``Delegate=yes`` on
its unit, ``FARM_BUILD_CGROUP`` a subdirectory of its own cgroup) so that it
may move its children.
"""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

CONTROLLERS = ("memory", "pids")
# The watchdog's threshold above a kernel limit: the kernel acts first.
WATCHDOG_SLACK = 1.1


class CgroupUnavailable(RuntimeError):
    """``FARM_BUILD_CGROUP`` names a directory builds cannot be limited in."""


def configured() -> Path | None:
    """``FARM_BUILD_CGROUP``, or None (no kernel limits: the watchdog)."""
    from farm.core.settings import get_settings

    value = str(get_settings().farm_build_cgroup or "").strip()
    return Path(value) if value else None


def check(root: Path) -> str | None:
    """Why ``root`` cannot hold build cgroups (None: it can)."""
    if not (root / "cgroup.controllers").is_file():
        return (
            f"FARM_BUILD_CGROUP={root} is not a cgroup v2 directory (no cgroup.controllers "
            f"in it): create it under the cgroup2 mount, e.g. mkdir /sys/fs/cgroup/farm-builds"
        )
    try:
        enabled = (root / "cgroup.subtree_control").read_text().split()
    except OSError as exc:
        return f"cannot read {root}/cgroup.subtree_control: {exc}"
    missing = [c for c in CONTROLLERS if c not in enabled]
    if missing:
        plus = " ".join(f"+{c}" for c in missing)
        return (
            f"FARM_BUILD_CGROUP={root} does not give its children the {', '.join(missing)} "
            f"controller(s): echo {plus} > {root}/cgroup.subtree_control (and in its "
            f"parent's cgroup.subtree_control first)"
        )
    if not os.access(root, os.W_OK):
        return f"FARM_BUILD_CGROUP={root} is not writable by this worker (delegate it)"
    return None


@dataclass
class BuildCgroup:
    """One child's cgroup: its limits, how it ended, its removal."""

    path: Path
    memory_mb: float
    max_procs: int

    def wrap(self, argv: list[str]) -> list[str]:
        """``argv`` started inside this cgroup (the shell moves itself, then
        execs it: no process of the child is ever outside)."""
        return [
            "/bin/sh",
            "-c",
            'echo 0 > "$0" && exec "$@"',
            str(self.path / "cgroup.procs"),
            *argv,
        ]

    def events(self) -> dict[str, int]:
        out: dict[str, int] = {}
        with contextlib.suppress(OSError):
            for line in (self.path / "memory.events").read_text().splitlines():
                key, _, value = line.partition(" ")
                out[key] = int(value or 0)
        return out

    def oom_killed(self) -> bool:
        return self.events().get("oom_kill", 0) > 0

    def peak_mb(self) -> float:
        with contextlib.suppress(OSError, ValueError):
            return int((self.path / "memory.peak").read_text()) / 2**20
        return 0.0

    def describe(self) -> str:
        return (
            f"kernel: cgroup {self.path.name} memory.max {self.memory_mb:.0f} MB, "
            f"pids.max {self.max_procs}"
        )

    def close(self) -> None:
        """Kill whatever is left in it and remove it."""
        with contextlib.suppress(OSError):
            (self.path / "cgroup.kill").write_text("1")
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.1)  # its last processes are still exiting


def create(root: Path, *, memory_mb: float, max_procs: int) -> BuildCgroup:
    """A new child cgroup of ``root`` with the build's limits. Raises
    ``CgroupUnavailable`` when ``root`` cannot hold one."""
    why = check(root)
    if why is not None:
        raise CgroupUnavailable(why)
    path = root / f"build-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        path.mkdir()
        (path / "memory.max").write_text(str(int(memory_mb * 2**20)))
        with contextlib.suppress(FileNotFoundError):  # no swap accounting on this kernel
            (path / "memory.swap.max").write_text("0")
        (path / "pids.max").write_text(str(int(max_procs)))
        # An out-of-memory kill takes the whole build, not one of its processes.
        with contextlib.suppress(FileNotFoundError):
            (path / "memory.oom.group").write_text("1")
    except OSError as exc:
        with contextlib.suppress(OSError):
            path.rmdir()
        raise CgroupUnavailable(f"cannot create a build cgroup in {root}: {exc}") from exc
    return BuildCgroup(path=path, memory_mb=memory_mb, max_procs=max_procs)
