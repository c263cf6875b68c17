"""Shared fixtures live in tests/fixtures/, one module per real service."""

import os
import tempfile

pytest_plugins = [
    "tests.fixtures.db",
    "tests.fixtures.s3",
    "tests.fixtures.farm",
    "tests.fixtures.faults",
]


def pytest_configure() -> None:
    # The per-machine CPU ISA cache (farm.core.cpu_isa) of this test session, not
    # the user's: shared with the workers and children the tests start, so the
    # ISA is test-compiled once per session rather than once per process.
    # Likewise farm.build.aoti_check's answer (a tiny AOTI build and load).
    d = tempfile.mkdtemp(prefix="farm-test-machine-")
    os.environ.setdefault("FARM_ISA_CACHE", os.path.join(d, "cpu-isa.json"))
    os.environ.setdefault("FARM_AOTI_CHECK_CACHE", os.path.join(d, "aoti-check.json"))
