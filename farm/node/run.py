"""``farm run -- python SCRIPT ARGS...``: run a Python script in a fork of the
node agent (farm.node.agent), which has torch, Dynamo, Inductor and the farm's
loader imported already, so a training artifact's load does not pay for them.

This module is the client, and it must stay cheap: it imports no torch and
nothing of the farm beyond the standard library. It hands the agent its argv,
environment, working directory and its stdin/stdout/stderr (SCM_RIGHTS), relays
SIGINT/SIGTERM/SIGHUP/SIGQUIT to the child, and exits as the child did (a child
killed by a signal kills the client with the same signal). With no agent to
answer, or one that refuses the command, it runs the command itself
(``os.execvp``) and says so in one line on stderr.

    python -m farm.node.run [--agent PATH] -- python SCRIPT ARGS...
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import struct
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

# The request header: the JSON body's length; the three fds ride on it.
HEADER = struct.Struct("!I")
MAX_REQUEST = 4 << 20
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)


def default_socket() -> Path:
    """FARM_AGENT_SOCKET; else $XDG_RUNTIME_DIR/farm-agent.sock; else agent.sock in
    the node's cache dir (CLIENT_CACHE_DIR, else FARM_HOME/cache), computed here
    without farm.core.settings (pydantic: 0.1 s this client does not need)."""
    if os.environ.get("FARM_AGENT_SOCKET"):
        return Path(os.environ["FARM_AGENT_SOCKET"])
    if os.environ.get("XDG_RUNTIME_DIR"):
        return Path(os.environ["XDG_RUNTIME_DIR"]) / "farm-agent.sock"
    if os.environ.get("CLIENT_CACHE_DIR"):
        return Path(os.environ["CLIENT_CACHE_DIR"]) / "agent.sock"
    home = Path(os.environ.get("FARM_HOME") or Path.home() / ".farm")
    return home / "cache" / "agent.sock"


def read_messages(buf: bytearray, data: bytes) -> list[dict[str, Any]]:
    """Newline-delimited JSON: append data, return the complete messages."""
    buf += data
    out = []
    while b"\n" in buf:
        line, _, rest = bytes(buf).partition(b"\n")
        buf[:] = rest
        if line.strip():
            out.append(json.loads(line))
    return out


def send_message(sock: socket.socket, msg: dict[str, Any]) -> None:
    sock.sendall(json.dumps(msg).encode() + b"\n")


class NoAgent(Exception):
    """The agent is not there or would not run this command: run it here instead."""


def submit(sock_path: Path, argv: list[str]
           ) -> tuple[socket.socket, bytearray, list[dict[str, Any]]]:
    """Connect and hand the command over; returns the socket (and what was read
    past the "started" message) once the agent has forked the child. Raises
    NoAgent when nothing runs it."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(str(sock_path))
    except OSError as exc:
        sock.close()
        raise NoAgent(f"no agent at {sock_path} ({exc.strerror or exc})") from None
    body = json.dumps({"argv": argv, "env": dict(os.environ), "cwd": os.getcwd()}).encode()
    try:
        socket.send_fds(sock, [HEADER.pack(len(body))], [0, 1, 2])
        sock.sendall(body)
        buf = bytearray()
        while True:
            data = sock.recv(65536)
            if not data:
                raise NoAgent(f"the agent at {sock_path} closed the connection")
            msgs = read_messages(buf, data)
            for i, msg in enumerate(msgs):
                if "refused" in msg:
                    raise NoAgent(f"the agent at {sock_path} refused: {msg['refused']}")
                if "started" in msg:
                    # What came after "started" (a fast child's exit) is for wait().
                    return sock, buf, msgs[i + 1:]
    except OSError as exc:
        sock.close()
        raise NoAgent(f"the agent at {sock_path} failed: {exc}") from None
    except NoAgent:
        sock.close()
        raise


def wait(sock: socket.socket, buf: bytearray, pending: list[dict[str, Any]],
         early: Sequence[int] = ()) -> dict[str, Any]:
    """The child's end: {"exit": code} or {"signal": n}; signals to this process
    go to the child meanwhile (and those that came before it started)."""
    def forward(signum: int, _frame: Any) -> None:
        with contextlib.suppress(OSError):
            send_message(sock, {"signal": signum})

    for sig in FORWARDED_SIGNALS:
        signal.signal(sig, forward)
    for early_sig in early:
        forward(early_sig, None)
    while True:
        for msg in pending:
            if "exit" in msg or "signal" in msg:
                return msg
        try:
            data = sock.recv(65536)
        except InterruptedError:  # pragma: no cover - PEP 475 retries
            continue
        if not data:
            return {"lost": "the agent closed the connection before the child ended"}
        pending = read_messages(buf, data)


def exit_like(result: dict[str, Any]) -> NoReturn:
    if "signal" in result:
        sig = int(result["signal"])
        sys.stdout.flush()
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
        sys.exit(128 + sig)  # a signal whose default is not to end the process
    if "exit" in result:
        sys.exit(int(result["exit"]))
    sys.stderr.write(f"farm run: {result.get('lost', result)}\n")
    sys.exit(255)


def run(argv: list[str], *, agent: Path | None = None) -> NoReturn:
    if not argv:
        sys.stderr.write("farm run: no command; usage: farm run [--agent PATH] -- python "
                         "SCRIPT ARGS...\n")
        sys.exit(2)
    path = agent or default_socket()
    # Held from the start: a signal before the child runs is its, not ours.
    early: list[int] = []
    for sig in FORWARDED_SIGNALS:
        signal.signal(sig, lambda signum, _frame: early.append(signum))
    try:
        sock, buf, pending = submit(path, argv)
    except NoAgent as exc:
        for sig in FORWARDED_SIGNALS:
            signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT
                          else signal.SIG_DFL)
        for early_sig in early:
            os.kill(os.getpid(), early_sig)
        sys.stderr.write(f"farm run: {exc}; running the command directly\n")
        sys.stderr.flush()
        try:
            os.execvp(argv[0], argv)
        except OSError as err:
            sys.stderr.write(f"farm run: cannot run {argv[0]}: {err.strerror}\n")
            sys.exit(127)
    exit_like(wait(sock, buf, pending, early))


def main(args: list[str] | None = None) -> NoReturn:
    args = list(sys.argv[1:] if args is None else args)
    agent = None
    while args and args[0] != "--":
        if args[0] == "--agent" and len(args) > 1:
            agent = Path(args[1])
            del args[:2]
        elif args[0].startswith("--agent="):
            agent = Path(args[0].split("=", 1)[1])
            del args[0]
        else:
            break
    if args and args[0] == "--":
        del args[0]
    run(args, agent=agent)


if __name__ == "__main__":
    main()
