"""The HTTP API against real databases (PostgreSQL and SQLite), real blob
stores (a local directory and S3 over HTTP) and, for the enqueue, real Redis.

Rows are made through ``registry.service`` exactly as the workers make them
(submit, trace, claim, finish), so the API reads what production writes.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Generator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import func, select

from farm.core.settings import Settings
from farm.core.specs import JobSpec
from farm.core.target import Target
from registry import auth, service
from registry import models as m
from registry.api import create_app
from registry.blobstore import BlobStore, open_blob_store
from registry.db import Database

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
ADMIN_TOKEN = "api-test-admin-token"
CPU = Target.parse("cpu/python=3.11.7/torch=2.13.0+cpu/isa=avx2/threads=2")
CPU_512 = Target.parse("cpu/python=3.11.7/torch=2.13.0+cpu/isa=avx512/threads=2")
ENTRYPOINT = "farm.zoo.llama:tiny"


@dataclass
class Api:
    client: TestClient
    db: Database  # the test's own handle, for setup and row counts
    store: BlobStore
    settings: Settings
    enqueued: list[str] = field(default_factory=list)
    tokens: dict[str, str] = field(default_factory=dict)

    def h(self, role: str = "admin") -> dict[str, str]:
        return {"Authorization": f"Bearer {self.tokens[role]}"}

    def get(self, url: str, role: str = "read", **kw: Any) -> httpx.Response:
        return self.client.get(url, headers={**self.h(role), **kw.pop("headers", {})}, **kw)

    def post(self, url: str, role: str = "submit", **kw: Any) -> httpx.Response:
        return self.client.post(url, headers={**self.h(role), **kw.pop("headers", {})}, **kw)

    def put(self, url: str, role: str = "submit", **kw: Any) -> httpx.Response:
        return self.client.put(url, headers={**self.h(role), **kw.pop("headers", {})}, **kw)


def make_settings(tmp_path: Path, db_url: str, **over: Any) -> Settings:
    values: dict[str, Any] = {
        "farm_home": tmp_path / "home",
        "database_url": db_url,
        "blob_store_url": (tmp_path / "blobs").as_uri(),
        "farm_admin_token": ADMIN_TOKEN,
        "farm_auth": True,
        "broker_url": "memory://",
        "redis_url": "",
        "max_body_bytes": 64_000,
        "heartbeat_s": 10,
    }
    values.update(over)
    return Settings(**values)


@pytest.fixture
def api(db_url: str, tmp_path: Path) -> Iterator[Api]:
    yield from _api(db_url, tmp_path)


def _api(db_url: str, tmp_path: Path, *, resolve_cache_s: float = 0,
         **over: Any) -> Generator[Api, None, None]:
    settings = make_settings(tmp_path, db_url, **over)
    db = Database(db_url)
    enqueued: list[str] = []
    app = create_app(settings, enqueue=enqueued.append, resolve_cache_s=resolve_cache_s)
    tokens = {"admin": ADMIN_TOKEN}
    for role in ("read", "submit"):
        tokens[role] = auth.create_token(db, f"test-{role}", role)
    store = open_blob_store(settings.resolved_blob_store_url(),
                            **({"endpoint_url": settings.s3_endpoint_url}
                               if settings.resolved_blob_store_url().startswith("s3://") else {}))
    with TestClient(app) as client:
        yield Api(client, db, store, settings, enqueued, tokens)
    db.dispose()


def spec_json(name: str = "tiny", version: str = "1", *, inputs: list[str] | None = None,
              targets: list[str] | None = None, entrypoint: str = ENTRYPOINT,
              grad_mode: str = "inference") -> dict[str, Any]:
    return {
        "name": name, "version": version,
        "model": {"entrypoint": entrypoint, "kwargs": {"vocab": 64}, "kind": "factory"},
        "inputs": inputs or ["int64[1,16]"], "grad_mode": grad_mode, "options": {},
        "targets": [str(CPU)] if targets is None else targets,
    }


def beat(db: Database, target: Target, worker: str = "host:1") -> None:
    service.record_heartbeat(db, worker_id=worker, kind="compile", queue=target.queue,
                             target=str(target))


def make_artifact(db: Database, store: BlobStore, *, name: str = "tiny", version: str = "1",
                  inputs: tuple[str, ...] = ("int64[1,16]",), target: Target = CPU,
                  fmt: str = "aoti", data: bytes | None = None,
                  fingerprint: str = "f" * 64, also: tuple[str, ...] = (),
                  name_key: Path | None = None) -> dict[str, Any]:
    """An artifact made the way the workers make one (and one more per format in
    ``also``, from the same build); returns the first as its job view shows it.
    With ``name_key``, the version is bound by it as the API binds a submission
    (needed to set an alias on it); no builder attests these rows."""
    spec = JobSpec.from_json(spec_json(name, version, inputs=list(inputs), targets=[str(target)]))
    job_id = service.submit_job(db, spec, targets=[target])
    if name_key is not None:
        bind_version(db, spec, name_key)
    service.start_trace(db, job_id)
    dispatch = service.record_trace(db, job_id, {"fingerprint": fingerprint, "param_count": 10})
    data = data if data is not None else os.urandom(3000) + name.encode() + version.encode()
    blobs = {fmt: data, **{f: os.urandom(2000) for f in also}}
    infos = {f: store.put_bytes(b) for f, b in blobs.items()}
    for d in dispatch:
        assert service.begin_compile(db, d.build_key, worker_id="host:1",
                                     heartbeat_max_age_s=30).action == "run"
        service.finish_compile(
            db, d.build_key, target=target, spec=spec, fingerprint=fingerprint,
            artifacts=[service.NewArtifact(digest=i.digest, size=i.size, format=f,
                                           verified=True, first_call_compiles=False,
                                           max_abs_err=0.0, first_call_s=0.01, load_s=0.1,
                                           meta={}) for f, i in infos.items()],
            compile_s=2.5)
    view = service.job_view(db, job_id)
    assert view["state"] == "succeeded", view
    arts = {a["format"]: a for b in view["builds"] for a in b["artifacts"]}
    assert set(arts) == set(blobs), view
    return dict(arts[fmt], data=data, job_id=job_id)


def bind_version(db: Database, spec: JobSpec, name_key: Path) -> None:
    import json

    from farm.core import attest
    from farm.core.keys import load_or_create_signing_key
    from registry.service import trust

    stmt = attest.version_statement(model=spec.name, version=spec.version,
                                    program=attest.program_of_spec(spec),
                                    issued_at=attest.now_iso())
    env = attest.sign_statement(load_or_create_signing_key(name_key), stmt)
    trust.put_binding(db, model=spec.name, kind=trust.VERSION, ref=spec.version,
                      version=spec.version, envelope=json.dumps(env))


def name_key_of(settings: Settings) -> Path:
    return settings.farm_home / "name-key.pem"


def row_counts(db: Database) -> dict[str, int]:
    with db.session() as s:
        return {t.name: int(s.scalar(select(func.count()).select_from(t)) or 0)
                for t in m.Base.metadata.sorted_tables}


def resolve_params(model: str = "tiny", *, ref: str | None = "1",
                   inputs: tuple[str, ...] = ("int64[1,16]",), target: Target = CPU,
                   **extra: Any) -> list[tuple[str, str]]:
    params = [("model", model), ("target", str(target))]
    if ref is not None:
        params.append(("ref", ref))
    params += [("input", i) for i in inputs]
    params += [(k, str(v)) for k, v in extra.items()]
    return params


# --- jobs ---------------------------------------------------------------------


def test_openapi_document(api: Api) -> None:
    doc = api.client.get("/openapi.json").json()
    for path in ("/v1/jobs", "/v1/jobs/{job_id}", "/v1/models", "/v1/models/{name}",
                 "/v1/models/{name}/aliases/{alias}", "/v1/resolve", "/v1/artifacts/{digest}",
                 "/v1/artifacts/{digest}/blob", "/v1/targets", "/v1/misses", "/v1/tokens",
                 "/healthz", "/metrics", "/v1/trust-list", "/v1/keys", "/v1/root-key"):
        assert path in doc["paths"], path
    assert doc["components"]["securitySchemes"]


def test_submit_job_then_status(api: Api) -> None:
    r = api.post("/v1/jobs", json=spec_json())
    assert r.status_code == 201, r.text
    body = r.json()
    assert body["state"] == "queued" and body["enqueued"] is True
    assert r.headers["location"] == f"/v1/jobs/{body['id']}"
    assert [b["target"] for b in body["builds"]] == [str(CPU)]
    assert [b["state"] for b in body["builds"]] == ["pending"]
    # Enqueued exactly once, after the commit (the row is already readable).
    assert api.enqueued == [body["id"]]
    job = api.get(f"/v1/jobs/{body['id']}").json()
    assert job["model"] == "tiny" and job["version"] == "1" and job["state"] == "queued"
    assert job["submitted_by"] == "test-submit"
    assert job["spec"]["inputs"] == ["int64[1,16]"]


def test_submit_expands_a_selector_to_live_targets(api: Api) -> None:
    beat(api.db, CPU, "a:1")
    beat(api.db, CPU_512, "b:1")
    r = api.post("/v1/jobs", json=spec_json(targets=["cpu/isa=avx512"]))
    assert r.status_code == 201, r.text
    assert [b["target"] for b in r.json()["builds"]] == [str(CPU_512)]
    r = api.post("/v1/jobs", json=spec_json(targets=[]))
    assert r.status_code == 201, r.text
    assert sorted(b["target"] for b in r.json()["builds"]) == sorted([str(CPU), str(CPU_512)])


def test_enqueue_failure_keeps_the_job(db_url: str, tmp_path: Path) -> None:
    def broker_down(job_id: str) -> None:
        raise ConnectionError("Error 111 connecting to 127.0.0.1:6399. Connection refused.")

    settings = make_settings(tmp_path, db_url)
    app = create_app(settings, enqueue=broker_down)
    with TestClient(app) as client:
        r = client.post("/v1/jobs", json=spec_json(),
                        headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
    assert r.status_code == 201, r.text
    body = r.json()
    assert body["enqueued"] is False and "broker" in body["warning"]
    db = Database(db_url)
    try:
        assert service.job_view(db, body["id"])["state"] == "queued"
    finally:
        db.dispose()


def test_default_enqueue_lands_on_redis_trace_queue(db_url: str, tmp_path: Path,
                                                    redis_url: str) -> None:
    import redis

    client = redis.Redis.from_url(redis_url)
    client.delete("trace")
    # A fresh interpreter: the Celery app reads its broker from the environment
    # once, at import, and must not be shared with other tests.
    script = (
        "import json, sys\n"
        "from fastapi.testclient import TestClient\n"
        "from registry.api import create_app\n"
        "c = TestClient(create_app())\n"
        f"r = c.post('/v1/jobs', json={spec_json()!r}, "
        f"headers={{'Authorization': 'Bearer {ADMIN_TOKEN}'}})\n"
        "print(json.dumps(r.json()))\n"
        "sys.exit(0 if r.status_code == 201 else 1)\n"
    )
    env = {**os.environ, "DATABASE_URL": db_url, "REDIS_URL": redis_url,
           "BLOB_STORE_URL": (tmp_path / "blobs").as_uri(), "FARM_HOME": str(tmp_path / "h"),
           "FARM_ADMIN_TOKEN": ADMIN_TOKEN, "FARM_AUTH": "true"}
    env.pop("BROKER_URL", None)
    out = subprocess.run([sys.executable, "-c", script], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    body = json.loads(out.stdout.strip().splitlines()[-1])
    assert body["enqueued"] is True, body.get("warning")
    assert client.llen("trace") == 1
    message = json.loads(client.lindex("trace", 0) or b"{}")
    assert message["headers"]["task"] == "farm.trace"
    assert body["id"] in message["headers"]["argsrepr"]
    client.delete("trace")


# --- models and aliases -----------------------------------------------------


def test_models_versions_aliases(api: Api) -> None:
    key = name_key_of(api.settings)
    a1 = make_artifact(api.db, api.store, version="1", name_key=key)
    a2 = make_artifact(api.db, api.store, version="2", fingerprint="e" * 64, name_key=key)
    r = api.put("/v1/models/tiny/aliases/prod", json={"version": "1"})
    assert r.status_code == 200, r.text
    models = api.get("/v1/models").json()["models"]
    assert [x["name"] for x in models] == ["tiny"]
    assert models[0]["aliases"] == {"prod": "1"}
    assert [(v["version"], v["artifacts"]) for v in models[0]["versions"]] == [("1", 1), ("2", 1)]
    one = api.get("/v1/models/tiny").json()
    assert [v["artifacts"][0]["digest"] for v in one["versions"]] == [a1["digest"], a2["digest"]]
    # Resolve follows the alias, and follows it again when it moves.
    assert api.get("/v1/resolve", params=resolve_params(ref="prod")).json()["version"] == "1"
    assert api.put("/v1/models/tiny/aliases/prod", json={"version": "2"}).status_code == 200
    r = api.get("/v1/resolve", params=resolve_params(ref="prod"))
    assert r.json()["version"] == "2" and r.json()["artifact"]["digest"] == a2["digest"]
    # No ref: the newest version (no 'latest' alias).
    assert api.get("/v1/resolve", params=resolve_params(ref=None)).json()["version"] == "2"


def test_alias_move_is_seen_through_the_resolve_cache(db_url: str, tmp_path: Path) -> None:
    settings = make_settings(tmp_path, db_url)
    db = Database(db_url)
    store = open_blob_store(settings.resolved_blob_store_url())
    make_artifact(db, store, version="1", name_key=name_key_of(settings))
    make_artifact(db, store, version="2", fingerprint="e" * 64, name_key=name_key_of(settings))
    service.set_alias(db, "tiny", "prod", "1")
    hdr = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    with TestClient(create_app(settings, enqueue=lambda _: None, resolve_cache_s=60)) as c:
        assert c.get("/v1/resolve", params=resolve_params(ref="prod"),
                     headers=hdr).json()["version"] == "1"
        assert c.put("/v1/models/tiny/aliases/prod", json={"version": "2"},
                     headers=hdr).status_code == 200
        assert c.get("/v1/resolve", params=resolve_params(ref="prod"),
                     headers=hdr).json()["version"] == "2"
        # Cached answers go only to the token that was admitted for them.
        r = c.get("/v1/resolve", params=resolve_params(ref="prod"),
                  headers={"Authorization": "Bearer nope"})
        assert r.status_code == 401
    db.dispose()


# --- resolve ----------------------------------------------------------------


def test_resolve_serves_stored_attestations_and_signs_nothing(api: Api) -> None:
    # Rows made straight through the service: no builder attested them and no
    # submission bound the version. The API serves that absence as it is.
    art = make_artifact(api.db, api.store, also=("aot_compile",))
    r = api.get("/v1/resolve", params=resolve_params())
    assert r.status_code == 200, r.text
    body = r.json()
    best = body["artifact"]
    # CPU prefers the AOTInductor package; the other format is an alternative.
    assert best["format"] == "aoti" and best["digest"] == art["digest"]
    assert [a["format"] for a in body["alternatives"]] == ["aot_compile"]
    assert best["version"] == "1" and best["target"] == str(CPU)
    assert best["download_url"].endswith(f"/v1/artifacts/{art['digest']}/blob")
    assert best["attestation"] == {"build_statement": None, "version": None, "alias": None}
    # The legacy per-row signature is gone: the build statement is what nodes check.
    assert "signature" not in best
    with api.db.session() as s:
        assert s.scalar(select(m.Artifact.attestation)
                        .where(m.Artifact.digest == art["digest"])) is None
    # A submission over the API binds the version with the name key, at once.
    assert api.post("/v1/jobs", json=spec_json()).status_code == 201
    again = api.get("/v1/resolve", params=resolve_params()).json()["artifact"]["attestation"]
    from farm.core import attest
    from farm.core.keys import load_public_key

    name_key = api.get("/v1/keys").json()["name_key"]
    _, payload = attest.verify_envelope(
        again["version"], {name_key["keyid"]: load_public_key(name_key["public_key"])},
        payload_type=attest.IN_TOTO_PAYLOAD_TYPE)
    st = attest.parse_statement(payload, predicate_type=attest.VERSION_PREDICATE)
    assert st.predicate["model"] == "tiny" and st.predicate["version"] == "1"
    assert st.predicate["program"]["entrypoint"] == ENTRYPOINT
    # Submitting it again does not re-sign it.
    assert api.post("/v1/jobs", json=spec_json()).status_code == 201
    third = api.get("/v1/resolve", params=resolve_params()).json()["artifact"]["attestation"]
    assert third["version"] == again["version"]


def test_alias_needs_a_bound_version(api: Api) -> None:
    make_artifact(api.db, api.store)  # rows only: no submission bound it
    r = api.put("/v1/models/tiny/aliases/prod", json={"version": "1"})
    assert r.status_code == 422 and "no name binding" in r.text


def test_resolve_covers_dynamic_ranges(api: Api) -> None:
    make_artifact(api.db, api.store, inputs=("float32[2..64,32]",))
    r = api.get("/v1/resolve", params=resolve_params(inputs=("float32[8,32]",)))
    assert r.status_code == 200, r.text
    r = api.get("/v1/resolve", params=resolve_params(inputs=("float32[128,32]",)))
    assert r.status_code == 404
    assert [x["code"] for x in r.json()["rejections"]] == ["inputs"]


def test_resolve_miss_carries_rejections_and_is_recorded(api: Api) -> None:
    art = make_artifact(api.db, api.store)
    r = api.get("/v1/resolve", params=resolve_params(target=CPU_512))
    assert r.status_code == 404, r.text
    body = r.json()
    assert "no artifact of tiny@1 fits" in body["detail"]
    (rej,) = body["rejections"]
    assert rej["digest"] == art["digest"] and rej["code"] == "isa"
    assert rej["format"] == "aoti" and rej["target"] == str(CPU) and "avx512" in rej["reason"]
    r = api.get("/v1/resolve", params=resolve_params(grad_mode="training"))
    assert r.status_code == 404 and r.json()["rejections"][0]["code"] == "grad_mode"
    with api.db.session() as s:
        misses = s.scalars(select(m.ResolveMiss).order_by(m.ResolveMiss.id)).all()
        assert [(x.model, x.version, x.target) for x in misses] == [
            ("tiny", "1", str(CPU_512)), ("tiny", "1", str(CPU))]
        assert misses[0].reasons[0]["code"] == "isa"
    r = api.get("/v1/resolve", params=resolve_params(format="aot_compile"))
    assert r.status_code == 404 and r.json()["rejections"][0]["code"] == "format"


def test_resolve_version_without_artifacts(api: Api) -> None:
    assert api.post("/v1/jobs", json=spec_json(version="9")).status_code == 201
    r = api.get("/v1/resolve", params=resolve_params(ref="9"))
    assert r.status_code == 404
    assert "no artifacts yet" in r.json()["detail"] and r.json()["rejections"] == []


# --- artifacts --------------------------------------------------------------


def test_artifact_metadata(api: Api) -> None:
    art = make_artifact(api.db, api.store)
    r = api.get(f"/v1/artifacts/{art['digest']}")
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["digest"] == art["digest"] and body["size"] == len(art["data"])
    assert body["attestation"]["build"] is None and body["download_url"].endswith("/blob")


def test_download_range_etag(api: Api) -> None:
    data = bytes(range(256)) * 5000  # 1.28 MB: more than one chunk
    art = make_artifact(api.db, api.store, data=data)
    url = f"/v1/artifacts/{art['digest']}/blob"
    r = api.get(url)
    assert r.status_code == 200 and r.content == data
    assert r.headers["etag"] == f'"{art["digest"]}"'
    assert r.headers["accept-ranges"] == "bytes"
    assert int(r.headers["content-length"]) == len(data)
    r = api.get(url, headers={"Range": "bytes=10-19"})
    assert r.status_code == 206 and r.content == data[10:20]
    assert r.headers["content-range"] == f"bytes 10-19/{len(data)}"
    r = api.get(url, headers={"Range": "bytes=-100"})
    assert r.status_code == 206 and r.content == data[-100:]
    r = api.get(url, headers={"Range": f"bytes={len(data) - 5}-"})
    assert r.status_code == 206 and r.content == data[-5:]
    r = api.get(url, headers={"Range": "bytes=0-99999999"})
    assert r.status_code == 206 and r.content == data
    r = api.get(url, headers={"Range": f"bytes={len(data)}-"})
    assert r.status_code == 416 and r.headers["content-range"] == f"bytes */{len(data)}"
    assert "outside" in r.json()["detail"]
    # A Range that does not parse is ignored: the whole blob.
    r = api.get(url, headers={"Range": "lines=1-2"})
    assert r.status_code == 200 and r.content == data
    r = api.get(url, headers={"If-None-Match": f'"{art["digest"]}"'})
    assert r.status_code == 304 and r.content == b"" and r.headers["etag"]
    r = api.get(url, headers={"If-None-Match": '"something-else"'})
    assert r.status_code == 200 and r.content == data
    # If-Range with another entity: the Range is dropped.
    r = api.get(url, headers={"Range": "bytes=0-9", "If-Range": '"other"'})
    assert r.status_code == 200 and r.content == data


def test_download_of_a_corrupted_blob_is_aborted(api: Api) -> None:
    art = make_artifact(api.db, api.store, data=b"x" * 5000)
    url = f"/v1/artifacts/{art['digest']}/blob"
    assert api.get(url).content == b"x" * 5000  # verified once, then served unhashed
    path = api.store.local_path(art["digest"])
    assert path is not None
    path.chmod(0o644)
    st = path.stat()
    path.write_bytes(b"y" * 5000)
    # Even with its mtime put back, the changed file is hashed again and refused.
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.raises(Exception, match="corrupt"):
        api.get(url)


def test_corrupt_blob_never_reaches_a_client_whole(api: Api) -> None:
    # Three 4 MB chunks and a bit, damaged in the last one: the API holds that
    # chunk back until the digest checks, so the client gets less than the
    # blob whichever chunk is damaged.
    from registry.api.artifacts import FILE_CHUNK

    size = 3 * FILE_CHUNK + 1000
    art = make_artifact(api.db, api.store, data=b"a" * size)
    path = api.store.local_path(art["digest"])
    assert path is not None
    path.chmod(0o644)
    with open(path, "r+b") as f:
        f.seek(size - 1)
        f.write(b"b")
    got = 0
    with pytest.raises(Exception, match="corrupt"), api.client.stream(
        "GET", f"/v1/artifacts/{art['digest']}/blob", headers=api.h("read")
    ) as r:
        for chunk in r.iter_bytes():
            got += len(chunk)
    assert got <= size - (size - 3 * FILE_CHUNK)  # the last chunk never went out


def test_download_unknown_digest_is_404(api: Api) -> None:
    r = api.get(f"/v1/artifacts/{'a' * 64}/blob")
    assert r.status_code == 404 and "not found" in r.json()["detail"]
    r = api.get(f"/v1/artifacts/{'a' * 64}")
    assert r.status_code == 404 and "no artifact" in r.json()["detail"]


def test_s3_download_redirects_to_a_presigned_url(db_url: str, tmp_path: Path,
                                                  s3_bucket_url: str, s3_server: str) -> None:
    gen = _api(db_url, tmp_path, blob_store_url=s3_bucket_url, s3_endpoint_url=s3_server)
    api = next(gen)
    try:
        art = make_artifact(api.db, api.store, data=b"s3 bytes " * 1000)
        r = api.get(f"/v1/artifacts/{art['digest']}/blob", follow_redirects=False)
        assert r.status_code == 307, r.text
        location = r.headers["location"]
        assert location.startswith(s3_server) and "Signature" in location
        got = httpx.get(location, timeout=30, trust_env=False)
        assert got.status_code == 200 and got.content == art["data"]
        # Unknown digests are refused here, not redirected to an S3 404.
        r = api.get(f"/v1/artifacts/{'b' * 64}/blob", follow_redirects=False)
        assert r.status_code == 404
        assert api.client.get("/healthz").json()["checks"]["blob_store"] == "ok"
    finally:
        gen.close()


# --- targets, misses, tokens, health, metrics -------------------------------


def test_targets_lists_live_workers(api: Api) -> None:
    beat(api.db, CPU, "a:1")
    beat(api.db, CPU, "a:2")
    service.record_heartbeat(api.db, worker_id="t:1", kind="trace", queue="trace", target=None)
    body = api.get("/v1/targets").json()
    assert body["targets"] == [{"target": str(CPU), "workers": 2, "queue": CPU.queue}]
    assert sorted(w["id"] for w in body["workers"]) == ["a:1", "a:2", "t:1"]


def test_report_miss(api: Api) -> None:
    r = api.post("/v1/misses", role="read", json={
        "model": "tiny", "ref": "prod", "inputs": ["int64[1,16]"], "grad_mode": "inference",
        "target": str(CPU), "reasons": [{"code": "load", "reason": "signature did not verify"}]})
    assert r.status_code == 202, r.text
    with api.db.session() as s:
        (miss,) = s.scalars(select(m.ResolveMiss)).all()
        assert (miss.model, miss.version, miss.inputs) == ("tiny", "prod", "int64[1,16]")
        assert miss.reasons == [{"code": "load", "reason": "signature did not verify"}]


def test_tokens_and_roles(api: Api) -> None:
    r = api.post("/v1/tokens", role="admin", json={"name": "fleet", "role": "read"})
    assert r.status_code == 201, r.text
    fleet = r.json()["token"]
    assert r.json()["role"] == "read"
    with api.db.session() as s:
        row = s.scalar(select(m.ApiToken).where(m.ApiToken.name == "fleet"))
        assert row is not None and row.token_hash == auth.hash_token(fleet)
        assert fleet not in row.token_hash
    hdr = {"Authorization": f"Bearer {fleet}"}
    assert api.client.get("/v1/models", headers=hdr).status_code == 200
    r = api.client.post("/v1/jobs", json=spec_json(), headers=hdr)
    assert r.status_code == 403 and "role 'submit'" in r.json()["detail"]
    assert api.post("/v1/jobs", json=spec_json()).status_code == 201
    # Revocation takes effect (this app's cache is dropped at once).
    r = api.client.delete("/v1/tokens/fleet", headers=api.h("admin"))
    assert r.status_code == 200 and r.json()["revoked"] == 1
    assert api.client.get("/v1/models", headers=hdr).status_code == 401


def test_auth_disabled_for_embedded_mode(db_url: str, tmp_path: Path) -> None:
    settings = make_settings(tmp_path, db_url, farm_auth=False)
    with TestClient(create_app(settings, enqueue=lambda _: None)) as c:
        assert c.get("/v1/models").status_code == 200
        assert c.post("/v1/jobs", json=spec_json()).status_code == 201


def test_name_key_from_settings(db_url: str, tmp_path: Path) -> None:
    from farm.core.keys import generate_keypair
    from registry.api.signer import NameKeyError

    private, public = generate_keypair()
    key_file = tmp_path / "k.pem"
    key_file.write_text(private)
    settings = make_settings(tmp_path, db_url, farm_name_key=str(key_file))
    hdr = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    with TestClient(create_app(settings, enqueue=lambda _: None)) as c:
        assert c.get("/v1/keys", headers=hdr).json()["name_key"]["public_key"] == public
    # Inline PEM would sit in the environment, readable by the user's other processes.
    with pytest.raises(NameKeyError):
        create_app(make_settings(tmp_path, db_url, farm_name_key=private),
                   enqueue=lambda _: None)


def test_healthz(api: Api) -> None:
    r = api.client.get("/healthz")
    assert r.status_code == 200 and r.json()["status"] == "ok"


def test_livez_answers_while_the_farm_is_not_ready(api: Api) -> None:
    # No compile worker beats here: not ready for jobs, yet alive (what a
    # container healthcheck asks; docker-compose.yml).
    assert api.client.get("/readyz").status_code == 503
    r = api.client.get("/livez")
    assert r.status_code == 200 and r.json() == {"status": "ok"}


def test_metrics(db_url: str, tmp_path: Path, redis_url: str) -> None:
    import redis

    r_client = redis.Redis.from_url(redis_url)
    r_client.delete("trace", CPU.queue)
    r_client.rpush("trace", b"{}", b"{}")
    r_client.rpush(CPU.queue, b"{}")
    gen = _api(db_url, tmp_path, broker_url="", redis_url=redis_url)
    api = next(gen)
    try:
        beat(api.db, CPU)
        make_artifact(api.db, api.store)
        assert api.post("/v1/jobs", json=spec_json(version="2")).status_code == 201
        assert api.get("/v1/resolve", params=resolve_params()).status_code == 200
        assert api.get("/v1/resolve", params=resolve_params(target=CPU_512)).status_code == 404
        r = api.client.get("/metrics")
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
        samples = {}
        for family in text_string_to_metric_families(r.text):
            for s in family.samples:
                samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
        assert samples[("farm_jobs", (("state", "succeeded"),))] == 1
        assert samples[("farm_jobs", (("state", "queued"),))] == 1
        assert samples[("farm_builds", (("state", "succeeded"),))] == 1
        assert samples[("farm_builds", (("state", "pending"),))] == 1
        assert samples[("farm_compile_seconds_total", ())] == 2.5
        assert samples[("farm_resolve_total", (("result", "hit"),))] == 1
        assert samples[("farm_resolve_total", (("result", "miss"),))] == 1
        assert samples[("farm_queue_depth", (("queue", "trace"),))] == 2
        assert samples[("farm_queue_depth", (("queue", CPU.queue),))] == 1
        assert samples[("farm_database_up", ())] == 1
        # The workers' side, per target: builds by state, failures, compile
        # durations and the compile queue's depth under the target's name.
        target = (("target", str(CPU)),)
        assert samples[("farm_target_builds", (("state", "succeeded"), *target))] == 1
        assert samples[("farm_target_builds", (("state", "pending"), *target))] == 1
        assert samples[("farm_target_builds_failed", target)] == 0
        assert samples[("farm_target_compile_seconds_sum", target)] == 2.5
        assert samples[("farm_target_compile_seconds_count", target)] == 1
        assert samples[("farm_target_queue_depth", target)] == 1
        key = ("farm_http_request_duration_seconds_count",
               (("method", "GET"), ("route", "/v1/resolve"), ("status", "200")))
        assert samples[key] == 1
    finally:
        gen.close()
        r_client.delete("trace", CPU.queue)


# --- the database going away and coming back --------------------------------


class TcpProxy:
    """A TCP proxy that can cut every connection and refuse new ones."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.up = True
        self.conns: list[socket.socket] = []
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if not self.up:
                client.close()
                continue
            try:
                server = socket.create_connection(self.upstream)
            except OSError:
                client.close()
                continue
            with self.lock:
                self.conns += [client, server]
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def cut(self) -> None:
        self.up = False
        with self.lock:
            for c in self.conns:
                with contextlib.suppress(OSError):
                    c.shutdown(socket.SHUT_RDWR)
                c.close()
            self.conns.clear()

    def restore(self) -> None:
        self.up = True

    def close(self) -> None:
        self.cut()
        self.listener.close()


def test_database_outage_answers_503_and_recovers(make_pg_database: Any,
                                                  tmp_path: Path) -> None:
    """PostgreSQL reached through a proxy that cuts every connection, then comes back."""
    from sqlalchemy.engine import make_url

    from registry.db import upgrade

    db_url = make_pg_database()
    upgrade(db_url)
    url = make_url(db_url)
    proxy = TcpProxy((url.host or "127.0.0.1", url.port or 5432))
    proxied = url.set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False)
    try:
        gen = _api(proxied, tmp_path, resolve_cache_s=0.2)
        api = next(gen)
        try:
            make_artifact(api.db, api.store)
            assert api.get("/v1/models").status_code == 200
            hit = api.get("/v1/resolve", params=resolve_params())
            assert hit.status_code == 200
            proxy.cut()
            time.sleep(0.3)  # past the caches' freshness: what follows is served stale
            # The fleet keeps resolving through the outage, from what was known.
            r = api.get("/v1/resolve", params=resolve_params())
            assert r.status_code == 200, r.text
            assert r.json()["artifact"]["digest"] == hit.json()["artifact"]["digest"]
            for path in ("/v1/models", "/v1/jobs/x"):
                r = api.get(path)
                assert r.status_code == 503, (path, r.text)
                assert "database" in r.json()["detail"]
            r = api.post("/v1/jobs", json=spec_json(version="5"))
            assert r.status_code == 503 and "database" in r.json()["detail"]
            h = api.client.get("/healthz")
            assert h.status_code == 503 and h.json()["checks"]["database"] != "ok"
            assert "database" in h.json()["detail"]
            assert api.client.get("/metrics").status_code == 200
            proxy.restore()
            deadline = time.monotonic() + 10
            while api.get("/v1/models").status_code != 200:
                assert time.monotonic() < deadline, "the API did not recover"
                time.sleep(0.1)
            assert api.client.get("/healthz").status_code == 200
            assert api.get("/v1/resolve", params=resolve_params()).status_code == 200
        finally:
            proxy.restore()
            gen.close()
    finally:
        proxy.close()


def test_a_format_that_fails_when_rebuilt_is_not_rebuilt_on_every_submission(api: Api) -> None:
    """A deleted format is built again once. If that compile cannot make it
    (its AOTI fails now), the kept artifact records so, and the next
    submission reuses the build instead of compiling again and again."""
    art = make_artifact(api.db, api.store, name="again", also=("aot_compile",))
    service.delete_artifact(api.db, art["digest"])  # the aoti one
    spec = JobSpec.from_json(spec_json("again", "1"))
    job_id = service.submit_job(api.db, spec, targets=[CPU])
    service.start_trace(api.db, job_id)
    (d,) = service.record_trace(api.db, job_id, {"fingerprint": "f" * 64})
    assert service.job_view(api.db, job_id)["builds"][0]["state"] == "queued"  # not reused
    assert service.begin_compile(api.db, d.build_key, worker_id="host:1",
                                 heartbeat_max_age_s=30).action == "run"
    info = api.store.put_bytes(os.urandom(2000))
    failed = {"aoti": {"stage": "compile", "reason": "no C++ compiler"}}
    unnamed = service.finish_compile(
        api.db, d.build_key, target=CPU, spec=spec, fingerprint="f" * 64, compile_s=1.0,
        artifacts=[service.NewArtifact(digest=info.digest, size=info.size, format="aot_compile",
                                       verified=True, first_call_compiles=False, max_abs_err=0.0,
                                       first_call_s=0.01, load_s=0.1,
                                       meta={"formats_failed": failed})])
    # The kept aot_compile row stays; the new copy's blob is named by no row.
    assert unnamed == [info.digest]
    view = service.job_view(api.db, job_id)
    (build,) = view["builds"]
    assert build["state"] == "succeeded" and build["formats_failed"] == failed, build
    again = service.submit_job(api.db, spec, targets=[CPU])
    service.start_trace(api.db, again)
    assert service.record_trace(api.db, again, {"fingerprint": "f" * 64}) == []
    assert service.job_view(api.db, again)["builds"][0]["state"] == "reused"
