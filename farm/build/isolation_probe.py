"""The start-up check that a worker's sandbox isolates what it claims to.

One real sandboxed child (the same command line a build gets) tries, as a
hostile model would:

- the network: a TCP connect to a socket this worker listens on at
  127.0.0.1, and to the farm's own port (``FARM_URL``'s): both must fail;
- the parent: its pid namespace must not be the worker's, and no
  ``/proc/*/environ`` it can read may hold any of the worker's environment
  entries that the child was not given (credentials: the database, broker,
  bucket and key settings);
- the kernel: the seccomp filter must be on (``Seccomp: 2``) and a new user
  namespace (``unshare(CLONE_NEWUSER)``) refused with EPERM;
- its uid: the sandbox's.

``findings`` lists each failed check in words; the worker refuses to start
(``FARM_SANDBOX=on``) when there is any.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import socket
from collections.abc import Container, Iterator, Mapping
from typing import Any
from urllib.parse import urlsplit

CLONE_NEWUSER = 0x10000000


def _entry_digest(key: str, value: str) -> str:
    return hashlib.sha256(f"{key}={value}".encode()).hexdigest()


@contextlib.contextmanager
def listener() -> Iterator[int]:
    """A TCP socket listening on 127.0.0.1 for the probe to try; its port."""
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        yield int(s.getsockname()[1])
    finally:
        s.close()


def farm_port(url: str) -> int | None:
    with contextlib.suppress(ValueError):
        parts = urlsplit(url)
        if parts.hostname in ("127.0.0.1", "localhost", "::1"):
            return parts.port or (443 if parts.scheme == "https" else 80)
    return None


def payload(ports: list[int]) -> dict[str, Any]:
    return {"ports": ports}


def probe_child(p: Mapping[str, Any]) -> dict[str, Any]:
    """Runs inside the sandbox: what it can reach and read."""
    import ctypes

    connects = {}
    for port in p.get("ports", []):
        try:
            socket.create_connection(("127.0.0.1", int(port)), timeout=1.0).close()
            connects[str(port)] = "connected"
        except OSError as exc:
            connects[str(port)] = type(exc).__name__
    environs: dict[str, list[str]] = {}
    for pid in (d for d in os.listdir("/proc") if d.isdigit()):
        with contextlib.suppress(OSError):
            with open(f"/proc/{pid}/environ", "rb") as f:
                raw = f.read()
            entries = [e.decode("utf-8", "replace") for e in raw.split(b"\0") if b"=" in e]
            environs[pid] = [_entry_digest(*e.split("=", 1)) for e in entries]
    libc = ctypes.CDLL(None, use_errno=True)
    ctypes.set_errno(0)
    rc = libc.unshare(CLONE_NEWUSER)
    err = ctypes.get_errno()
    with open("/proc/self/status") as f:
        seccomp = next((ln.split()[1] for ln in f if ln.startswith("Seccomp:")), "?")
    return {
        "uid": os.getuid(),
        "pid_ns": os.readlink("/proc/self/ns/pid"),
        "connects": connects,
        "environs": environs,
        "unshare_newuser": "ok" if rc == 0 else os.strerror(err),
        "unshare_errno": 0 if rc == 0 else err,
        "seccomp": seccomp,
    }


def findings(
    value: Mapping[str, Any], *, uids: Container[int], child_env: Mapping[str, str]
) -> list[str]:
    """What the probe child's report shows is not isolated (empty: all holds);
    ``uids``: the sandbox uids it may run as."""
    import errno

    out = []
    if value.get("uid") not in uids or value.get("uid") == os.geteuid() != 0:
        out.append(f"it runs as uid {value.get('uid')}, not a sandbox uid")
    if value.get("pid_ns") == os.readlink("/proc/self/ns/pid"):
        out.append("it shares the worker's pid namespace")
    reached = [port for port, how in (value.get("connects") or {}).items() if how == "connected"]
    if reached:
        out.append(f"it reached 127.0.0.1 port(s) {', '.join(reached)} (no network namespace)")
    # The worker's entries the child was not given: the credentials among them.
    secret = {_entry_digest(k, v) for k, v in os.environ.items() if child_env.get(k) != v}
    for pid, digests in (value.get("environs") or {}).items():
        if secret & set(digests):
            out.append(f"/proc/{pid}/environ in the sandbox holds the worker's environment")
            break
    if value.get("seccomp") != "2":
        out.append("no seccomp filter is on (Seccomp: " + str(value.get("seccomp")) + ")")
    if value.get("unshare_errno") != errno.EPERM:
        out.append(f"a new user namespace was not refused ({value.get('unshare_newuser')})")
    return out
