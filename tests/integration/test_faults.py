"""Faults on a real distributed farm: workers killed, the broker restarted,
the database and S3 unreachable, blobs changed under their digest, artifacts
tampered with. Nothing may be lost, nothing built twice, and nothing wrong
ever loaded.

One farm for the module (``faults``): its own Redis (not persistent, as in
CI: a restart loses every message), PostgreSQL and S3 each behind a TCP proxy
the tests cut, two trace and two CPU compile workers, 1 s heartbeats,
a 30 s trace limit (scaled) and a 4 s re-send age for jobs and claims stuck queued.
The models are tiny Linears built for training (one aot_compile artifact,
about 12 s to compile and verify here).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from sqlalchemy import update

from registry import models as m
from tests.fixtures.farm import ADMIN_TOKEN, ROOT, _wait_http, free_port, models_pack
from tests.fixtures.faults import FaultFarm, MakeFarm, farm_spec
from tests.slowdown import scaled

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TRACE_TIMEOUT_S = scaled(30)


@pytest.fixture(scope="module")
def faults(make_farm: MakeFarm) -> Iterator[FaultFarm]:
    f = make_farm(
        "faults",
        pg_proxy=True,
        s3_proxy=True,
        env={"TRACE_TIMEOUT_S": str(TRACE_TIMEOUT_S), "FARM_REQUEUE_AFTER_S": "4",
             "BUILD_TIMEOUT_S": str(scaled(120)),
             # These models coordinate with the test through the host's files
             # and pids (slow_once's marker, its parent worker): unisolated.
             # Isolation is tested in test_hostile_models and test_byom.
             "FARM_SANDBOX": "off"},
        workers=(("trace", "trace"), ("trace2", "trace"), ("compile", "compile"),
                 ("compile2", "compile")),
    )
    try:
        yield f
    finally:
        f.close()


def linear(name: str, dim: int, version: str = "1") -> dict[str, Any]:
    return farm_spec(name, version, "tests.models.broken:linear", inputs=[f"float32[2,{dim}]"],
                     kwargs={"in_features": dim, "out_features": 4}, grad_mode="training")


def built_once(f: FaultFarm, job: dict[str, Any]) -> str:
    """The job succeeded, its build compiled once and left one artifact per
    format, each with its blob in S3. Returns the build key."""
    assert job["state"] == "succeeded", json.dumps(job, indent=1)[:4000]
    (build,) = job["builds"]
    key = str(build["build_key"])
    assert f.claim_attempts(key) == 1, (key, f.claim_attempts(key))
    arts = f.artifacts(key)
    assert [fmt for fmt, _ in arts] == sorted({fmt for fmt, _ in arts}), arts
    assert arts and all(f.blob_in_s3(d) for _, d in arts), arts
    return key


def no_row_without_its_blob(f: FaultFarm) -> None:
    for key, fmt, digest in f.all_artifacts():
        assert f.blob_in_s3(digest), f"artifact row {key[:12]}/{fmt} points at a missing blob"


# --- the broker restarted -------------------------------------------------------------------


def test_redis_restart_loses_every_message_and_no_job_is_lost(faults: FaultFarm) -> None:
    assert faults.redis is not None
    a = faults.submit(linear("redis-a", 6))
    faults.wait_build(a, lambda b: b["state"] == "running")  # compiling
    t0 = time.monotonic()
    faults.redis.stop()  # no persistence: the queues and unacked messages are gone
    with faults.http() as c:
        # With the test models' code pack, as faults.submit sends them.
        code = faults.upload_pack(models_pack())
        r = c.post("/v1/jobs", json={**linear("redis-c", 7), "code_digest": code})
        assert r.status_code == 201, r.text
        during = r.json()
        assert during["enqueued"] is False and "broker" in during["warning"], during
    time.sleep(3)
    faults.redis.start()
    down_s = time.monotonic() - t0
    with faults.http() as c:
        r = c.post("/v1/jobs",  # same build as a
                   json={**linear("redis-a", 6, version="2"), "code_digest": code})
        assert r.status_code == 201, r.text
        after = r.json()
    jobs = {"a": a, "c": during["id"], "d": after["id"]}
    views = {k: faults.wait_job(j, timeout=180) for k, j in jobs.items()}
    recovered_s = time.monotonic() - t0
    key_a = built_once(faults, views["a"])
    built_once(faults, views["c"])  # compiled after the restart: the worker reconnected
    assert views["d"]["state"] == "succeeded"
    assert views["d"]["builds"][0]["build_key"] == key_a
    assert views["d"]["builds"][0]["state"] in ("reused", "succeeded")
    print(f"redis down {down_s:.1f} s with one build compiling and one job submitted; "
          f"all three jobs done {recovered_s:.1f} s after the stop "
          f"(API re-enqueued after restart: {after['enqueued']})")


# --- workers killed ----------------------------------------------------------------------


def test_kill_9_trace_worker_mid_trace_is_redelivered_and_finished_once(
    faults: FaultFarm,
) -> None:
    marker = faults.home / "slow-trace-started"
    job_id = faults.submit(farm_spec(
        "slow-trace", "1", "tests.models_env:slow_once", inputs=["float32[2,6]"],
        # The same graph as redis-a's Linear: after that test, no compile is needed.
        kwargs={"marker": str(marker), "seconds": 300, "dim": 6}, grad_mode="training"))
    deadline = time.monotonic() + 60
    while not marker.exists():
        assert time.monotonic() < deadline, faults.logs()
        time.sleep(0.1)
    child = psutil.Process(int(marker.read_text()))  # the trace step, sleeping in the model
    victim = faults.name_of_pid(child.ppid())
    assert victim in ("trace", "trace2"), (child.ppid(), child.cmdline())
    killed_at = time.monotonic()
    faults.stop(victim, signal.SIGKILL)
    # Its sandbox child dies with it (PR_SET_PDEATHSIG), instead of sleeping on,
    # unwatched, for the 300 s the model asked for.
    gone, _ = psutil.wait_procs([child], timeout=5)
    assert gone, f"the killed worker's model child {child.pid} is still running"
    job = faults.wait_job(job_id, timeout=180)
    recovered_s = time.monotonic() - killed_at
    built_once(faults, job)
    assert faults.procs["trace2" if victim == "trace" else "trace"].poll() is None
    # Re-sent when the victim's heartbeat stopped (3 s here), and traced again:
    # sooner than the trace limit, after which the sweep re-sends any trace.
    assert recovered_s < TRACE_TIMEOUT_S, (recovered_s, faults.logs())
    print(f"trace worker killed mid-trace: job finished {recovered_s:.1f} s later "
          "(re-sent by the sweep once its heartbeat stopped)")
    faults.start_worker(victim, "trace")  # back to two trace workers


# --- the database unreachable ------------------------------------------------------------------


def test_database_unreachable_api_answers_503_and_recovers(faults: FaultFarm) -> None:
    assert faults.pg_proxy is not None
    e = faults.submit(linear("db-e", 9))
    faults.wait_build(e, lambda b: b["state"] == "running")
    time.sleep(1)
    faults.pg_proxy.cut()
    cut_at = time.monotonic()
    seen: dict[str, int] = {}
    try:
        with faults.http() as c:
            for _ in range(50):
                if time.monotonic() - cut_at > 5:
                    break
                for what, r in (("GET job", c.get(f"/v1/jobs/{e}")),
                                ("POST job", c.post("/v1/jobs", json=linear("db-x", 3))),
                                ("GET models", c.get("/v1/models"))):
                    assert r.status_code == 503, (what, r.status_code, r.text)
                    assert "database" in r.json()["detail"], r.text
                    assert r.headers.get("retry-after"), r.headers
                    seen[what] = seen.get(what, 0) + 1
                h = c.get("/healthz")
                assert h.status_code == 503 and h.json()["checks"]["database"] != "ok", h.text
                time.sleep(0.3)
    finally:
        faults.pg_proxy.restore()
    restored_at = time.monotonic()
    with faults.http() as c:
        for _ in range(300):
            if c.get(f"/v1/jobs/{e}").status_code == 200:
                break
            assert time.monotonic() - restored_at < 30, "the API did not recover by itself"
            time.sleep(0.1)
    api_back_s = time.monotonic() - restored_at
    job = faults.wait_job(e, timeout=180)
    # The compile ran on through the outage and committed once the database
    # was back; nobody took its build over (attempts 1), though every
    # heartbeat went stale meanwhile.
    built_once(faults, job)
    assert seen, "no request was made during the outage"
    # Nothing submitted during the outage got in.
    with faults.http() as c:
        names = {x["name"] for x in c.get("/v1/models").json()["models"]}
    assert "db-x" not in names
    print(f"database cut {restored_at - cut_at:.1f} s: API answered 503 "
          f"({sum(seen.values())} requests), was back {api_back_s:.2f} s after the restore; "
          "the build in flight finished with 1 attempt")


# --- S3 unreachable during the upload -----------------------------------------------------------


def test_s3_unreachable_during_upload_then_back_no_row_without_blob(faults: FaultFarm) -> None:
    assert faults.s3_proxy is not None
    # The model's code, uploaded and unpacked on the workers (FARM_HOME/code, as
    # any earlier build of it leaves it) before the outage: this test is about
    # the artifact's upload, not the code's download.
    from farm.build.codeenv import code_dir, code_root

    pack = models_pack()
    faults.upload_pack(pack)
    code_dir(pack.digest, fetch=lambda _d, dest: dest.write_bytes(pack.data),
             root=code_root(faults.home))
    faults.s3_proxy.cut()
    try:
        f = faults.submit(linear("s3-f", 10))
        key = faults.wait_build(f, lambda b: b["state"] == "running", timeout=120)["build_key"]
        deadline = time.monotonic() + 120
        while faults.s3_proxy.refused == 0:  # the compile is done; the upload starts
            assert time.monotonic() < deadline, faults.logs()
            time.sleep(0.1)
        first = time.monotonic()
        # However long the outage, no row may name a blob that is not stored.
        while time.monotonic() - first < 8:
            assert faults.artifacts(key) == [], "a row was committed for a blob not stored"
            with faults.http() as c:
                assert c.get(f"/v1/jobs/{f}").json()["state"] != "succeeded"
            time.sleep(0.5)
        refused = faults.s3_proxy.refused
    finally:
        faults.s3_proxy.restore()
    outage_s = time.monotonic() - first
    job = faults.wait_job(f, timeout=240)
    assert job["state"] == "succeeded", json.dumps(job, indent=1)[:4000]
    attempts = faults.claim_attempts(str(key))
    assert faults.artifacts(str(key)), job
    no_row_without_its_blob(faults)
    print(f"S3 cut for {outage_s:.0f} s from the first upload attempt "
          f"({refused} connections refused): the build retried ({attempts} compile "
          "attempts) and finished once S3 was back; no row without its blob")


# --- corruption and tampering ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def built(faults: FaultFarm) -> dict[str, Any]:
    """A finished build whose artifact the corruption tests damage (and mend)."""
    # db-e's graph: after that test this is a reuse, not a compile.
    job = faults.wait_job(faults.submit(linear("corrupt-me", 9)), timeout=180)
    built_once(faults, job)
    (build,) = job["builds"]
    (art,) = [a for a in build["artifacts"] if a["format"] == "aot_compile"]
    return {"job": job, "target": build["target"], "artifact": art, "dim": 9}


def public_pem(f: FaultFarm) -> str:
    """The farm's root public key, as its nodes pin it."""
    return Path(f.env["FARM_ROOT_KEY"]).read_text()


def node_client(f: FaultFarm, cache_dir: Path, url: str | None = None,
                public_key: str | None = None) -> Any:
    from farm.node.cache import ArtifactCache
    from farm.node.client import FarmClient

    return FarmClient(url or f.url, ADMIN_TOKEN, public_key=public_key or public_pem(f),
                      cache=ArtifactCache(cache_dir, 1 << 30), retries=0)


def resolve(client: Any, built: dict[str, Any]) -> dict[str, Any]:
    return dict(client.resolve("corrupt-me", "1", inputs=[f"float32[2,{built['dim']}]"],
                               grad_mode="training", target=built["target"],
                               formats=["aot_compile"]))


@pytest.fixture
def never_loaded(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Fails the test if anything reaches the unpickling loader."""
    import farm.node.loader

    calls: list[Any] = []

    def refuse(*args: Any, **kw: Any) -> Any:
        calls.append(args)
        raise AssertionError("an unverified artifact reached load_artifact")

    monkeypatch.setattr(farm.node.loader, "load_artifact", refuse)
    return calls


def flip_a_byte(data: bytes) -> bytes:
    b = bytearray(data)
    b[len(b) // 2] ^= 0xFF
    return bytes(b)


def test_blob_changed_in_s3_is_detected_and_never_loaded(
    faults: FaultFarm, built: dict[str, Any], tmp_path: Path, never_loaded: list[Any]
) -> None:
    from farm.node.errors import IntegrityError

    digest = built["artifact"]["digest"]
    key = faults.blob_key(digest)
    original = faults.s3.get_object(Bucket=faults.bucket, Key=key)["Body"].read()
    assert hashlib.sha256(original).hexdigest() == digest
    faults.s3.put_object(Bucket=faults.bucket, Key=key, Body=flip_a_byte(original))
    try:
        with node_client(faults, tmp_path / "node") as client:
            resolved = resolve(client, built)
            assert resolved["artifact"]["digest"] == digest
            with pytest.raises(IntegrityError, match=r"hash|sha256|corrupt"):
                client.load(resolved)
            assert client.cache.get(digest) is None
            assert not list((tmp_path / "node" / "blobs").iterdir())
    finally:
        faults.s3.put_object(Bucket=faults.bucket, Key=key, Body=original)
    assert never_loaded == []
    # Mended, the same node fetches it: it was the damage that was refused.
    with node_client(faults, tmp_path / "node") as client:
        path = client.fetch(resolve(client, built))
        assert hashlib.sha256(path.read_bytes()).hexdigest() == digest


def test_blob_changed_on_disk_is_detected_by_api_and_client(
    faults: FaultFarm, built: dict[str, Any], tmp_path: Path, never_loaded: list[Any]
) -> None:
    """A file-store API (a second API process on the same database) streams a
    blob that was rewritten in place, after it had been served and verified
    once, with its size and mtime kept: the API re-hashes it and aborts the
    download, and the node refuses it."""
    from farm.node.errors import FarmError
    from registry.blobstore import LocalBlobStore

    digest = built["artifact"]["digest"]
    original = faults.s3.get_object(Bucket=faults.bucket, Key=faults.blob_key(digest))
    data = original["Body"].read()
    store = LocalBlobStore(tmp_path / "blobs")
    store.put_bytes(data)
    port = free_port()
    env = {**faults.env, "BLOB_STORE_URL": store.url, "DATABASE_URL": faults.db_url}
    log = tmp_path / "api-file.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "farm.app.cli", "serve", "--host", "127.0.0.1", "--port", str(port)],
        env=env, stdout=open(log, "ab"), stderr=subprocess.STDOUT,  # noqa: SIM115
        start_new_session=True, cwd=ROOT)
    faults.procs["api-file"] = proc
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_http(url, proc, log)
        with node_client(faults, tmp_path / "node-1", url=url) as client:
            resolved = resolve(client, built)
            client.fetch(resolved)  # served and verified once
        path = store.path_for(digest)
        st = path.stat()
        path.chmod(0o644)
        path.write_bytes(flip_a_byte(data))
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # the same size and mtime
        # What a plain HTTP client gets: the API re-hashes the changed file
        # and holds the last chunk back until the digest checks, so the body
        # is cut short of its Content-Length wherever the damage is (a blob of
        # one chunk sends no byte of it).
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
                          timeout=30) as c, pytest.raises(httpx.HTTPError):
            c.get(f"/v1/artifacts/{digest}/blob").read()
        with node_client(faults, tmp_path / "node-2", url=url) as client:
            with pytest.raises(FarmError):
                client.load(resolve(client, built))
            assert client.cache.get(digest) is None
        assert never_loaded == []
        assert "aborted a download" in log.read_text()
        print("blob rewritten on disk: API aborted the stream, a plain client saw a cut-short "
              "body; the node refused it")
    finally:
        faults.stop("api-file")


def test_tampered_or_unsigned_artifact_is_refused(
    faults: FaultFarm, built: dict[str, Any], tmp_path: Path, never_loaded: list[Any]
) -> None:
    from farm.core.keys import generate_keypair
    from farm.node.errors import IntegrityError

    with node_client(faults, tmp_path / "node") as client:
        resolved = resolve(client, built)
        art = resolved["artifact"]
        assert art["attestation"]["build"] and art["attestation"]["version"]
        # A man in the middle (or a broken proxy) edits the answer.
        other = "f" * 64 if art["digest"] != "f" * 64 else "e" * 64
        att = art["attestation"]
        for field, value in [("attestation", None), ("digest", other), ("size", art["size"] + 1),
                             ("build_key", "0" * 64),
                             # The statement's name taken out, or swapped for one
                             # the farm does not have (the node fetches it by digest).
                             ("attestation", {**att, "build": None, "build_statement": None}),
                             ("attestation", {**att, "build": None,
                                              "build_statement": {"digest": "0" * 64}}),
                             ("attestation", {**att, "version": None})]:
            edited = {**art, field: value}
            if value is None:
                del edited[field]
            with pytest.raises(IntegrityError):
                client.load({**resolved, "artifact": edited})
            # Fetching alone (farm fetch, prefetch) refuses it too: there is
            # no switch that takes an artifact without its build statement.
            with pytest.raises(IntegrityError):
                client.fetch({**resolved, "artifact": edited})
        assert client.cache.get(art["digest"]) is None  # refused before any download
    # A node that trusts another key refuses the farm's artifacts.
    _, stranger = generate_keypair()
    with node_client(faults, tmp_path / "node-2", public_key=stranger) as client, \
            pytest.raises(IntegrityError):
        client.load(resolve(client, built))
    # Someone with write access to the database points the row at bytes of
    # their own, uploaded under their own digest (so the hash checks pass).
    evil = b"not a torch artifact " * 500
    evil_digest = hashlib.sha256(evil).hexdigest()
    faults.s3.put_object(Bucket=faults.bucket, Key=faults.blob_key(evil_digest), Body=evil)
    with faults.db.session() as s:
        s.execute(update(m.Artifact).where(m.Artifact.digest == art["digest"])
                  .values(digest=evil_digest, size=len(evil)))
    try:
        # The API learns of the change from PostgreSQL's notification, which
        # here passes the test's TCP proxy (a Python thread on a busy machine).
        deadline = time.monotonic() + scaled(10)
        with node_client(faults, tmp_path / "node-3") as client:
            swapped = resolve(client, built)
            while swapped["artifact"]["digest"] != evil_digest and time.monotonic() < deadline:
                time.sleep(0.2)
                swapped = resolve(client, built)
            assert swapped["artifact"]["digest"] == evil_digest
            with pytest.raises(IntegrityError, match="digest"):
                client.load(swapped)
            assert client.cache.get(evil_digest) is None
    finally:
        with faults.db.session() as s:
            s.execute(update(m.Artifact).where(m.Artifact.digest == evil_digest)
                      .values(digest=art["digest"], size=art["size"]))
        with contextlib.suppress(Exception):
            faults.s3.delete_object(Bucket=faults.bucket, Key=faults.blob_key(evil_digest))
    assert never_loaded == []
