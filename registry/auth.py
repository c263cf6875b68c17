"""API tokens and roles.

A token is a random string shown once, when it is created; the database keeps
only its sha256, so a leaked database does not leak working tokens. Roles are
ordered, each including the ones below it::

    read    resolve, download, list, report a miss   (fleet nodes)
    submit  + submit jobs, set aliases               (CI, model owners)
    admin   + create tokens

Two tokens never touch the table: the bootstrap admin token from
``FARM_ADMIN_TOKEN`` (for first setup, kept only as a hash in memory), and,
with ``FARM_AUTH=false`` (the embedded single-user mode), no token at all.

Lookups are cached for a few seconds: a fleet rollout sends thousands of
resolves with the same read token, and each must not cost a query. A revoked
token therefore keeps working for at most ``cache_ttl_s`` (and, while the
database is unreachable, a token admitted lately keeps working for
``stale_s``).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import threading
import time
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.exc import OperationalError

from registry import models as m
from registry.db import Database, DatabaseUnavailable

log = logging.getLogger(__name__)

ROLES: tuple[str, ...] = ("read", "submit", "admin")
_RANK = {role: i for i, role in enumerate(ROLES)}
TOKEN_PREFIX = "farm_"
_MAX_TOKEN_CHARS = 256
_MAX_NAME_CHARS = 128


class AuthError(Exception):
    """Authentication or authorization failed; ``status`` is 401 or 403."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True)
class Principal:
    name: str
    role: str

    def allows(self, role: str) -> bool:
        return _RANK[self.role] >= _RANK[role]


ANONYMOUS_ADMIN = Principal("anonymous (auth disabled)", "admin")


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def check_role(role: str) -> str:
    if role not in _RANK:
        raise ValueError(f"unknown role {role!r}; known: {', '.join(ROLES)}")
    return role


def create_token(db: Database, name: str, role: str) -> str:
    """Store a new token for ``name`` with ``role``; returns the plaintext (shown once)."""
    check_role(role)
    name = name.strip()
    if not name or len(name) > _MAX_NAME_CHARS:
        raise ValueError(f"a token needs a name of 1 to {_MAX_NAME_CHARS} characters")
    token = TOKEN_PREFIX + secrets.token_urlsafe(32)
    with db.session() as s:
        s.add(m.ApiToken(name=name, token_hash=hash_token(token), role=role))
    log.info("created %s token %r", role, name)
    return token


def revoke_tokens(db: Database, name: str) -> int:
    """Revoke every token named ``name``; returns how many were live."""
    with db.session() as s:
        rows = s.scalars(select(m.ApiToken).where(m.ApiToken.name == name,
                                                  m.ApiToken.revoked.is_(False))).all()
        for row in rows:
            row.revoked = True
        return len(rows)


def list_tokens(db: Database, *, include_revoked: bool = False) -> list[dict[str, object]]:
    """Tokens by name (never their hashes), oldest first."""
    with db.session() as s:
        q = select(m.ApiToken).order_by(m.ApiToken.created_at, m.ApiToken.id)
        if not include_revoked:
            q = q.where(m.ApiToken.revoked.is_(False))
        return [{"name": r.name, "role": r.role, "revoked": r.revoked,
                 "created_at": r.created_at.isoformat()} for r in s.scalars(q)]


def lookup_token(db: Database, token_hash: str) -> Principal | None:
    with db.session() as s:
        row = s.scalar(select(m.ApiToken).where(m.ApiToken.token_hash == token_hash))
        if row is None or row.revoked:
            return None
        return Principal(row.name, row.role)


def bearer_token(header: str | None) -> str:
    """The token of an ``Authorization: Bearer ...`` header, or AuthError(401)."""
    if not header:
        raise AuthError(401, "missing token: send 'Authorization: Bearer <token>'")
    scheme, _, token = header.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        raise AuthError(401, "malformed Authorization header: expected 'Bearer <token>'")
    if len(token) > _MAX_TOKEN_CHARS:
        raise AuthError(401, "invalid token")
    return token


class Authenticator:
    """Turns a bearer token into a ``Principal``; see the module docstring."""

    def __init__(self, db: Database, *, enabled: bool = True, admin_token: str = "",
                 cache_ttl_s: float = 5.0, stale_s: float = 0.0) -> None:
        self.db = db
        self.enabled = enabled
        self._admin_hash = hash_token(admin_token) if admin_token else None
        self._ttl = cache_ttl_s
        self._stale_s = stale_s
        # token hash -> (expires at, principal or None for "no such token")
        self._cache: dict[str, tuple[float, Principal | None]] = {}
        self._lock = threading.Lock()
        if not enabled:
            log.warning("API authentication is OFF (FARM_AUTH=false): anyone who can reach "
                        "the API is admin")

    def cached(self, token: str) -> tuple[bool, Principal | None]:
        """(hit, principal) from memory alone; for the event loop's fast path."""
        h = hash_token(token)
        if self._admin_hash is not None and hmac.compare_digest(h, self._admin_hash):
            return True, Principal("bootstrap admin", "admin")
        entry = self._cache.get(h)
        if entry is not None and entry[0] > time.monotonic():
            return True, entry[1]
        return False, None

    def load(self, token: str) -> Principal | None:
        """Look the token up in the database (blocking) and cache the answer."""
        h = hash_token(token)
        try:
            principal = lookup_token(self.db, h)
        except (DatabaseUnavailable, OperationalError):
            # The database is down: a token admitted lately still is (for
            # ``stale_s``), so fleet reads keep working through a blip.
            entry = self._cache.get(h)
            if (entry is not None and entry[1] is not None
                    and entry[0] - self._ttl + self._stale_s > time.monotonic()):
                return entry[1]
            raise
        with self._lock:
            if len(self._cache) > 10_000:
                # Unknown tokens are cached too; a flood of random ones must not grow it forever.
                self._cache.clear()
            self._cache[h] = (time.monotonic() + self._ttl, principal)
        return principal

    def forget(self) -> None:
        with self._lock:
            self._cache.clear()

    @staticmethod
    def authorize(principal: Principal | None, role: str) -> Principal:
        if principal is None:
            raise AuthError(401, "invalid or revoked token")
        if not principal.allows(role):
            raise AuthError(403, f"token {principal.name!r} has role {principal.role!r}; "
                                 f"this needs role {role!r} or higher")
        return principal


__all__ = [
    "ANONYMOUS_ADMIN", "ROLES", "AuthError", "Authenticator", "Principal", "bearer_token",
    "check_role", "create_token", "hash_token", "list_tokens", "lookup_token", "revoke_tokens",
]
