"""Bad input against a live API (uvicorn in its own process, PostgreSQL, S3):
schemathesis fuzzes every operation of the OpenAPI document (no 5xx, no
unhandled error), then the inputs a fuzzer rarely builds: NUL characters,
bodies that do not parse, requests HTTP itself refuses, path traversal in
every path parameter, oversized bodies where test_api_bad_input.py does not
look. Each refused request is a 4xx with a message and changes nothing.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from registry import service
from registry.blobstore import S3BlobStore
from tests.fixtures.farm import ADMIN_TOKEN
from tests.fixtures.faults import FaultFarm, MakeFarm
from tests.integration.test_api import CPU, make_artifact, row_counts, spec_json

pytestmark = pytest.mark.integration

MAX_EXAMPLES = 25  # per operation and phase: about 1,200 requests, 20 s here
SEED = 1


@pytest.fixture(scope="module")
def api(make_farm: MakeFarm) -> Iterator[FaultFarm]:
    """The API alone (no workers: a submitted job stays queued), with a model,
    an alias, an artifact in S3 and a live compile worker's heartbeat, so
    the fuzzer reaches past the 404s."""
    f = make_farm("fuzz", workers=())
    store = S3BlobStore(f.bucket, "artifacts", endpoint_url=f.env["S3_ENDPOINT_URL"])
    make_artifact(f.db, store, name_key=Path(f.env["FARM_NAME_KEY"]))
    service.set_alias(f.db, "tiny", "prod", "1")
    service.record_heartbeat(f.db, worker_id="w:1", kind="compile", queue=CPU.queue,
                             target=str(CPU))
    try:
        yield f
    finally:
        f.close()


def client(f: FaultFarm) -> httpx.Client:
    return httpx.Client(base_url=f.url, headers=f.headers, timeout=30)


def test_schemathesis_finds_no_server_error(api: FaultFarm) -> None:
    t0 = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "schemathesis.cli", "run", f"{api.url}/openapi.json",
         "--checks", "not_a_server_error",
         # Readiness answers 503 by design while no compile worker beats (the
         # seeded heartbeat goes stale during the run); test_everyday.py tests it.
         "--exclude-path", "/readyz",
         "-H", f"Authorization: Bearer {ADMIN_TOKEN}",
         "--max-examples", str(MAX_EXAMPLES), "--seed", str(SEED),
         # One worker: schemathesis' own generators are not thread-safe here
         # (hypothesis' lambda-source cache raised RuntimeErrors with two).
         "--workers", "1", "--no-shrink", "--request-timeout", "20"],
        cwd=api.home, env={**os.environ, "NO_COLOR": "1"}, capture_output=True, text=True,
        timeout=240,
    )
    report = out.stdout[-6000:] + out.stderr[-2000:]
    assert out.returncode == 0, report
    assert " passed" in out.stdout and "failure" not in out.stdout.lower(), report
    # Nothing unhandled reached the API's catch-all either.
    assert "unhandled error" not in api.log("api"), api.log("api")
    print(f"schemathesis: {out.stdout.strip().splitlines()[-1]} ({time.monotonic() - t0:.0f} s)")


# --- NUL characters: PostgreSQL cannot store them in text ---------------------------

NUL_REQUESTS: list[tuple[str, str, dict[str, Any]]] = [
    ("GET", "/v1/jobs/a%00b", {}),
    ("GET", "/v1/resolve", {"params": {"model": "tiny\x00", "input": "int64[1,16]",
                                       "target": str(CPU)}}),
    ("GET", "/v1/resolve", {"params": {"model": "tiny", "ref": "1\x00", "input": "int64[1,16]",
                                       "target": str(CPU)}}),
    ("POST", "/v1/misses", {"json": {"model": "tiny\x00", "inputs": ["int64[1,16]"],
                                     "target": str(CPU), "reasons": ["x\x00"]}}),
    ("POST", "/v1/tokens", {"json": {"name": "a\x00b", "role": "read"}}),
    ("DELETE", "/v1/tokens/a%00b", {}),
    ("PUT", "/v1/models/tiny/aliases/prod", {"json": {"version": "1\x00"}}),
]


@pytest.mark.parametrize(("method", "path", "kw"), NUL_REQUESTS,
                         ids=[f"{m} {p}" for m, p, _ in NUL_REQUESTS])
def test_nul_characters_are_refused_not_500(api: FaultFarm, method: str, path: str,
                                            kw: dict[str, Any]) -> None:
    before = row_counts(api.db)
    with client(api) as c:
        r = c.request(method, path, **kw)
    # Before the fix these were 500 "database error: PostgreSQL text fields
    # cannot contain NUL (0x00) bytes".
    assert r.status_code in (404, 422), (r.status_code, r.text)
    assert r.json()["detail"], r.text
    assert row_counts(api.db) == before


def test_blank_token_name_is_422(api: FaultFarm) -> None:
    before = row_counts(api.db)
    with client(api) as c:
        for name in ("\f", "   ", "\t\n"):
            r = c.post("/v1/tokens", json={"name": name, "role": "read"})
            # Found by schemathesis: it was a 500 (a ValueError from registry.auth).
            assert r.status_code == 422, r.text
            assert "name" in r.json()["detail"]
    assert row_counts(api.db) == before


# --- bodies that do not parse ---------------------------------------------------------

UNPARSEABLE = {
    "deeply nested": b'{"name": "tiny", "model": {"kwargs": {"x": ' + b"[" * 100_000
                     + b"]" * 100_000 + b"}}}",
    "huge integer": b'{"name": "tiny", "version": "9", "model": {"entrypoint": "a:b", '
                    b'"kwargs": {"x": ' + b"9" * 50_000 + b"}}, \"inputs\": [\"int64[1,16]\"]}",
    "not UTF-8": b'{"name": "\xff\xfe\xfd"}',
    "a lone surrogate": b'{"name": "\\ud800", "version": "1"}',
    "NUL byte raw": b'{"name": "ti\x00ny"}',
    "infinity": b'{"name": "tiny", "version": "9", "model": {"entrypoint": "a:b", '
                b'"kwargs": {"x": 1e999}}, "inputs": ["int64[1,16]"]}',
}


@pytest.mark.parametrize("body", list(UNPARSEABLE), ids=list(UNPARSEABLE))
def test_bodies_that_do_not_parse_are_4xx(api: FaultFarm, body: str) -> None:
    before = row_counts(api.db)
    with client(api) as c:
        r = c.post("/v1/jobs", content=UNPARSEABLE[body],
                   headers={"Content-Type": "application/json"})
    assert 400 <= r.status_code < 500, (r.status_code, r.text)
    assert r.json()["detail"], r.text
    assert row_counts(api.db) == before


# --- requests HTTP itself refuses (raw sockets: no client library cleans them up) -----


def raw_status(f: FaultFarm, data: bytes) -> int:
    host, _, port = f.url.removeprefix("http://").partition(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(data)
        head = s.recv(64)
    assert head.startswith(b"HTTP/1.1 "), head
    return int(head.split()[1])


AUTH = f"Authorization: Bearer {ADMIN_TOKEN}\r\n".encode()
RAW = {
    "100 KB path": b"GET /v1/models/" + b"a" * 100_000 + b" HTTP/1.1\r\nHost: x\r\n" + AUTH
                   + b"\r\n",
    "garbage request line": b"\x00\x01\x02 garbage\r\n\r\n",
    "non-numeric Content-Length": b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\n" + AUTH
                                  + b"Content-Length: abc\r\n\r\n",
    "negative Content-Length": b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\n" + AUTH
                               + b"Content-Length: -5\r\n\r\n",
    "control character in token": b"GET /v1/models HTTP/1.1\r\nHost: x\r\n"
                                   b"Authorization: Bearer a\x01b\r\n\r\n",
}


@pytest.mark.parametrize("case", list(RAW), ids=list(RAW))
def test_malformed_http_is_4xx(api: FaultFarm, case: str) -> None:
    status = raw_status(api, RAW[case])
    assert 400 <= status < 500, status
    with client(api) as c:  # and the server is still there
        assert c.get("/healthz").status_code == 200


# --- path traversal in every path parameter ----------------------------------------------

TRAVERSAL = [
    ("GET", "/v1/models/..%2F..%2F..%2Fetc%2Fpasswd"),
    ("GET", "/v1/models/%2e%2e"),
    ("GET", "/v1/models/tiny/..%2F..%2Fv1%2Ftokens"),
    ("PUT", "/v1/models/tiny/aliases/..%2F..%2Fx"),
    ("PUT", "/v1/models/tiny/aliases/%2e%2e"),
    ("GET", "/v1/jobs/..%2F..%2Fetc%2Fpasswd"),
    ("DELETE", "/v1/tokens/..%2F..%2Fadmin"),
    ("GET", "/v1/artifacts/..%2F..%2F..%2Fetc%2Fpasswd/blob"),
]


@pytest.mark.parametrize(("method", "path"), TRAVERSAL, ids=[p for _, p in TRAVERSAL])
def test_path_traversal_is_refused(api: FaultFarm, method: str, path: str) -> None:
    before = row_counts(api.db)
    with client(api) as c:
        r = c.request(method, path, json={"version": "1"} if method == "PUT" else None)
    assert r.status_code in (404, 405, 422), (r.status_code, r.text)
    assert "root:" not in r.text and "BEGIN" not in r.text
    assert row_counts(api.db) == before


# --- oversized bodies on the routes test_api_bad_input.py does not cover -------------------


@pytest.mark.parametrize(("method", "path"), [("PUT", "/v1/models/tiny/aliases/prod"),
                                              ("POST", "/v1/tokens")])
def test_oversized_body_elsewhere_is_413(api: FaultFarm, method: str, path: str) -> None:
    before = row_counts(api.db)
    big = {"version": "1", "name": "x", "role": "read", "pad": "x" * 1_100_000}
    with client(api) as c:
        r = c.request(method, path, json=big)
    assert r.status_code == 413, r.text
    assert "too large" in r.json()["detail"]
    assert row_counts(api.db) == before


# --- malformed specs that still parse -----------------------------------------------------------


def test_malformed_specs_that_parse_are_refused(api: FaultFarm) -> None:
    """Specs that are valid JSON but not valid jobs. (An entrypoint is code by
    design and may name anything importable, os:system included: the sandbox,
    not the API, is the line model code does not cross.)"""
    cases: list[tuple[dict[str, Any], str]] = [
        ({"model": {"entrypoint": "../../etc:passwd"}}, "bad entrypoint"),
        ({"inputs": ["float32[2..1]"]}, "upper bound below"),
        ({"inputs": ["float32[" + "1" * 300 + "]"]}, "256 characters"),
        ({"inputs": ["int64[1,16]"] * 65}, "64 items"),
        ({"targets": ["cpu/python=3/torch=2/threads=-1"]}, "threads"),
    ]
    with client(api) as c:
        for patch, needle in cases:
            before = row_counts(api.db)
            r = c.post("/v1/jobs", json=spec_json(version="h1") | patch)
            assert r.status_code == 422, (patch, r.text)
            assert needle in r.json()["detail"], (needle, r.text)
            assert row_counts(api.db) == before
