"""Alembic migrations against real PostgreSQL and SQLite: they apply, they
undo, they build exactly the schema the models declare, and the farm refuses a
database that is not at head."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from pprint import pformat

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import UniqueConstraint, inspect, text

from registry import db as dbmod
from registry.db import (
    Database,
    SchemaOutOfDate,
    check_schema,
    current_revision,
    downgrade,
    head_revision,
    make_engine,
    migration_engine,
    upgrade,
)
from registry.models import Base

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
MODEL_TABLES = set(Base.metadata.tables)


def _tables(url: str) -> set[str]:
    engine = make_engine(url)
    try:
        return set(inspect(engine).get_table_names())
    finally:
        engine.dispose()


def test_upgrade_downgrade_upgrade(empty_db_url: str) -> None:
    assert current_revision(empty_db_url) is None

    upgrade(empty_db_url)
    assert current_revision(empty_db_url) == head_revision()
    assert _tables(empty_db_url) == MODEL_TABLES | {"alembic_version"}

    downgrade(empty_db_url)
    assert current_revision(empty_db_url) is None
    assert _tables(empty_db_url) <= {"alembic_version"}

    upgrade(empty_db_url)
    assert current_revision(empty_db_url) == head_revision()
    assert _tables(empty_db_url) == MODEL_TABLES | {"alembic_version"}


def test_models_match_migrations(empty_db_url: str) -> None:
    upgrade(empty_db_url)
    engine = make_engine(empty_db_url)
    try:
        with engine.connect() as connection:
            context = MigrationContext.configure(
                connection, opts={"compare_type": True, "compare_server_default": True}
            )
            diff = compare_metadata(context, Base.metadata)
    finally:
        engine.dispose()
    assert diff == [], "models and migrations differ; write a migration:\n" + pformat(diff)


def test_constraint_names_follow_the_naming_convention(empty_db_url: str) -> None:
    # compare_metadata does not look at names; the names are what later
    # migrations (and Conflict.constraint) refer to, so they must match too.
    upgrade(empty_db_url)
    engine = make_engine(empty_db_url)
    try:
        insp = inspect(engine)
        for table in Base.metadata.sorted_tables:
            want_unique = {c.name for c in table.constraints if isinstance(c, UniqueConstraint)}
            want_fks = {fk.name for fk in table.foreign_key_constraints}
            want_indexes = {i.name for i in table.indexes}
            assert {u["name"] for u in insp.get_unique_constraints(table.name)} == want_unique
            assert {f["name"] for f in insp.get_foreign_keys(table.name)} == want_fks
            # PostgreSQL also reports the index behind each unique constraint.
            indexes = {
                i["name"] for i in insp.get_indexes(table.name) if "duplicates_constraint" not in i
            }
            assert indexes == want_indexes
            assert insp.get_pk_constraint(table.name)["name"] == f"pk_{table.name}"
    finally:
        engine.dispose()


def test_check_schema_refuses_an_unmigrated_database(empty_db_url: str) -> None:
    with pytest.raises(SchemaOutOfDate, match="farm db upgrade"):
        Database(empty_db_url, check=True)

    upgrade(empty_db_url)
    Database(empty_db_url, check=True).dispose()


def test_check_schema_names_the_upgrade_for_an_old_revision(
    empty_db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    upgrade(empty_db_url)
    current = dbmod.head_revision()
    # Code one migration ahead of the database: what a deploy without
    # `farm db upgrade` looks like.
    monkeypatch.setattr(dbmod, "head_revision", lambda: "9999")
    engine = make_engine(empty_db_url)
    try:
        with pytest.raises(SchemaOutOfDate, match=rf"at revision {current} .* `farm db upgrade`"):
            check_schema(engine)
    finally:
        engine.dispose()


def test_check_schema_refuses_a_database_from_newer_code(empty_db_url: str) -> None:
    upgrade(empty_db_url)
    engine = make_engine(empty_db_url)
    try:
        with engine.begin() as connection:
            connection.execute(text("UPDATE alembic_version SET version_num = 'f00dfeed'"))
        with pytest.raises(SchemaOutOfDate, match="newer torch-farm"):
            check_schema(engine)
    finally:
        engine.dispose()


def test_concurrent_upgrades_both_succeed(empty_db_url: str) -> None:
    # Services started together each run `farm db upgrade`; Alembic's context
    # is process-global, so race real processes, not threads.
    script = "import sys; from registry.db import upgrade; upgrade(sys.argv[1])"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script, empty_db_url],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for _ in range(2)
    ]
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(outputs)
    assert current_revision(empty_db_url) == head_revision()


def test_sqlite_migrations_are_transactional(sqlite_url: str) -> None:
    # pysqlite would autocommit DDL; the migration engine must not.
    engine = migration_engine(sqlite_url)
    try:
        with engine.connect() as connection:
            transaction = connection.begin()
            connection.execute(text("CREATE TABLE half_done (id INTEGER)"))
            transaction.rollback()
    finally:
        engine.dispose()
    assert "half_done" not in _tables(sqlite_url)


def test_alembic_command_line_uses_the_shipped_ini(sqlite_url: str) -> None:
    ini = REPO / "migrations" / "alembic.ini"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "alembic",
            "-c",
            str(ini),
            "-x",
            f"url={sqlite_url}",
            "upgrade",
            "head",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert current_revision(sqlite_url) == head_revision()
