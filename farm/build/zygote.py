"""A warm start for sandboxed build children: a process that has already
imported torch, Dynamo and Inductor forks each child instead of a new
interpreter importing them again.

Why: every trace, compile and verify child started as a new ``python`` that
spent its first 5-8 s (on 2 cores) importing torch, Dynamo and Inductor
before any model code ran; a small CPU build is about 24 s of child CPU, of
which 7-15 s were those imports (``bench/build_phases.py``).

How it stays isolated. The zygote runs in a bubblewrap sandbox of its own,
built exactly as a build child's (``farm.build.isolation``: its own user, pid,
net, mount, ipc and uts namespaces, the sandbox uid, no capabilities, the
read-only system), with one writable directory, the *slot* (``slot_root``),
private to this worker process. A build that runs through it keeps
everything it touches under the slot: its build directory, its payload, a
copy of its code pack. And one build runs at a time; between two children:

- nothing else may be alive in the sandbox but the zygote (a model that left
  a process behind, a daemon, a stopped child: the whole sandbox is killed
  and the next child starts a new one);
- its ``/tmp`` and ``/dev/shm`` are emptied, and the worker removes the
  build's files from the slot;
- the zygote is not dumpable (``PR_SET_DUMPABLE`` 0): a child of the same
  uid can neither ptrace it nor read its memory or environment;
- a time-out or memory-out kills the sandbox, not only the child.

The zygote itself never runs model code and reads nothing but its requests
from the worker's pipe. What a forked child shares with it: the imported
modules and their import-time state. torch's configs read some environment
variables when imported (``farm.core.import_env``), so the worker keeps one
zygote per set of those values (and per set of preloaded modules: a trace
worker's leaves Inductor out), and a child whose values have no zygote
starts one. The child's environment, working directory, ``sys.path``,
signal handlers and random seeds are set as a fresh process has them.

``FARM_BUILD_ZYGOTE=off`` starts every child as a new interpreter, as before;
a zygote that fails to start, or any path of a child outside the slot,
does the same for that child.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import json
import logging
import os
import select
import shutil
import signal as signal_mod
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from farm.build import stage_times
from farm.build.stage_times import describe
from farm.build.steps import TRACE_STEP
from farm.core import isa_checks

log = logging.getLogger(__name__)

# What a zygote imports before it serves: what its children import before
# running model code. A trace child needs torch and Dynamo, a compile or
# verify child Inductor too; a trace worker's zygote leaves Inductor out
# (3.7 against 5.4 CPU-s of imports on 2 cores, for each zygote a trace
# worker starts). The set is part of the zygote's key, so a build child never
# forks from a zygote without Inductor.
_TRACE_PRELOAD = (
    "torch",
    "torch._dynamo",
    "farm.build.sandbox",
    "farm.build.steps",
    "farm.build.trace",
)
PRELOADS: dict[str, tuple[str, ...]] = {
    "trace": _TRACE_PRELOAD,
    "build": (*_TRACE_PRELOAD, "torch._inductor.compile_fx", "farm.build.compile",
              "farm.build.verify"),
}
# Imported where present (Triton on a CUDA host): a missing one is no failure.
OPTIONAL_PRELOADS: dict[str, tuple[str, ...]] = {
    "trace": (),
    "build": ("triton", "torch._inductor.runtime.triton_heuristics"),
}


def preload_for(target: str) -> str:
    """The preload set (a key of ``PRELOADS``) a child running ``target`` needs."""
    return "trace" if target == TRACE_STEP else "build"


# The C++ compiler Inductor's config reads from CXX/CC when imported.
# PATH too: a zygote's sandbox mounts what its PATH needs (a verify child's
# compiler-free directory), and a child must find its own PATH's entries.
# ATen's capability: a build zygote answers Inductor's ISA pick before it
# serves (_warm_answers), and the pick folds it in.
# FARM_ISA_CHECKS: the zygote answers Inductor's ISA pick with it at its start.
_IMPORT_TIME_EXTRA = ("CC", "CXX", "CPP", "PATH", "ATEN_CPU_CAPABILITY", "FARM_ISA_CHECKS")
_START_TIMEOUT_S = 300.0
_REPLY_TIMEOUT_S = 30.0
_MAX_ZYGOTES = 3


def slot_root() -> Path:
    """This worker process's slot: the one writable directory its zygotes see.
    Removed when this process exits (its zygotes stopped first)."""
    pid = os.getpid()
    root = Path(tempfile.gettempdir()) / f"farm-slot-{pid}"
    root.mkdir(mode=0o711, exist_ok=True)
    if pid not in _SLOT_CLEANUP:
        _SLOT_CLEANUP.add(pid)
        atexit.register(_remove_slot, root, pid)
    return root


# The pids whose slot is removed at exit: a forked child inherits the
# parent's atexit handlers, and must not remove the parent's slot.
_SLOT_CLEANUP: set[int] = set()


def _remove_slot(root: Path, pid: int) -> None:
    if os.getpid() != pid:
        return
    with contextlib.suppress(Exception):
        ZYGOTES.stop_all()
    shutil.rmtree(root, ignore_errors=True)


def work_dir() -> str | None:
    """Where a build keeps its files (``tempfile``'s ``dir``): in the slot when
    zygotes are on, so its children can be forked (None: the default)."""
    return str(slot_root()) if enabled() else None


def warm_up_enabled() -> bool:
    """``FARM_ZYGOTE_WARM_UP``: a zygote compiles a sample before it serves
    (``warm_up_compiler``)."""
    from farm.core.settings import get_settings

    return bool(get_settings().farm_zygote_warm_up)


def enabled() -> bool:
    """``FARM_BUILD_ZYGOTE`` is on. GPU hosts too: a zygote imports with
    torch's NVML-based CUDA check (as the node agent does,
    ``farm.node.agent.preload``), so no import starts the CUDA driver, and it
    proves that before it serves (``_cuda_fork_safe``: CUDA not initialised,
    and a forked child that torch would let use CUDA); one that cannot is
    not used, and its children start fresh."""
    from farm.core.settings import get_settings

    return str(getattr(get_settings(), "farm_build_zygote", "on")).lower() not in (
        "off", "0", "false", "no")


def under(path: str | Path, root: Path) -> bool:
    p = Path(path).resolve()
    return p == root or root in p.parents


class ZygoteFailed(RuntimeError):
    """The zygote could not run this child; the caller starts a fresh process."""


@dataclass
class _Child:
    """What ``farm.build.watchdog.watch`` needs of a process: the forked
    child, seen from the worker, with its end reported by the zygote."""

    zygote: Zygote
    pid: int
    returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.zygote._read_end(self, timeout=0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired("zygote child", timeout or 0.0)
            if not self.zygote.alive():
                # The sandbox died (killed by the watchdog, or by the child):
                # the child went with it.
                self.returncode = -signal_mod.SIGKILL
                break
            self.zygote._read_end(self, timeout=0.05)
        assert self.returncode is not None
        return self.returncode


@dataclass
class Zygote:
    """One sandboxed zygote (``start``), serving one child at a time (``fork``)."""

    env: dict[str, str]
    uid: int
    memory_mb: float
    slot: Path
    preload: str = "build"
    proc: subprocess.Popen[bytes] | None = None
    host_pid: int = 0
    dirty: bool = False
    state: Path | None = None
    lease: Any = None  # farm.build.uid_slots.Lease, while started
    # Its start: the worker's seconds from launch to its answer, and the
    # zygote's own split of them (kept_phases).
    start_s: float = 0.0
    start_phases: dict[str, float] = field(default_factory=dict)
    # Children forked so far: the first one waited for the start.
    served: int = 0
    _buf: bytes = b""

    def start(self) -> None:
        from farm.build import uid_slots
        from farm.build.child_env import sandbox_user
        from farm.build.isolation import Isolation, bwrap_argv

        # A uid of its own for the zygote's life (farm.build.uid_slots): its
        # children's process limit is not another build's.
        self.lease = uid_slots.take()
        self.uid = self.lease.uid

        self.state = Path(tempfile.mkdtemp(prefix="zygote-", dir=self.slot))
        env = {**self.env, **sandbox_user(self.state)}
        cmd = bwrap_argv([sys.executable, "-m", "farm.build.zygote", str(self.slot),
                           self.preload, "warm" if warm_up_enabled() else "cold"],
                          isolation=Isolation(writable=(str(self.slot),), uid=self.uid),
                          tmpdir=self.state, readonly=(), env=env, cwd=None,
                          memory_mb=self.memory_mb)
        if os.geteuid() == 0:
            # bwrap_argv gave the slot to the sandbox uid, as it does a build
            # directory: take the slot itself back (children may pass through
            # it, not list it or add to it); what is under it stays theirs.
            os.chown(self.slot, 0, 0)
            os.chmod(self.slot, 0o711)
        with open(self.state / "zygote.log", "wb") as err:
            try:
                self.proc = subprocess.Popen(cmd.argv, stdin=subprocess.PIPE,
                                             stdout=subprocess.PIPE, stderr=err, env=env,
                                             pass_fds=cmd.pass_fds, start_new_session=True)
            finally:
                cmd.close()
        t0 = time.monotonic()
        ready = self._reply(_START_TIMEOUT_S)
        # Where the start went, for the log of the build that waited for it:
        # on a GPU host it was most of a first build (docs/benchmarks.md).
        self.start_s = round(time.monotonic() - t0, 3)
        self.start_phases = kept_phases(ready.get("phases"), total_s=self.start_s)
        log.info("build zygote (%s) answered in %.1f s: %s", self.preload, self.start_s,
                 describe(self.start_phases))
        if not ready.get("ready"):
            raise ZygoteFailed(f"zygote did not start: {ready}")
        import psutil

        for p in psutil.Process(self.proc.pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                if "farm.build.zygote" in p.cmdline():
                    self.host_pid = p.pid
        if not self.host_pid:
            raise ZygoteFailed("zygote process not found in its sandbox")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal_mod.SIGKILL)
            with contextlib.suppress(Exception):
                self.proc.kill()
                self.proc.wait(timeout=10)
            for f in (self.proc.stdin, self.proc.stdout):
                with contextlib.suppress(Exception):
                    f.close()  # type: ignore[union-attr]
        if self.state is not None:
            shutil.rmtree(self.state, ignore_errors=True)
        if self.lease is not None:
            self.lease.release()
            self.lease = None

    def _send(self, msg: Mapping[str, Any]) -> None:
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(dict(msg)).encode() + b"\n")
        self.proc.stdin.flush()

    def _line(self, timeout: float) -> bytes | None:
        assert self.proc is not None and self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([fd], [], [], max(0.0, left))
            if not ready:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                raise ZygoteFailed("the zygote exited")
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return line

    def _reply(self, timeout: float) -> dict[str, Any]:
        line = self._line(timeout)
        if line is None:
            raise ZygoteFailed(f"no answer from the zygote within {timeout:.0f} s")
        return dict(json.loads(line))

    def _read_end(self, child: _Child, *, timeout: float) -> None:
        try:
            line = self._line(timeout)
        except (ZygoteFailed, OSError, ValueError):
            child.returncode = -signal_mod.SIGKILL
            self.dirty = True
            return
        if line is None:
            return
        status = int(json.loads(line)["status"])
        child.returncode = (-os.WTERMSIG(status) if os.WIFSIGNALED(status)
                            else os.WEXITSTATUS(status))

    def settle(self) -> None:
        """After a child's end: the zygote's word on its sandbox (what
        outlived the child, whether it could clean up), which it sends once
        its helpers' grace and the wipe are over. Anything but a clean
        sandbox, or no word in time, and it serves no other child."""
        try:
            line = self._line(_LEFTOVER_GRACE_S + _REPLY_TIMEOUT_S)
            end = json.loads(line) if line is not None else {}
        except (ZygoteFailed, OSError, ValueError):
            end = {}
        if end.get("leftovers") or end.get("clean") is not True:
            # A process outlived the child, or the zygote could not clean up:
            # this sandbox serves no other child.
            log.warning("build sandbox: %s after the child; starting a new zygote",
                        f"{end['leftovers']} left" if end.get("leftovers") else "not clean")
            self.dirty = True

    def fork(self, request: Mapping[str, Any]) -> _Child:
        self.served += 1
        self._send(request)
        answer = self._reply(_REPLY_TIMEOUT_S)
        if "pid" not in answer:
            raise ZygoteFailed(f"the zygote refused the child: {answer}")
        import psutil

        kids = [p.pid for p in psutil.Process(self.host_pid).children()]
        if len(kids) != 1:
            # The child ended already (or something else is there): read its end.
            child = _Child(self, pid=kids[0] if kids else 0)
            if not kids:
                child.wait(timeout=_REPLY_TIMEOUT_S)
            return child
        return _Child(self, pid=kids[0])


def zygote_key(env: Mapping[str, str], *, uid: int, memory_mb: float,
               preload: str = "build") -> str:
    """Which zygote a child with ``env`` forks from: children with one key
    share one. What the zygote's imports read from the environment
    (``farm.core.import_env``, and ``_IMPORT_TIME_EXTRA``), what it imports
    (``PRELOADS``), its sandbox user and its memory limit."""
    from farm.core.import_env import import_time_env

    return hashlib.sha256(json.dumps(
        [sorted(import_time_env(env, extra=_IMPORT_TIME_EXTRA).items()), uid, memory_mb,
         preload],
    ).encode()).hexdigest()


class Zygotes:
    """This worker process's zygotes, one per import-time environment."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # One child at a time in this process's slot, whichever zygote runs it:
        # two builds in one slot could read each other's files.
        self.busy = threading.Lock()
        self._by_key: dict[str, Zygote] = {}
        self.disabled = False

    def take(self, env: Mapping[str, str], *, uid: int, memory_mb: float,
             preload: str = "build") -> Zygote | None:
        """A started zygote for ``env`` that has imported ``PRELOADS[preload]``,
        locked for the caller; None when every one that fits is busy (the
        caller starts a fresh process)."""
        key = zygote_key(env, uid=uid, memory_mb=memory_mb, preload=preload)
        if self.disabled or not self.busy.acquire(blocking=False):
            return None
        with self._lock:
            z = self._by_key.get(key)
            if z is not None and (z.dirty or not z.alive()):
                z.stop()
                z = None
            if z is None:
                while len(self._by_key) >= _MAX_ZYGOTES:
                    _, old = self._by_key.popitem()
                    old.stop()
                z = Zygote(env=dict(env), uid=uid, memory_mb=memory_mb, slot=slot_root(),
                           preload=preload)
                self._by_key[key] = z
        if z.proc is None:
            try:
                z.start()
            except Exception as exc:
                log.warning("build zygote did not start (%s): children start fresh", exc)
                z.dirty = True
                self.busy.release()
                return None
        return z

    def release(self) -> None:
        self.busy.release()

    def disable(self) -> None:
        """No more zygotes in this process (a GPU host where a forked child
        could not use CUDA after all): every child starts fresh."""
        self.disabled = True
        self.stop_all()

    def stop_all(self) -> None:
        with self._lock:
            for z in self._by_key.values():
                z.stop()
            self._by_key.clear()


ZYGOTES = Zygotes()


# --- inside the sandbox ----------------------------------------------------------


# The pipe to the worker: a duplicate of the zygote's first stdout, which then
# goes to its log like stderr (nothing a library prints can reach the worker
# as an answer). Closed in every child.
_PROTO_FD = -1


def _write(msg: Mapping[str, Any]) -> None:
    os.write(_PROTO_FD, json.dumps(dict(msg)).encode() + b"\n")


# How long a child's own helpers may take to go after it (Inductor's compile
# pool exits when its parent does, within a second; the child also ends its
# descendants itself, farm.build.sandbox.child_main) before they count as left
# behind and the sandbox is thrown away.
_LEFTOVER_GRACE_S = 2.0


def _others_after_grace() -> list[int]:
    deadline = time.monotonic() + _LEFTOVER_GRACE_S
    left = _others()
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = _others()
    return left


def _others() -> list[int]:
    me = os.getpid()
    return [int(p) for p in os.listdir("/proc")
            if p.isdigit() and int(p) not in (1, me)]


def _mount_points() -> set[str]:
    """Every mount point in this sandbox (bubblewrap puts a bind's missing
    parent directories on the private /tmp: a checkout or a venv under /tmp)."""
    points = set()
    with contextlib.suppress(OSError), open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            if len(fields) > 4:
                points.add(fields[4].replace("\\040", " "))
    return points


def _wipe(top: str, keep: set[str]) -> bool:
    """Empty ``top`` but for mount points and the directories that lead to one."""
    ok = True
    with contextlib.suppress(FileNotFoundError):
        for name in os.listdir(top):
            p = os.path.join(top, name)
            if p in keep:
                continue
            if any(k.startswith(p + "/") for k in keep):
                if not _wipe(p, keep):
                    ok = False
                continue
            try:
                if os.path.isdir(p) and not os.path.islink(p):
                    for d, _, _ in os.walk(p):
                        with contextlib.suppress(OSError):
                            os.chmod(d, 0o700)
                    shutil.rmtree(p)
                else:
                    os.unlink(p)
            except OSError as exc:
                print(f"zygote: cannot remove {p}: {exc}", file=sys.stderr, flush=True)
                ok = False
    return ok


def _child(req: dict[str, Any]) -> None:
    code = 70
    try:
        os.close(_PROTO_FD)
        os.setsid()
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        for fd, name in ((1, "stdout"), (2, "stderr")):
            out = os.open(req[name], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.dup2(out, fd)
            os.close(out)
        os.close(null)
        for sig in (signal_mod.SIGTERM, signal_mod.SIGINT, signal_mod.SIGHUP,
                    signal_mod.SIGCHLD):
            signal_mod.signal(sig, signal_mod.SIG_DFL)
        os.environ.clear()
        os.environ.update(req["env"])
        os.chdir(req["cwd"])
        sys.path[:0] = list(req["paths"])
        sys.argv = [req["argv0"], req["target"], req["tmpdir"], "isolated"]
        # As a fresh process has them: its own random seeds, the farm's
        # settings read again from this child's environment.
        from farm.build.sandbox import child_main
        from farm.node.agent_child import fresh_farm, reseed

        reseed()
        fresh_farm()

        code = child_main([req["target"], req["tmpdir"], "isolated"])
    except BaseException:
        import traceback

        with contextlib.suppress(Exception):
            traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _warm_answers(slot: str, *, warm: bool) -> None:
    """Answer, once per zygote, what every compile child asks before its first
    kernel and what depends only on this zygote's key (its import-time
    environment: the compiler, ATen's capability, Inductor's ISA settings):
    Inductor's vector ISA pick (``pick_vec_isa``, cached for the process;
    it test-compiles a program per candidate, 2-7 s of every compile child
    on 2 cores). Its probe builds go to a directory of the zygote's own,
    emptied with ``/tmp`` before the first child; a failure leaves the
    children to ask themselves, as before. On a GPU host too: CUDA builds
    of AOTI packages ask for it (``AotCodeCompiler.compile``,
    ``get_device_information``), there it took 33.5 of a zygote's 49.6 s
    start on an H100 host, and each child would pay it again."""
    with _scratch_inductor_cache(), stage_times.stage("ISA pick"):
        try:
            from torch._inductor.cpu_vec_isa import pick_vec_isa

            # The test compiles this machine's worker recorded are answered
            # from its record; only others compile (farm.core.isa_checks).
            isa_checks.replay_from_env()
            pick_vec_isa()
        except Exception as exc:  # the children ask again
            print(f"zygote: Inductor's ISA pick failed here ({exc}); children pick",
                  file=sys.stderr, flush=True)
    _warm_compile(slot, backend="inductor", warm=warm)


def _warm_compile(slot: str, *, backend: str, warm: bool) -> None:
    """``warm_up_compiler`` before serving, where ``FARM_ZYGOTE_WARM_UP``
    asks for it; what the zygote wrote for itself goes with ``/tmp``."""
    if warm:
        with stage_times.stage("warm-up compile"):
            warm_up_compiler(backend)
    _wipe("/tmp", _mount_points() | {slot})


# What a zygote may report of its start (main), in order.
START_PHASES = ("imports", "optional imports", "precompiled headers", "ISA pick",
                "warm-up compile", "CUDA fork check")


def kept_phases(reported: Any, *, total_s: float) -> dict[str, float]:
    """What the worker keeps of a zygote's account of its start
    (``stage_times.kept``: known phases, within the start it measured; the
    zygote runs no model code, but its answer still comes from a sandbox)."""
    return stage_times.kept(reported, START_PHASES, limit_s=total_s)


def warm_up_compiler(backend: str = "inductor") -> None:
    """Compile a small sample once, on CPU: what every child's first compile
    paid on top of its model's (Dynamo's, AOTAutograd's and Inductor's lazy
    imports and first-use tables): 1.1 of a 16-layer Llama's 3.0 s of Dynamo
    on 2 cores (docs/benchmarks.md). Dynamo's caches are reset afterwards, so
    a child starts with none of the sample's code, and the process keeps one
    thread. A failure leaves the children to pay it.

    Not where this process can see a CUDA device: Dynamo saves and restores
    the CUDA RNG state around every frame it converts
    (``convert_frame.preserve_global_state`` calls ``torch.cuda.get_rng_state``
    whenever ``torch.cuda.is_available()``), which starts CUDA, and torch then
    refuses CUDA in every fork: the zygote would serve nobody (measured on an
    H100 host: "CUDA was initialised by an import", children started fresh).
    The question itself is NVML's there (``main`` sets
    ``PYTORCH_NVML_BASED_CUDA_CHECK``), so asking starts nothing."""
    import torch

    if torch.cuda.is_available():
        print("zygote: no warm-up compile on a host with a CUDA device (Dynamo would "
              "start CUDA, and no fork could use it)", file=sys.stderr, flush=True)
        return
    with _scratch_inductor_cache():
        try:
            sample = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(),
                                         torch.nn.LayerNorm(8))
            # One compile thread: a pool's threads would outlive the warm-up,
            # and a zygote with a second thread serves nobody (main).
            with torch._inductor.config.patch(compile_threads=1):
                torch.compile(sample, backend=backend, fullgraph=True)(torch.randn(2, 8))
        except Exception as exc:  # the children pay it
            print(f"zygote: the warm-up compile failed here ({exc})", file=sys.stderr,
                  flush=True)
        finally:
            with contextlib.suppress(Exception):
                torch._dynamo.reset()
                # Its cache misses and graph counts are not a child's.
                torch._dynamo.utils.counters.clear()
            _stop_tqdm_monitor()


@contextlib.contextmanager
def _scratch_inductor_cache() -> Iterator[None]:
    """``TORCHINDUCTOR_CACHE_DIR`` pointed at a new directory of this
    process's own while the zygote compiles for itself (its files go with
    ``/tmp``), and back as it was after."""
    saved = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="zygote-warm-")
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = saved


def _stop_tqdm_monitor() -> None:
    """Inductor's compile shows a tqdm bar, and tqdm starts a monitor thread
    for it; a fork copies only the calling thread, so the zygote stops it (a
    child's own bar starts its own)."""
    tqdm_mod = sys.modules.get("tqdm")
    monitor = getattr(getattr(tqdm_mod, "tqdm", None), "monitor", None)
    if monitor is not None:
        with contextlib.suppress(Exception):
            monitor.exit()
        tqdm_mod.tqdm.monitor = None  # type: ignore[union-attr]


def _cuda_fork_safe() -> str | None:
    """None when a forked child may use CUDA as a fresh process would (or
    this torch has no CUDA); else why not. A zygote that fails this serves
    nobody: its children start fresh."""
    import torch

    if not torch.version.cuda:
        return None
    if torch.cuda.is_initialized():
        return "CUDA was initialised by an import"
    pid = os.fork()
    if pid == 0:
        os._exit(1 if torch.cuda._is_in_bad_fork() else 0)
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        return "torch marks forks of this zygote unable to use CUDA"
    return None


def main() -> int:
    import ctypes
    import importlib

    global _PROTO_FD
    slot = sys.argv[1]
    which = sys.argv[2] if len(sys.argv) > 2 else "build"
    warm = (sys.argv[3] if len(sys.argv) > 3 else "warm") == "warm"
    preload = PRELOADS[which]
    _PROTO_FD = os.dup(1)
    os.dup2(2, 1)
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(4, 0)  # PR_SET_DUMPABLE, 0
    # Inductor's and cpp_extension's imports ask torch.cuda.is_available(); its
    # default answer (cudaGetDeviceCount) starts the CUDA driver, and torch then
    # refuses CUDA in every fork. NVML answers without it (as in the node
    # agent); the variable is gone again before any child runs.
    nvml_check = "PYTORCH_NVML_BASED_CUDA_CHECK" not in os.environ
    if nvml_check:
        os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
    stage_times.reset()  # the start's phases (START_PHASES); each child resets them too
    try:
        with stage_times.stage("imports"):
            for name in preload:
                importlib.import_module(name)
        with stage_times.stage("optional imports"):
            for name in OPTIONAL_PRELOADS.get(which, ()):
                with contextlib.suppress(ImportError):
                    importlib.import_module(name)
        if "farm.build.compile" in preload:
            # Its children inherit the hook (farm.build.pch); they install it
            # again, which changes nothing.
            from farm.core.precompiled_headers import install_from_env

            with stage_times.stage("precompiled headers"):
                install_from_env()
            _warm_answers(slot, warm=warm)
        else:
            _warm_compile(slot, backend="eager", warm=warm)
    finally:
        if nvml_check:
            os.environ.pop("PYTORCH_NVML_BASED_CUDA_CHECK", None)
    with stage_times.stage("CUDA fork check"):
        cuda_ok = _cuda_fork_safe()
    # One Python thread: a fork copies only the calling one. (numpy's OpenBLAS
    # starts a native pool when torch imports numpy; its own pthread_atfork
    # handlers stop it before a fork and the child starts its own, as in the
    # node agent, farm.node.agent.)
    threads = threading.active_count()
    _write({"ready": threads == 1 and cuda_ok is None, "threads": threads,
            "others": len(_others()), "cuda": cuda_ok or "fork-safe",
            "phases": stage_times.snapshot()})
    if threads != 1 or cuda_ok is not None:
        return 1
    stdin = os.fdopen(0, "rb", buffering=0)
    pending = b""
    while True:
        while b"\n" not in pending:
            chunk = stdin.read(65536)
            if not chunk:
                return 0
            pending += chunk
        line, _, pending = pending.partition(b"\n")
        req = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            stdin.close()
            _child(req)
        _write({"pid": pid})
        _, status = os.waitpid(pid, 0)
        # The child's end at once, its sandbox's state after: the grace for
        # its helpers and the wipe are not the child's time (a child ending
        # just inside its limit must not be timed out by them).
        _write({"status": status})
        left = _others_after_grace()
        keep = _mount_points() | {slot}
        clean = _wipe("/tmp", keep) and _wipe("/dev/shm", keep)
        _write({"leftovers": len(left), "clean": clean and not left})


if __name__ == "__main__":
    sys.exit(main())
