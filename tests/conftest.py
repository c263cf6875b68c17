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
    # The per-machine CPU ISA cache (farm.cpu_isa) of this test session, not
    # the user's: shared with the workers and children the tests start, so the
    # ISA is test-compiled once per session rather than once per process.
    if "FARM_ISA_CACHE" not in os.environ:
        d = tempfile.mkdtemp(prefix="farm-test-isa-")
        os.environ["FARM_ISA_CACHE"] = os.path.join(d, "cpu-isa.json")
