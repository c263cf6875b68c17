"""A uid of its own for each sandboxed build running on this host at once.

A root worker drops every build child to an unprivileged uid. Were that one
uid for all (65534, "nobody"), the per-uid process limit (``RLIMIT_NPROC``,
``BUILD_MAX_PROCS``) would be shared: one build's fork bomb would leave no
process to any other build of the host, and one build's processes could
signal another's. So each running child, and each warm zygote
(``farm.build.zygote``), leases one of ``FARM_SANDBOX_UIDS`` uids from
``FARM_SANDBOX_UID_BASE`` up.

A lease is an exclusive ``flock`` on one file per uid, in ``/run/farm-sandbox-uids``
(or ``FARM_HOME/sandbox-uids`` where /run is not writable): every worker process
of the host sees the same files, and the kernel drops a dead worker's leases
with its descriptors. Only a root worker leases: an unprivileged worker's
sandbox maps its own uid, the only one it has (a cgroup's ``pids.max``,
``farm.build.cgroup_limits``, bounds its builds instead).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from farm.build.isolation import SandboxUnavailable

RUN_DIR = Path("/run/farm-sandbox-uids")
_WAIT_S = 0.2


class NoFreeUid(SandboxUnavailable):
    """Every sandbox uid of this host is leased (or none can be leased here)."""


@dataclass
class Lease:
    uid: int
    fd: int | None

    def release(self) -> None:
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.fd)  # closing the descriptor drops the flock
            self.fd = None


def leases_dir() -> Path:
    """Where the lease files are: /run (tmpfs: gone at boot, as leases are)
    where this process may write there, else under FARM_HOME."""
    for d in (RUN_DIR, _home_dir()):
        with contextlib.suppress(OSError):
            d.mkdir(mode=0o700, parents=True, exist_ok=True)
            if os.access(d, os.W_OK):
                return d
    raise NoFreeUid(f"cannot create the uid lease directory {RUN_DIR} or {_home_dir()}")


def _home_dir() -> Path:
    from farm.core.settings import get_settings

    return Path(get_settings().farm_home) / "sandbox-uids"


def _settings() -> tuple[int, int, int]:
    from farm.core.settings import get_settings

    s = get_settings()
    return (int(s.farm_sandbox_uid), int(s.farm_sandbox_uid_base), int(s.farm_sandbox_uids))


def take(*, base: int | None = None, count: int | None = None, wait_s: float = 300.0) -> Lease:
    """A uid no other running build of this host has (the caller ``release``s
    it). With ``FARM_SANDBOX_UIDS=0`` or as an unprivileged worker: the one
    sandbox uid, ``FARM_SANDBOX_UID``, unleased. Waits up to ``wait_s`` for a
    free one, then raises ``NoFreeUid``."""
    fixed, cfg_base, cfg_count = _settings()
    base = cfg_base if base is None else base
    count = cfg_count if count is None else count
    if count <= 0 or os.geteuid() != 0:
        return Lease(uid=fixed, fd=None)
    d = leases_dir()
    deadline = time.monotonic() + wait_s
    while True:
        for i in range(count):
            fd = os.open(d / f"uid-{base + i}", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            return Lease(uid=base + i, fd=fd)
        if time.monotonic() > deadline:
            raise NoFreeUid(
                f"all {count} sandbox uids from {base} are in use on this host: "
                f"raise FARM_SANDBOX_UIDS or run fewer builds at once"
            )
        time.sleep(_WAIT_S)


@contextlib.contextmanager
def leased(**kw: int) -> Iterator[int]:
    """``take`` for the length of a ``with`` block; the uid."""
    lease = take(**kw)
    try:
        yield lease.uid
    finally:
        lease.release()
