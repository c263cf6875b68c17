"""Resolve from the API's read model, as a user of the HTTP API sees it.

- Freshness: a change committed through one API process (an alias moved, a
  new artifact) is in the very next resolve another API process answers,
  with no sleep between (real PostgreSQL and its notifications; the second
  API a ``farm serve`` process of its own). SQLite's embedded farm: the same
  with two apps on one database file.
- Bounded answers: the resolve answer is the same size whether the build
  statement carries a 7-entry or a 700-entry weights manifest; the statement
  itself comes from ``/v1/attestations/<digest>`` with an immutable
  Cache-Control, an ETag and 304s, and an unknown digest is a 404 that says
  what to do.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import Engine, select

from farm.core.net import free_port
from registry import models as m
from tests.fixtures.db import _truncate_if_dirty
from tests.fixtures.farm import _wait_http, start_api
from tests.integration.test_api import (
    ADMIN_TOKEN,
    Api,
    _api,
    make_artifact,
    name_key_of,
    resolve_params,
)

pytestmark = pytest.mark.integration


@pytest.fixture
def api(db_url: str, tmp_path: Path) -> Iterator[Api]:
    yield from _api(db_url, tmp_path)


@pytest.fixture
def pg_api(_pg_head: tuple[str, Engine], tmp_path: Path) -> Iterator[Api]:
    """The writer: an API app on the session's PostgreSQL."""
    url, engine = _pg_head
    yield from _api(url, tmp_path)
    _truncate_if_dirty(engine)


@pytest.fixture
def second_api(pg_api: Api, tmp_path: Path) -> Iterator[str]:
    """Another API process (``farm serve``) on the same database; its URL."""
    port = free_port()
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("FARM_", "DATABASE_", "BROKER_", "REDIS_", "BLOB_", "S3_"))
    }
    env.update(
        {
            "FARM_HOME": str(tmp_path / "home2"),
            "DATABASE_URL": str(pg_api.settings.database_url),
            "BLOB_STORE_URL": pg_api.settings.resolved_blob_store_url(),
            "BROKER_URL": "memory://",
            "FARM_AUTH": "true",
            "FARM_ADMIN_TOKEN": ADMIN_TOKEN,
            "FARM_RESOLVE_CACHE_S": "1",
            "PYTHONUNBUFFERED": "1",
        }
    )
    log = tmp_path / "api2.log"
    proc = start_api(env, port, log, "--workers", "1")
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_http(url, proc, log)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _version_of(client: httpx.Client, token: str, ref: str) -> str:
    r = client.get(
        "/v1/resolve", params=resolve_params(ref=ref), headers={"Authorization": f"Bearer {token}"}
    )
    assert r.status_code == 200, r.text
    return str(r.json()["version"])


def test_an_alias_move_and_a_new_artifact_are_in_the_next_resolve_of_another_process(
    pg_api: Api, second_api: str
) -> None:
    key = name_key_of(pg_api.settings)
    for version in ("1", "2"):
        make_artifact(
            pg_api.db, pg_api.store, version=version, name_key=key, fingerprint=version * 64
        )
    read = pg_api.tokens["read"]
    with httpx.Client(base_url=second_api, timeout=10, trust_env=False) as other:
        assert pg_api.put("/v1/models/tiny/aliases/prod", json={"version": "1"}).status_code == 200
        assert _version_of(other, read, "prod") == "1"
        # Each move through the first process, then at once a resolve of the
        # second (its whole-answer cache on: it must not outlive the change).
        for version in ("2", "1", "2", "1", "2", "1", "2", "1"):
            r = pg_api.put("/v1/models/tiny/aliases/prod", json={"version": version})
            assert r.status_code == 200, r.text
            assert _version_of(other, read, "prod") == version
            assert _version_of(other, read, "prod") == version  # and from its cache

        # A new artifact of a shape nobody had: a 404 with its reasons first,
        # then, right after the rows are committed (a writer that is not an
        # API: the service, as a compile worker writes), the artifact.
        params = resolve_params(ref="2", inputs=("int64[1,64]",))
        h = {"Authorization": f"Bearer {read}"}
        assert other.get("/v1/resolve", params=params, headers=h).status_code == 404
        art = make_artifact(
            pg_api.db, pg_api.store, version="2", inputs=("int64[1,64]",), fingerprint="3" * 64
        )
        r = other.get("/v1/resolve", params=params, headers=h)
        assert r.status_code == 200, r.text
        assert r.json()["artifact"]["digest"] == art["digest"]


def test_the_embedded_farms_sqlite_read_model_sees_another_apps_commit(
    _sqlite_head_template: Path, tmp_path: Path
) -> None:
    shutil.copyfile(_sqlite_head_template, tmp_path / "farm.db")
    sqlite_url = f"sqlite:///{tmp_path / 'farm.db'}"
    gen = _api(sqlite_url, tmp_path / "a")
    writer = next(gen)
    reader_gen = _api(sqlite_url, tmp_path / "b")
    reader = next(reader_gen)
    try:
        key = name_key_of(writer.settings)
        for version in ("1", "2"):
            make_artifact(
                writer.db, writer.store, version=version, name_key=key, fingerprint=version * 64
            )
        h = {"Authorization": f"Bearer {writer.tokens['read']}"}
        for version in ("1", "2", "1"):
            assert (
                writer.put("/v1/models/tiny/aliases/prod", json={"version": version}).status_code
                == 200
            )
            r = reader.client.get("/v1/resolve", params=resolve_params(ref="prod"), headers=h)
            assert r.status_code == 200, r.text
            assert r.json()["version"] == version
    finally:
        for g in (reader_gen, gen):
            g.close()


def _statement(manifest_entries: int, digest: str) -> str:
    """A build statement shaped like a large model's: its weights manifest and
    verification report grow with the parameter count (unsigned: only the
    answer's size and the route are under test here)."""
    manifest = [
        {
            "name": f"layers.{i // 10}.w{i % 10}",
            "shape": [8192, 8192],
            "dtype": "bfloat16",
            "device": "meta",
            "requires_grad": False,
        }
        for i in range(manifest_entries)
    ]
    report = {"outputs": [{"index": i, "max_abs_err": 0.001} for i in range(manifest_entries)]}
    payload = {
        "predicate": {
            "artifact": {"digest": digest},
            "weights_manifest": manifest,
            "verification": report,
        }
    }
    return json.dumps(
        {
            "payloadType": "application/vnd.in-toto+json",
            "payload": json.dumps(payload),
            "signatures": [],
        }
    )


def _with_statement(api: Api, name: str, entries: int) -> tuple[dict[str, Any], str]:
    art = make_artifact(api.db, api.store, name=name)
    text = _statement(entries, art["digest"])
    with api.db.session() as s:
        row = s.scalar(select(m.Artifact).where(m.Artifact.digest == art["digest"]))
        assert row is not None
        row.attestation = text
        row.meta = {
            **row.meta,
            "weights_manifest": json.loads(json.loads(text)["payload"])["predicate"][
                "weights_manifest"
            ],
        }
    return art, text


def test_answer_size_does_not_grow_with_the_manifest_and_the_statement_is_served_by_digest(
    api: Api,
) -> None:
    _, small_text = _with_statement(api, "small", 7)
    big_art, big_text = _with_statement(api, "big", 700)
    assert len(big_text) > 50 * len(small_text) / 10  # the statements do differ a lot
    sizes = {}
    bodies = {}
    for name in ("small", "big"):
        r = api.get("/v1/resolve", params=resolve_params(name), role="read")
        assert r.status_code == 200, r.text
        sizes[name], bodies[name] = len(r.content), r.json()
    # Equal but for the model's name (3 vs 5 letters, twice) and the random digests.
    assert abs(sizes["big"] - sizes["small"]) <= 8, sizes
    art = bodies["big"]["artifact"]
    assert "weights_manifest" not in json.dumps(bodies["big"])
    named = art["attestation"]["build_statement"]
    digest = hashlib.sha256(big_text.encode()).hexdigest()
    assert named == {"digest": digest, "url": f"/v1/attestations/{digest}"}
    assert art["digest"] == big_art["digest"]

    r = api.get(named["url"], role="read")
    assert r.status_code == 200
    assert r.content == big_text.encode()
    assert hashlib.sha256(r.content).hexdigest() == digest
    assert r.headers["etag"] == f'"{digest}"'
    assert "immutable" in r.headers["cache-control"]
    assert "max-age=31536000" in r.headers["cache-control"]
    again = api.get(named["url"], role="read", headers={"If-None-Match": f'"{digest}"'})
    assert again.status_code == 304 and again.content == b""

    unknown = api.get(f"/v1/attestations/{'0' * 64}", role="read")
    assert unknown.status_code == 404
    assert "resolve again" in unknown.json()["detail"]
    bad = api.get("/v1/attestations/not-a-digest", role="read")
    assert bad.status_code == 422
    assert api.client.get(named["url"]).status_code == 401  # a token, as for everything
