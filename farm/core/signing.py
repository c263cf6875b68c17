"""Ed25519 signatures over an artifact's digest and metadata.

Loading an artifact unpickles it, which runs code, so a fleet node must know
the bytes came from the farm before it loads them. The farm signs
``(digest, metadata)``; a node checks the digest of the bytes it downloaded and
this signature against the farm's public key, both before unpickling.

The signed message is::

    b"torch-farm-artifact-v1\\n" + digest + b"\\n" + canonical JSON of metadata

The domain prefix keeps a signature made for one purpose from being replayed
as another; canonical JSON (sorted keys, no whitespace, UTF-8, no NaN) makes
the signer and verifier agree on bytes whatever order a dict was built in.
Metadata that travels through JSON (tuples become lists) signs the same.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import hashlib
import json
import logging
import os
import secrets
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)

from farm.core.digests import validate_digest

logger = logging.getLogger(__name__)

DOMAIN = b"torch-farm-artifact-v1\n"
_SIGNATURE_LEN = 64

KeySource = str | bytes | os.PathLike[str]


class SignatureInvalid(Exception):
    """The signature does not prove the farm signed this digest and metadata."""


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


def canonical_message(digest: str, metadata: dict[str, Any]) -> bytes:
    """The exact bytes that are signed for ``(digest, metadata)``."""
    validate_digest(digest)
    body = json.dumps(
        metadata, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    )
    return DOMAIN + digest.encode("ascii") + b"\n" + body.encode("utf-8")


def sign_artifact(
    private_key: Ed25519PrivateKey | KeySource, digest: str, metadata: dict[str, Any]
) -> str:
    """A base64 Ed25519 signature over ``(digest, metadata)``."""
    key = load_private_key(private_key)
    return base64.b64encode(key.sign(canonical_message(digest, metadata))).decode("ascii")


def verify_artifact_signature(
    public_key: Ed25519PublicKey | Ed25519PrivateKey | KeySource,
    digest: str,
    metadata: dict[str, Any],
    signature: str,
) -> None:
    """Return if ``signature`` is the farm's over ``(digest, metadata)``; else raise.

    Raises ``SignatureInvalid`` for a malformed signature or one that does not
    verify: the bytes, their metadata or the signing key are not what the farm
    signed, so the artifact must not be loaded.
    """
    key = load_public_key(public_key)
    short = digest[:12] if isinstance(digest, str) else repr(digest)
    try:
        raw = base64.b64decode(signature, validate=True)
    except (binascii.Error, ValueError, TypeError) as e:
        raise SignatureInvalid(f"artifact sha256:{short}: signature is not base64 ({e})") from e
    if len(raw) != _SIGNATURE_LEN:
        raise SignatureInvalid(
            f"artifact sha256:{short}: signature is {len(raw)} bytes, an Ed25519 "
            f"signature is {_SIGNATURE_LEN}"
        )
    try:
        key.verify(raw, canonical_message(digest, metadata))
    except InvalidSignature:
        raise SignatureInvalid(
            f"artifact sha256:{short}: signature does not verify under farm key "
            f"{key_id(key)}; its digest or metadata differ from what was signed, or it "
            "was signed by another key; refusing it"
        ) from None
