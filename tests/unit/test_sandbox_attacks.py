"""A hostile model's attacks on the kernel from inside the build sandbox
(tests/unit/attackers/syscall_attacks.py): new user namespaces, joining
namespaces, ptrace and reading another process's memory, kernel modules and
kexec, the keyring, mounts, bpf, perf events, userfaultfd and file handles.
Each is refused by the sandbox's seccomp filter (farm.build.syscall_filter)
with EPERM; the same attacks run unsandboxed show the refusals are the
filter's, not the machine's."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from farm.build import isolation as isolation_mod
from farm.build import syscall_filter
from farm.build.isolation import Isolation, bwrap_argv
from farm.build.sandbox import run_isolated
from tests.sandbox_required import require_sandbox

ATTACKERS = Path(__file__).parent / "attackers"


@pytest.fixture(autouse=True)
def _needs_sandbox() -> None:
    require_sandbox()


def _attack(isolation: Isolation | None) -> dict[str, str]:
    res = run_isolated(
        "syscall_attacks:attack",
        {},
        timeout_s=120,
        memory_mb=2000,
        import_paths=[ATTACKERS],
        isolation=isolation,
        warm=False,
    )
    assert res.ok, (res.error, res.traceback, res.stderr_tail)
    assert isinstance(res.value, dict)
    return res.value


def test_every_refused_syscall_family_fails_with_eperm_in_the_sandbox() -> None:
    inside = _attack(Isolation())
    assert inside.pop("seccomp mode") == "2", "no seccomp filter on the sandboxed child"
    # clone3's flags cannot be read by a filter: ENOSYS makes libc use clone.
    assert inside.pop("clone3") == "ENOSYS"
    assert inside.pop("unshare --user (the command)").startswith("refused")
    refused = {k: v for k, v in inside.items() if v != "EPERM"}
    assert not refused, f"attacks that were not refused: {refused}"

    # The same calls outside the sandbox: some succeed or fail otherwise, so
    # the refusals above are the filter's.
    outside = _attack(None)
    assert outside.pop("seccomp mode") == "0"
    assert outside["setns(-1)"] == "EBADF"
    assert outside["keyctl(GET_KEYRING_ID)"] == "ok"
    assert outside["add_key"] == "ok"
    differ = sorted(k for k in inside if outside.get(k) != "EPERM")
    assert len(differ) >= 4, (differ, outside)


def test_a_new_user_namespace_inside_the_sandbox_is_refused_by_the_kernel_switch_too(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # An unprivileged worker's sandbox has a user namespace of its own;
    # bubblewrap's --disable-userns (where it has it) forbids any further one,
    # beside the filter. Root's sandbox has none (the filter refuses them).
    monkeypatch.setattr(isolation_mod.os, "geteuid", lambda: 1000)
    cmd = bwrap_argv(
        ["true"],
        isolation=Isolation(),
        tmpdir=tmp_path,
        readonly=(),
        env={},
        cwd=None,
        memory_mb=1000,
    )
    try:
        argv = cmd.argv
        assert "--unshare-user" in argv
        if isolation_mod.bwrap_supports("--disable-userns"):
            assert "--disable-userns" in argv
        fd = int(argv[argv.index("--seccomp") + 1])
        assert cmd.pass_fds == (fd,)
        assert os.read(fd, 1 << 20) == syscall_filter.filter_bpf()  # the whole program
    finally:
        cmd.close()


def test_the_filter_is_a_bpf_program_of_whole_instructions() -> None:
    program = syscall_filter.filter_bpf()
    # struct sock_filter is 8 bytes; a filter of this size has every rule.
    assert len(program) % 8 == 0 and len(program) // 8 > len(syscall_filter.REFUSED)
