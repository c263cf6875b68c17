"""Salts of the shared compile caches (``farm.build.compile_cache``), one per target.

A salt is part of every cache entry's namespace: a new one disowns every
entry written before it, at once and for every worker of the target (REAPI's
cache salt). Workers read it at the start of each build.
"""

from __future__ import annotations

import secrets

from sqlalchemy import select

from farm.core.target import Target, TargetError
from registry import models as m
from registry.db import Database
from registry.service.common import InvalidRequest, _now

# A target's salt until someone sets one.
FIRST_SALT = "0"


def _target_text(text: str) -> str:
    try:
        return str(Target.parse(text))
    except TargetError as exc:
        raise InvalidRequest(f"bad target {text!r}: {exc}; `farm targets` lists the live "
                             "ones, spelled as this expects") from None


def cache_salt(db: Database, target: str) -> str:
    """``target``'s current salt."""
    key = _target_text(target)
    with db.session() as s:
        salt = s.scalar(select(m.CacheSalt.salt).where(m.CacheSalt.target == key))
    return salt or FIRST_SALT


def new_cache_salt(db: Database, target: str, *, by: str | None = None) -> dict[str, str]:
    """Give ``target`` a fresh random salt; returns the old and the new one."""
    key = _target_text(target)
    salt = secrets.token_hex(8)
    with db.session() as s:
        row = s.get(m.CacheSalt, key)
        old = row.salt if row is not None else FIRST_SALT
        if row is None:
            s.add(m.CacheSalt(target=key, salt=salt, updated_by=by, updated_at=_now()))
        else:
            row.salt, row.updated_by, row.updated_at = salt, by, _now()
    return {"target": key, "old_salt": old, "salt": salt}
