"""Alembic migrations against real PostgreSQL and SQLite: they apply, they
undo, they build exactly the schema the models declare, and the farm refuses a
database that is not at head."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from pprint import pformat

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import Connection, UniqueConstraint, inspect, text

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


@contextlib.contextmanager
def _connection(url: str, *, write: bool = False) -> Iterator[Connection]:
    """A connection to ``url`` (in a transaction committed at the end when
    ``write``), its engine disposed after."""
    engine = make_engine(url)
    try:
        with engine.begin() if write else engine.connect() as c:
            yield c
    finally:
        engine.dispose()


def _tables(url: str) -> set[str]:
    with _connection(url) as c:
        return set(inspect(c).get_table_names())


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


def test_projects_migration_keeps_existing_data(empty_db_url: str) -> None:
    """0009 (projects): what a farm built before it is all still there, in the
    ``default`` project; tokens that could write keep writing there; an alias
    a version shadowed is renamed, and the history says so."""
    upgrade(empty_db_url, "0008")
    now = "2026-12-01 00:00:00"
    with _connection(empty_db_url, write=True) as c:
        for i, (name, role, revoked) in enumerate([
                ("fleet", "read", False), ("ci", "submit", False), ("ops", "admin", False),
                ("gone", "submit", True), ("ci", "read", False)]):
            c.execute(text("INSERT INTO api_tokens (name, token_hash, role, revoked, "
                           "created_at) VALUES (:n, :h, :r, :rv, :t)"),
                      {"n": name, "h": f"{i:064d}", "r": role, "rv": revoked, "t": now})
        c.execute(text("INSERT INTO models (id, name, created_at) VALUES "
                       "(1, 'payments', :t), (2, 'tiny', :t)"), {"t": now})
        for vid, mid, version in [(1, 1, "1"), (2, 1, "2"), (3, 2, "1")]:
            c.execute(text("INSERT INTO model_versions (id, model_id, version, entrypoint, "
                           "kwargs, kind, created_at) VALUES (:id, :m, :v, 'farm.zoo.mlp:make',"
                           " '{}', 'factory', :t)"), {"id": vid, "m": mid, "v": version,
                                                      "t": now})
        # "prod" is a plain alias; "2" is shadowed by version 2 (dead, and the
        # takeover the issue describes).
        for aid, name, vid in [(1, "prod", 1), (2, "2", 1)]:
            c.execute(text("INSERT INTO aliases (id, model_id, name, version_id, updated_at) "
                           "VALUES (:id, 1, :n, :v, :t)"), {"id": aid, "n": name, "v": vid,
                                                           "t": now})
        c.execute(text("INSERT INTO name_bindings (model, kind, ref, version, envelope, "
                       "issued_at) VALUES ('payments', 'alias', '2', '1', '{}', :t), "
                       "('payments', 'alias', 'prod', '1', '{}', :t)"), {"t": now})

    upgrade(empty_db_url)

    with _connection(empty_db_url) as c:
        assert c.execute(text("SELECT name, project FROM models ORDER BY id")).all() == [
            ("payments", "default"), ("tiny", "default")]
        assert c.execute(text("SELECT count(*) FROM model_versions")).scalar() == 3
        assert c.execute(text("SELECT count(*) FROM api_tokens")).scalar() == 5
        roles = c.execute(text("SELECT project, principal, role FROM project_roles "
                               "ORDER BY principal")).all()
        # fleet (read only) stays a farm-wide reader: no role; a revoked token none.
        assert roles == [("default", "ci", "maintainer"), ("default", "ops", "owner")]
        aliases = c.execute(text("SELECT a.name, v.version FROM aliases a JOIN "
                                 "model_versions v ON v.id = a.version_id "
                                 "ORDER BY a.name")).all()
        assert aliases == [("2-alias", "1"), ("prod", "1")]
        assert c.execute(text("SELECT ref FROM name_bindings WHERE kind = 'alias'")
                         ).scalars().all() == ["prod"]
        events = c.execute(text("SELECT alias, version, previous, actor FROM alias_events "
                                "ORDER BY id")).all()
        assert [(a, v, p) for a, v, p, _ in events] == [("2", None, "1"),
                                                         ("2-alias", "1", None)]
        assert "shadowed by version '2'" in events[0][3]

    downgrade(empty_db_url, "0008")
    assert "projects" not in _tables(empty_db_url)
    upgrade(empty_db_url)


def test_repeated_blocks_migration_reads_the_kept_trace_reports(empty_db_url: str) -> None:
    """0013: a job whose log still holds its trace report gets the report's
    region count; one whose log is an error, or that was never traced, none."""
    upgrade(empty_db_url, "0012")
    now = "2026-12-01 00:00:00"
    with _connection(empty_db_url, write=True) as c:
        c.execute(text("INSERT INTO models (id, name, project, created_at) VALUES "
                       "(1, 'llama', 'default', :t)"), {"t": now})
        c.execute(text("INSERT INTO model_versions (id, model_id, version, entrypoint, "
                       "kwargs, kind, created_at) VALUES (1, 1, '1', 'farm.zoo.mlp:make',"
                       " '{}', 'factory', :t)"), {"t": now})
        for job_id, fingerprint, log in [
                ("traced", "f" * 64, '{"capture": "dynamo+regions", "regions": 16}'),
                ("failed-later", "f" * 64, "Traceback (most recent call last): ..."),
                ("queued", None, None)]:
            c.execute(text("INSERT INTO jobs (id, version_id, spec, inputs, grad_mode, "
                           "options, state, fingerprint, log, rebuild, created_at, "
                           "updated_at) VALUES (:id, 1, '{}', 'x:float32[1]', 'inference', "
                           "'{}', 'compiling', :fp, :log, false, :t, :t)"),
                      {"id": job_id, "fp": fingerprint, "log": log, "t": now})

    upgrade(empty_db_url)

    with _connection(empty_db_url) as c:
        assert dict(c.execute(text("SELECT id, repeated_blocks FROM jobs")).all()) == {
            "traced": 16, "failed-later": None, "queued": None}
