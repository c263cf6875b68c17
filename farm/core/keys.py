"""Ed25519 keys: made, loaded (objects, PEM text or PEM files) and named.

The farm's root, builder and name keys sign the attestations nodes check
(``farm.core.attest``: in-toto statements in DSSE envelopes, and the trust
list); this module only makes and reads the keys.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import secrets
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)

logger = logging.getLogger(__name__)

KeySource = str | bytes | os.PathLike[str]


class SigningKeyError(ValueError):
    """A key could not be loaded (not PEM, not Ed25519, unreadable file)."""


def generate_keypair() -> tuple[str, str]:
    """A new Ed25519 key pair as ``(private_pem, public_pem)`` text."""
    key = Ed25519PrivateKey.generate()
    return _private_pem(key), public_key_pem(key)


def _private_pem(key: Ed25519PrivateKey) -> str:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    ).decode("ascii")


def public_key_pem(key: Ed25519PrivateKey | Ed25519PublicKey) -> str:
    public = key.public_key() if isinstance(key, Ed25519PrivateKey) else key
    return public.public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    ).decode("ascii")


def key_id(key: Ed25519PrivateKey | Ed25519PublicKey) -> str:
    """A short fingerprint of the public key, for logs and error messages."""
    public = key.public_key() if isinstance(key, Ed25519PrivateKey) else key
    raw = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


def _pem_bytes(source: KeySource) -> bytes:
    """PEM text given inline, or read from the file a path names."""
    if isinstance(source, bytes):
        text = source
    elif isinstance(source, str) and "-----BEGIN" in source:
        try:
            text = source.encode("ascii")
        except UnicodeEncodeError:
            raise SigningKeyError("PEM text must be ASCII") from None
    else:
        try:
            text = Path(source).read_bytes()
        except (OSError, ValueError) as e:  # ValueError: a NUL in the path
            raise SigningKeyError(f"cannot read key file {os.fspath(source)!r}: {e}") from e
    if b"-----BEGIN" not in text:
        raise SigningKeyError("key is not PEM text (expected '-----BEGIN ...')")
    return text


def load_private_key(source: Ed25519PrivateKey | KeySource) -> Ed25519PrivateKey:
    """An Ed25519 private key from a key object, PEM text or a PEM file path."""
    if isinstance(source, Ed25519PrivateKey):
        return source
    pem = _pem_bytes(source)
    try:
        key = serialization.load_pem_private_key(pem, password=None)
    except (ValueError, TypeError) as e:
        raise SigningKeyError(f"not a usable private key: {e}") from e
    if not isinstance(key, Ed25519PrivateKey):
        raise SigningKeyError(f"expected an Ed25519 private key, got {type(key).__name__}")
    return key


def load_public_key(
    source: Ed25519PublicKey | Ed25519PrivateKey | KeySource,
) -> Ed25519PublicKey:
    """An Ed25519 public key from a key object, PEM text or a PEM file path.

    A private key (object or PEM) is accepted too and its public half returned,
    so one setting can serve a farm that both signs and verifies.
    """
    if isinstance(source, Ed25519PublicKey):
        return source
    if isinstance(source, Ed25519PrivateKey):
        return source.public_key()
    pem = _pem_bytes(source)
    if b"PRIVATE KEY" in pem:
        return load_private_key(pem).public_key()
    try:
        key = serialization.load_pem_public_key(pem)
    except (ValueError, TypeError) as e:
        raise SigningKeyError(f"not a usable public key: {e}") from e
    if not isinstance(key, Ed25519PublicKey):
        raise SigningKeyError(f"expected an Ed25519 public key, got {type(key).__name__}")
    return key


def load_or_create_signing_key(path: str | os.PathLike[str]) -> Ed25519PrivateKey:
    """Load the farm's key from ``path``, creating it (mode 0600) if absent.

    Safe when several processes start at once: the key is written to a private
    temp file and hard-linked into place, which fails if another process got
    there first, and then everyone loads the winner's key.
    """
    path = Path(path)
    if path.exists():
        return load_private_key(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    key = Ed25519PrivateKey.generate()
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(_private_pem(key).encode("ascii"))
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            return load_private_key(path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    logger.info("created farm signing key %s at %s", key_id(key), path)
    return key
