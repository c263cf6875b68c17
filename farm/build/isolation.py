"""How an isolated build child is confined: the bubblewrap command line
(namespaces, the read-only system, its own build directory, a private
``/tmp``) for an ``Isolation``, and the errors that say why a machine cannot
isolate. ``farm.build.sandbox`` runs the child under it."""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from farm.build import syscall_filter
from farm.build.bytecode import CHILD_ENV as BYTECODE_ENV
from farm.build.child_env import compiler_free_dir
from farm.core.precompiled_headers import CHILD_ENV

SANDBOX_MODES = ("on", "auto", "off")
DEFAULT_SANDBOX_UID = 65534
# A private /tmp is tmpfs, i.e. memory the RSS watchdog does not see: bounded.
MAX_TMPFS_MB = 4096


class SandboxUnavailable(RuntimeError):
    """Model code cannot be isolated here; the message says why and what to do."""


@dataclass(frozen=True)
class Isolation:
    """What an isolated child sees besides the system (``/usr``), the Python
    installation and the ``farm`` package: ``readonly`` paths (an artifact to
    verify) and ``writable`` ones (its build directory), each at its own path.
    ``import_paths`` (code packs) are mounted read-only too."""

    readonly: tuple[str, ...] = ()
    writable: tuple[str, ...] = ()
    uid: int = DEFAULT_SANDBOX_UID


def farm_package_dir() -> Path:
    """The ``farm`` package's directory (mounted read-only in every child)."""
    return Path(__file__).resolve().parents[1]


def worker_pythonpath(env: Mapping[str, str] | None = None) -> list[str]:
    """The worker's own ``PYTHONPATH`` entries that an isolated child keeps:
    absolute directories that exist. On a host whose farm dependencies come
    from ``PYTHONPATH`` (a GPU image's packages outside any site directory),
    a child without them cannot import what the farm itself needs (the
    verifier's ``cryptography``). Relative entries mean the worker's working
    directory, which the child does not have."""
    raw = (os.environ if env is None else env).get("PYTHONPATH", "")
    out: list[str] = []
    for entry in raw.split(os.pathsep):
        if entry and os.path.isabs(entry) and Path(entry).is_dir() and entry not in out:
            out.append(entry)
    return out


def _python_roots() -> list[Path]:
    """The Python installation the child runs: prefixes, site directories,
    the worker's ``PYTHONPATH`` directories (``worker_pythonpath``) and the
    ``farm`` package (an editable install lives outside site-packages); all
    read-only in the child."""
    import site
    import sysconfig

    roots = {sys.prefix, sys.base_prefix, sys.exec_prefix, str(Path(sys.executable).parent)}
    paths = sysconfig.get_paths()
    roots.update(paths.get(k, "") for k in ("stdlib", "platstdlib", "purelib", "platlib",
                                            "include"))
    with contextlib.suppress(AttributeError):
        roots.update(site.getsitepackages())
    roots.update(worker_pythonpath())
    out = [Path(r).resolve() for r in roots if r and Path(r).exists()]
    out.append(farm_package_dir())
    # The interpreter itself, when the venv's python is a link to it.
    exe = Path(sys.executable).resolve()
    out.append(exe.parent.parent if exe.parent.name == "bin" else exe.parent)
    return out


def _system_roots() -> list[tuple[str, Path]]:
    """(kind, path) of the system parts: /usr and the merged-/usr links, the
    dynamic loader's configuration and the compiler alternatives."""
    out: list[tuple[str, Path]] = [("ro", Path("/usr"))]
    for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        p = Path("/") / name
        if p.is_symlink():
            out.append(("link", p))
        elif p.is_dir():
            out.append(("ro", p))
    for etc in ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "alternatives", "localtime"):
        p = Path("/etc") / etc
        if p.exists():
            out.append(("ro", p))
    # Thread counts and CPU topology (OpenMP, torch.get_num_threads, the ISA probe).
    for p in (Path("/sys/devices/system/cpu"), Path("/sys/fs/cgroup")):
        if p.exists():
            out.append(("ro", p))
    return out


def _covered(p: Path, roots: Sequence[Path]) -> bool:
    return any(p == r or r in p.parents for r in roots)


@functools.lru_cache(maxsize=4)
def bwrap_supports(flag: str, bwrap: str = "bwrap") -> bool:
    """Whether this bubblewrap knows ``flag`` (``--disable-userns``: 0.8 and later)."""
    try:
        out = subprocess.run([bwrap, "--help"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return False
    return flag in out.stdout + out.stderr


@dataclass
class BwrapCommand:
    """A bubblewrap command line and the descriptors it reads (the seccomp
    filter): the caller passes ``pass_fds`` to ``Popen`` and ``close``s
    them once the sandbox has started."""

    argv: list[str]
    pass_fds: tuple[int, ...] = field(default=())

    def close(self) -> None:
        for fd in self.pass_fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.pass_fds = ()


def bwrap_argv(
    argv: Sequence[str],
    *,
    isolation: Isolation,
    tmpdir: Path,
    readonly: Sequence[str | Path],
    env: Mapping[str, str],
    cwd: str | Path | None,
    memory_mb: float,
) -> BwrapCommand:
    """The bubblewrap command line that runs ``argv`` isolated, with the
    syscall filter (``farm.build.syscall_filter``) on a fresh descriptor.
    Raises ``SandboxUnavailable`` without bubblewrap or the filter."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise SandboxUnavailable(NO_BWRAP)
    try:
        seccomp_fd = syscall_filter.filter_fd()
    except syscall_filter.FilterUnavailable as exc:
        raise SandboxUnavailable(str(exc)) from exc
    root = os.geteuid() == 0
    args = [bwrap, "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
            "--unshare-cgroup-try", "--die-with-parent", "--hostname", "farm-sandbox",
            "--seccomp", str(seccomp_fd)]
    if not root:
        # The worker's own uid, mapped to the sandbox's number inside a user
        # namespace of its own; no further user namespace inside it (the
        # filter refuses them too; this is the kernel's own switch).
        args += ["--unshare-user", "--uid", str(isolation.uid), "--gid", str(isolation.uid)]
        if bwrap_supports("--disable-userns", bwrap):
            args.append("--disable-userns")
    mounted: list[Path] = []
    made: set[Path] = set()

    def ancestors(p: Path) -> None:
        # Directories bubblewrap makes on its own are 0700 (root's): the
        # unprivileged child could not walk through them. Under /tmp (the
        # sandbox's own bounded tmpfs) they are the child's to write, as /tmp
        # is: a CUDA aot_compile artifact's load recreates its build's
        # Inductor cache path, and under a build directory in the worker's
        # slot that failed, "Permission denied", where a node creates it.
        for a in reversed(p.parents):
            if a == Path("/") or a in made or _covered(a, mounted):
                continue
            perms = "1777" if Path("/tmp") in a.parents else "0755"
            args.extend(["--perms", perms, "--dir", str(a)])
            made.add(a)

    def bind(kind: str, p: Path) -> None:
        if _covered(p, mounted):
            return
        ancestors(p)
        flag = {"ro": "--ro-bind", "rw": "--bind", "dev": "--dev-bind"}[kind]
        args.extend([flag, str(p), str(p)])
        mounted.append(p)

    for kind, p in _system_roots():
        if kind == "link":
            args.extend(["--symlink", os.readlink(p), str(p)])
        else:
            bind(kind, p)
    args += ["--proc", "/proc", "--dev", "/dev"]
    # A writable, bounded /dev/shm: Inductor's parallel compile pool (and any
    # multiprocessing queue) needs POSIX shared memory; bubblewrap's own
    # /dev/shm is root's and read-only to the sandbox uid.
    args += ["--size", str(shm_mb(memory_mb) * 2**20), "--perms", "1777", "--tmpfs", "/dev/shm"]
    for dev in sorted(Path("/dev").glob("nvidia*")):  # GPU workers
        args.extend(["--dev-bind", str(dev), str(dev)])
    args += ["--size", str(tmpfs_mb(memory_mb) * 2**20), "--perms", "1777", "--tmpfs", "/tmp"]
    made.add(Path("/tmp"))
    # The files the child writes the result to, its HOME, its user name.
    passwd = tmpdir / "passwd"
    passwd.write_text(f"sandbox:x:{isolation.uid}:{isolation.uid}:farm build sandbox:"
                      f"{tmpdir / 'home'}:/usr/sbin/nologin\n")
    group = tmpdir / "group"
    group.write_text(f"sandbox:x:{isolation.uid}:\n")
    for py in _python_roots():
        bind("ro", py)
    for ro in readonly:
        bind("ro", Path(ro).resolve())
    for var in ("CXX", "CC"):
        # A compiler outside /usr (the H200 image's /opt/gcc): its install tree.
        exe = env.get(var)
        if exe and os.path.isabs(exe) and Path(exe).exists():
            where = Path(exe).resolve().parent
            bind("ro", where.parent if where.name == "bin" else where)
    headers = env.get(CHILD_ENV)
    if headers and os.path.isabs(headers) and Path(headers).is_dir():
        # This machine's precompiled headers (farm.build.pch): read, never written.
        bind("ro", Path(headers).resolve())
    pyc = env.get(BYTECODE_ENV)
    if pyc and os.path.isabs(pyc) and Path(pyc).is_dir():
        # This machine's compiled bytecode (farm.build.bytecode): read, never written.
        bind("ro", Path(pyc).resolve())
    nocc = compiler_free_dir()
    for entry in env.get("PATH", "").split(os.pathsep):
        if nocc is not None and entry == str(nocc):
            bind("ro", nocc)  # the compiler-free PATH of a verify child
    for rw in isolation.writable:
        bind("rw", Path(rw).resolve())
    bind("rw", tmpdir)
    args += ["--ro-bind", str(passwd), "/etc/passwd", "--ro-bind", str(group), "/etc/group"]
    work = Path(cwd).resolve() if cwd and _covered(Path(cwd).resolve(), mounted) else tmpdir
    args += ["--chdir", str(work)]
    if root:
        # Mounts are made as root; the model runs as the sandbox uid with no
        # capabilities at all (setpriv keeps none across exec).
        _chown_tree(tmpdir, isolation.uid)
        for rw in isolation.writable:
            _chown_tree(Path(rw), isolation.uid)
        args += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID", "--", setpriv(),
                 f"--reuid={isolation.uid}", f"--regid={isolation.uid}", "--clear-groups",
                 "--inh-caps=-all", "--bounding-set=-all"]
    else:
        args.append("--")
    return BwrapCommand(argv=[*args, *argv], pass_fds=(seccomp_fd,))


def tmpfs_mb(memory_mb: float) -> int:
    """The private /tmp's size: memory the child's processes do not map, so
    bounded apart (the watchdog counts what it holds)."""
    return int(max(64, min(MAX_TMPFS_MB, memory_mb)))


def shm_mb(memory_mb: float) -> int:
    """The private /dev/shm's size: a quarter of the limit, at most 2 GB."""
    return int(max(64, min(2048, memory_mb / 4)))


def _chown_tree(top: Path, uid: int) -> None:
    for dirpath, _, filenames in os.walk(top):
        with contextlib.suppress(OSError):
            os.chown(dirpath, uid, uid)
        for f in filenames:
            with contextlib.suppress(OSError):
                os.chown(Path(dirpath) / f, uid, uid, follow_symlinks=False)


NO_BWRAP = ("bubblewrap (bwrap) is not installed, so model code cannot be isolated from the "
             "worker's credentials: install it (Debian/Ubuntu: apt-get install -y bubblewrap), "
             "or, for development on a machine you trust, set FARM_SANDBOX=off")


def setpriv() -> str:
    exe = shutil.which("setpriv") or "/usr/bin/setpriv"
    return exe
