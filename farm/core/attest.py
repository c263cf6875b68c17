"""Attestations: in-toto Statements v1 in DSSE envelopes, signed with Ed25519.

Three kinds of statement travel with an artifact, and one document says whose
signatures count:

- a *build* statement, signed by the compile worker that built and verified
  the bytes (a builder key): the artifact's digest, size and format bound to
  everything the build was made from (``farm.build.provenance``);
- a *version* statement, signed by the API's name key when a submission is
  accepted: ``model@version`` is this program (entrypoint, kwargs, kind,
  code digest);
- an *alias* statement, signed by the name key when an alias is set:
  ``model@alias`` points at this version, issued at this time;
- the *trust list*, signed by the farm's root key (kept offline): which
  builder keys and which name key are enrolled, and which keys are revoked.

The envelope is DSSE (github.com/secure-systems-lab/dsse, "envelope.md" and
"protocol.md"), the one sigstore, SLSA and Hugging Face kernels use::

    {"payloadType": "application/vnd.in-toto+json",
     "payload": base64(statement JSON),
     "signatures": [{"keyid": "<sha256 of the raw public key>", "sig": base64}]}

and the bytes signed are the Pre-Authentication Encoding of type and body
(``pae``), so a signature over one payload type can never verify as another.
Nothing here touches the network, a database or torch: the node's checks
(``farm.node.verify``) and the signers (workers, API, CLI) share it.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)

from farm.core.keys import KeySource, SigningKeyError, load_private_key, load_public_key

IN_TOTO_PAYLOAD_TYPE = "application/vnd.in-toto+json"
STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
TRUST_LIST_PAYLOAD_TYPE = "application/vnd.torch-farm.trust-list+json"
TRUST_LIST_TYPE = "https://torch-farm.dev/trust-list/v1"

BUILD_PREDICATE = "https://torch-farm.dev/provenance/build/v1"
VERSION_PREDICATE = "https://torch-farm.dev/name/version/v1"
ALIAS_PREDICATE = "https://torch-farm.dev/name/alias/v1"

ROLE_BUILDER = "builder"
ROLE_NAMES = "names"
ROLES = (ROLE_BUILDER, ROLE_NAMES)
# Which role may sign which statement: a builder key cannot name a model and
# the name key cannot vouch for bytes.
ROLE_OF_PREDICATE = {
    BUILD_PREDICATE: ROLE_BUILDER,
    VERSION_PREDICATE: ROLE_NAMES,
    ALIAS_PREDICATE: ROLE_NAMES,
}

# Envelopes are small (a few KB); anything much larger is not ours.
MAX_ENVELOPE_BYTES = 1 << 20
_SIG_LEN = 64


class AttestationError(Exception):
    """An envelope, statement or trust list is malformed or does not verify.

    ``field`` names what was wrong (``"signature"``, ``"model"``,
    ``"trust_list.version"``, ...) so a refusal says which check failed.
    """

    def __init__(self, message: str, *, field: str = "envelope") -> None:
        super().__init__(message)
        self.field = field


# --- keys -------------------------------------------------------------------------


def keyid(key: Ed25519PublicKey | Ed25519PrivateKey | KeySource) -> str:
    """The key's id in envelopes and trust lists: sha256 hex of the raw public key."""
    public = load_public_key(key)
    raw = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()


# --- DSSE -------------------------------------------------------------------------


def pae(payload_type: str, payload: bytes) -> bytes:
    """DSSE v1 Pre-Authentication Encoding:
    ``"DSSEv1" SP LEN(type) SP type SP LEN(body) SP body``, lengths in ASCII decimal
    of the UTF-8 bytes."""
    t = payload_type.encode("utf-8")
    return b"DSSEv1 %d %s %d %s" % (len(t), t, len(payload), payload)


def canonical_bytes(value: Any) -> bytes:
    """Sorted keys, no whitespace, UTF-8, no NaN: one byte string per value."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      allow_nan=False).encode("utf-8")


def sign_envelope(private_key: Ed25519PrivateKey | KeySource, payload_type: str,
                  payload: bytes) -> dict[str, Any]:
    key = load_private_key(private_key)
    sig = key.sign(pae(payload_type, payload))
    return {
        "payloadType": payload_type,
        "payload": base64.b64encode(payload).decode("ascii"),
        "signatures": [{"keyid": keyid(key), "sig": base64.b64encode(sig).decode("ascii")}],
    }


def parse_envelope(envelope: Any) -> tuple[str, bytes, list[tuple[str, bytes]]]:
    """``(payloadType, payload, [(keyid, sig)])`` of an envelope given as a dict
    or JSON text; raises ``AttestationError`` for anything malformed."""
    if isinstance(envelope, (str, bytes)):
        if len(envelope) > MAX_ENVELOPE_BYTES:
            raise AttestationError("envelope is larger than 1 MiB")
        try:
            envelope = json.loads(envelope)
        except ValueError as exc:
            raise AttestationError(f"envelope is not JSON: {exc}") from None
    if not isinstance(envelope, Mapping):
        raise AttestationError(f"envelope must be a JSON object, got {type(envelope).__name__}")
    ptype, body, sigs = (envelope.get("payloadType"), envelope.get("payload"),
                         envelope.get("signatures"))
    if not isinstance(ptype, str) or not isinstance(body, str):
        raise AttestationError("envelope lacks payloadType or payload")
    try:
        payload = base64.b64decode(body, validate=True)
    except (binascii.Error, ValueError):
        raise AttestationError("envelope payload is not base64") from None
    if not isinstance(sigs, list) or not sigs:
        raise AttestationError("envelope has no signatures", field="signature")
    out = []
    for s in sigs:
        if not isinstance(s, Mapping) or not isinstance(s.get("sig"), str):
            raise AttestationError("envelope signature entry is malformed", field="signature")
        try:
            raw = base64.b64decode(s["sig"], validate=True)
        except (binascii.Error, ValueError):
            raise AttestationError("envelope signature is not base64", field="signature") from None
        out.append((str(s.get("keyid") or ""), raw))
    return ptype, payload, out


def verify_envelope(envelope: Any, keys: Mapping[str, Ed25519PublicKey], *,
                    payload_type: str) -> tuple[str, bytes]:
    """``(keyid, payload)`` of the first signature that verifies under one of
    ``keys`` (by key id); ``AttestationError`` when none does.

    The payload type is checked before anything is parsed: an envelope made
    for one purpose never passes as another.
    """
    ptype, payload, sigs = parse_envelope(envelope)
    if ptype != payload_type:
        raise AttestationError(f"payloadType is {ptype!r}, expected {payload_type!r}",
                               field="payloadType")
    message = pae(ptype, payload)
    unknown = []
    for kid, sig in sigs:
        key = keys.get(kid)
        if key is None:
            unknown.append(kid[:16] or "(no keyid)")
            continue
        if len(sig) != _SIG_LEN:
            continue
        try:
            key.verify(sig, message)
        except InvalidSignature:
            continue
        return kid, payload
    if unknown and len(unknown) == len(sigs):
        raise AttestationError(f"signed by key(s) {', '.join(unknown)}, none of which is "
                               "trusted for this", field="signature")
    raise AttestationError("signature does not verify: the payload was changed after it "
                           "was signed, or another key signed it", field="signature")


def payload_json(payload: bytes) -> dict[str, Any]:
    try:
        value = json.loads(payload)
    except ValueError as exc:
        raise AttestationError(f"payload is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise AttestationError("payload is not a JSON object")
    return value


# --- in-toto statements -------------------------------------------------------------


def statement(subject_name: str, sha256: str, predicate_type: str,
              predicate: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "_type": STATEMENT_TYPE,
        "subject": [{"name": subject_name, "digest": {"sha256": sha256}}],
        "predicateType": predicate_type,
        "predicate": dict(predicate),
    }


def sign_statement(private_key: Ed25519PrivateKey | KeySource,
                   stmt: Mapping[str, Any]) -> dict[str, Any]:
    return sign_envelope(private_key, IN_TOTO_PAYLOAD_TYPE, canonical_bytes(stmt))


@dataclass(frozen=True)
class Statement:
    """A statement whose envelope verified, with the key that signed it."""

    keyid: str
    predicate_type: str
    subject_name: str
    subject_sha256: str
    predicate: dict[str, Any]


def parse_statement(payload: bytes, *, predicate_type: str, keyid_: str = "") -> Statement:
    body = payload_json(payload)
    if body.get("_type") != STATEMENT_TYPE:
        raise AttestationError(f"not an in-toto Statement v1 (_type {body.get('_type')!r})",
                               field="statement")
    if body.get("predicateType") != predicate_type:
        raise AttestationError(f"predicateType is {body.get('predicateType')!r}, expected "
                               f"{predicate_type!r}", field="predicateType")
    subject = body.get("subject")
    if (not isinstance(subject, list) or len(subject) != 1 or not isinstance(subject[0], dict)
            or not isinstance(subject[0].get("digest"), dict)):
        raise AttestationError("statement must have exactly one subject with a digest",
                               field="subject")
    sha = subject[0]["digest"].get("sha256")
    if not isinstance(sha, str) or len(sha) != 64:
        raise AttestationError("statement subject has no sha256 digest", field="subject")
    predicate = body.get("predicate")
    if not isinstance(predicate, dict):
        raise AttestationError("statement has no predicate", field="predicate")
    return Statement(keyid=keyid_, predicate_type=predicate_type,
                     subject_name=str(subject[0].get("name") or ""), subject_sha256=sha,
                     predicate=predicate)


def program_digest(program: Mapping[str, Any]) -> str:
    """The sha256 of a program's canonical JSON: the subject of a version statement."""
    return hashlib.sha256(canonical_bytes(dict(program))).hexdigest()


def program_of(entrypoint: str, kwargs: Mapping[str, Any], kind: str,
               code_digest: str | None = None) -> dict[str, Any]:
    """What a model version *is*: the code and how it is called. ``code_digest``
    (the shipped code pack's sha256) is None for code installed on the workers."""
    return {"entrypoint": entrypoint, "kwargs": dict(kwargs), "kind": kind,
            "code_digest": code_digest}


def program_of_spec(spec: Any) -> dict[str, Any]:
    """The program a ``JobSpec`` builds, as version and build statements name it
    (``code_digest``: the shipped code pack's sha256, when the spec has one)."""
    mj = spec.model.to_json()
    code = mj.get("code_digest") or getattr(spec, "code_digest", None) \
        or getattr(spec.model, "code_digest", None)
    return program_of(mj["entrypoint"], mj.get("kwargs") or {}, mj.get("kind", "factory"), code)


def version_statement(*, model: str, version: str, program: Mapping[str, Any],
                      issued_at: str, submitted_by: str | None = None,
                      project: str | None = None) -> dict[str, Any]:
    # Who bound it and in which project: signed, so the history a node or an
    # auditor reads cannot be rewritten in the database alone.
    return statement(f"{model}@{version}", program_digest(program), VERSION_PREDICATE, {
        "model": model, "version": version, "program": dict(program),
        "issued_at": issued_at, "submitted_by": submitted_by,
        **({"project": project} if project is not None else {}),
    })


def alias_statement(*, model: str, alias: str, version: str, program: Mapping[str, Any],
                    issued_at: str, set_by: str | None = None,
                    project: str | None = None) -> dict[str, Any]:
    return statement(f"{model}@{alias}", program_digest(program), ALIAS_PREDICATE, {
        "model": model, "alias": alias, "version": version, "issued_at": issued_at,
        "set_by": set_by, **({"project": project} if project is not None else {}),
    })


def now_iso() -> str:
    """UTC, microseconds: alias statements are ordered by it."""
    return datetime.now(timezone.utc).isoformat(timespec="microseconds")


def parse_time(text: Any, *, field: str) -> datetime:
    if not isinstance(text, str):
        raise AttestationError(f"{field} is missing", field=field)
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise AttestationError(f"{field} {text!r} is not an ISO 8601 time", field=field) from None
    if when.tzinfo is None:
        raise AttestationError(f"{field} {text!r} has no time zone", field=field)
    return when


# --- the trust list ----------------------------------------------------------------


@dataclass(frozen=True)
class TrustedKey:
    keyid: str
    role: str
    name: str
    public_key: Ed25519PublicKey
    public_pem: str


@dataclass(frozen=True)
class TrustList:
    """A trust list whose root signature verified."""

    version: int
    issued_at: datetime
    expires: datetime
    keys: dict[str, TrustedKey]
    revoked: dict[str, str]  # keyid -> reason
    root_keyid: str
    envelope: dict[str, Any]

    def keys_for(self, role: str) -> dict[str, Ed25519PublicKey]:
        return {k: t.public_key for k, t in self.keys.items()
                if t.role == role and k not in self.revoked}


def trust_list_payload(*, version: int, keys: Sequence[Mapping[str, Any]],
                       revoked: Sequence[Mapping[str, Any]], issued_at: datetime | None = None,
                       expires_days: float = 90.0) -> dict[str, Any]:
    """The trust list document. ``keys``: ``{keyid, role, name, public_key}``
    (PEM); ``revoked``: ``{keyid, reason}``. It expires so a node cannot be
    held on an old list (one that still trusts a revoked key) forever."""
    issued = issued_at or datetime.now(timezone.utc)
    if version < 1:
        raise AttestationError("trust list version must be >= 1", field="trust_list.version")
    revoked_ids = {str(r["keyid"]) for r in revoked}
    entries = []
    for k in keys:
        role = str(k["role"])
        if role not in ROLES:
            raise AttestationError(f"unknown role {role!r}; known: {', '.join(ROLES)}",
                                   field="trust_list.role")
        kid = keyid(str(k["public_key"]))
        if kid != k.get("keyid", kid):
            raise AttestationError(f"key {k.get('name')!r}: keyid does not match its public key",
                                   field="trust_list.keyid")
        if kid in revoked_ids:
            continue
        entries.append({"keyid": kid, "role": role, "name": str(k.get("name") or ""),
                        "public_key": str(k["public_key"])})
    return {
        "_type": TRUST_LIST_TYPE,
        "version": int(version),
        "issued_at": issued.isoformat(timespec="seconds"),
        "expires": (issued + timedelta(days=expires_days)).isoformat(timespec="seconds"),
        "keys": sorted(entries, key=lambda e: e["keyid"]),
        "revoked": sorted(({"keyid": str(r["keyid"]), "reason": str(r.get("reason") or "")}
                           for r in revoked), key=lambda e: e["keyid"]),
    }


def sign_trust_list(root_key: Ed25519PrivateKey | KeySource,
                    payload: Mapping[str, Any]) -> dict[str, Any]:
    return sign_envelope(root_key, TRUST_LIST_PAYLOAD_TYPE, canonical_bytes(dict(payload)))


def verify_trust_list(envelope: Any, root_key: Ed25519PublicKey | KeySource, *,
                      now: datetime | None = None) -> TrustList:
    """The trust list, if the root key signed it and it has not expired."""
    try:
        root = load_public_key(root_key)
    except SigningKeyError as exc:
        raise AttestationError(f"root key: {exc}", field="root_key") from None
    rid = keyid(root)
    try:
        _, payload = verify_envelope(envelope, {rid: root}, payload_type=TRUST_LIST_PAYLOAD_TYPE)
    except AttestationError as exc:
        raise AttestationError(f"trust list: {exc} (root key {rid[:16]})",
                               field="trust_list") from None
    body = payload_json(payload)
    if body.get("_type") != TRUST_LIST_TYPE:
        raise AttestationError("not a torch-farm trust list", field="trust_list")
    version = body.get("version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise AttestationError("trust list has no version", field="trust_list.version")
    issued = parse_time(body.get("issued_at"), field="trust_list.issued_at")
    expires = parse_time(body.get("expires"), field="trust_list.expires")
    if (now or datetime.now(timezone.utc)) >= expires:
        raise AttestationError(f"trust list version {version} expired at {expires.isoformat()}; "
                               "the admin must sign a new one (farm keys sign-trust-list)",
                               field="trust_list.expires")
    revoked = {}
    for r in body.get("revoked") or []:
        if isinstance(r, dict) and isinstance(r.get("keyid"), str):
            revoked[r["keyid"]] = str(r.get("reason") or "")
    keys = {}
    for k in body.get("keys") or []:
        if not isinstance(k, dict):
            raise AttestationError("trust list key entry is malformed", field="trust_list.keys")
        try:
            pub = load_public_key(str(k.get("public_key") or ""))
        except SigningKeyError as exc:
            raise AttestationError(f"trust list key {k.get('name')!r}: {exc}",
                                   field="trust_list.keys") from None
        kid = keyid(pub)
        if kid != k.get("keyid") or k.get("role") not in ROLES:
            raise AttestationError(f"trust list key {k.get('name')!r}: keyid or role is wrong",
                                   field="trust_list.keys")
        keys[kid] = TrustedKey(keyid=kid, role=str(k["role"]), name=str(k.get("name") or ""),
                               public_key=pub, public_pem=str(k["public_key"]))
    env = envelope if isinstance(envelope, dict) else json.loads(envelope)
    return TrustList(version=version, issued_at=issued, expires=expires, keys=keys,
                     revoked=revoked, root_keyid=rid, envelope=env)


def verify_statement(envelope: Any, trust: TrustList, *, predicate_type: str) -> Statement:
    """A statement signed by a key the trust list gives the role this kind of
    statement needs, not revoked."""
    role = ROLE_OF_PREDICATE[predicate_type]
    what = predicate_type.rsplit("/", 2)[-2]
    try:
        _, _, sigs = parse_envelope(envelope)
    except AttestationError as exc:
        raise AttestationError(f"{what} statement: {exc}", field=exc.field) from None
    for kid, _sig in sigs:
        if kid in trust.revoked:
            reason = trust.revoked[kid]
            raise AttestationError(
                f"{what} statement is signed by key {kid[:16]}, which is revoked"
                + (f" ({reason})" if reason else ""), field="revoked")
    try:
        kid, payload = verify_envelope(envelope, trust.keys_for(role),
                                       payload_type=IN_TOTO_PAYLOAD_TYPE)
    except AttestationError as exc:
        raise AttestationError(f"{what} statement: {exc} (trust list version {trust.version} "
                               f"gives role {role!r} to "
                               f"{', '.join(k[:16] for k in trust.keys_for(role)) or 'no key'})",
                               field=exc.field) from None
    return parse_statement(payload, predicate_type=predicate_type, keyid_=kid)
