"""Signing keys, trust lists and name bindings as the registry stores them.

Nothing here signs or decides trust: the database holds envelopes that were
signed elsewhere (a builder's, the API's name key, the admin's offline root
key) and what the next trust list should contain. A node verifies all of it
against the root key it pins, so a row written straight into these tables
is worth nothing without the matching private key.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from farm.core import attest
from registry import models as m
from registry.db import Database
from registry.service.common import InvalidRequest, NotFound, _now

VERSION = "version"
ALIAS = "alias"


@dataclass(frozen=True)
class KeyRecord:
    keyid: str
    name: str
    role: str
    public_key: str
    enrolled_by: str | None
    enrolled_at: datetime | None
    revoked_at: datetime | None
    revoked_reason: str | None

    def to_json(self) -> dict[str, Any]:
        return {
            "keyid": self.keyid, "name": self.name, "role": self.role,
            "public_key": self.public_key, "enrolled_by": self.enrolled_by,
            "enrolled_at": self.enrolled_at.isoformat() if self.enrolled_at else None,
            "revoked_at": self.revoked_at.isoformat() if self.revoked_at else None,
            "revoked_reason": self.revoked_reason,
        }


def _key(row: m.SigningKey) -> KeyRecord:
    return KeyRecord(row.keyid, row.name, row.role, row.public_key, row.enrolled_by,
                     row.enrolled_at, row.revoked_at, row.revoked_reason)


def enroll_key(db: Database, *, name: str, role: str, public_key: str,
               enrolled_by: str | None) -> KeyRecord:
    """Record a public key for the next trust list (idempotent for the same key)."""
    from farm.core.keys import SigningKeyError, load_public_key, public_key_pem

    if role not in attest.ROLES:
        raise InvalidRequest(f"unknown role {role!r}; known: {', '.join(attest.ROLES)}")
    try:
        pem = public_key_pem(load_public_key(public_key))
    except SigningKeyError as exc:
        raise InvalidRequest(f"public_key: {exc}") from None
    if "PRIVATE" in public_key:
        raise InvalidRequest("that is a private key: enrol the public half "
                             "(farm keys generate writes FILE.pub beside FILE)")
    kid = attest.keyid(pem)
    with db.session() as s:
        row = s.get(m.SigningKey, kid)
        if row is not None:
            if row.revoked_at is not None:
                raise InvalidRequest(f"key {kid[:16]} was revoked; a revoked key cannot be "
                                     "enrolled again: generate a new one")
            if row.role != role:
                raise InvalidRequest(f"key {kid[:16]} is enrolled as {row.role!r}; one key has "
                                     "one role")
            return _key(row)
        row = m.SigningKey(keyid=kid, name=name, role=role, public_key=pem,
                           enrolled_by=enrolled_by, enrolled_at=_now())
        s.add(row)
        s.flush()
        return _key(row)


def revoke_key(db: Database, keyid: str, *, reason: str) -> KeyRecord:
    with db.session() as s:
        rows = s.scalars(select(m.SigningKey).where(m.SigningKey.keyid.startswith(keyid))).all()
        if not rows:
            raise NotFound(f"no enrolled key {keyid!r}")
        if len(rows) > 1:
            raise InvalidRequest(f"key id prefix {keyid!r} is ambiguous; give more of it")
        row = rows[0]
        if row.revoked_at is None:
            row.revoked_at = _now()
            row.revoked_reason = reason
        return _key(row)


def list_keys(db: Database) -> list[KeyRecord]:
    with db.session() as s:
        return [_key(r) for r in s.scalars(select(m.SigningKey).order_by(m.SigningKey.enrolled_at))]


def latest_trust_list(db: Database) -> tuple[int, str] | None:
    with db.session() as s:
        row = s.scalar(select(m.TrustListRow).order_by(m.TrustListRow.version.desc()).limit(1))
        return (row.version, row.envelope) if row is not None else None


def store_trust_list(db: Database, envelope: dict[str, Any], *, root_keyid: str,
                     version: int, uploaded_by: str | None) -> None:
    """Keep a trust list; versions only go up (a node refuses a lower one anyway)."""
    with db.session() as s:
        newest = s.scalar(select(m.TrustListRow.version).order_by(
            m.TrustListRow.version.desc()).limit(1))
        if newest is not None and version <= newest:
            raise InvalidRequest(f"trust list version {version} is not newer than the stored "
                                 f"version {newest}; sign version {newest + 1}")
        s.add(m.TrustListRow(version=version, envelope=json.dumps(envelope, sort_keys=True),
                             root_keyid=root_keyid, uploaded_by=uploaded_by, created_at=_now()))


def get_binding(db: Database, model: str, kind: str, ref: str) -> tuple[str, str] | None:
    """``(version, envelope)`` of the stored name statement, or None."""
    with db.session() as s:
        row = s.scalar(select(m.NameBinding).where(
            m.NameBinding.model == model, m.NameBinding.kind == kind, m.NameBinding.ref == ref))
        return (row.version, row.envelope) if row is not None else None


def put_binding(db: Database, *, model: str, kind: str, ref: str, version: str,
                envelope: str) -> None:
    """Store (or replace: an alias moves) the statement the API just signed."""
    with db.session() as s:
        row = s.scalar(select(m.NameBinding).where(
            m.NameBinding.model == model, m.NameBinding.kind == kind, m.NameBinding.ref == ref))
        if row is None:
            s.add(m.NameBinding(model=model, kind=kind, ref=ref, version=version,
                                envelope=envelope, issued_at=_now()))
        else:
            row.version = version
            row.envelope = envelope
            row.issued_at = _now()


def bindings_for(db: Database, model: str, version: str, ref: str | None) -> dict[str, Any]:
    """The name statements a resolve of ``model`` at ``ref`` (which resolved to
    ``version``) serves: the version's, and the alias's when ``ref`` (or the
    default, ``latest``) is an alias."""
    with db.session() as s:
        return bindings_in(s, model, version, ref)


def bindings_in(s: Session, model: str, version: str, ref: str | None) -> dict[str, Any]:
    """``bindings_for`` in the caller's session (the resolve path reads the
    artifacts and these in one transaction)."""
    rows = s.scalars(select(m.NameBinding).where(m.NameBinding.model == model)).all()
    out: dict[str, Any] = {"version": None, "alias": None}
    alias = ref if ref is not None and ref != version else (None if ref else "latest")
    for r in rows:
        if r.kind == VERSION and r.ref == version:
            out["version"] = json.loads(r.envelope)
        elif r.kind == ALIAS and alias is not None and r.ref == alias:
            out["alias"] = json.loads(r.envelope)
    return out
