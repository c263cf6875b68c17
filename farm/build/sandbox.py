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
- Memory: a watchdog samples the resident set of the child and all its
  descendants and kills the group above the limit. ``RLIMIT_AS`` is not used:
  CUDA reserves far more virtual address space than it ever touches, so an
  address-space limit breaks every GPU child.
- Environment: the farm's credentials never reach model code (see ``SCRUBBED``).
- Crashes: the child's exceptions come back as type, message and traceback; a
  fatal signal (abort, segfault) is reported by name, with ``faulthandler``'s
  Python stack in ``stderr_tail``.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import json
import os
import re
import shutil
import signal as signal_mod
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psutil

# Exact names and name prefixes of environment variables that the child never
# sees: the farm's database, broker, blob store and signing credentials, and
# cloud credentials that model code could use to reach the farm's bucket.
SCRUBBED = frozenset({
    "DATABASE_URL",
    "REDIS_URL",
    "BROKER_URL",
    "CELERY_BROKER_URL",
    "CELERY_RESULT_BACKEND",
    "BLOB_STORE_URL",
    "FARM_TOKEN",
    "FARM_ADMIN_TOKEN",
    "FARM_SIGNING_KEY",
    "SSH_AUTH_SOCK",
    "GOOGLE_APPLICATION_CREDENTIALS",
})
# libpq's PG* variables reach the database with no URL at all (PGHOST, PGUSER).
SCRUBBED_PREFIXES = ("AWS_", "S3_", "MINIO_", "AZURE_", "PG", "CELERY_")
# The farm's own configuration goes too (every variable ``farm.core.settings``
# reads, and the workers' knobs): it names the database, the broker, the
# bucket and where the signing key and SQLite file live (FARM_HOME).
# Settings the children read themselves (CHILD_SETTINGS: FARM_COORDESC) stay.
FARM_KNOBS = frozenset({"FARM_ISA_CACHE", "FARM_AOTI_CHECK_CACHE"})
# Anything that looks like a secret by name goes too.
SCRUBBED_MARKERS = ("TOKEN", "SECRET", "PASSWORD", "PASSWD", "CREDENTIAL", "PRIVATE_KEY")

# What a child's crash, time-out or memory-out reports keep of its output.
TAIL_CHARS = 8000
_POLL_S = 0.05
_TERM_GRACE_S = 2.0
_RESULT = "result.json"
_PAYLOAD = "payload.json"

# C/C++ compiler names hidden by ``without_compilers`` (inductor looks up g++,
# c++, clang++ and the CXX variable).
COMPILER_NAMES = ("gcc", "g++", "cc", "c++", "c89", "c99", "clang", "clang++", "icx", "icpx", "cpp")
# gcc, g++-12, x86_64-linux-gnu-g++-12, clang++-17; not gcc-ar or c++filt.
_COMPILER_RE = re.compile(
    r"^(?:[A-Za-z0-9_.]+-)*(?:"
    + "|".join(re.escape(c) for c in COMPILER_NAMES)
    + r")(?:-[0-9.]+)?$"
)


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
    peak_rss_mb: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        """One line saying how the child ended."""
        if self.ok:
            return f"ok in {self.wall_s:.1f} s, peak {self.peak_rss_mb:.0f} MB"
        if self.timed_out:
            return f"timed out after {self.wall_s:.0f} s"
        if self.oom:
            return f"exceeded its memory limit ({self.peak_rss_mb:.0f} MB peak)"
        if self.signal:
            return f"crashed with {self.signal}"
        if self.error_type:
            return f"{self.error_type}: {self.error}"
        return f"exited with code {self.exit_code}"


def scrubbed_env(
    base: Mapping[str, str] | None = None, extra: Mapping[str, str] | None = None
) -> dict[str, str]:
    """``base`` (default: this process's environment) without the farm's secrets,
    then ``extra`` on top (the caller's explicit choice, never scrubbed)."""
    env = {k: v for k, v in (os.environ if base is None else base).items() if not _is_secret(k)}
    env.update(extra or {})
    return env


@functools.lru_cache(maxsize=1)
def _farm_settings() -> frozenset[str]:
    from farm.core.settings import CHILD_SETTINGS, Settings

    names = set(Settings.model_fields) - CHILD_SETTINGS
    return frozenset(name.upper() for name in names) | FARM_KNOBS


def _is_secret(name: str) -> bool:
    upper = name.upper()
    return (
        upper in SCRUBBED
        or upper in _farm_settings()
        or upper.startswith(SCRUBBED_PREFIXES)
        or any(m in upper for m in SCRUBBED_MARKERS)
    )


def run_isolated(
    target: str,
    payload: Mapping[str, Any],
    *,
    timeout_s: float,
    memory_mb: float,
    cwd: str | Path | None = None,
    env_extra: Mapping[str, str] | None = None,
    env: Mapping[str, str] | None = None,
) -> SandboxResult:
    """Call ``target`` ("pkg.mod:function") with ``payload`` in a fresh process.

    ``env`` replaces the inherited environment (it is still scrubbed);
    ``env_extra`` is added after scrubbing. Never raises for anything the child
    does; raises ``ValueError`` for a malformed target.
    """
    if ":" not in target:
        raise ValueError(f"bad sandbox target {target!r}: expected 'package.module:function'")
    child_env = scrubbed_env(env, env_extra)
    # The child must import farm (and the target) the way this process does,
    # even when farm is not installed but only on sys.path (a source checkout).
    farm_root = str(Path(__file__).resolve().parent.parent)
    child_env["PYTHONPATH"] = os.pathsep.join(
        p for p in (farm_root, child_env.get("PYTHONPATH", "")) if p
    )
    child_env.setdefault("PYTHONFAULTHANDLER", "1")
    with tempfile.TemporaryDirectory(prefix="farm-sandbox-") as tmp:
        tmpdir = Path(tmp)
        (tmpdir / _PAYLOAD).write_text(json.dumps(dict(payload)))
        out_path, err_path = tmpdir / "stdout", tmpdir / "stderr"
        t0 = time.monotonic()
        with open(out_path, "wb") as out_f, open(err_path, "wb") as err_f:
            proc = subprocess.Popen(
                [sys.executable, "-m", "farm.build.sandbox", target, str(tmpdir), str(os.getpid())],
                stdin=subprocess.DEVNULL,
                stdout=out_f,
                stderr=err_f,
                cwd=str(cwd) if cwd else None,
                env=child_env,
                # Its own session and process group: one killpg ends the child
                # and everything it started, and a Ctrl-C aimed at the parent's
                # terminal does not reach it.
                start_new_session=True,
            )
            watch = _watch(proc, timeout_s=timeout_s, memory_mb=memory_mb)
        wall = time.monotonic() - t0
        res = SandboxResult(
            ok=False,
            wall_s=wall,
            peak_rss_mb=watch.peak_rss_mb,
            timed_out=watch.timed_out,
            oom=watch.oom,
            stdout_tail=_tail(out_path),
            stderr_tail=_tail(err_path),
        )
        rc = proc.returncode
        if rc is not None and rc < 0:
            res.signal = _signal_name(-rc)
        else:
            res.exit_code = rc
        if watch.timed_out or watch.oom:
            res.error = (
                f"killed after {timeout_s:.0f} s wall-clock limit"
                if watch.timed_out
                else f"killed above {memory_mb:.0f} MB resident memory"
            )
            return res
        result_file = tmpdir / _RESULT
        if result_file.exists():
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
        elif res.signal is None:
            res.error = f"child exited with code {rc} without a result"
        return res


@dataclass
class _Watch:
    timed_out: bool = False
    oom: bool = False
    peak_rss_mb: float = 0.0


def _watch(proc: subprocess.Popen[bytes], *, timeout_s: float, memory_mb: float) -> _Watch:
    """Wait for ``proc``; kill its group on time-out or memory-out."""
    w = _Watch()
    deadline = time.monotonic() + timeout_s
    try:
        root = psutil.Process(proc.pid)
    except psutil.Error:  # already gone
        proc.wait()
        return w
    while proc.poll() is None:
        rss = _tree_rss_mb(root)
        w.peak_rss_mb = max(w.peak_rss_mb, rss)
        if rss > memory_mb:
            w.oom = True
            _kill_tree(proc, root, grace_s=0.0)
            break
        if time.monotonic() > deadline:
            w.timed_out = True
            _kill_tree(proc, root, grace_s=_TERM_GRACE_S)
            break
        time.sleep(_POLL_S)
    proc.wait()
    return w


def _tree_rss_mb(root: psutil.Process) -> float:
    total = 0
    try:
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0.0
    for p in procs:
        with contextlib.suppress(psutil.Error):
            total += p.memory_info().rss
    return total / 2**20


def _kill_tree(proc: subprocess.Popen[bytes], root: psutil.Process, *, grace_s: float) -> None:
    """SIGTERM (after ``grace_s``: SIGKILL) to the child's process group, and to
    any descendant that left the group (a compile worker with its own session)."""
    try:
        stray = root.children(recursive=True)
    except psutil.Error:
        stray = []
    pgid = proc.pid  # start_new_session: the child leads its own group
    if grace_s > 0:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal_mod.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace_s)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal_mod.SIGKILL)
    for p in stray:
        with contextlib.suppress(psutil.Error):
            p.kill()


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


# --- environments for cold-node checks ------------------------------------------

_NO_CC_DIR: Path | None = None
_NO_CC_LOCK = threading.Lock()


def _is_compiler(name: str) -> bool:
    return _COMPILER_RE.match(name) is not None


def without_compilers(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's) as seen by a node with no C/C++ compiler.

    PATH becomes one directory of links to every executable on the original
    PATH except compilers, and CC/CXX are unset: a child can still run the
    ordinary tools it finds on PATH but cannot compile C++.
    """
    global _NO_CC_DIR
    env = dict(os.environ if env is None else env)
    path = env.get("PATH", os.defpath)
    with _NO_CC_LOCK:
        if _NO_CC_DIR is None or not _NO_CC_DIR.exists():
            d = Path(tempfile.mkdtemp(prefix="farm-nocc-bin-"))
            for entry in path.split(os.pathsep):
                p = Path(entry)
                if not p.is_dir():
                    continue
                with contextlib.suppress(OSError):
                    for exe in p.iterdir():
                        if _is_compiler(exe.name) or (d / exe.name).exists():
                            continue
                        if exe.is_file() and os.access(exe, os.X_OK):
                            with contextlib.suppress(OSError):
                                (d / exe.name).symlink_to(exe)
            _NO_CC_DIR = d
    env["PATH"] = str(_NO_CC_DIR)
    for var in ("CC", "CXX", "CPP", "TORCHINDUCTOR_CPP_COMPILER"):
        env.pop(var, None)
    return env


def compilers_on_path(env: Mapping[str, str]) -> dict[str, str]:
    """Which compilers ``env``'s PATH finds (empty: none)."""
    path = env.get("PATH", "")
    found = {}
    for name in ("gcc", "g++", "cc", "c++", "clang", "clang++"):
        where = shutil.which(name, path=path)
        if where:
            found[name] = where
    return found


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
    target, tmp = argv[0], Path(argv[1])
    if len(argv) > 2:
        _die_with_parent(int(argv[2]))
    import faulthandler
    import resource

    # A crashing model must not leave multi-GB core files on the worker's disk.
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    faulthandler.enable()
    try:
        payload = json.loads((tmp / _PAYLOAD).read_text())
        fn = resolve_target(target)
        value = fn(payload)
        try:
            text = json.dumps({"ok": True, "value": value})
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
        })
        sys.stdout.flush()
        sys.stderr.flush()
        return 1
    sys.stdout.flush()
    sys.stderr.flush()
    return 0


if __name__ == "__main__":
    if len(sys.argv) not in (3, 4):
        print("usage: python -m farm.build.sandbox package.module:function TMPDIR [PARENT_PID]",
              file=sys.stderr)
        sys.exit(2)
    # os._exit skips interpreter teardown: torch's atexit handlers and compile
    # pools can hang or crash at shutdown after the result is already written.
    code = child_main(sys.argv[1:])
    os._exit(code)
