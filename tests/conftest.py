"""Shared fixtures live in tests/fixtures/, one module per real service."""

pytest_plugins = [
    "tests.fixtures.db",
    "tests.fixtures.s3",
    "tests.fixtures.farm",
    "tests.fixtures.faults",
]
