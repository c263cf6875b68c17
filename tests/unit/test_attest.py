"""The pure parts of attestation: DSSE's PAE and envelopes, the trust list, and
every field a node compares with its request (farm.core.attest, farm.node.verify,
farm.build.provenance)."""

from __future__ import annotations

import base64
import copy
import hashlib
import json
from dataclasses import replace
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from farm.build.provenance import BuildSigner, program_of_spec
from farm.core import attest
from farm.core.inputs import parse_inputs
from farm.core.keys import public_key_pem
from farm.core.specs import CompileOptions, GradMode, JobSpec, ModelRef, build_key
from farm.core.target import Target
from farm.node.verify import (
    AttestationRefused,
    NodeRequest,
    TrustStore,
    check_file,
    make_bundle,
    verify_attestation,
    verify_file,
)

CPU = Target(device="cpu", python_version="3.12", torch_version="2.13.0", cpu_isa="AVX2",
             threads=2)


def test_pae_matches_the_dsse_spec_vector() -> None:
    # protocol.md of secure-systems-lab/dsse
    assert attest.pae("http://example.com/HelloWorld", b"hello world") == (
        b"DSSEv1 29 http://example.com/HelloWorld 11 hello world")
    # Lengths are of UTF-8 bytes, not characters.
    assert attest.pae("t", "é".encode()) == b"DSSEv1 1 t 2 \xc3\xa9"


def test_envelope_round_trip_and_tampering() -> None:
    key = Ed25519PrivateKey.generate()
    kid = attest.keyid(key)
    env = attest.sign_envelope(key, "application/x-test", b'{"a":1}')
    assert env["signatures"][0]["keyid"] == kid
    assert attest.verify_envelope(env, {kid: key.public_key()},
                                  payload_type="application/x-test") == (kid, b'{"a":1}')
    # JSON text works too
    attest.verify_envelope(json.dumps(env), {kid: key.public_key()},
                           payload_type="application/x-test")

    changed = dict(env, payload=base64.b64encode(b'{"a":2}').decode())
    with pytest.raises(attest.AttestationError, match="does not verify") as exc:
        attest.verify_envelope(changed, {kid: key.public_key()}, payload_type="application/x-test")
    assert exc.value.field == "signature"
    # The same bytes under another type never verify: PAE binds the type.
    with pytest.raises(attest.AttestationError) as exc:
        attest.verify_envelope(dict(env, payloadType="application/x-other"),
                               {kid: key.public_key()}, payload_type="application/x-other")
    assert exc.value.field == "signature"
    with pytest.raises(attest.AttestationError, match="payloadType") as exc:
        attest.verify_envelope(env, {kid: key.public_key()}, payload_type="application/x-other")
    other = Ed25519PrivateKey.generate()
    with pytest.raises(attest.AttestationError, match="none of which is trusted"):
        attest.verify_envelope(env, {attest.keyid(other): other.public_key()},
                               payload_type="application/x-test")
    # A signature claimed under a trusted key id but made by another key
    forged = attest.sign_envelope(other, "application/x-test", b'{"a":1}')
    forged["signatures"][0]["keyid"] = kid
    with pytest.raises(attest.AttestationError, match="does not verify"):
        attest.verify_envelope(forged, {kid: key.public_key()}, payload_type="application/x-test")
    for bad in ({}, {"payloadType": "x", "payload": "!!", "signatures": []}, "not json", 3):
        with pytest.raises(attest.AttestationError):
            attest.verify_envelope(bad, {}, payload_type="x")


# --- a whole farm's worth of keys and statements ---------------------------------------


class Farm:
    def __init__(self) -> None:
        self.root = Ed25519PrivateKey.generate()
        self.names = Ed25519PrivateKey.generate()
        self.builder = Ed25519PrivateKey.generate()
        self.version = 1
        self.revoked: list[dict[str, str]] = []

    def trust(self, *, expires_days: float = 30.0, extra: list[Any] | None = None) -> Any:
        keys = [{"role": "names", "name": "api", "public_key": public_key_pem(self.names)},
                {"role": "builder", "name": "pool-a", "public_key": public_key_pem(self.builder)}]
        payload = attest.trust_list_payload(version=self.version, keys=keys + (extra or []),
                                            revoked=self.revoked, expires_days=expires_days)
        env = attest.sign_trust_list(self.root, payload)
        return attest.verify_trust_list(env, public_key_pem(self.root))

    def spec(self, *, name: str = "mlp", version: str = "1", kwargs: dict[str, Any] | None = None,
             inputs: tuple[str, ...] = ("float32[2..16,64]",),
             grad: GradMode = GradMode.INFERENCE) -> JobSpec:
        return JobSpec(name=name, version=version,
                       model=ModelRef("farm.zoo.basic:mlp", kwargs or {}),
                       inputs=parse_inputs(list(inputs)), grad_mode=grad)

    def build(self, spec: JobSpec, *, key: Ed25519PrivateKey | None = None,
              target: Target = CPU, digest: str = "a" * 64, size: int = 1234,
              fmt: str = "aoti", fingerprint: str = "f" * 64) -> dict[str, Any]:
        bk = build_key(fingerprint=fingerprint, inputs=spec.inputs, grad_mode=spec.grad_mode,
                       options=spec.options, target=str(target), project=spec.project)
        signer = BuildSigner(key or self.builder, builder_id="host:1")
        return json.loads(signer.sign(digest=digest, size=size, fmt=fmt, build_key=bk,
                                      fingerprint=fingerprint, spec=spec, target=target,
                                      meta={"cxx": "/usr/bin/g++: g++ 13",
                                            "model_class": "farm.zoo.basic.MLP"},
                                      verification={"max_abs_err": float("nan")}))

    def version_env(self, spec: JobSpec, *, key: Ed25519PrivateKey | None = None) -> Any:
        stmt = attest.version_statement(model=spec.name, version=spec.version,
                                        program=program_of_spec(spec), issued_at=attest.now_iso())
        return attest.sign_statement(key or self.names, stmt)

    def alias_env(self, spec: JobSpec, alias: str, *, issued_at: str | None = None) -> Any:
        stmt = attest.alias_statement(model=spec.name, alias=alias, version=spec.version,
                                      program=program_of_spec(spec),
                                      issued_at=issued_at or attest.now_iso())
        return attest.sign_statement(self.names, stmt)


def req(model: str = "mlp", ref: str | None = "1", inputs: str = "float32[8,64]",
        grad: GradMode = GradMode.INFERENCE, target: Target = CPU, **kw: Any) -> NodeRequest:
    return NodeRequest(model=model, ref=ref, inputs=parse_inputs([inputs]), grad_mode=grad,
                       target=target, **kw)


@pytest.fixture()
def farm() -> Farm:
    return Farm()


def refused(field: str, bundle: dict[str, Any], trust: Any, request: NodeRequest,
            **kw: Any) -> AttestationRefused:
    with pytest.raises(AttestationRefused) as exc:
        verify_attestation(bundle, trust, request, **kw)
    assert exc.value.field == field, str(exc.value)
    return exc.value


def test_a_matching_bundle_verifies(farm: Farm) -> None:
    spec = farm.spec()
    bundle = {"build": farm.build(spec), "version": farm.version_env(spec)}
    v = verify_attestation(bundle, farm.trust(), req())
    assert (v.model, v.version, v.format, v.size) == ("mlp", "1", "aoti", 1234)
    assert v.builder_keyid == attest.keyid(farm.builder)
    assert v.build["toolchain"]["cxx"] == "/usr/bin/g++: g++ 13"
    assert v.build["toolchain"]["torch"]
    # NaN has no canonical JSON; and the statement says who ran the comparison.
    assert v.build["verification"] == {
        "max_abs_err": None, "performed_by": "submitter-code sandbox",
        "meaning": "the submitter's own code ran the comparison with eager in the build "
                   "sandbox: it catches honest mistakes, not a hostile submitter"}


def test_each_request_field_is_checked(farm: Farm) -> None:
    spec = farm.spec()
    tl = farm.trust()
    bundle = {"build": farm.build(spec), "version": farm.version_env(spec)}
    refused("model", bundle, tl, req(model="other"))
    refused("inputs", bundle, tl, req(inputs="float32[32,64]"))  # outside 2..16
    refused("inputs", bundle, tl, req(inputs="float16[8,64]"))
    refused("grad_mode", bundle, tl, req(grad=GradMode.TRAINING))
    refused("options", bundle, tl, req(options=CompileOptions(mode="max-autotune")))
    refused("target.cpu_isa", bundle, tl, req(target=Target(
        device="cpu", python_version="3.12", torch_version="2.13.0", cpu_isa="AVX512",
        threads=2)))
    refused("target.torch_version", bundle, tl, req(target=Target(
        device="cpu", python_version="3.12", torch_version="2.12.0", cpu_isa="AVX2", threads=2)))
    refused("target.threads", bundle, tl, req(target=Target(
        device="cpu", python_version="3.12", torch_version="2.13.0", cpu_isa="AVX2", threads=4)))
    refused("format", bundle, tl, req(formats=("aot_compile",)))
    refused("version", bundle, tl, req(ref="2"))  # asked for a version, no alias statement
    # The farm's answer may not claim anything else than the statements.
    refused("digest", bundle, tl, req(), claimed={"digest": "b" * 64})
    refused("version", bundle, tl, req(), claimed={"version": "2"})
    refused("size", bundle, tl, req(), claimed={"size": 1})


def test_another_models_build_is_refused_by_program(farm: Farm) -> None:
    mine, theirs = farm.spec(name="mlp"), farm.spec(name="other", kwargs={"hidden": 7})
    bundle = {"build": farm.build(theirs), "version": farm.version_env(mine)}
    err = refused("program", bundle, farm.trust(), req())
    assert "kwargs" in str(err)
    # The same program under a second name is the same build: it serves both.
    alias_name = farm.spec(name="mlp-copy")
    ok = {"build": farm.build(mine), "version": farm.version_env(alias_name)}
    assert verify_attestation(ok, farm.trust(), req(model="mlp-copy")).model == "mlp-copy"


def test_aliases(farm: Farm) -> None:
    v1, v2 = farm.spec(version="1"), farm.spec(version="2", kwargs={"hidden": 8})
    tl = farm.trust()
    old = farm.alias_env(v1, "prod", issued_at="2026-01-01T00:00:00+00:00")
    new = farm.alias_env(v2, "prod")
    ok = {"build": farm.build(v2), "version": farm.version_env(v2), "alias": new}
    v = verify_attestation(ok, tl, req(ref="prod"))
    assert (v.version, v.alias) == ("2", "prod")
    # v1's build and name statements with the current alias statement
    refused("version", {"build": farm.build(v1), "version": farm.version_env(v1), "alias": new},
            tl, req(ref="prod"))
    # no alias statement at all
    refused("version", {"build": farm.build(v1), "version": farm.version_env(v1)}, tl,
            req(ref="prod"))
    # another alias's statement
    staging = farm.alias_env(v1, "staging")
    refused("alias", {"build": farm.build(v1), "version": farm.version_env(v1),
                      "alias": staging}, tl, req(ref="prod"))
    # a whole old answer, to a node that has seen the newer binding
    old_bundle = {"build": farm.build(v1), "version": farm.version_env(v1), "alias": old}
    verify_attestation(old_bundle, tl, req(ref="prod"))  # a fresh node cannot tell
    refused("alias.issued_at", old_bundle, tl, req(ref="prod"), alias_seen=v.alias_issued_at)
    # default ref: "latest" when the farm sends one, any version otherwise
    latest = farm.alias_env(v2, "latest")
    assert verify_attestation({**ok, "alias": latest}, tl, req(ref=None)).alias == "latest"
    assert verify_attestation({**ok, "alias": None}, tl, req(ref=None)).alias is None


def test_keys_only_sign_what_their_role_allows(farm: Farm) -> None:
    spec = farm.spec()
    tl = farm.trust()
    # a builder key cannot name a model; the name key cannot vouch for bytes
    refused("version_statement.signature",
            {"build": farm.build(spec), "version": farm.version_env(spec, key=farm.builder)},
            tl, req())
    refused("build_statement.signature",
            {"build": farm.build(spec, key=farm.names), "version": farm.version_env(spec)},
            tl, req())
    stranger = Ed25519PrivateKey.generate()
    refused("build_statement.signature",
            {"build": farm.build(spec, key=stranger), "version": farm.version_env(spec)},
            tl, req())
    refused("build_statement", {"build": None, "version": farm.version_env(spec)}, tl, req())


def test_revoked_builder_key_is_refused(farm: Farm) -> None:
    spec = farm.spec()
    bundle = {"build": farm.build(spec), "version": farm.version_env(spec)}
    farm.version = 2
    farm.revoked = [{"keyid": attest.keyid(farm.builder), "reason": "host compromised"}]
    tl = farm.trust()
    assert attest.keyid(farm.builder) not in tl.keys
    err = refused("revoked", bundle, tl, req())
    assert "host compromised" in str(err)


def test_edited_statements_do_not_verify(farm: Farm) -> None:
    spec = farm.spec()
    build = farm.build(spec)
    body = json.loads(base64.b64decode(build["payload"]))
    body["predicate"]["inputs"] = "float32[1..1024,64]"
    edited = dict(build, payload=base64.b64encode(attest.canonical_bytes(body)).decode())
    refused("build_statement.signature", {"build": edited, "version": farm.version_env(spec)},
            farm.trust(), req())


def test_build_key_must_follow_from_the_statement(farm: Farm) -> None:
    spec = farm.spec()
    stmt = json.loads(base64.b64decode(farm.build(spec)["payload"]))
    stmt["predicate"]["build_key"] = "0" * 64
    resigned = attest.sign_statement(farm.builder, stmt)
    refused("build_key", {"build": resigned, "version": farm.version_env(spec)}, farm.trust(),
            req())


def test_a_projects_build_key_holds_its_project(farm: Farm) -> None:
    """Another project's build of the same graph has another key; the node
    recomputes it from the signed project, so dropping (or changing) the
    project in the statement is refused."""
    spec = replace(farm.spec(), project="team-b")
    built = farm.build(spec)
    v = verify_attestation({"build": built, "version": farm.version_env(spec)}, farm.trust(),
                           req())
    assert v.build["project"] == "team-b"
    assert v.build["build_key"] != json.loads(base64.b64decode(
        farm.build(farm.spec())["payload"]))["predicate"]["build_key"]
    for project in (None, "team-a"):
        stmt = json.loads(base64.b64decode(built["payload"]))
        if project is None:
            del stmt["predicate"]["project"]
        else:
            stmt["predicate"]["project"] = project
        resigned = attest.sign_statement(farm.builder, stmt)
        refused("build_key", {"build": resigned, "version": farm.version_env(spec)},
                farm.trust(), req())


def test_trust_list(farm: Farm) -> None:
    tl = farm.trust()
    assert tl.version == 1 and len(tl.keys) == 2
    env = copy.deepcopy(tl.envelope)
    # an attacker adds their key to the list
    body = json.loads(base64.b64decode(env["payload"]))
    mallory = Ed25519PrivateKey.generate()
    body["keys"].append({"keyid": attest.keyid(mallory), "role": "builder", "name": "m",
                         "public_key": public_key_pem(mallory)})
    env["payload"] = base64.b64encode(attest.canonical_bytes(body)).decode()
    with pytest.raises(attest.AttestationError) as exc:
        attest.verify_trust_list(env, public_key_pem(farm.root))
    assert exc.value.field == "trust_list"
    # signed by another root
    with pytest.raises(attest.AttestationError):
        attest.verify_trust_list(tl.envelope, public_key_pem(Ed25519PrivateKey.generate()))
    # expired
    expired = attest.sign_trust_list(farm.root, attest.trust_list_payload(
        version=3, keys=[], revoked=[], issued_at=datetime.now(timezone.utc) - timedelta(days=2),
        expires_days=1))
    with pytest.raises(attest.AttestationError) as exc:
        attest.verify_trust_list(expired, public_key_pem(farm.root))
    assert exc.value.field == "trust_list.expires"


def test_trust_store_never_goes_back(farm: Farm, tmp_path: Path) -> None:
    store = TrustStore(tmp_path)
    root_pub = public_key_pem(farm.root)
    first = farm.trust()
    assert store.accept_trust_list(first, root_pub).version == 1
    farm.version = 2
    farm.revoked = [{"keyid": attest.keyid(farm.builder), "reason": "r"}]
    second = farm.trust()
    assert store.accept_trust_list(second, root_pub).version == 2
    # a farm (or proxy) serving the old list still gets the new one applied
    kept = store.accept_trust_list(first, root_pub)
    assert kept.version == 2 and attest.keyid(farm.builder) in kept.revoked
    assert TrustStore(tmp_path).accept_trust_list(None, root_pub).version == 2


def test_file_and_bundle(farm: Farm, tmp_path: Path) -> None:
    data = b"artifact bytes"
    digest = hashlib.sha256(data).hexdigest()
    spec = farm.spec()
    tl = farm.trust()
    att = {"build": farm.build(spec, digest=digest, size=len(data)),
           "version": farm.version_env(spec)}
    path = tmp_path / "model.pt2"
    path.write_bytes(data)
    v = verify_attestation(att, tl, req())
    check_file(path, v)
    (tmp_path / "model.pt2.attestation.json").write_text(json.dumps(
        make_bundle(attestation=att, trust_list=tl, request=req(), farm_url="https://farm")))
    root_pub = public_key_pem(farm.root)
    assert verify_file(path, root_key=root_pub, node_target=CPU).digest == digest
    # on a node of another ISA: refused, naming it
    with pytest.raises(AttestationRefused) as exc:
        verify_file(path, root_key=root_pub, node_target=Target(
            device="cpu", python_version="3.12", torch_version="2.13.0", cpu_isa="AVX512",
            threads=2))
    assert exc.value.field == "target.cpu_isa"
    # another farm's root
    with pytest.raises(AttestationRefused):
        verify_file(path, root_key=public_key_pem(Ed25519PrivateKey.generate()), node_target=CPU)
    path.write_bytes(b"artifact bytez")
    with pytest.raises(AttestationRefused) as exc:
        verify_file(path, root_key=root_pub, node_target=CPU)
    assert exc.value.field == "digest"
    (tmp_path / "bare").write_bytes(data)
    with pytest.raises(AttestationRefused) as exc:
        verify_file(tmp_path / "bare", root_key=root_pub, node_target=CPU)
    assert exc.value.field == "attestation"


def test_a_node_that_names_no_options_refuses_a_signed_unguarded_build(farm: Farm) -> None:
    # The farm's answer (or a farm that serves what it likes) hands a plain
    # request a validly signed artifact built with disable_guard_check: the
    # node's own check of the signed options refuses it.
    from dataclasses import replace

    spec = replace(farm.spec(), options=CompileOptions(disable_guard_check=True))
    bundle = {"build": farm.build(spec), "version": farm.version_env(spec)}
    err = refused("options", bundle, farm.trust(), req())
    assert "did not ask for: disable_guard_check" in str(err)
    v = verify_attestation(bundle, farm.trust(),
                           req(options=CompileOptions(disable_guard_check=True)))
    assert v.format == "aoti"


def test_the_class_a_node_checks_is_the_signed_one(farm: Farm) -> None:
    from farm.node.compiled import class_mismatch

    spec = farm.spec()
    bundle = {"build": farm.build(spec), "version": farm.version_env(spec)}
    v = verify_attestation(bundle, farm.trust(), req())
    assert v.build["model_class"] == "farm.zoo.basic.MLP"

    class MLP:  # not farm.zoo.basic's: another program's class under the same name
        pass

    # The farm's unsigned row says whatever matches the node's module; the
    # signed statement says what was built, and that is what is compared.
    mine = f"{MLP.__module__}.{MLP.__qualname__}"
    row = {"digest": "a" * 64, "meta": {"model_class": mine}}
    assert class_mismatch(row, MLP()) is None  # unsigned: only where nothing is signed
    why = class_mismatch(row, MLP(), signed=v.build)
    assert why is not None and "was built from farm.zoo.basic.MLP" in why
