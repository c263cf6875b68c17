"""The backup and restore of docs/operations.md, done as it says: pg_dump
of a farm's database, the database wiped, pg_restore, and a fresh API over
the restored database resolves the same artifact to the same bytes (the
blob store is backed up apart: it is content-addressed, so a copy of it is
consistent with any dump taken after it). Real PostgreSQL."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from registry.db import upgrade
from tests.integration.test_api import _api, make_artifact, resolve_params

pytestmark = pytest.mark.integration


def libpq_url(db_url: str) -> str:
    """The URL pg_dump and pg_restore take (no SQLAlchemy driver name)."""
    return make_url(db_url).set(drivername="postgresql").render_as_string(hide_password=False)


def resolve(db_url: str, tmp_path: Path) -> tuple[str, bytes]:
    gen = _api(db_url, tmp_path)
    api = next(gen)
    try:
        r = api.get("/v1/resolve", params=resolve_params())
        assert r.status_code == 200, r.text
        digest = r.json()["artifact"]["digest"]
        blob = api.get(f"/v1/artifacts/{digest}/blob")
        assert blob.status_code == 200
        return digest, blob.content
    finally:
        gen.close()


def test_dump_wipe_restore_and_the_same_artifact_resolves(
        make_pg_database: Callable[[], str], tmp_path: Path) -> None:
    db_url = make_pg_database()
    upgrade(db_url)
    gen = _api(db_url, tmp_path)
    api = next(gen)
    try:
        art = make_artifact(api.db, api.store, data=b"restored bytes " * 100)
    finally:
        gen.close()
    before = resolve(db_url, tmp_path)
    assert before == (art["digest"], art["data"])

    dump = tmp_path / "farm.dump"
    subprocess.run(["pg_dump", "--format=custom", "--file", str(dump), libpq_url(db_url)],
                   check=True, timeout=120)
    # The wipe: every table gone, as after a lost disk.
    engine = create_engine(db_url)
    with engine.begin() as c:
        c.execute(text("DROP SCHEMA public CASCADE"))
        c.execute(text("CREATE SCHEMA public"))
    with engine.connect() as c:
        assert c.execute(text("SELECT count(*) FROM pg_tables WHERE schemaname = 'public'")
                         ).scalar() == 0
    engine.dispose()
    subprocess.run(["pg_restore", "--no-owner", "--exit-on-error", "--dbname", libpq_url(db_url),
                    str(dump)], check=True, timeout=120)
    # At the head migration still: an upgrade after a restore has nothing to do.
    upgrade(db_url)
    assert resolve(db_url, tmp_path) == before
