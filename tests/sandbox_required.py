"""Sandbox tests fail, not skip, where the sandbox cannot be built: a CI
machine without bubblewrap or the seccomp library would otherwise pass with
the tests that attack the sandbox not run at all (scripts/bootstrap.sh
installs both).

A developer's machine that cannot have them sets
``FARM_TEST_SANDBOX_OPTIONAL=1`` to skip those tests instead; CI never sets it.

Use in a test module::

    @pytest.fixture(autouse=True)
    def _needs_sandbox() -> None:
        require_sandbox()
"""

from __future__ import annotations

import os
import shutil

import pytest

OPT_OUT = "FARM_TEST_SANDBOX_OPTIONAL"


def sandbox_missing() -> str | None:
    """What this machine lacks to run sandboxed builds (None: nothing)."""
    from farm.build import syscall_filter
    from farm.build.isolation import NO_BWRAP

    if shutil.which("bwrap") is None:
        return NO_BWRAP
    return syscall_filter.available()


def require_sandbox() -> None:
    """Fail the calling test when the sandbox is missing (skip with the opt-out)."""
    why = sandbox_missing()
    if why is None:
        return
    if os.environ.get(OPT_OUT) == "1":
        pytest.skip(f"{why} ({OPT_OUT}=1)")
    pytest.fail(
        f"this test needs the build sandbox: {why}; set {OPT_OUT}=1 to skip it on a "
        "development machine that cannot have it",
        pytrace=False,
    )
