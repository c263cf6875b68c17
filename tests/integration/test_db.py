"""The database layer on real PostgreSQL and SQLite: managed sessions, the
constraints that make duplicates impossible, and rows back to entities."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from sqlalchemy import delete, func, select, text

from farm.core.inputs import parse_inputs
from farm.core.specs import CompileOptions, GradMode
from farm.core.target import Target
from registry import models as m
from registry.convert import BadRow, artifact_row
from registry.db import (
    Conflict,
    Database,
    DatabaseUnavailable,
    artifact_to_record,
    make_engine,
)

pytestmark = pytest.mark.integration

CPU = Target(
    device="cpu",
    python_version="3.11.7",
    torch_version="2.13.0+cpu",
    cpu_isa="avx512",
    threads=2,
)
H200 = Target(
    device="cuda",
    python_version="3.12.3",
    torch_version="2.11.0+cu130",
    gpu_name="NVIDIA H200",
    capability="9.0",
    cuda_version="13.0",
    triton_version="3.6",
)


def _artifact(
    *,
    target: Target = CPU,
    fmt: str = "aot_compile",
    digest: str = "a" * 64,
    fingerprint: str = "f" * 64,
    **extra: Any,
) -> m.Artifact:
    return artifact_row(
        digest=digest,
        size=187_000,
        format=fmt,
        fingerprint=fingerprint,
        inputs=parse_inputs(["float32[2..64,128]", "int64[1,16]"]),
        grad_mode=GradMode.INFERENCE,
        options=CompileOptions(mode="max-autotune"),
        target=target,
        **extra,
    )


def _model_version(db: Database, name: str = "mlp", version: str = "1.0") -> int:
    with db.session() as s:
        model = m.Model(name=name)
        s.add(model)
        s.flush()
        mv = m.ModelVersion(model_id=model.id, version=version, entrypoint="farm.zoo:mlp")
        s.add(mv)
        s.flush()
        return mv.id


def _count(db: Database, model: type[m.Base]) -> int:
    with db.session() as s:
        return int(s.scalar(select(func.count()).select_from(model)) or 0)


# --- managed sessions --------------------------------------------------------


def test_session_commits(database: Database) -> None:
    with database.session() as s:
        s.add(m.Model(name="mlp"))
    with database.session() as s:
        assert s.scalars(select(m.Model.name)).all() == ["mlp"]


def test_session_rolls_back_on_error(database: Database) -> None:
    with pytest.raises(RuntimeError, match="boom"), database.session() as s:
        s.add(m.Model(name="mlp"))
        s.flush()  # the row reached the database, inside the transaction
        raise RuntimeError("boom")
    assert _count(database, m.Model) == 0


def test_savepoint_as_first_write_is_still_rolled_back(database: Database) -> None:
    # On SQLite a SAVEPOINT outside a transaction would start (and, when
    # released, commit) one of its own.
    with pytest.raises(RuntimeError), database.session() as s:
        with s.begin_nested():
            s.add(m.Model(name="mlp"))
        raise RuntimeError("after the savepoint")
    assert _count(database, m.Model) == 0


def test_duplicate_model_name_conflicts(database: Database) -> None:
    _model_version(database, "mlp")
    with pytest.raises(Conflict, match="uq_models_name") as err, database.session() as s:
        s.add(m.Model(name="mlp"))
    assert err.value.constraint == "uq_models_name"
    # The failed session left nothing broken behind.
    _model_version(database, "other")
    assert _count(database, m.Model) == 2


def test_duplicate_model_version_conflicts(database: Database) -> None:
    version_id = _model_version(database, "mlp", "1.0")
    with database.session() as s:
        model_id = s.get_one(m.ModelVersion, version_id).model_id
    with pytest.raises(Conflict) as err, database.session() as s:
        s.add(m.ModelVersion(model_id=model_id, version="1.0", entrypoint="farm.zoo:mlp"))
    assert err.value.constraint == "uq_model_versions_model_id_version"
    with database.session() as s:
        s.add(m.ModelVersion(model_id=model_id, version="1.1", entrypoint="farm.zoo:mlp"))


def test_duplicate_artifact_conflicts(database: Database) -> None:
    with database.session() as s:
        s.add(_artifact())
    # Other bytes, same build: still one artifact per (build_key, format).
    with (
        pytest.raises(Conflict, match="conflicts with existing data") as err,
        database.session() as s,
    ):
        s.add(_artifact(digest="b" * 64))
    assert err.value.constraint == "uq_artifacts_build_key_format"

    with database.session() as s:
        s.add(_artifact(fmt="aoti"))  # another format of the same build
        s.add(_artifact(target=H200))  # the same bytes may back another build
    assert _count(database, m.Artifact) == 3


def test_duplicate_build_per_job_and_target_conflicts(database: Database) -> None:
    version_id = _model_version(database)
    with database.session() as s:
        s.add(
            m.Job(
                id="j1",
                version_id=version_id,
                spec={},
                inputs="float32[8,64]",
                grad_mode="inference",
                options="{}",
            )
        )
        s.flush()
        s.add(m.Build(id="b1", job_id="j1", target=str(CPU)))
    with pytest.raises(Conflict) as err, database.session() as s:
        s.add(m.Build(id="b2", job_id="j1", target=str(CPU)))
    assert err.value.constraint == "uq_builds_job_id_target"


def test_foreign_keys_are_enforced(database: Database) -> None:
    with pytest.raises(Conflict), database.session() as s:
        s.add(m.ModelVersion(model_id=12345, version="1.0", entrypoint="farm.zoo:mlp"))


def test_deleting_a_model_cascades(database: Database) -> None:
    _model_version(database, "mlp")
    with database.session() as s:
        s.execute(delete(m.Model))
    assert _count(database, m.ModelVersion) == 0


def test_datetimes_come_back_aware_in_utc(database: Database) -> None:
    seen = datetime(2026, 1, 2, 3, 4, 5, tzinfo=timezone(timedelta(hours=2)))
    with database.session() as s:
        s.add(m.WorkerHeartbeat(id="h:1", kind="trace", queue="trace", last_seen=seen))
        naive_utc = datetime(2026, 1, 2, 1, 4, 5)  # taken as UTC
        s.add(m.WorkerHeartbeat(id="h:2", kind="trace", queue="trace", last_seen=naive_utc))
    with database.session() as s:
        rows = s.scalars(select(m.WorkerHeartbeat).order_by(m.WorkerHeartbeat.id)).all()
        for row in rows:
            assert row.last_seen == seen
            assert row.last_seen.utcoffset() == timedelta(0)
            assert row.started_at.tzinfo is not None
        cutoff = seen - timedelta(seconds=1)
        fresh = s.scalars(select(m.WorkerHeartbeat.id).where(m.WorkerHeartbeat.last_seen > cutoff))
        assert sorted(fresh) == ["h:1", "h:2"]


# --- rows to entities ----------------------------------------------------------


@pytest.mark.parametrize("target", [CPU, H200], ids=["cpu", "cuda"])
def test_artifact_to_record_round_trip(database: Database, target: Target) -> None:
    with database.session() as s:
        row = _artifact(
            target=target,
            verified=True,
            max_abs_err=1e-6,
            first_call_s=0.01,
            load_s=2.3,
            attestation='{"payload": "x"}',
            meta={"compile_s": 15.2},
        )
        s.add(row)
        s.flush()
        artifact_id = row.id
    with database.session() as s:
        record = artifact_to_record(s.get_one(m.Artifact, artifact_id))

    assert record.id == artifact_id
    assert record.target == target
    assert record.inputs == parse_inputs(["float32[2..64,128]", "int64[1,16]"])
    assert record.inputs[0].dynamic_dims == (0,)
    assert record.grad_mode is GradMode.INFERENCE
    assert record.options == CompileOptions(mode="max-autotune")
    assert (record.digest, record.size, record.format) == ("a" * 64, 187_000, "aot_compile")
    assert record.verified is True and record.first_call_compiles is False
    assert (record.max_abs_err, record.first_call_s, record.load_s) == (1e-6, 0.01, 2.3)
    assert record.attestation == '{"payload": "x"}'
    assert "signature" not in record.to_json()
    assert record.meta == {"compile_s": 15.2}
    assert record.created_at is not None and record.created_at.utcoffset() == timedelta(0)
    assert record.to_json()["target_fields"] == target.to_json()


def test_artifact_row_fills_the_target_columns(database: Database) -> None:
    with database.session() as s:
        s.add(_artifact(target=H200))
    with database.session() as s:
        found = s.execute(
            text("SELECT gpu_name, capability, cuda_version, cpu_isa FROM artifacts")
        ).one()
    assert tuple(found) == ("NVIDIA H200", "9.0", "13.0", None)


def test_artifact_to_record_rejects_columns_that_contradict_the_target(
    database: Database,
) -> None:
    with database.session() as s:
        row = _artifact(target=CPU)
        row.cpu_isa = "avx2"
        s.add(row)
        s.flush()
        with pytest.raises(BadRow, match="cpu_isa"):
            artifact_to_record(row)


# --- engines -------------------------------------------------------------------


def test_unreachable_database_is_unavailable(tmp_path: Any) -> None:
    url = "postgresql://postgres@127.0.0.1:1/nothing"  # nothing listens on port 1
    db = Database(url)
    try:
        with pytest.raises(DatabaseUnavailable, match="cannot reach"), db.session():
            pass
    finally:
        db.dispose()
    with pytest.raises(DatabaseUnavailable):
        Database(url, check=True)


def test_make_engine_picks_psycopg_and_rejects_unknown_schemes() -> None:
    engine = make_engine("postgresql://postgres@127.0.0.1:5432/x")
    assert engine.url.drivername == "postgresql+psycopg"
    engine.dispose()
    with pytest.raises(ValueError, match=r"known schemes: .*sqlite:///"):
        make_engine("mysql://root@localhost/x")


def test_postgres_connections_give_up_on_a_silent_peer_in_seconds(pg_url: str) -> None:
    """What the server's connection reports it runs with: unacknowledged
    sends bounded (tcp_user_timeout) and keepalives on, so a query to a host
    gone without a FIN fails in seconds instead of TCP's minutes."""
    engine = make_engine(pg_url)
    try:
        with engine.connect() as conn:
            params = conn.connection.dbapi_connection.info.get_parameters()  # type: ignore[union-attr]
        assert params["tcp_user_timeout"] == "10000" and params["keepalives"] == "1", params
        assert int(params["connect_timeout"]) <= 5, params
    finally:
        engine.dispose()


def test_sqlite_engine_creates_its_directory_and_sets_pragmas(tmp_path: Any) -> None:
    engine = make_engine(f"sqlite:///{tmp_path / 'a' / 'b' / 'farm.db'}")
    try:
        with engine.connect() as connection:
            pragma = connection.exec_driver_sql
            assert pragma("PRAGMA journal_mode").scalar() == "wal"
            assert pragma("PRAGMA foreign_keys").scalar() == 1
            assert pragma("PRAGMA busy_timeout").scalar() == 30_000
    finally:
        engine.dispose()
    assert (tmp_path / "a" / "b" / "farm.db").exists()
