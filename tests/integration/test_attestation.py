"""Attestation against the real services: a farm (PostgreSQL, Redis, moto S3
over HTTP, the API and Celery workers in their own processes; the one
test_pipeline uses, which runs first), whose compile worker signs what it
builds, whose API binds names as it accepts them, and nodes that check all
of it against their own request.

Each attack is refused and nothing is loaded: a forged artifact row written
straight into PostgreSQL with a blob the attacker uploaded; another model's
attested artifact replayed by a proxy in the middle; an older version
replayed for ``prod``; a tampered trust list; an artifact of a revoked
builder key. And an attested file copied to another node loads there after
``farm verify``.

Two builds serve it all: ``victim@1`` and ``victim@2`` are two programs;
``other@1`` is the first program under another name (a reuse: no build).
"""

from __future__ import annotations

import base64
import hashlib
import json
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import select

from registry import models as m
from tests.fixtures.farm import ADMIN_TOKEN, ROOT
from tests.fixtures.faults import FaultFarm, farm_spec
from tests.fixtures.keys import keypair
from tests.fixtures.node import node_python

pytestmark = pytest.mark.integration

INPUTS = ["float32[4,32]"]


def spec(name: str, version: str, hidden: int) -> dict[str, Any]:
    return farm_spec(name, version, "farm.zoo.basic:mlp", inputs=INPUTS,
                     kwargs={"d_in": 32, "hidden": hidden, "d_out": 8})


@pytest.fixture(scope="module")
def farm(aoti_farm: FaultFarm) -> Iterator[FaultFarm]:
    # Both formats: its nodes fetch AOTI packages too. The farm is shared with
    # test_pipeline (tests/fixtures/faults.py); the last test here revokes its
    # builder key, so nothing may build on it after this module.
    f = aoti_farm
    for s in (spec("victim", "1", 16), spec("victim", "2", 24), spec("other", "1", 16)):
        job = f.wait_job(f.submit(s), timeout=900)
        assert job["state"] == "succeeded", json.dumps(job)[:3000]
    with f.http() as c:
        assert c.put("/v1/models/victim/aliases/prod", json={"version": "1"}).status_code == 200
    yield f


class Rewriter(httpx.BaseTransport):
    """A proxy in the middle of the node's connection: every answer passes
    through ``rewrite(request, response_json)``, which may return other JSON."""

    def __init__(self, rewrite: Callable[[httpx.Request, Any], Any]) -> None:
        self.inner = httpx.HTTPTransport()
        self.rewrite = rewrite
        self.rewritten = 0

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        r = self.inner.handle_request(request)
        if "json" not in r.headers.get("content-type", ""):
            return r
        r.read()
        body = r.json()
        new = self.rewrite(request, body)
        if new is body:
            return r
        self.rewritten += 1
        headers = {k: v for k, v in r.headers.items()
                   if k.lower() not in ("content-length", "content-encoding")}
        return httpx.Response(r.status_code, headers=headers, json=new, request=request)


def node(f: FaultFarm, cache: Path, transport: httpx.BaseTransport | None = None) -> Any:
    from farm.node.cache import ArtifactCache
    from farm.node.client import FarmClient

    return FarmClient(f.url, ADMIN_TOKEN, root_key=Path(f.env["FARM_ROOT_KEY"]).read_text(),
                      cache=ArtifactCache(cache, 1 << 30), retries=0, transport=transport)


def node_target() -> Any:
    from farm.core.target import detect_local_target

    return detect_local_target("cpu", check_compiler=False)


def resolve(client: Any, model: str, ref: str | None) -> dict[str, Any]:
    return dict(client.resolve(model, ref, inputs=INPUTS, grad_mode="inference",
                               target=node_target()))


@pytest.fixture
def never_loaded(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Fails the test if any bytes reach torch's unpickler or the AOTI loader."""
    import farm.node.loader as loader

    calls: list[Any] = []

    def refuse(*args: Any, **kw: Any) -> Any:
        calls.append(args)
        raise AssertionError("bytes reached the loader")

    monkeypatch.setattr(loader, "_load_aot_compile", refuse)
    monkeypatch.setattr(loader, "_load_aoti", refuse)
    return calls


def refused(client: Any, resolved: dict[str, Any], field: str) -> None:
    from farm.node.verify import AttestationRefused

    with pytest.raises(AttestationRefused) as exc:
        client.load(resolved)
    assert exc.value.field == field, str(exc.value)
    print(exc.value)


def cached_blobs(cache: Path) -> list[Path]:
    return [p for p in cache.rglob("*") if p.is_file() and len(p.name) == 64]


def test_a_good_answer_loads(farm: FaultFarm, tmp_path: Path) -> None:
    with node(farm, tmp_path / "n") as client:
        resolved = resolve(client, "victim", "prod")
        path, verified = client.fetch_verified(resolved)
        assert (verified.model, verified.version, verified.alias) == ("victim", "1", "prod")
        b = verified.build
        assert b["program"]["kwargs"] == {"d_in": 32, "hidden": 16, "d_out": 8}
        assert b["toolchain"]["torch"] and b["builder"]["keyid"] == verified.builder_keyid
        assert path.stat().st_size == verified.size


class Recorder(httpx.BaseTransport):
    """The node's connection, recording the paths it asks for; with
    ``statement``, a proxy that answers every build statement request with
    those bytes instead."""

    def __init__(self, statement: bytes | None = None) -> None:
        self.inner = httpx.HTTPTransport()
        self.statement = statement
        self.paths: list[str] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        self.paths.append(request.url.path)
        if self.statement is not None and request.url.path.startswith("/v1/attestations/"):
            return httpx.Response(200, content=self.statement, request=request,
                                  headers={"content-type": "application/json"})
        return self.inner.handle_request(request)


def test_the_build_statement_comes_by_digest_once_and_a_swapped_one_is_refused(
    farm: FaultFarm, tmp_path: Path, never_loaded: list[Any]
) -> None:
    # The answer names the build statement (which holds the weights manifest)
    # by digest instead of carrying it.
    with farm.http() as c:
        raw = c.get("/v1/resolve", params=[("model", "victim"), ("ref", "prod"),
                                           ("target", str(node_target())),
                                           ("input", INPUTS[0])]).json()
    named = raw["artifact"]["attestation"]["build_statement"]
    assert "build" not in raw["artifact"]["attestation"]
    assert "weights_manifest" not in json.dumps(raw)
    t = Recorder()
    with node(farm, tmp_path / "n", transport=t) as client:
        for _ in range(2):
            path, verified = client.fetch_verified(resolve(client, "victim", "prod"))
            assert verified.version == "1" and path.stat().st_size == verified.size
    # Fetched once, kept by digest, and it is what the build's worker signed.
    assert t.paths.count(named["url"]) == 1
    kept = tmp_path / "n" / "statements" / f"{named['digest']}.json"
    assert hashlib.sha256(kept.read_bytes()).hexdigest() == named["digest"]
    # A proxy that serves another (genuine, signed) statement under this
    # digest, victim@2's build's: refused by the digest, before any
    # signature is looked at.
    with farm.http() as c:
        other = c.get("/v1/resolve", params=[("model", "victim"), ("ref", "2"),
                                             ("target", str(node_target())),
                                             ("input", INPUTS[0])]).json()
        theirs = c.get(other["artifact"]["attestation"]["build_statement"]["url"]).content
    assert hashlib.sha256(theirs).hexdigest() != named["digest"]
    from farm.node.errors import IntegrityError

    with node(farm, tmp_path / "n2", transport=Recorder(statement=theirs)) as client, \
            pytest.raises(IntegrityError, match="does not hash to its digest"):
        client.load(resolve(client, "victim", "prod"))
    assert cached_blobs(tmp_path / "n2") == []
    assert never_loaded == []


def test_forged_row_with_the_attackers_blob_is_refused(
    farm: FaultFarm, tmp_path: Path, never_loaded: list[Any]
) -> None:
    """Database and bucket write access, no signing key: a row of its own for
    victim@2 pointing at its own bytes (so every digest check would pass)."""
    evil = b"import os; os.system('id')  " * 300
    digest = hashlib.sha256(evil).hexdigest()
    farm.s3.put_object(Bucket=farm.bucket, Key=farm.blob_key(digest), Body=evil)
    with farm.db.session() as s:
        real = s.scalars(select(m.Artifact).join(
            m.VersionArtifact, m.VersionArtifact.artifact_id == m.Artifact.id).join(
            m.ModelVersion, m.ModelVersion.id == m.VersionArtifact.version_id).join(
            m.Model, m.Model.id == m.ModelVersion.model_id).where(
            m.Model.name == "victim", m.ModelVersion.version == "2")).all()
        saved = {a.id: (a.digest, a.size, a.attestation) for a in real}
        for a in real:
            # One row with the attacker's bytes and no attestation; one with
            # the attacker's bytes and a genuine attestation copied from the other.
            if a.format == "aoti":
                a.digest, a.size, a.attestation = digest, len(evil), None
            else:
                a.digest, a.size = digest, len(evil)
    try:
        time.sleep(1.5)  # past the API's resolve cache
        with node(farm, tmp_path / "n") as client:
            for fmt, field in (("aoti", "build_statement"), ("aot_compile", "digest")):
                resolved = dict(client.resolve("victim", "2", inputs=INPUTS,
                                               grad_mode="inference", formats=[fmt],
                                               target=node_target()))
                assert resolved["artifact"]["digest"] == digest
                refused(client, resolved, field)
        assert cached_blobs(tmp_path / "n") == []  # refused before the download
    finally:
        with farm.db.session() as s:
            for aid, (d, size, att) in saved.items():
                row = s.get(m.Artifact, aid)
                assert row is not None
                row.digest, row.size, row.attestation = d, size, att
    assert never_loaded == []


def test_another_models_artifact_replayed_by_a_proxy_is_refused(
    farm: FaultFarm, tmp_path: Path, never_loaded: list[Any]
) -> None:
    # What the proxy replays: other@1's answer (a genuine one, for a program
    # that is not victim@2's).
    with node(farm, tmp_path / "capture") as client:
        theirs = resolve(client, "other", "1")
    for variant, field in (("whole", "model"), ("build", "program")):
        def rewrite(request: httpx.Request, body: Any, variant: str = variant) -> Any:
            if request.url.path != "/v1/resolve" or "artifact" not in body:
                return body
            if variant == "whole":  # other's answer, all of it
                return {**theirs, "node_request": None}
            # other's build statement and bytes with victim's name statement
            art = {**theirs["artifact"],
                   "attestation": {**body["artifact"]["attestation"],
                                   "build": theirs["artifact"]["attestation"]["build"]}}
            return {**body, "artifact": art}

        t = Rewriter(rewrite)
        with node(farm, tmp_path / variant, transport=t) as client:
            resolved = resolve(client, "victim", "2")
            assert t.rewritten
            refused(client, resolved, field)
        assert cached_blobs(tmp_path / variant) == []
    assert never_loaded == []


def test_an_older_version_replayed_for_prod_is_refused(
    farm: FaultFarm, tmp_path: Path, never_loaded: list[Any]
) -> None:
    cache = tmp_path / "n"
    with node(farm, cache) as client:
        old = resolve(client, "victim", "prod")  # prod -> 1, signed when it was set
        assert old["version"] == "1"
    with farm.http() as c:
        assert c.put("/v1/models/victim/aliases/prod", json={"version": "2"}).status_code == 200
    try:
        time.sleep(1.5)
        with node(farm, cache) as client:
            current = resolve(client, "victim", "prod")
            assert current["version"] == "2"
            client.fetch(current)  # this node has now seen prod -> 2
        # 1) version 1's statements under today's prod -> 2 alias statement
        def splice(request: httpx.Request, body: Any) -> Any:
            if request.url.path != "/v1/resolve" or "artifact" not in body:
                return body
            att = {**old["artifact"]["attestation"],
                   "alias": body["artifact"]["attestation"]["alias"]}
            return {**old, "artifact": {**old["artifact"], "attestation": att}}

        # 2) the whole old answer, old alias statement included
        def replay(request: httpx.Request, body: Any) -> Any:
            return old if request.url.path == "/v1/resolve" and "artifact" in body else body

        for rewrite, field, where in ((splice, "version", cache), (replay, "alias.issued_at",
                                                                  cache)):
            t = Rewriter(rewrite)
            with node(farm, where, transport=t) as client:
                refused(client, resolve(client, "victim", "prod"), field)
                assert t.rewritten
    finally:
        with farm.http() as c:
            c.put("/v1/models/victim/aliases/prod", json={"version": "1"})
        time.sleep(1.5)
    assert never_loaded == []


def test_a_tampered_trust_list_is_refused(
    farm: FaultFarm, tmp_path: Path, never_loaded: list[Any]
) -> None:
    """The proxy (or a database writer) adds its own builder key to the list."""
    from farm.core import attest
    from farm.core.keys import generate_keypair

    _, mallory = generate_keypair()

    def rewrite(request: httpx.Request, body: Any) -> Any:
        if request.url.path != "/v1/trust-list":
            return body
        payload = json.loads(base64.b64decode(body["payload"]))
        payload["keys"].append({"keyid": attest.keyid(mallory), "role": "builder",
                                "name": "mallory", "public_key": mallory})
        return {**body, "payload": base64.b64encode(attest.canonical_bytes(payload)).decode()}

    t = Rewriter(rewrite)
    with node(farm, tmp_path / "n", transport=t) as client:
        refused(client, resolve(client, "victim", "1"), "trust_list")
        assert t.rewritten
    # The same list written straight into the database
    with farm.db.session() as s:
        row = s.scalar(select(m.TrustListRow).order_by(m.TrustListRow.version.desc()))
        assert row is not None
        original = row.envelope
        env = json.loads(original)
        row.envelope = json.dumps(rewrite(httpx.Request("GET", f"{farm.url}/v1/trust-list"), env))
    try:
        with node(farm, tmp_path / "n2") as client:
            refused(client, resolve(client, "victim", "1"), "trust_list")
    finally:
        with farm.db.session() as s:
            row = s.scalar(select(m.TrustListRow).order_by(m.TrustListRow.version.desc()))
            assert row is not None
            row.envelope = original
    assert never_loaded == []


def farm_cli(f: FaultFarm, *args: str, env: dict[str, str] | None = None,
             check: bool = True) -> subprocess.CompletedProcess[str]:
    out = subprocess.run([sys.executable, "-m", "farm.app.cli", *args],
                         env={**f.env, **(env or {})}, cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    if check:
        assert out.returncode == 0, out.stdout + out.stderr
    return out


def test_an_attested_file_copied_to_another_node_loads_after_farm_verify(
    farm: FaultFarm, tmp_path: Path
) -> None:
    out = tmp_path / "fetched" / "victim.pt2"
    out.parent.mkdir()
    farm_cli(farm, "fetch", "victim@1", "--input", INPUTS[0], "--format", "aoti",
             "-o", str(out), env={"CLIENT_CACHE_DIR": str(tmp_path / "fetch-cache")})
    bundle = out.with_name(out.name + ".attestation.json")
    assert bundle.exists()
    # Another node: its own cache, the farm's root key pinned, no farm to ask.
    other = tmp_path / "other-node"
    other.mkdir()
    shutil.copy(out, other / "model.pt2")
    shutil.copy(bundle, other / "model.pt2.attestation.json")
    offline = {"CLIENT_CACHE_DIR": str(tmp_path / "other-cache"), "FARM_URL": "http://127.0.0.1:9"}
    ok = farm_cli(farm, "verify", str(other / "model.pt2"), "--json", env=offline)
    verdict = json.loads(ok.stdout)
    assert verdict["ok"] and verdict["model"] == "victim" and verdict["version"] == "1"
    load = subprocess.run([*node_python(), "-c", LOAD_AND_COMPARE, str(other / "model.pt2")],
                          env={**farm.env, **offline}, cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert load.returncode == 0, load.stdout + load.stderr
    assert float(load.stdout.strip().splitlines()[-1]) < 1e-4
    # One byte changed: farm verify says so and the loader refuses it.
    data = bytearray((other / "model.pt2").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (other / "model.pt2").write_bytes(bytes(data))
    bad = farm_cli(farm, "verify", str(other / "model.pt2"), env=offline, check=False)
    assert bad.returncode != 0 and "digest" in bad.stderr, bad.stdout + bad.stderr
    # A file with no attestation beside it is not loaded unless asked for.
    (other / "model.pt2.attestation.json").unlink()
    shutil.copy(out, other / "model.pt2")
    from farm.node.verify import AttestationRefused

    with pytest.raises(AttestationRefused, match="attestation"):
        from farm.node.loader import load_artifact

        load_artifact(other / "model.pt2", "aoti")


LOAD_AND_COMPARE = """
import sys, torch
from farm.core.modelref import build_module
from farm.core.specs import ModelRef
from farm.node.loader import load_artifact
module = build_module(ModelRef("farm.zoo.basic:mlp", {"d_in": 32, "hidden": 16, "d_out": 8}),
                      device="cpu", seed=0).eval()
fn = load_artifact(sys.argv[1], "aoti", module=module)
x = torch.randn(4, 32)
with torch.no_grad():
    print(float((fn(x) - module(x)).abs().max()))
"""


def test_a_revoked_builder_keys_artifacts_are_refused(
    farm: FaultFarm, tmp_path: Path, never_loaded: list[Any]
) -> None:
    """Last in this module: the farm's only builder key is revoked through the
    CLI and the admin signs a new trust list with the offline root key."""
    with node(farm, tmp_path / "before") as client:
        before = resolve(client, "victim", "1")
        client.fetch(before)  # loads fine while the key is trusted
    keys = json.loads(farm_cli(farm, "keys", "list", "--json").stdout)
    (builder,) = [k for k in keys["keys"] if k["role"] == "builder"]
    farm_cli(farm, "keys", "revoke", builder["keyid"][:16], "--reason", "host compromised")
    signed = farm_cli(farm, "keys", "sign-trust-list", "--root-key",
                      str(farm.home / "root-key.pem"), "--json")
    assert json.loads(signed.stdout)["version"] == 2
    with node(farm, tmp_path / "after") as client:
        refused(client, resolve(client, "victim", "1"), "revoked")
    # A node that had the old list kept refreshes it within its TTL and
    # refuses too, even for bytes already in its cache.
    with node(farm, tmp_path / "before") as client:
        refused(client, resolve(client, "victim", "1"), "revoked")
    # A revoked key cannot be enrolled again; a new key can.
    (tmp_path / "old.pub").write_text(builder["public_key"])
    again = farm_cli(farm, "keys", "enroll", "--name", "pool-1", "--role", "builder",
                     "--public-key", str(tmp_path / "old.pub"), check=False)
    assert again.returncode != 0 and "revoked" in again.stderr, again.stdout + again.stderr
    pub = keypair(tmp_path / "fresh.pem")
    assert json.loads(farm_cli(farm, "keys", "enroll", "--name", "pool-2", "--role", "builder",
                               "--public-key", str(pub), "--json").stdout)["role"] == "builder"
    assert never_loaded == []
