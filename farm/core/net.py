"""Local networking helpers (the demo, benchmarks and tests start servers),
and what a service URL names."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now (the OS picks it; another process may
    still take it before the caller binds, which a caller that retries covers)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


# The schemes redis-py's ``Redis.from_url`` accepts (TLS and a Unix socket
# included): a URL with one of them names a Redis server, anything else does not.
REDIS_URL_SCHEMES = ("redis://", "rediss://", "unix://")


def is_redis_url(url: str) -> bool:
    return url.startswith(REDIS_URL_SCHEMES)
