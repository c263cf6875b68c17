"""The seccomp filter every sandboxed build child runs under (bubblewrap's
``--seccomp FD``), built with libseccomp (its ctypes bindings, ``pyseccomp``).

Model code needs none of these calls, and each is how a process in a
namespace sandbox attacks the kernel or its neighbours, so each fails with
EPERM (a clear error in the child, not a kill that looks like a crash):

- new user namespaces (``unshare``/``clone`` with ``CLONE_NEWUSER``) and
  joining others (``setns``): a nested user namespace hands the child every
  capability inside it, the door to most namespace kernel bugs;
- another process's memory (``ptrace``, ``process_vm_readv``/``writev``);
- the kernel itself: modules, ``kexec``, ``bpf``, ``perf_event_open``,
  ``userfaultfd`` (the usual race helper of kernel exploits);
- the kernel keyring (``add_key``, ``request_key``, ``keyctl``): keys are per
  uid, not per namespace;
- mounts, old and new API, and ``pivot_root``; ``open_by_handle_at`` (reads
  any file of a mounted file system by handle, past the sandbox's mounts);
- ``io_uring``'s calls: a large kernel surface untrusted code does not need;
- ``ioctl(TIOCSTI)``: typing into a terminal the child was given.

``clone3`` passes its flags in memory a filter cannot read, so it fails with
ENOSYS: glibc then falls back to ``clone``, whose flags the filter checks
(as Flatpak and Docker do).

Syscall names are resolved by libseccomp for this machine's architecture;
calls of another ABI (i386 ``int 0x80``, x32 on x86_64) do not match the
filter's architecture and kill the process.
"""

from __future__ import annotations

import errno
import functools
import os
import tempfile
from typing import Any

# The calls refused outright (EPERM), whatever their arguments.
REFUSED = (
    "setns",
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "init_module",
    "finit_module",
    "delete_module",
    "kexec_load",
    "kexec_file_load",
    "add_key",
    "request_key",
    "keyctl",
    "mount",
    "umount2",
    "pivot_root",
    "move_mount",
    "open_tree",
    "fsopen",
    "fsmount",
    "fsconfig",
    "fspick",
    "mount_setattr",
    "bpf",
    "perf_event_open",
    "userfaultfd",
    "open_by_handle_at",
    # io_uring: a large kernel surface behind its own syscalls (Docker and
    # ChromeOS refuse it to untrusted code as well).
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
)
CLONE_NEWUSER = 0x10000000
TIOCSTI = 0x5412

MISSING = (
    "the seccomp library is missing, so build children cannot be given their syscall "
    "filter: install libseccomp (Debian/Ubuntu: apt-get install -y libseccomp2) and "
    "pyseccomp (pip install 'pyseccomp>=0.1.2', part of torch-farm-server)"
)


class FilterUnavailable(RuntimeError):
    """libseccomp or its bindings are missing; the message says what to install."""


def _carried_libseccomp() -> str | None:
    """libseccomp where ``ctypes.util.find_library`` does not look: a library
    unpacked from Debian's package without an install step (a GPU image
    without it), found on ``LD_LIBRARY_PATH`` (find_library's own search
    there needs the unversioned ``.so`` of the -dev package)."""
    for d in os.environ.get("LD_LIBRARY_PATH", "").split(os.pathsep):
        if d:
            for name in ("libseccomp.so.2", "libseccomp.so"):
                if os.path.isfile(os.path.join(d, name)):
                    return os.path.join(d, name)
    return None


def _bindings() -> Any:
    """``pyseccomp``, pointed at a carried libseccomp where needed."""
    import ctypes.util

    if ctypes.util.find_library("seccomp") is None and (lib := _carried_libseccomp()):
        real = ctypes.util.find_library
        ctypes.util.find_library = lambda name: lib if name == "seccomp" else real(name)
        try:
            import pyseccomp
        finally:
            ctypes.util.find_library = real
        return pyseccomp
    import pyseccomp

    return pyseccomp


@functools.lru_cache(maxsize=1)
def filter_bpf() -> bytes:
    """The compiled BPF program (built once per process)."""
    try:
        sc = _bindings()
    except (ImportError, OSError, RuntimeError) as exc:  # no bindings, or no libseccomp.so
        raise FilterUnavailable(f"{MISSING} ({exc})") from exc
    f = sc.SyscallFilter(sc.ALLOW)
    eperm = sc.ERRNO(errno.EPERM)
    for name in REFUSED:
        try:
            f.add_rule(eperm, name)
        except (ValueError, RuntimeError, OSError):
            # A call this architecture or libseccomp version does not know
            # cannot be made here either.
            continue
    for name in ("unshare", "clone"):
        # unshare(flags), and clone's flags (its first argument on x86_64 and arm64).
        f.add_rule(eperm, name, sc.Arg(0, sc.MASKED_EQ, CLONE_NEWUSER, CLONE_NEWUSER))
    f.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
    f.add_rule(eperm, "ioctl", sc.Arg(1, sc.MASKED_EQ, 0xFFFFFFFF, TIOCSTI))
    with tempfile.TemporaryFile() as out:
        f.export_bpf(out)
        out.seek(0)
        return out.read()


def filter_fd() -> int:
    """A fresh file descriptor holding the filter, at offset 0, for one
    bubblewrap (which reads it to the end): the caller passes it to the
    child (``pass_fds``) and closes it after the start."""
    program = filter_bpf()
    fd = os.memfd_create("farm-seccomp", 0)
    try:
        os.write(fd, program)
        os.lseek(fd, 0, os.SEEK_SET)
    except OSError:
        os.close(fd)
        raise
    return fd


def available() -> str | None:
    """Why no filter can be built here (None: it can)."""
    try:
        filter_bpf()
    except FilterUnavailable as exc:
        return str(exc)
    return None
