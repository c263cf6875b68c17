"""deploy/seccomp-bwrap.json, the build workers' seccomp profile, applied
with libseccomp (Debian's python3-seccomp, as runc applies a profile) to an
unprivileged process with no capabilities, as a worker runs in its
container: bubblewrap still makes the sandbox the farm uses, and the calls
the profile denies fail with EPERM."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROFILE = ROOT / "deploy/seccomp-bwrap.json"
SYSTEM_PYTHON = "/usr/bin/python3"  # the one python3-seccomp installs for
WORKER_UID = "10001"  # the image's user (Dockerfile)

# Loads the profile into the process, then execs the rest of argv, as runc
# does before it starts a container's process.
LOADER = r"""
import json, os, sys
import seccomp
prof = json.load(open(sys.argv[1]))
assert prof["defaultAction"] == "SCMP_ACT_ALLOW"
f = seccomp.SyscallFilter(defaction=seccomp.ALLOW)
for rule in prof["syscalls"]:
    assert rule["action"] == "SCMP_ACT_ERRNO"
    for name in rule["names"]:
        try:
            f.add_rule(seccomp.ERRNO(rule.get("errnoRet", 1)), name)
        except (RuntimeError, ValueError):
            pass  # not a call of this architecture (runc skips those too)
f.load()
os.execvp(sys.argv[2], sys.argv[2:])
"""

# Syscall numbers on x86_64, where this test runs.
PROBE = r"""
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
for name, nr in (("keyctl", 250), ("bpf", 321), ("open_by_handle_at", 304), ("ptrace", 101),
                 ("kexec_load", 246), ("init_module", 175), ("io_uring_setup", 425)):
    ctypes.set_errno(0)
    r = libc.syscall(nr, 0, 0, 0, 0, 0)
    print(name, r, ctypes.get_errno())
"""


def _unprivileged(*argv: str) -> list[str]:
    """argv as the worker's uid with no capabilities at all (the container
    drops them: cap_drop ALL), under the profile."""
    return [
        "setpriv",
        "--reuid",
        WORKER_UID,
        "--regid",
        WORKER_UID,
        "--clear-groups",
        "--inh-caps=-all",
        "--bounding-set=-all",
        SYSTEM_PYTHON,
        "-c",
        LOADER,
        str(PROFILE),
        *argv,
    ]


@pytest.fixture(scope="module", autouse=True)
def _libseccomp() -> None:
    r = subprocess.run([SYSTEM_PYTHON, "-c", "import seccomp"], capture_output=True)
    assert r.returncode == 0, (
        "python3-seccomp is missing: scripts/bootstrap.sh installs it "
        "(apt-get install -y python3-seccomp)"
    )
    assert shutil.which("setpriv") and shutil.which("bwrap")


def test_the_profile_is_docker_shaped() -> None:
    prof = json.loads(PROFILE.read_text())
    assert prof["defaultAction"] == "SCMP_ACT_ALLOW"
    assert set(prof["architectures"]) == {"SCMP_ARCH_X86_64", "SCMP_ARCH_AARCH64"}
    denied = {n for rule in prof["syscalls"] for n in rule["names"]}
    # What bubblewrap needs stays allowed.
    assert not denied & {
        "clone",
        "clone3",
        "unshare",
        "setns",
        "mount",
        "umount2",
        "pivot_root",
        "sethostname",
    }


def test_bubblewrap_makes_the_farm_sandbox_under_the_profile(tmp_path: Path) -> None:
    # The namespaces farm.build.isolation asks for, as a non-root worker does
    # (a user namespace of its own, the sandbox uid inside it).
    r = subprocess.run(
        _unprivileged(
            "bwrap",
            "--unshare-user",
            "--uid",
            "65534",
            "--gid",
            "65534",
            "--unshare-pid",
            "--unshare-net",
            "--unshare-ipc",
            "--unshare-uts",
            "--unshare-cgroup-try",
            "--die-with-parent",
            "--hostname",
            "farm-sandbox",
            "--ro-bind",
            "/usr",
            "/usr",
            "--symlink",
            "usr/bin",
            "/bin",
            "--symlink",
            "usr/lib",
            "/lib",
            "--symlink",
            "usr/lib64",
            "/lib64",
            "--proc",
            "/proc",
            "--dev",
            "/dev",
            "--tmpfs",
            "/tmp",
            "/bin/sh",
            "-c",
            "id -u; hostname; grep CapEff /proc/self/status",
        ),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    uid, host, caps = r.stdout.split("\n")[:3]
    assert uid == "65534" and host == "farm-sandbox"
    assert caps.split()[-1] == "0000000000000000"


def test_denied_calls_fail_with_eperm() -> None:
    r = subprocess.run(
        _unprivileged(SYSTEM_PYTHON, "-c", PROBE), capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stderr
    got = {
        line.split()[0]: (int(line.split()[1]), int(line.split()[2]))
        for line in r.stdout.splitlines()
    }
    assert set(got) >= {"keyctl", "bpf", "open_by_handle_at", "ptrace"}
    for name, (ret, err) in got.items():
        assert (ret, err) == (-1, 1), f"{name}: {ret}, errno {err}"
    # The control: without the profile, keyctl's error is the kernel's own.
    r = subprocess.run(
        [
            "setpriv",
            "--reuid",
            WORKER_UID,
            "--regid",
            WORKER_UID,
            "--clear-groups",
            "--inh-caps=-all",
            "--bounding-set=-all",
            SYSTEM_PYTHON,
            "-c",
            PROBE,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    keyctl = next(line for line in r.stdout.splitlines() if line.startswith("keyctl "))
    assert keyctl.split()[2] != "1", keyctl
