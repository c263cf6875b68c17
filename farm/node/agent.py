"""The node agent: a process that has already imported what loading a training
artifact needs (torch, Dynamo, Inductor, AOTAutograd, Triton when installed,
the farm's loader) and forks a child per ``farm run -- python SCRIPT`` (those
imports were about 4.4 s of a training node's first result on the H200).

    farm agent [--socket PATH]        # one per node, or one per GPU (its own socket)
    farm run -- python train.py ...   # farm.node.run, the client

It never initializes CUDA and holds one Python thread when it forks (both
checked before each fork: the request is refused otherwise, and ``farm run``
then runs the command itself). One native thread besides the main one is there: numpy's
OpenBLAS starts its worker pool when imported (``import numpy`` alone shows it
in /proc/self/task; OPENBLAS_NUM_THREADS=1 removes it), and OpenBLAS's own
pthread_atfork handlers (numpy's libscipy_openblas links __register_atfork)
stop that pool before a fork and let the child start its own, which is what
makes a fork with it safe. On the H200 (torch 2.11, Triton 3.6) there is one more, a
CUDA driver thread ("cuda0000..."), though torch's CUDA is not initialized:
the agent makes torch.cuda.is_available() ask NVML while it imports (see
preload) so that torch does not mark its forks unable to use CUDA, and at start
it forks a probe child that checks just that; there, forked children ran a
matmul and a torch.compile Triton kernel on the GPU. It serves only its own uid (SO_PEERCRED) on a
socket of mode 0600.

The child is set up to look like a fresh ``python SCRIPT``: the client's
stdin/stdout/stderr, environment, working directory, sys.argv and sys.path, a
new session (its own process group: the client forwards its signals to it),
default signal handlers, a fresh seed for ``random``, numpy's global generator
and torch's CPU generator, and Python's own exit path (non-daemon threads
joined, atexit handlers run, uncaught KeyboardInterrupt ends it by SIGINT).
What it shares with the agent, unlike a fresh process: the imported modules
and their import-time state (torch's configs read their environment variables
when imported, so a request whose import-time variables differ from the
agent's is refused: see ``farm.core.import_env``), the str hash seed
(PYTHONHASHSEED), warnings already shown once, and the interpreter's flags.
The child's side lives in ``farm.node.agent_child``.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import selectors
import shutil
import signal
import socket
import struct
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from farm.core.import_env import import_time_env
from farm.node.agent_child import FRESH_WARNING_FILTERS, Command, child_main
from farm.node.run import HEADER, MAX_REQUEST, default_socket, read_messages, send_message

# What loading an aot_compile artifact imports (farm.node.compiled's warm
# imports, then the modules a training artifact's compiled_train_step and first
# step added to sys.modules on top of them: measured on torch 2.13 CPU), and the
# farm's node modules (the fleet path's verification imports cryptography).
PRELOAD = (
    "torch",
    "torch._dynamo",
    "torch._inductor",
    "torch._inductor.compile_fx",
    "torch._inductor.codecache",
    "torch._inductor.codegen.memory_planning",
    "torch._inductor.hooks",
    "torch._functorch.aot_autograd",
    "torch._dynamo.aot_compile",
    "torch.utils.cpp_extension",
    "torch.compiler",
    "torch.fx.experimental.validator",
    "torch._functorch._aot_autograd.subclass_codegen",
    "torch.profiler",
    "triton",
    "farm.node",
    "farm.node.loader",
    "farm.node.compiled",
    "farm.node.client",
    "farm.node.training",
    "farm.node.verify",
    "farm.node.weight_check",
    "farm.core.modelref",
)





class Refused(Exception):
    """A request the agent will not run (the client runs it itself)."""


def log(msg: str) -> None:
    sys.stderr.write(f"farm agent: {msg}\n")
    sys.stderr.flush()


def preload() -> dict[str, Any]:
    t0 = time.perf_counter()
    skipped = []
    # Inductor's benchmarking module and cpp_extension call torch.cuda.is_available()
    # at import; its default way (cudaGetDeviceCount) starts the CUDA driver, and
    # torch then refuses CUDA in every forked child ("Cannot re-initialize CUDA in
    # forked subprocess", seen on the H200). NVML answers the same question
    # without it. The variable is read per call, and removed again: the agent's
    # environment, which requests are compared with, stays as it was given.
    nvml_check = "PYTORCH_NVML_BASED_CUDA_CHECK" not in os.environ
    if nvml_check:
        os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
    try:
        for name in PRELOAD:
            try:
                importlib.import_module(name)
            except ImportError as exc:  # triton on a CPU node, a module this torch lacks
                skipped.append(f"{name} ({exc})")
    finally:
        if nvml_check:
            del os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"]
    return {"preload_s": time.perf_counter() - t0, "skipped": skipped}


def fork_probe() -> str | None:
    """Fork once and ask the child whether torch would let it use CUDA: None if
    yes (or no CUDA build), else why not."""
    import torch

    pid = os.fork()
    if pid == 0:
        os._exit(1 if torch.cuda._is_in_bad_fork() else 0)
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        return ("torch marked forks of the agent unable to use CUDA (an import queried "
                "the CUDA driver): forked children could not use the GPU")
    return None


def native_threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return -1


def fork_state() -> dict[str, Any]:
    import torch

    return {"threads": threading.active_count(), "native_threads": native_threads(),
            "cuda_initialized": bool(torch.cuda.is_initialized())}


def check_forkable(state: dict[str, Any]) -> None:
    # A fork copies only the calling thread: a lock another thread holds stays
    # held in the child forever; and a CUDA context does not survive a fork.
    if state["threads"] != 1:
        names = ", ".join(t.name for t in threading.enumerate())
        raise Refused(f"the agent has {state['threads']} threads ({names}); it forks only "
                      "with one: restart it")
    if state["cuda_initialized"]:
        raise Refused("CUDA is initialized in the agent; a forked child could not use it: "
                      "restart it")


def same_interpreter(exe: str, env: dict[str, str], cwd: str) -> bool:
    found = exe if "/" in exe else shutil.which(exe, path=env.get("PATH", os.defpath))
    if not found:
        return False
    cand = os.path.abspath(os.path.join(cwd, found))
    mine = os.path.abspath(sys.executable)
    # python and python3 of one venv: the same binary, the same prefix.
    return cand == mine or (os.path.dirname(cand) == os.path.dirname(mine)
                            and os.path.realpath(cand) == os.path.realpath(mine))


def parse_command(argv: list[str], env: dict[str, str], cwd: str) -> Command:
    if not argv or not same_interpreter(argv[0], env, cwd):
        raise Refused(f"{argv[0] if argv else '(nothing)'} is not this agent's interpreter "
                      f"({sys.executable})")
    unbuffered = bool(env.get("PYTHONUNBUFFERED"))
    rest = argv[1:]
    while rest and rest[0].startswith("-") and rest[0] != "-":
        opt = rest.pop(0)
        if opt == "-u":
            unbuffered = True
        elif opt == "-m" and rest:
            return Command(None, rest[0], rest[1:], unbuffered)
        elif opt.startswith("-m") and len(opt) > 2:
            return Command(None, opt[2:], rest, unbuffered)
        elif opt == "-c" and rest:
            return Command(None, None, rest[1:], unbuffered, code=rest[0])
        elif opt.startswith("-c") and len(opt) > 2:
            return Command(None, None, rest, unbuffered, code=opt[2:])
        else:
            raise Refused(f"python option {opt} is not supported under the agent")
    if not rest or rest[0] == "-":
        raise Refused("no script (an interactive or stdin session is not supported)")
    path = os.path.join(cwd, rest[0])
    if not os.path.isfile(path):
        raise Refused(f"no script file {rest[0]} in {cwd}")
    return Command(rest[0], None, rest[1:], unbuffered)


def check_env(env: dict[str, str], base: dict[str, str]) -> None:
    mine, theirs = import_time_env(base), import_time_env(env)
    differ = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
    if differ:
        raise Refused(f"{', '.join(differ[:5])} differ from the agent's, and torch read them "
                      "when the agent imported it: start an agent with them")


# --- the agent --------------------------------------------------------------------


@dataclass
class Child:
    pid: int
    conn: socket.socket | None
    buf: bytearray = field(default_factory=bytearray)


class Agent:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.env = dict(os.environ)
        self.base_path = self._base_path()
        self.children: dict[int, Child] = {}
        self.by_conn: dict[int, Child] = {}
        self.stopping = False
        self.sel = selectors.DefaultSelector()
        self.started = time.time()

    def _base_path(self) -> list[str]:
        # The agent's sys.path less its own first entry and PYTHONPATH's.
        own = {os.path.abspath(p) for p in self.env.get("PYTHONPATH", "").split(os.pathsep) if p}
        return [p for p in sys.path[1:] if os.path.abspath(p) not in own]

    def listen(self) -> socket.socket:
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        if self.path.exists():
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                probe.connect(str(self.path))
                raise SystemExit(f"farm agent: another agent listens at {self.path}")
            except (ConnectionRefusedError, FileNotFoundError):
                self.path.unlink(missing_ok=True)  # a dead agent's socket
            finally:
                probe.close()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)  # 0600 from the start, no window for another uid
        try:
            sock.bind(str(self.path))
        finally:
            os.umask(old)
        os.chmod(self.path, 0o600)
        sock.listen(64)
        sock.setblocking(False)
        return sock

    def serve(self, listener: socket.socket, *, ready: dict[str, Any]) -> int:
        rfd, wfd = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.set_wakeup_fd(wfd, warn_on_full_buffer=False)

        def stop(_signum: int, _frame: Any) -> None:
            self.stopping = True

        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
        self.sel.register(listener, selectors.EVENT_READ, "listen")
        self.sel.register(rfd, selectors.EVENT_READ, "wakeup")
        self.listener: socket.socket | None = listener
        self.wakeup = (rfd, wfd)
        log(f"listening at {self.path} (pid {os.getpid()}): " + json.dumps(ready))
        while True:
            if self.stopping and self.listener is not None:
                # Finish the running children; take no new ones.
                self.sel.unregister(self.listener)
                self.listener.close()
                self.listener = None
                self.path.unlink(missing_ok=True)
                log("stopping: no new runs")
            if self.stopping and not self.children:
                return 0
            for key, _ in self.sel.select(timeout=1.0):
                if key.data == "listen":
                    self._accept()
                elif key.data == "wakeup":
                    with contextlib.suppress(BlockingIOError):
                        os.read(rfd, 512)
                else:
                    self._from_client(key.data)
            self._reap()

    def _accept(self) -> None:
        assert self.listener is not None
        try:
            conn, _ = self.listener.accept()
        except BlockingIOError:
            return
        try:
            conn.settimeout(10)  # a slow client holds the agent only this long
            self._handle(conn)
        except Refused as exc:
            # In the agent's log too: the client runs the command itself,
            # slower, and an operator looking at a slow node looks here.
            log(f"refused a request: {exc}")
            self._answer_and_close(conn, {"refused": str(exc)})
        except (OSError, ValueError) as exc:
            log(f"a request failed: {exc}")
            conn.close()

    def _answer_and_close(self, conn: socket.socket, msg: dict[str, Any]) -> None:
        with contextlib.suppress(OSError):
            send_message(conn, msg)
        conn.close()

    def _handle(self, conn: socket.socket) -> None:
        pid, uid, _gid = struct.unpack("3i", conn.getsockopt(
            socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
        head = b""
        fds: list[int] = []
        while len(head) < HEADER.size:
            data, more, _flags, _addr = socket.recv_fds(conn, HEADER.size - len(head), 3)
            if not data:
                raise ValueError("the client closed before its request")
            head += data
            fds += more
        try:
            (size,) = HEADER.unpack(head)
            if size > MAX_REQUEST:
                raise Refused(f"request of {size} bytes is too large")
            body = b""
            while len(body) < size:
                chunk = conn.recv(size - len(body))
                if not chunk:
                    raise ValueError("the client closed mid-request")
                body += chunk
            # Checked once the request is read: a refusal the client can read
            # (closing on an unread request would reset its connection).
            check_peer(uid)
            req = json.loads(body)
            if req.get("op") == "status":
                self._answer_and_close(conn, {**fork_state(), "pid": os.getpid(),
                                              "uptime_s": time.time() - self.started,
                                              "running": len(self.children)})
                return
            if len(fds) != 3:
                raise Refused(f"expected the client's stdin, stdout and stderr, got {len(fds)} fds")
            cmd = parse_command(list(req["argv"]), dict(req["env"]), str(req["cwd"]))
            check_env(dict(req["env"]), self.env)
            state = fork_state()
            check_forkable(state)
            sys.stdout.flush()
            sys.stderr.flush()
            child = os.fork()
            if child == 0:
                close = [conn.fileno(), self.wakeup[0], self.wakeup[1], self.sel.fileno(),
                         *(c.conn.fileno() for c in self.children.values() if c.conn)]
                if self.listener is not None:
                    close.append(self.listener.fileno())
                child_main(cmd, req, fds, close, self.base_path)
        finally:
            for fd in fds:
                os.close(fd)
        conn.settimeout(None)
        conn.setblocking(False)
        entry = Child(child, conn)
        self.children[child] = entry
        self.by_conn[conn.fileno()] = entry
        self.sel.register(conn, selectors.EVENT_READ, entry)
        conn.setblocking(True)
        send_message(conn, {"started": child, "peer_pid": pid, **state})
        conn.setblocking(False)

    def _from_client(self, entry: Child) -> None:
        assert entry.conn is not None
        try:
            data = entry.conn.recv(4096)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            # The client is gone: as a terminal's hangup would.
            self._drop_conn(entry)
            self._signal(entry, signal.SIGHUP)
            return
        for msg in read_messages(entry.buf, data):
            if "signal" in msg:
                self._signal(entry, int(msg["signal"]))

    def _signal(self, entry: Child, signum: int) -> None:
        if entry.pid in self.children:  # not reaped: the pid is still the child's
            with contextlib.suppress(ProcessLookupError):
                os.killpg(entry.pid, signum)

    def _drop_conn(self, entry: Child) -> None:
        if entry.conn is not None:
            self.sel.unregister(entry.conn)
            self.by_conn.pop(entry.conn.fileno(), None)
            entry.conn.close()
            entry.conn = None

    def _reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            entry = self.children.pop(pid, None)
            if entry is None:
                continue
            code = os.waitstatus_to_exitcode(status)
            msg = {"signal": -code} if code < 0 else {"exit": code}
            if entry.conn is not None:
                conn = entry.conn
                self._drop_conn_keep_open(entry)
                conn.setblocking(True)
                self._answer_and_close(conn, msg)

    def _drop_conn_keep_open(self, entry: Child) -> None:
        assert entry.conn is not None
        self.sel.unregister(entry.conn)
        self.by_conn.pop(entry.conn.fileno(), None)
        entry.conn = None


def check_peer(uid: int) -> None:
    if uid != os.getuid():
        raise Refused(f"uid {uid} is not the agent's ({os.getuid()}); run your own agent")


def request_status(path: Path) -> dict[str, Any]:
    """The agent's state (threads, CUDA) without running anything."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(str(path))
        body = json.dumps({"op": "status"}).encode()
        sock.sendall(HEADER.pack(len(body)) + body)
        buf = bytearray()
        while True:
            data = sock.recv(65536)
            if not data:
                raise ConnectionError("the agent closed without a status")
            msgs = read_messages(buf, data)
            if msgs:
                return msgs[0]
    finally:
        sock.close()


def main(argv: list[str] | None = None, *, socket_path: Path | None = None) -> int:
    if argv is not None:
        import argparse

        ap = argparse.ArgumentParser(prog="farm agent", description=__doc__.split("\n\n")[0])
        ap.add_argument("--socket", type=Path, default=None)
        socket_path = ap.parse_args(argv).socket
    path = socket_path or default_socket()
    t0 = time.time()
    # Python 3.12 warns at each fork of a process with more OS threads than
    # one; here those are OpenBLAS's pool, which its atfork handlers stop
    # (see the module docstring). Python threads are checked before each fork.
    import warnings

    FRESH_WARNING_FILTERS[:] = warnings.filters
    warnings.filterwarnings("ignore", message=r"This process \(pid=\d+\) is multi-threaded",
                            category=DeprecationWarning)
    info = preload()
    agent = Agent(path)
    listener = agent.listen()
    state = fork_state()
    state["fork_cuda_ok"] = (bad := fork_probe()) is None
    ready = {"start_s": round(time.time() - t0, 3), "preload_s": round(info["preload_s"], 3),
             "skipped": info["skipped"], **state}
    try:
        check_forkable(state)
        if bad:
            raise Refused(bad)
    except Refused as exc:
        log(f"cannot serve: {exc}")
        listener.close()
        path.unlink(missing_ok=True)
        return 1
    return agent.serve(listener, ready=ready)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
