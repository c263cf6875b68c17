"""Local networking helpers (the demo, benchmarks and tests start servers)."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now (the OS picks it; another process may
    still take it before the caller binds, which a caller that retries covers)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
