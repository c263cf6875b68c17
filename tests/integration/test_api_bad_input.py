"""Bad input gets a 4xx with a message and changes nothing.

Every case runs against PostgreSQL and SQLite and checks, besides the status
and the message, that no table gained or lost a row.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from registry import service
from tests.integration.test_api import (
    ADMIN_TOKEN,
    CPU,
    Api,
    _api,
    make_artifact,
    resolve_params,
    row_counts,
    spec_json,
)

pytestmark = pytest.mark.integration


@pytest.fixture
def api(db_url: str, tmp_path: Path) -> Iterator[Api]:
    yield from _api(db_url, tmp_path)


@pytest.fixture
def seeded(api: Api) -> Api:
    """A model with one version, one artifact and an alias; a live worker."""
    make_artifact(api.db, api.store, name_key=api.settings.farm_home / "name-key.pem")
    service.set_alias(api.db, "tiny", "prod", "1")
    service.record_heartbeat(api.db, worker_id="w:1", kind="compile", queue=CPU.queue,
                             target=str(CPU))
    return api


def refused(api: Api, r: httpx.Response, status: int, *needles: str,
            before: dict[str, int]) -> dict[str, Any]:
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    assert isinstance(body["detail"], str) and body["detail"], body
    for needle in needles:
        assert needle in body["detail"], (needle, body["detail"])
    assert row_counts(api.db) == before, "a refused request changed the database"
    return dict(body)


# --- job specs ----------------------------------------------------------------


MALFORMED_INPUTS = [
    (["float32[8,"], "bad input spec 'float32[8,'"),
    (["complex64[2]"], "unknown dtype 'complex64'"),
    (["float32[0..4]"], "starts below 2"),
    (["float32[-1,2]"], "negative dim"),
    (["float32[8,x]"], "bad dim 'x'"),
    (["float32[1,2,3,4,5,6,7,8,9]"], "more than 8 dims"),
    (["float32[+8]"], "bad dim '+8'"),
    (["float32[8]", 7], "inputs"),
    ([], "at least one input spec"),
]


def test_malformed_input_specs(seeded: Api) -> None:
    before = row_counts(seeded.db)
    for inputs, needle in MALFORMED_INPUTS:
        r = seeded.post("/v1/jobs", json=spec_json(version="2") | {"inputs": inputs})
        refused(seeded, r, 422, needle, before=before)
    assert seeded.enqueued == []


MALFORMED_SPECS: list[tuple[dict[str, Any], str]] = [
    ({"inputs": "float32[8,64]"}, "inputs"),
    ({"name": "bad name!"}, "bad model name"),
    ({"version": "../1"}, "bad version"),
    ({"grad_mode": "eval"}, "unknown grad_mode 'eval'"),
    ({"options": {"mode": "turbo"}}, "unknown mode 'turbo'"),
    ({"options": {"colour": "red"}}, "unknown compile options: colour"),
    ({"model": {"entrypoint": "no colon here"}}, "bad entrypoint"),
    ({"model": {"entrypoint": "os:path", "kind": "script"}}, "unknown model kind"),
    ({"model": {"entrypoint": "os:path", "kwargs": {"x": float("nan")}}}, "JSON"),
    ({"targets": ["gpu"]}, "device 'gpu' unknown"),
    ({"targets": ["cuda"]}, "no live compile worker matches target 'cuda'"),
    ({"targets": ["cpu/flavour=sweet"]}, "bad target field"),
    ({"surprise": 1}, "surprise"),
    ({"name": None}, "name"),
]


def test_malformed_job_specs(seeded: Api) -> None:
    before = row_counts(seeded.db)
    for patch, needle in MALFORMED_SPECS:
        try:
            r = seeded.post("/v1/jobs", json=spec_json(version="2") | patch)
        except ValueError:  # httpx refuses to send NaN; send it as text
            import json

            r = seeded.post("/v1/jobs", content=json.dumps(spec_json(version="2") | patch),
                            headers={"Content-Type": "application/json"})
        refused(seeded, r, 422, needle, before=before)
    assert seeded.enqueued == []


def test_missing_field_and_bad_json(seeded: Api) -> None:
    before = row_counts(seeded.db)
    body = spec_json(version="2")
    del body["model"]
    refused(seeded, seeded.post("/v1/jobs", json=body), 422, "model", before=before)
    r = seeded.post("/v1/jobs", content=b'{"name": "tiny", ',
                    headers={"Content-Type": "application/json"})
    refused(seeded, r, 422, "JSON", before=before)
    refused(seeded, seeded.post("/v1/jobs", json=[1, 2]), 422, "invalid request", before=before)


def test_version_rebound_to_another_entrypoint_conflicts(seeded: Api) -> None:
    before = row_counts(seeded.db)
    r = seeded.post("/v1/jobs", json=spec_json(version="1", entrypoint="farm.core.specs:JobSpec"))
    refused(seeded, r, 409, "already exists", before=before)


# --- entrypoints that do not import -------------------------------------------


@pytest.fixture
def booby_trapped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A package whose import would leave a marker: the API must never run it."""
    root = tmp_path / "site"
    pkg = root / "trap_pkg_api"
    (pkg / "sub").mkdir(parents=True)
    marker = tmp_path / "imported"
    (pkg / "__init__.py").write_text(f"open({str(marker)!r}, 'w').write('pkg')\n")
    (pkg / "sub" / "__init__.py").write_text(f"open({str(marker)!r}, 'w').write('sub')\n")
    (pkg / "sub" / "model.py").write_text(f"open({str(marker)!r}, 'w').write('model')\n")
    (pkg / "plain.py").write_text(f"open({str(marker)!r}, 'w').write('plain')\n")
    monkeypatch.syspath_prepend(str(root))
    return marker


def test_entrypoint_that_does_not_import(seeded: Api, booby_trapped: Path) -> None:
    before = row_counts(seeded.db)
    for entrypoint, needle in [
        ("no_such_package_xyz:make", "no module named 'no_such_package_xyz'"),
        ("trap_pkg_api.missing:make", "no module named 'trap_pkg_api.missing'"),
        ("trap_pkg_api.sub.nope:make", "no module named 'trap_pkg_api.sub.nope'"),
        ("trap_pkg_api.plain.deeper:make", "is a module, not a package"),
    ]:
        r = seeded.post("/v1/jobs", json=spec_json(version="2", entrypoint=entrypoint))
        refused(seeded, r, 422, f"entrypoint {entrypoint!r} does not import", needle,
                before=before)
    assert not booby_trapped.exists(), "the API executed model code"
    assert "trap_pkg_api" not in sys.modules
    assert seeded.enqueued == []


def test_entrypoint_found_without_running_it(seeded: Api, booby_trapped: Path) -> None:
    spec = spec_json(version="2", entrypoint="trap_pkg_api.sub.model:make")
    r = seeded.post("/v1/jobs", json=spec)
    assert r.status_code == 201, r.text
    assert not booby_trapped.exists(), "the API executed model code"


# --- unknown models, versions, aliases, jobs, artifacts ---------------------------


def test_unknown_model_or_alias(seeded: Api) -> None:
    before = row_counts(seeded.db)
    for params, needle in [
        (resolve_params("nope"), "no model 'nope'"),
        (resolve_params(ref="staging"), "no version or alias 'staging'"),
        (resolve_params(ref="../1"), "no version or alias '../1'"),
    ]:
        body = refused(seeded, seeded.get("/v1/resolve", params=params), 404, needle,
                       before=before)
        assert body["rejections"] == []
    refused(seeded, seeded.get("/v1/models/nope"), 404, "no model 'nope'", before=before)
    r = seeded.put("/v1/models/nope/aliases/prod", json={"version": "1"})
    refused(seeded, r, 404, "no model 'nope'", before=before)
    r = seeded.put("/v1/models/tiny/aliases/prod", json={"version": "7"})
    refused(seeded, r, 404, "no version '7'", before=before)
    r = seeded.put("/v1/models/tiny/aliases/-prod", json={"version": "1"})
    refused(seeded, r, 422, "bad alias", before=before)
    seeded.post("/v1/jobs", json=spec_json(version="beta"))
    before = row_counts(seeded.db)
    r = seeded.put("/v1/models/tiny/aliases/beta", json={"version": "1"})
    refused(seeded, r, 409, "also a version", before=before)
    r = seeded.put("/v1/models/tiny/aliases/prod", json={"v": "1"})
    refused(seeded, r, 422, "version", before=before)
    refused(seeded, seeded.get("/v1/jobs/not-a-job"), 404, "no job not-a-job", before=before)
    refused(seeded, seeded.get(f"/v1/artifacts/{'0' * 64}"), 404, "no artifact", before=before)


def test_malformed_resolve_queries(seeded: Api) -> None:
    before = row_counts(seeded.db)
    for patch, needle in [
        ({"input": "float32[8,"}, "bad input spec"),
        ({"input": "float32[0..]"}, "starts below 2"),
        ({"target": "cpu"}, "incomplete target 'cpu'"),
        ({"target": "tpu/python=3/torch=2"}, "device 'tpu' unknown"),
        ({"target": "cpu/python=3/torch=2/threads=zero"}, "threads"),
        ({"grad_mode": "eval"}, "unknown grad_mode 'eval'"),
        ({"format": "onnx"}, "unknown format(s) 'onnx'"),
        ({"options": "{not json"}, "options must be a JSON object"),
        ({"options": "[1]"}, "options must be a JSON object"),
        ({"options": '{"mode": "turbo"}'}, "unknown mode 'turbo'"),
    ]:
        params = dict(resolve_params())
        params.update(patch)
        refused(seeded, seeded.get("/v1/resolve", params=params), 422, needle, before=before)


def test_resolve_without_inputs_or_target(seeded: Api) -> None:
    before = row_counts(seeded.db)
    r = seeded.get("/v1/resolve", params={"model": "tiny", "target": str(CPU)})
    refused(seeded, r, 422, "input", before=before)
    r = seeded.get("/v1/resolve", params={"model": "tiny", "input": "int64[1,16]"})
    refused(seeded, r, 422, "target", before=before)


def test_malformed_miss_reports(seeded: Api) -> None:
    before = row_counts(seeded.db)
    good: dict[str, Any] = {"model": "tiny", "inputs": ["int64[1,16]"], "target": str(CPU)}
    cases: list[tuple[dict[str, Any], str]] = [({"inputs": ["int64[1,"]}, "bad input spec"),
                          ({"target": "cpu"}, "incomplete target"),
                          ({"grad_mode": "x"}, "unknown grad_mode"),
                          ({"inputs": []}, "inputs")]
    for patch, needle in cases:
        r = seeded.post("/v1/misses", role="read", json=good | patch)
        refused(seeded, r, 422, needle, before=before)


# --- tokens ---------------------------------------------------------------------


def test_missing_or_wrong_token(seeded: Api) -> None:
    before = row_counts(seeded.db)
    c = seeded.client
    for headers, needle in [
        ({}, "missing token"),
        ({"Authorization": "Bearer wrong"}, "invalid or revoked token"),
        ({"Authorization": "Basic dXNlcjpwYXNz"}, "expected 'Bearer <token>'"),
        ({"Authorization": "Bearer"}, "expected 'Bearer <token>'"),
        ({"Authorization": f"Bearer {ADMIN_TOKEN}x"}, "invalid or revoked token"),
    ]:
        requests: list[tuple[str, str, dict[str, Any]]] = [
            ("POST", "/v1/jobs", {"json": spec_json(version="3")}),
            ("GET", "/v1/resolve", {"params": resolve_params()}),
            ("GET", "/v1/models", {}),
            ("POST", "/v1/tokens", {"json": {"name": "x", "role": "admin"}}),
        ]
        for method, url, kw in requests:
            r = c.request(method, url, headers=headers, **kw)
            body = refused(seeded, r, 401, needle, before=before)
            assert r.headers["www-authenticate"] == "Bearer", body
    assert seeded.enqueued == []


def test_read_token_cannot_submit(seeded: Api) -> None:
    before = row_counts(seeded.db)
    r = seeded.post("/v1/jobs", role="read", json=spec_json(version="3"))
    refused(seeded, r, 403, "has role 'read'", "needs role 'submit'", before=before)
    r = seeded.put("/v1/models/tiny/aliases/prod", role="read", json={"version": "1"})
    refused(seeded, r, 403, "needs role 'submit'", before=before)
    r = seeded.post("/v1/tokens", role="submit", json={"name": "x", "role": "admin"})
    refused(seeded, r, 403, "needs role 'admin'", before=before)
    r = seeded.post("/v1/tokens", role="admin", json={"name": "x", "role": "root"})
    refused(seeded, r, 422, "role", before=before)
    assert seeded.enqueued == []


# --- oversized bodies -------------------------------------------------------------


def test_oversized_body(seeded: Api) -> None:
    before = row_counts(seeded.db)
    limit = seeded.settings.max_body_bytes
    big = spec_json(version="3") | {"model": {"entrypoint": ENTRY, "kwargs": {"pad": "x" * limit}}}
    r = seeded.post("/v1/jobs", json=big)
    refused(seeded, r, 413, "request body too large", str(limit), before=before)

    def chunks() -> Iterator[bytes]:  # no Content-Length: the limit bites while streaming
        yield b'{"name": "tiny", "version": "3", "pad": "'
        for _ in range(limit // 1000 + 2):
            yield b"x" * 1000
        yield b'"}'

    r = seeded.post("/v1/jobs", content=chunks(), headers={"Content-Type": "application/json"})
    refused(seeded, r, 413, "request body too large", before=before)
    r = seeded.post("/v1/misses", role="read",
                    json={"model": "tiny", "inputs": ["int64[1,16]"], "target": str(CPU),
                          "reasons": ["x" * limit]})
    refused(seeded, r, 413, "request body too large", before=before)
    assert seeded.enqueued == []


ENTRY = "farm.zoo.llama:tiny"


# --- digests with path characters ---------------------------------------------------


BAD_DIGESTS = [
    "..%2F..%2F..%2Fetc%2Fpasswd",
    "%2e%2e%2f%2e%2e%2fsecret",
    "..%2F",
    "%2F" + "a" * 64,
    "A" * 64,
    "a" * 63,
    "a" * 65,
    "g" * 64,
    "a" * 62 + "%00a",
    "sha256:" + "a" * 64,
    "x" * 300,
]


def test_digest_with_path_characters(seeded: Api) -> None:
    before = row_counts(seeded.db)
    for digest in BAD_DIGESTS:
        for suffix in ("", "/blob"):
            r = seeded.client.get(f"/v1/artifacts/{digest}{suffix}", headers=seeded.h("read"))
            refused(seeded, r, 422, "invalid sha256 digest", "64 lowercase hex", before=before)
