"""Run model code in a child process, under a time and a memory limit.

User model code (factories, forward methods) and torch's compilers run in a
fresh Python process started with ``python -m farm.build.sandbox``. The parent (a
Celery worker, a test) never imports the model, so a segfault, a leak or an
endless compile costs one child, not the worker.

- The call: ``"package.module:function"``, called with one JSON dict and
  returning a JSON-able value; both travel through files in a private temp dir
  (pipes would deadlock on large outputs and mix with the child's own prints).
- Time: a wall-clock limit; on expiry the whole process group is killed
  (SIGTERM, then SIGKILL), so the g++ and compile-pool grandchildren die too.
- Memory: a watchdog (``farm.build.watchdog``) samples the proportional set
  size of the child and all its descendants plus its tmpfs and kills the
  group above the limit (``BUILD_MEMORY_MB``; 0: ``farm.build.memory_budget``);
  where ``FARM_BUILD_CGROUP`` is set the kernel enforces it first
  (``farm.build.cgroup_limits``). ``RLIMIT_AS`` is not used:
  CUDA reserves far more virtual address space than it ever touches, so an
  address-space limit breaks every GPU child.
- Environment: the farm's credentials never reach model code
  (``farm.build.child_env``).
- Isolation (``Isolation``, what build children get; ``farm.build.isolation``
  writes bubblewrap's command line): the child runs under
  bubblewrap in its own user, pid, net, mount, ipc and uts namespaces, under
  a seccomp filter (``farm.build.syscall_filter``), as an unprivileged uid
  (when the worker is root: one of its own while it runs,
  ``farm.build.uid_slots``; the worker's own uid mapped to
  ``FARM_SANDBOX_UID`` otherwise). It
  sees a fresh ``/proc`` with only its own processes (the worker's
  ``/proc/<pid>/environ`` does not exist there), no network (a down
  loopback: PostgreSQL, Redis and S3 on 127.0.0.1 are unreachable), and a
  file system made of ``/usr``, the Python installation, the ``farm``
  package, the code pack and what it is given, all read-only except its
  build directory and a private, size-limited ``/tmp``; its environment is an
  allow-list. ``FARM_SANDBOX``: ``on`` (a worker refuses to start without
  bubblewrap and namespaces), ``auto`` (isolate when possible, else run as
  ``off`` with a warning: the embedded farm's default), ``off`` (development
  only: a warning at every build).
- Crashes: the child's exceptions come back as type, message and traceback; a
  fatal signal (abort, segfault) is reported by name, with ``faulthandler``'s
  Python stack in ``stderr_tail``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import json
import logging
import os
import shutil
import signal as signal_mod
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from farm.build import bytecode, cgroup_limits, memory_budget, stage_times, uid_slots, zygote
from farm.build.child_env import allowed_env, sandbox_user, scrubbed_env
from farm.build.crash_site import crash_site
from farm.build.isolation import (
    DEFAULT_SANDBOX_UID,
    NO_BWRAP,
    SANDBOX_MODES,
    Isolation,
    SandboxUnavailable,
    _chown_tree,
    bwrap_argv,
    farm_package_dir,
    setpriv,
    worker_pythonpath,
)
from farm.build.watchdog import Watch
from farm.build.watchdog import watch as watch_child
from farm.core import isa_checks
from farm.core.digests import sha256_file

log = logging.getLogger(__name__)

# What a child's crash, time-out or memory-out reports keep of its output.
TAIL_CHARS = 8000
_RESULT = "result.json"
_PAYLOAD = "payload.json"

# rlimits of an isolated child (besides RLIMIT_CORE=0 for every child).
ISOLATED_NPROC = 2048  # without _MAX_PROCS_ENV (BUILD_MAX_PROCS)
_MAX_PROCS_ENV = "SANDBOX_MAX_PROCS"
ISOLATED_FSIZE = 64 * 1024**3



@dataclass
class SandboxResult:
    ok: bool
    value: Any = None
    error_type: str | None = None  # qualified name of the child's exception
    error: str | None = None
    traceback: str | None = None
    exit_code: int | None = None  # None when a signal ended the child
    signal: str | None = None  # "SIGSEGV", "SIGABRT", "SIGKILL", ...
    timed_out: bool = False
    oom: bool = False
    stdout_tail: str = ""
    stderr_tail: str = ""
    wall_s: float = 0.0
    # The peak of what counted against the memory limit (PSS plus tmpfs, MB).
    peak_rss_mb: float = 0.0
    # The peak of the plain resident-set sum (torch's shared pages once per process).
    peak_rss_sum_mb: float = 0.0
    # Which limits applied, for the build log ("kernel: cgroup ..." or the watchdog).
    limits: str = ""
    # Where the child's seconds went (farm.build.stage_times): what the child
    # reported, kept only as far as the worker's checks allow (from_child),
    # with "child start" measured from the worker's request.
    stages: dict[str, float] = dataclasses.field(default_factory=dict)
    # Forked from a warm zygote (farm.build.zygote), not a new interpreter.
    warm: bool = False
    # The zygote's start, when this child was its first and waited for it:
    # "total" (the worker's seconds) and the zygote's own split of them.
    zygote_start: dict[str, float] = dataclasses.field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def crash_site(self) -> str | None:
        """Where a child that a signal ended was (its announced native phase,
        faulthandler's last Python frame): ``farm.build.crash_site``."""
        return crash_site(self.stderr_tail) if self.signal else None

    def describe(self) -> str:
        """One line saying how the child ended."""
        if self.ok:
            return f"ok in {self.wall_s:.1f} s, peak {self.peak_rss_mb:.0f} MB"
        if self.timed_out:
            return f"timed out after {self.wall_s:.0f} s"
        if self.oom:
            head = f"exceeded its memory limit ({self.peak_rss_mb:.0f} MB peak)"
            return f"{head}: {self.error}" if self.error else head
        if self.signal:
            where = self.crash_site()
            return f"crashed with {self.signal}" + (f" {where}" if where else "")
        if self.error_type:
            return f"{self.error_type}: {self.error}"
        return f"exited with code {self.exit_code}"


def run_isolated(
    target: str,
    payload: Mapping[str, Any],
    *,
    timeout_s: float,
    memory_mb: float,
    cwd: str | Path | None = None,
    env_extra: Mapping[str, str] | None = None,
    env: Mapping[str, str] | None = None,
    import_paths: Sequence[str | Path] = (),
    isolation: Isolation | None = None,
    warm: bool = True,
) -> SandboxResult:
    """Call ``target`` ("pkg.mod:function") with ``payload`` in a fresh process.

    ``env`` replaces the inherited environment (it is still scrubbed);
    ``env_extra`` is added after scrubbing. ``import_paths`` go first on the
    child's ``sys.path`` (unpacked code packs). With ``isolation`` the child
    runs in namespaces of its own (module docstring), forked from a warm zygote
    (``farm.build.zygote``) where one can run it and ``warm`` allows; without, it is only a
    process with a scrubbed environment. Never raises for anything the child
    does; raises ``ValueError`` for a malformed target and
    ``SandboxUnavailable`` when ``isolation`` is asked for and impossible.
    """
    if ":" not in target:
        raise ValueError(f"bad sandbox target {target!r}: expected 'package.module:function'")
    memory_mb = memory_budget.build_limit_mb(memory_mb) if memory_mb <= 0 else memory_mb
    child_env = scrubbed_env(env, env_extra)
    if isolation is not None:
        child_env = allowed_env(child_env, env_extra)
    # Inductor's parallel compile pool, sized to fit the limit (each worker is
    # a Python of its own), unless the caller chose.
    child_env.setdefault("TORCHINDUCTOR_COMPILE_THREADS",
                         str(memory_budget.compile_threads(memory_mb)))
    # This machine's compiled bytecode, where its Python keeps none
    # (farm.build.bytecode): read-only to the child.
    for key, value in bytecode.child_env().items():
        child_env.setdefault(key, value)
    # The child must import farm (and the target) the way this process does,
    # even when farm is not installed but only on sys.path (a source checkout).
    farm_root = str(farm_package_dir().parent)
    paths = [str(Path(p)) for p in import_paths]
    # An isolated child keeps the worker's own PYTHONPATH directories (mounted
    # read-only by farm.build.isolation), never the caller's relative ones.
    inherited = (worker_pythonpath() if isolation else [child_env.get("PYTHONPATH", "")])
    child_env["PYTHONPATH"] = os.pathsep.join(
        dict.fromkeys(p for p in (*paths, farm_root, *inherited) if p))
    child_env.setdefault("PYTHONFAULTHANDLER", "1")
    if isolation is not None:
        # Read and dropped by child_main: the farm's settings never reach model code.
        child_env[_MAX_PROCS_ENV] = str(_max_procs())
        # A zygote's children share its sandbox, so no cgroup of their own:
        # with kernel limits configured every child starts fresh.
        if warm and zygote.enabled() and cgroup_limits.configured() is None:
            forked = _run_in_zygote(target, payload, timeout_s=timeout_s, memory_mb=memory_mb,
                                    cwd=cwd, child_env=child_env, paths=paths,
                                    farm_root=farm_root, isolation=isolation)
            if forked is not None and not _cuda_refused_in_fork(forked):
                return forked
            if forked is not None:
                # A check the zygote passed and torch still refused: this
                # worker's builds start fresh from now on, this one again.
                log.warning("a forked build child could not use CUDA: children start fresh")
                zygote.ZYGOTES.disable()
    # A uid of its own while it runs (farm.build.uid_slots): its process limit
    # is its own, and no other build's processes share its uid.
    lease = uid_slots.take() if isolation is not None else None
    try:
        if lease is not None and isolation is not None:
            isolation = dataclasses.replace(isolation, uid=lease.uid)
        return _run_fresh(target, payload, timeout_s=timeout_s, memory_mb=memory_mb, cwd=cwd,
                          child_env=child_env, paths=paths, isolation=isolation)
    finally:
        if lease is not None:
            lease.release()


def _cuda_refused_in_fork(res: SandboxResult) -> bool:
    """torch refused CUDA in a forked child ("Cannot re-initialize CUDA in
    forked subprocess"): the child ran nothing of the model's on the GPU."""
    return (not res.ok and res.warm
            and "forked subprocess" in f"{res.error or ''}\n{res.stderr_tail}")


def _max_procs() -> int:
    from farm.core.settings import get_settings

    return int(get_settings().build_max_procs)


def _run_fresh(target: str, payload: Mapping[str, Any], *, timeout_s: float, memory_mb: float,
               cwd: str | Path | None, child_env: dict[str, str], paths: list[str],
               isolation: Isolation | None) -> SandboxResult:
    """``run_isolated`` in a new interpreter (under bubblewrap with ``isolation``)."""
    with tempfile.TemporaryDirectory(prefix="farm-sandbox-") as tmp:
        tmpdir = Path(tmp)
        (tmpdir / _PAYLOAD).write_text(json.dumps(dict(payload)))
        out_path, err_path = tmpdir / "stdout", tmpdir / "stderr"
        argv = [sys.executable, "-m", "farm.build.sandbox", target, str(tmpdir)]
        popen_cwd = str(cwd) if cwd else None
        pass_fds: tuple[int, ...] = ()
        cmd = None
        if isolation is None:
            argv.append(str(os.getpid()))
        else:
            argv.append("isolated")
            child_env.update(sandbox_user(tmpdir))
            cmd = bwrap_argv(argv, isolation=isolation, tmpdir=tmpdir,
                             readonly=(*paths, *isolation.readonly),
                             env=child_env, cwd=cwd, memory_mb=memory_mb)
            argv, pass_fds = cmd.argv, cmd.pass_fds
            popen_cwd = None
        cgroup_root = cgroup_limits.configured()
        cg = None
        watch_mb = memory_mb
        if cgroup_root is not None:
            try:
                cg = cgroup_limits.create(cgroup_root, memory_mb=memory_mb,
                                          max_procs=_max_procs())
            except cgroup_limits.CgroupUnavailable as exc:
                if cmd is not None:
                    cmd.close()
                raise SandboxUnavailable(str(exc)) from exc
            argv = cg.wrap(argv)
            watch_mb = memory_mb * cgroup_limits.WATCHDOG_SLACK  # the kernel acts first
        t0, asked = time.monotonic(), time.time()
        with open(out_path, "wb") as out_f, open(err_path, "wb") as err_f:
            try:
                proc = subprocess.Popen(
                    argv,
                    stdin=subprocess.DEVNULL,
                    stdout=out_f,
                    stderr=err_f,
                    cwd=popen_cwd,
                    env=child_env,
                    pass_fds=pass_fds,
                    # Its own session and process group: one killpg ends the
                    # child and everything it started, and a Ctrl-C aimed at
                    # the parent's terminal does not reach it.
                    start_new_session=True,
                )
            except BaseException:
                if cg is not None:
                    cg.close()
                raise
            finally:
                if cmd is not None:
                    cmd.close()  # the child has its own copy of the filter
            try:
                watch = watch_child(proc, timeout_s=timeout_s, memory_mb=watch_mb)
            finally:
                kernel_oom = cg is not None and cg.oom_killed()
                if cg is not None:
                    watch.peak_rss_mb = max(watch.peak_rss_mb, cg.peak_mb())
                    cg.close()
        if kernel_oom and not watch.oom:
            watch.oom = True
            watch.culprits = "the kernel's memory.max of its cgroup (its processes and its tmpfs)"
        res = _finish(tmpdir, proc.returncode, watch, time.monotonic() - t0,
                      timeout_s=timeout_s, memory_mb=memory_mb,
                      bwrap_status=isolation is not None, asked_at=asked)
        res.limits = _limits(cg, memory_mb, isolation)
        return res


def _limits(cg: cgroup_limits.BuildCgroup | None, memory_mb: float,
            isolation: Isolation | None) -> str:
    """Which limits applied to a child, for the build log."""
    procs = (f"; RLIMIT_NPROC {_max_procs()} on uid {isolation.uid}"
             if isolation is not None and os.geteuid() == 0 else "")
    if cg is not None:
        return (f"{cg.describe()}; watchdog backstop at "
                f"{memory_mb * cgroup_limits.WATCHDOG_SLACK:.0f} MB{procs}")
    return (f"watchdog: PSS of its processes plus its tmpfs above {memory_mb:.0f} MB "
            f"(no FARM_BUILD_CGROUP: no kernel memory limit){procs}")


def _run_in_zygote(target: str, payload: Mapping[str, Any], *, timeout_s: float,
                   memory_mb: float, cwd: str | Path | None, child_env: dict[str, str],
                   paths: list[str], farm_root: str,
                   isolation: Isolation) -> SandboxResult | None:
    """``run_isolated`` through a warm zygote (``farm.build.zygote``); None when
    none can run this child (a path outside the slot, the zygote busy or
    failing): the caller starts a fresh process."""
    slot = zygote.slot_root()
    inside = [*isolation.readonly, *isolation.writable, *([cwd] if cwd else [])]
    if not all(zygote.under(p, slot) for p in inside):
        return None
    tail = [farm_root, *worker_pythonpath()]
    zenv = {**child_env, "PYTHONPATH": os.pathsep.join(dict.fromkeys(tail))}
    z = zygote.ZYGOTES.take(zenv, uid=isolation.uid, memory_mb=memory_mb,
                            preload=zygote.preload_for(target))
    if z is None:
        return None
    run = Path(tempfile.mkdtemp(prefix="run-", dir=slot))
    try:
        io_dir, code = run / "io", run / "code"
        run.chmod(0o711)  # the child passes through; the names under it are its own
        io_dir.mkdir()
        user = sandbox_user(io_dir)  # before the chown below: its HOME is the child's
        code.mkdir(mode=0o755)
        # Code packs are copied in (the zygote sees only the slot), root's and
        # read-only to the child as where they came from.
        copies = []
        for i, src in enumerate(paths):
            dst = code / str(i)
            shutil.copytree(src, dst, symlinks=True)
            copies.append(str(dst))
        (io_dir / _PAYLOAD).write_text(json.dumps(dict(payload)))
        if os.geteuid() == 0:
            for own in (str(io_dir), *isolation.writable):
                _chown_tree(Path(own), z.uid)  # the zygote's leased uid
        before = {p: _digest(p) for p in isolation.readonly}
        env = {**child_env, "PYTHONPATH": os.pathsep.join(dict.fromkeys([*copies, *tail])),
               **user}
        work = str(Path(cwd).resolve()) if cwd else str(io_dir)
        first = z.served == 0
        t0, asked = time.monotonic(), time.time()
        child = z.fork({"target": target, "tmpdir": str(io_dir), "argv0": __file__,
                        "stdout": str(io_dir / "stdout"), "stderr": str(io_dir / "stderr"),
                        "env": env, "cwd": work, "paths": copies})
        watch = (Watch() if child.returncode is not None
                 else watch_child(child, timeout_s=timeout_s, memory_mb=memory_mb))
        wall_s = time.monotonic() - t0
        if watch.timed_out or watch.oom:
            z.dirty = True  # the sandbox goes with the child it could not stop
        else:
            z.settle()  # its helpers' grace and the wipe, after the child's time
        res = _finish(io_dir, child.returncode, watch, wall_s,
                      timeout_s=timeout_s, memory_mb=memory_mb, bwrap_status=False,
                      asked_at=asked)
        res.limits = _limits(None, memory_mb, dataclasses.replace(isolation, uid=z.uid))
        res.warm = True
        if first:
            res.zygote_start = {"total": z.start_s, **z.start_phases}
        changed = [p for p, d in before.items() if _digest(p) != d]
        if changed:
            res.ok = False
            res.error = f"the child changed its read-only input {changed[0]}"
        return res
    except (zygote.ZygoteFailed, OSError, ValueError) as exc:
        log.warning("build zygote failed (%s): the child starts fresh", exc)
        z.dirty = True
        return None
    except BaseException:
        # Interrupted (a task's time limit, a signal) with a child perhaps
        # still running: this sandbox serves nobody again.
        z.dirty = True
        raise
    finally:
        if z.dirty:
            z.stop()  # now, not at the next take: nothing more forks from it
        zygote.ZYGOTES.release()
        shutil.rmtree(run, ignore_errors=True)


def _digest(path: str) -> str | None:
    return sha256_file(path) if Path(path).is_file() else None


def _finish(tmpdir: Path, rc: int | None, watch: Watch, wall: float, *, timeout_s: float,
            memory_mb: float, bwrap_status: bool, asked_at: float | None = None
            ) -> SandboxResult:
    """The child's end, its output's tails and its result file, as a result.
    ``asked_at``: the worker's clock (``time.time()``) when it started or
    forked the child, for the child's start-up time."""
    out_path, err_path = tmpdir / "stdout", tmpdir / "stderr"
    res = SandboxResult(
        ok=False,
        wall_s=wall,
        peak_rss_mb=watch.peak_rss_mb,
        peak_rss_sum_mb=watch.peak_rss_sum_mb,
        timed_out=watch.timed_out,
        oom=watch.oom,
        stdout_tail=_tail(out_path),
        stderr_tail=_tail(err_path),
    )
    if rc is not None and rc < 0:
        res.signal = _signal_name(-rc)
    elif rc is not None and rc > 128 and bwrap_status:
        # bubblewrap reports a child killed by a signal as 128 + signal.
        res.signal = _signal_name(rc - 128)
    else:
        res.exit_code = rc
    if watch.timed_out or watch.oom:
        res.error = (
            f"killed after {timeout_s:.0f} s wall-clock limit"
            if watch.timed_out
            else _memory_out(memory_mb, watch)
        )
        return res
    result_file = tmpdir / _RESULT
    if result_file.exists() and not result_file.is_symlink():
        try:
            data = json.loads(result_file.read_text())
        except ValueError as exc:
            res.error = f"unreadable result from child: {exc}"
            return res
        res.ok = bool(data.get("ok")) and rc == 0
        res.value = data.get("value")
        res.error_type = data.get("error_type")
        res.error = data.get("error")
        res.traceback = data.get("traceback")
        res.signal = None if res.ok else res.signal
        res.stages = _stages(data, asked_at, wall)
    elif res.signal is None:
        res.error = f"child exited with code {rc} without a result"
        if bwrap_status and "bwrap:" in res.stderr_tail:
            res.error += f" (the sandbox failed to start: {_first_bwrap_line(res)})"
    return res


def _stages(data: dict[str, Any], asked_at: float | None, wall: float) -> dict[str, float]:
    """The child's stage times as the worker keeps them (farm.build.stage_times.from_child):
    its "child start" is the gap between the worker's request and the child's
    own clock reading at its first line, both on this host's clock."""
    reported = data.get("stages")
    reported = dict(reported) if isinstance(reported, dict) else {}
    started, finished = data.get("started_at"), data.get("finished_at")
    if asked_at is not None and isinstance(started, (int, float)):
        reported[stage_times.CHILD_START] = float(started) - asked_at
    if asked_at is not None and isinstance(finished, (int, float)):
        # From its result written to the worker seeing it gone (the
        # interpreter's and the sandbox's exit, the watchdog's next look).
        reported[stage_times.CHILD_EXIT] = asked_at + wall - float(finished)
    return stage_times.from_child(reported, wall_s=wall)


def _memory_out(memory_mb: float, watch: Watch) -> str:
    """What a memory-out says: the limit, what took the memory, how to raise it."""
    took = f"; the largest: {watch.culprits}" if watch.culprits else ""
    return (f"killed above {memory_mb:.0f} MB (the proportional set size of its processes "
            f"plus the files in its /tmp and /dev/shm){took}. Raise the limit with "
            f"{memory_budget.SETTING} (MB; 0 means half this machine's memory, at least "
            f"{memory_budget.FLOOR_MB // 1024} GB), or make the model need less")


def _first_bwrap_line(res: SandboxResult) -> str:
    return next((ln for ln in res.stderr_tail.splitlines() if "bwrap:" in ln), "")


@functools.lru_cache(maxsize=4)
def isolation_unavailable(uid: int = DEFAULT_SANDBOX_UID) -> str | None:
    """Why model code cannot be isolated on this machine (None: it can).

    Runs one real isolated child (a few hundred ms), once per process: the
    same command line a build uses, so a kernel or a container that forbids
    namespaces is found here, at worker start, not in the first build."""
    if shutil.which("bwrap") is None:
        return NO_BWRAP
    if os.geteuid() == 0 and not Path(setpriv()).exists():
        return "setpriv (util-linux) is not installed: the sandbox needs it to drop to its uid"
    from farm.build import isolation_probe
    from farm.core.settings import get_settings

    try:
        with isolation_probe.listener() as port:
            ports = [port]
            farm = isolation_probe.farm_port(str(get_settings().farm_url))
            if farm is not None:
                ports.append(farm)
            res = run_isolated("farm.build.isolation_probe:probe_child",
                               isolation_probe.payload(ports), timeout_s=60, memory_mb=4096,
                               isolation=Isolation(uid=uid), warm=False)
    except SandboxUnavailable as exc:
        return str(exc)
    if not res.ok:
        why = _first_bwrap_line(res) or res.describe()
        return (f"bubblewrap cannot create the sandbox here ({why}): in a container, allow "
                "user and mount namespaces (docker: security_opt seccomp=unconfined and "
                "apparmor=unconfined, or --privileged), or set FARM_SANDBOX=off for "
                "development only")
    s = get_settings()
    uids = {uid, *range(s.farm_sandbox_uid_base, s.farm_sandbox_uid_base + s.farm_sandbox_uids)}
    if os.geteuid() != 0:
        uids = {uid}  # mapped in its own user namespace: the number it is given
    weak = isolation_probe.findings(res.value or {}, uids=uids,
                                    child_env=allowed_env(scrubbed_env(None), None))
    if weak:
        return "the sandbox is weaker than configured: " + "; ".join(weak)
    return None


def sandbox_mode(value: str | None = None) -> str:
    """``FARM_SANDBOX`` (on, auto, off), checked."""
    if value is None:
        from farm.core.settings import get_settings

        value = str(getattr(get_settings(), "farm_sandbox", "on"))
    mode = value.strip().lower()
    if mode not in SANDBOX_MODES:
        raise SandboxUnavailable(f"FARM_SANDBOX={value!r} is not one of {', '.join(SANDBOX_MODES)}")
    return mode


def configured_uid() -> int:
    """The uid builds run as (``FARM_SANDBOX_UID``), which the isolation probe checks."""
    from farm.core.settings import get_settings

    return int(getattr(get_settings(), "farm_sandbox_uid", DEFAULT_SANDBOX_UID))


def build_isolation(*, readonly: Sequence[str | Path] = (), writable: Sequence[str | Path] = (),
                    mode: str | None = None, uid: int | None = None,
                    what: str = "build") -> Isolation | None:
    """The isolation a build child gets under ``FARM_SANDBOX``; None (with a
    warning, every time) when it runs unisolated: ``off``, or ``auto`` on a
    machine that cannot isolate. Raises ``SandboxUnavailable`` for ``on``
    when isolation is impossible (a worker checks at start, so this is rare)."""
    mode = sandbox_mode(mode)
    if uid is None:
        uid = configured_uid()
    if mode == "off":
        _warn_once("FARM_SANDBOX=off: builds run model code unisolated, where it can read "
                   "this worker's credentials; for development only")
        return None
    why = isolation_unavailable(uid)
    if why is not None:
        if mode == "on":
            raise SandboxUnavailable(why)
        _warn_once(f"FARM_SANDBOX=auto: builds run model code unisolated: {why}")
        return None
    return Isolation(readonly=tuple(str(p) for p in readonly),
                     writable=tuple(str(p) for p in writable), uid=uid)


@functools.lru_cache(maxsize=8)
def _warn_once(message: str) -> None:
    # Once per worker process: the same warning in every build's log buried
    # the one line that matters (the worker's start and the farm's first line
    # say it too).
    log.warning(message)


def check_worker_can_isolate(mode: str | None = None) -> None:
    """For worker start: raise ``SandboxUnavailable`` (say why, what to do)
    when ``FARM_SANDBOX=on`` and this machine cannot isolate model code;
    log the warning for ``off`` and for ``auto`` without isolation."""
    mode = sandbox_mode(mode)
    root = cgroup_limits.configured()
    if root is not None and (bad := cgroup_limits.check(root)) is not None:
        # Kernel limits asked for and impossible, whatever FARM_SANDBOX says:
        # every build would fail.
        raise SandboxUnavailable(f"this worker will not take builds: {bad}")
    if mode == "off":
        log.warning("FARM_SANDBOX=off: builds run model code unisolated, where it can read "
                    "this worker's credentials (database, broker, bucket, signing key); "
                    "for development only")
        return
    why = isolation_unavailable(configured_uid())
    if why is None:
        return
    if mode == "on":
        raise SandboxUnavailable(f"this worker cannot isolate model code, so it will not take "
                                 f"builds: {why}")
    log.warning("FARM_SANDBOX=auto and no isolation here (%s): builds run model code "
                "unisolated", why)


def _tail(path: Path, limit: int = TAIL_CHARS) -> str:
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            f.seek(max(0, size - limit))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


def _signal_name(num: int) -> str:
    try:
        return signal_mod.Signals(num).name
    except ValueError:
        return f"signal {num}"


# --- the child side ---------------------------------------------------------------


def resolve_target(target: str) -> Callable[[dict[str, Any]], Any]:
    module_name, _, attr_path = target.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in attr_path.split("."):
        obj = getattr(obj, part)
    if not callable(obj):
        raise TypeError(f"sandbox target {target!r} is not callable")
    return obj


def _write_result(tmpdir: Path, data: dict[str, Any]) -> None:
    tmp = tmpdir / (_RESULT + ".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, tmpdir / _RESULT)


def _die_with_parent(parent: int) -> None:
    """Linux: SIGKILL this child when the process that started it dies.

    The child has its own session (so the parent can kill its whole group);
    without this, a worker killed with ``kill -9``, or by the OOM killer,
    would leave its model code running, unwatched and unlimited, for as long
    as the model likes (a hanging model: forever)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal_mod.SIGKILL)
    if os.getppid() != parent:  # it died before the line above
        os._exit(70)


def child_main(argv: list[str]) -> int:
    started_at = time.time()  # the worker's "child start" ends here
    stage_times.reset()
    target, tmp = argv[0], Path(argv[1])
    isolated = len(argv) > 2 and argv[2] == "isolated"
    if len(argv) > 2 and not isolated:
        _die_with_parent(int(argv[2]))
    import faulthandler
    import resource

    # A crashing model must not leave multi-GB core files on the worker's disk.
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if isolated:
        # bubblewrap's --die-with-parent ties this child to the sandbox; its
        # uid is its own (farm.build.uid_slots), so a fork bomb meets this
        # limit alone.
        nproc = int(os.environ.pop(_MAX_PROCS_ENV, "") or ISOLATED_NPROC)
        for lim, value in ((resource.RLIMIT_NPROC, nproc),
                           (resource.RLIMIT_FSIZE, ISOLATED_FSIZE)):
            with contextlib.suppress(ValueError, OSError):
                _, hard = resource.getrlimit(lim)
                cap = value if hard == resource.RLIM_INFINITY else min(value, hard)
                resource.setrlimit(lim, (cap, cap))
    faulthandler.enable()
    try:
        payload = json.loads((tmp / _PAYLOAD).read_text())
        with stage_times.stage(stage_times.IMPORTS):
            fn = resolve_target(target)
            # Before anything compiles: Inductor's ISA test compiles, answered
            # from the worker's record (farm.core.isa_checks; nothing is
            # imported without one). Read and dropped, as every farm setting:
            # model code never sees one.
            isa_checks.replay_from_env()
            os.environ.pop(isa_checks.ISA_CHECKS_ENV, None)
        value = fn(payload)
        try:
            text = json.dumps({"ok": True, "value": value, "started_at": started_at,
                               "finished_at": time.time(), "stages": stage_times.snapshot()})
        except (TypeError, ValueError) as exc:
            raise TypeError(
                f"sandbox target {target!r} returned a value that is not JSON: {exc}"
            ) from exc
        (tmp / (_RESULT + ".tmp")).write_text(text)
        os.replace(tmp / (_RESULT + ".tmp"), tmp / _RESULT)
    except BaseException as exc:  # everything, SystemExit included, goes back to the parent
        etype = type(exc)
        _write_result(tmp, {
            "ok": False,
            "error_type": f"{etype.__module__}.{etype.__qualname__}"
            if etype.__module__ != "builtins" else etype.__qualname__,
            "error": str(exc),
            "traceback": traceback.format_exc(),
            "started_at": started_at,
            "finished_at": time.time(),
            "stages": stage_times.snapshot(),
        })
        sys.stdout.flush()
        sys.stderr.flush()
        _end_descendants()
        return 1
    sys.stdout.flush()
    sys.stderr.flush()
    _end_descendants()
    return 0


def _end_descendants(wait_s: float = 2.0) -> None:
    """Kill what the target started and left running, and wait for it: the
    child ends with ``os._exit``, so Inductor's compile pool (a process per
    compile thread, 16 on a GPU host) was still alive when a zygote looked
    for leftovers, and every build threw its sandbox away and paid a new
    zygote's start (measured on an H100 host). What escaped this process's
    tree (a daemon) is not found here, and the zygote still refuses to serve
    after it."""
    try:
        import psutil

        kids = psutil.Process().children(recursive=True)
    except Exception:  # the zygote's check still stands
        return
    for kid in kids:
        with contextlib.suppress(psutil.Error):
            kid.kill()
    with contextlib.suppress(Exception):
        psutil.wait_procs(kids, timeout=wait_s)


if __name__ == "__main__":
    if len(sys.argv) not in (3, 4):
        print("usage: python -m farm.build.sandbox package.module:function TMPDIR "
              "[PARENT_PID|isolated]",
              file=sys.stderr)
        sys.exit(2)
    # os._exit skips interpreter teardown: torch's atexit handlers and compile
    # pools can hang or crash at shutdown after the result is already written.
    code = child_main(sys.argv[1:])
    os._exit(code)
