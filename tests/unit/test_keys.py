"""Ed25519 keys (farm.core.keys): made, loaded from files, text and objects,
created once under concurrency, and refused with a clear error when they are
not Ed25519 PEM. What they sign is tested in test_attest.py."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from farm.core.keys import (
    SigningKeyError,
    generate_keypair,
    key_id,
    load_or_create_signing_key,
    load_private_key,
    load_public_key,
    public_key_pem,
)


@pytest.fixture(scope="module")
def keypair() -> tuple[str, str]:
    return generate_keypair()


def test_a_pair_round_trips_through_pem(keypair: tuple[str, str]) -> None:
    private_pem, public_pem = keypair
    assert private_pem.startswith("-----BEGIN PRIVATE KEY-----")
    assert public_pem.startswith("-----BEGIN PUBLIC KEY-----")
    key = load_private_key(private_pem)
    message = b"statement"
    load_public_key(public_pem).verify(key.sign(message), message)
    assert public_key_pem(key) == public_pem


def test_keys_load_from_files_and_objects(keypair: tuple[str, str], tmp_path: Path) -> None:
    private_pem, public_pem = keypair
    (tmp_path / "farm.key").write_text(private_pem)
    (tmp_path / "farm.pub").write_text(public_pem)
    key = load_private_key(tmp_path / "farm.key")
    public = load_public_key(str(tmp_path / "farm.pub"))
    assert key_id(key) == key_id(public) == key_id(load_public_key(key))
    # A private key also serves as its own public half.
    assert key_id(load_public_key(private_pem.encode())) == key_id(public)
    assert load_private_key(key) is key


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
