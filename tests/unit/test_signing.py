"""Ed25519 artifact signatures: what verifies and what must not."""

from __future__ import annotations

import base64
import hashlib
import json
import stat
from pathlib import Path
from typing import Any

import pytest

from farm.core.signing import (
    DOMAIN,
    SignatureInvalid,
    SigningKeyError,
    canonical_message,
    generate_keypair,
    key_id,
    load_or_create_signing_key,
    load_private_key,
    load_public_key,
    public_key_pem,
    sign_artifact,
    verify_artifact_signature,
)

DIGEST = hashlib.sha256(b"artifact bytes").hexdigest()
METADATA: dict[str, Any] = {
    "format": "aot_compile",
    "size": 187_000,
    "target": "cpu/python=3.11.7/torch=2.13.0+cpu/isa=avx512/threads=2",
    "inputs": [{"shape": [8, 512], "dtype": "bfloat16", "dynamic": [0]}],
    "grad_mode": "no_grad",
    "note": "ünïcode",
}


@pytest.fixture(scope="module")
def keypair() -> tuple[str, str]:
    return generate_keypair()


def test_round_trip(keypair: tuple[str, str]) -> None:
    private_pem, public_pem = keypair
    assert private_pem.startswith("-----BEGIN PRIVATE KEY-----")
    assert public_pem.startswith("-----BEGIN PUBLIC KEY-----")
    signature = sign_artifact(private_pem, DIGEST, METADATA)
    assert len(base64.b64decode(signature)) == 64
    verify_artifact_signature(public_pem, DIGEST, METADATA, signature)


def test_key_order_and_json_round_trip_do_not_matter(keypair: tuple[str, str]) -> None:
    private_pem, public_pem = keypair
    signature = sign_artifact(private_pem, DIGEST, METADATA)
    reordered = dict(reversed(list(METADATA.items())))
    verify_artifact_signature(public_pem, DIGEST, reordered, signature)
    # What a node gets back from the API after JSON: same signature holds.
    verify_artifact_signature(public_pem, DIGEST, json.loads(json.dumps(METADATA)), signature)


def test_changed_digest_fails(keypair: tuple[str, str]) -> None:
    private_pem, public_pem = keypair
    signature = sign_artifact(private_pem, DIGEST, METADATA)
    other = hashlib.sha256(b"tampered bytes").hexdigest()
    with pytest.raises(SignatureInvalid, match="does not verify"):
        verify_artifact_signature(public_pem, other, METADATA, signature)


@pytest.mark.parametrize(
    "change",
    [
        {"format": "aoti"},
        {"size": 187_001},
        {"target": "cpu/python=3.11.7/torch=2.13.0+cpu/isa=avx2/threads=2"},
        {"inputs": [{"shape": [8, 512], "dtype": "float32", "dynamic": [0]}]},
        {"extra": True},
    ],
)
def test_changed_metadata_fails(keypair: tuple[str, str], change: dict[str, Any]) -> None:
    private_pem, public_pem = keypair
    signature = sign_artifact(private_pem, DIGEST, METADATA)
    with pytest.raises(SignatureInvalid, match=DIGEST[:12]):
        verify_artifact_signature(public_pem, DIGEST, {**METADATA, **change}, signature)


def test_removed_metadata_field_fails(keypair: tuple[str, str]) -> None:
    private_pem, public_pem = keypair
    signature = sign_artifact(private_pem, DIGEST, METADATA)
    trimmed = {k: v for k, v in METADATA.items() if k != "grad_mode"}
    with pytest.raises(SignatureInvalid):
        verify_artifact_signature(public_pem, DIGEST, trimmed, signature)


def test_other_key_fails(keypair: tuple[str, str]) -> None:
    private_pem, _ = keypair
    _, other_public = generate_keypair()
    signature = sign_artifact(private_pem, DIGEST, METADATA)
    with pytest.raises(SignatureInvalid) as excinfo:
        verify_artifact_signature(other_public, DIGEST, METADATA, signature)
    assert key_id(load_public_key(other_public)) in str(excinfo.value)


@pytest.mark.parametrize(
    "signature",
    ["", "not base64!", base64.b64encode(b"short").decode(), base64.b64encode(bytes(64)).decode()],
)
def test_malformed_signatures_fail(keypair: tuple[str, str], signature: str) -> None:
    _, public_pem = keypair
    with pytest.raises(SignatureInvalid):
        verify_artifact_signature(public_pem, DIGEST, METADATA, signature)


def test_flipped_signature_bit_fails(keypair: tuple[str, str]) -> None:
    private_pem, public_pem = keypair
    raw = bytearray(base64.b64decode(sign_artifact(private_pem, DIGEST, METADATA)))
    raw[10] ^= 1
    with pytest.raises(SignatureInvalid):
        verify_artifact_signature(public_pem, DIGEST, METADATA, base64.b64encode(raw).decode())


def test_canonical_message_is_domain_separated() -> None:
    message = canonical_message(DIGEST, {"b": 1, "a": [1, 2]})
    assert message == DOMAIN + DIGEST.encode() + b'\n{"a":[1,2],"b":1}'
    assert message.startswith(b"torch-farm-artifact-v1\n")


@pytest.mark.parametrize("bad", ["../../etc/passwd", DIGEST.upper(), DIGEST[:-1]])
def test_bad_digest_is_rejected(keypair: tuple[str, str], bad: str) -> None:
    with pytest.raises(ValueError, match="invalid sha256 digest"):
        sign_artifact(keypair[0], bad, METADATA)


def test_nan_metadata_is_rejected(keypair: tuple[str, str]) -> None:
    with pytest.raises(ValueError):
        sign_artifact(keypair[0], DIGEST, {"max_abs_err": float("nan")})


def test_keys_load_from_files_and_objects(keypair: tuple[str, str], tmp_path: Path) -> None:
    private_pem, public_pem = keypair
    (tmp_path / "farm.key").write_text(private_pem)
    (tmp_path / "farm.pub").write_text(public_pem)
    signature = sign_artifact(tmp_path / "farm.key", DIGEST, METADATA)
    verify_artifact_signature(str(tmp_path / "farm.pub"), DIGEST, METADATA, signature)
    key = load_private_key(private_pem)
    verify_artifact_signature(key, DIGEST, METADATA, sign_artifact(key, DIGEST, METADATA))
    # A private key also serves as its own public half.
    verify_artifact_signature(private_pem.encode(), DIGEST, METADATA, signature)
    assert public_key_pem(key) == public_pem


def test_bad_keys_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(SigningKeyError, match="cannot read key file"):
        load_private_key(tmp_path / "missing.key")
    (tmp_path / "junk").write_text("hello")
    with pytest.raises(SigningKeyError, match="not PEM"):
        load_public_key(tmp_path / "junk")
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    ec_pem = ec.generate_private_key(ec.SECP256R1()).private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    with pytest.raises(SigningKeyError, match="Ed25519"):
        load_private_key(ec_pem)


def test_load_or_create_signing_key(tmp_path: Path) -> None:
    path = tmp_path / "keys" / "farm.key"
    key = load_or_create_signing_key(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    again = load_or_create_signing_key(path)
    assert key_id(again) == key_id(key)
    assert [p.name for p in path.parent.iterdir()] == ["farm.key"]
    signature = sign_artifact(key, DIGEST, METADATA)
    verify_artifact_signature(public_key_pem(again), DIGEST, METADATA, signature)
