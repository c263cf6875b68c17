"""What a hostile model tries against the kernel from inside the sandbox:
each attack is one raw syscall (ctypes), reported as "ok" or the errno's
name. Run by tests/unit/test_sandbox_attacks.py inside and outside the
sandbox (x86_64 and arm64 numbers; libc's wrappers where it has them)."""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import subprocess
from typing import Any

_LIBC = ctypes.CDLL(None, use_errno=True)
_X86 = platform.machine() == "x86_64"
# Raw numbers of the calls libc has no wrapper for on every version.
NR = {
    "clone": 56 if _X86 else 220,
    "clone3": 435,
    "setns": 308 if _X86 else 268,
    "process_vm_readv": 310 if _X86 else 270,
    "kexec_load": 246 if _X86 else 104,
    "finit_module": 313 if _X86 else 273,
    "delete_module": 176 if _X86 else 106,
    "add_key": 248 if _X86 else 217,
    "keyctl": 250 if _X86 else 219,
    "bpf": 321 if _X86 else 280,
    "perf_event_open": 298 if _X86 else 241,
    "userfaultfd": 323 if _X86 else 282,
    "open_by_handle_at": 304 if _X86 else 265,
    "pivot_root": 155 if _X86 else 41,
    "umount2": 166 if _X86 else 39,
    "fsopen": 430,
    "io_uring_setup": 425,
}
CLONE_NEWUSER = 0x10000000
SIGCHLD = 17
KEYCTL_GET_KEYRING_ID = 0
KEY_SPEC_SESSION_KEYRING = -3
PTRACE_TRACEME = 0


def _result(ret: int) -> str:
    if ret >= 0:
        return "ok"
    return errno.errorcode.get(ctypes.get_errno(), str(ctypes.get_errno()))


def _sys(name: str, *args: Any) -> str:
    ctypes.set_errno(0)
    return _result(_LIBC.syscall(ctypes.c_long(NR[name]), *args))


def _clone_newuser() -> str:
    ctypes.set_errno(0)
    ret = _LIBC.syscall(
        ctypes.c_long(NR["clone"]), ctypes.c_ulong(CLONE_NEWUSER | SIGCHLD), None, None, None, None
    )
    if ret == 0:  # the child, in a new user namespace: nothing to do here
        os._exit(0)
    if ret > 0:
        os.waitpid(ret, 0)
    return _result(ret)


def _process_vm_readv() -> str:
    buf = ctypes.create_string_buffer(8)
    src = ctypes.c_ulong(ctypes.addressof(buf))

    class IoVec(ctypes.Structure):
        _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]

    local, remote = IoVec(ctypes.addressof(buf), 8), IoVec(src.value, 8)
    return _sys("process_vm_readv", os.getpid(), ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)


def _mount() -> str:
    os.makedirs("/tmp/farm-mnt", exist_ok=True)
    ctypes.set_errno(0)
    return _result(_LIBC.mount(b"none", b"/tmp/farm-mnt", b"tmpfs", 0, None))


def _unshare_command() -> str:
    try:
        out = subprocess.run(
            ["unshare", "--user", "--map-root-user", "id", "-u"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except OSError as exc:
        return type(exc).__name__
    return "ok" if out.returncode == 0 else f"refused: {out.stderr.strip()[-200:]}"


def attack(payload: dict[str, Any]) -> dict[str, str]:
    """Every attack, with its outcome."""
    ctypes.set_errno(0)
    out = {
        "unshare(CLONE_NEWUSER)": _result(_LIBC.unshare(CLONE_NEWUSER)),
        "clone(CLONE_NEWUSER)": _clone_newuser(),
        "clone3": _sys("clone3", None, ctypes.c_size_t(0)),
        "unshare --user (the command)": _unshare_command(),
        "setns(-1)": _sys("setns", -1, 0),
        "ptrace(PTRACE_TRACEME)": (
            ctypes.set_errno(0),
            _result(_LIBC.ptrace(PTRACE_TRACEME, 0, None, None)),
        )[1],
        "process_vm_readv(self)": _process_vm_readv(),
        "finit_module": _sys("finit_module", -1, b"", 0),
        "delete_module": _sys("delete_module", b"farm_no_such_module", 0),
        "kexec_load": _sys("kexec_load", 0, 0, None, 0),
        "add_key": _sys("add_key", b"user", b"farm-probe", b"x", 1, KEY_SPEC_SESSION_KEYRING),
        "keyctl(GET_KEYRING_ID)": _sys(
            "keyctl", KEYCTL_GET_KEYRING_ID, KEY_SPEC_SESSION_KEYRING, 0
        ),
        "mount(tmpfs)": _mount(),
        "umount2(/proc)": _sys("umount2", b"/proc", 0),
        "pivot_root": _sys("pivot_root", b"/tmp", b"/tmp"),
        "fsopen(tmpfs)": _sys("fsopen", b"tmpfs", 0),
        "bpf(BPF_PROG_LOAD, NULL)": _sys("bpf", 5, None, 0),
        "perf_event_open(NULL)": _sys("perf_event_open", None, 0, -1, -1, 0),
        "userfaultfd": _sys("userfaultfd", 0),
        "open_by_handle_at(-1)": _sys("open_by_handle_at", -1, None, 0),
        "io_uring_setup(NULL)": _sys("io_uring_setup", 1, None),
    }
    with open("/proc/self/status") as f:
        out["seccomp mode"] = next((ln.split()[1] for ln in f if ln.startswith("Seccomp:")), "?")
    return out
