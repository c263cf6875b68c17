"""`farm demo --port`: the demo farm's port, and a port in use refused at
once with what to do (no farm is started)."""

from __future__ import annotations

import socket
import subprocess
import sys


def _farm(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "farm.app.cli", *argv], capture_output=True, text=True, timeout=120
    )


def test_demo_help_offers_a_port() -> None:
    r = _farm("demo", "--help")
    assert r.returncode == 0
    assert "--port PORT" in r.stdout and "default: a free one" in " ".join(r.stdout.split())


def test_demo_on_a_port_in_use_says_so_and_starts_nothing() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = _farm("demo", "--port", str(port))
    assert r.returncode == 1
    assert f"port {port} is in use" in r.stderr and "--port" in r.stderr
    assert "starting an embedded farm" not in r.stderr
