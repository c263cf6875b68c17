"""API tokens and roles.

A token is a random string shown once, when it is created; the database keeps
only its sha256, so a leaked database does not leak working tokens. Roles are
ordered, each including the ones below it::

    read    resolve, download, list, report a miss   (fleet nodes)
    submit  + submit jobs, set aliases               (CI, model owners)
    admin   + create tokens and projects, everything in every project

Submitting and moving aliases also need a role in the model's project
(``registry.service.projects``): a global role alone changes no model.

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
from collections.abc import Mapping
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
    # The projects the name holds a role in (registry.service.projects); None:
    # none at all, a farm-wide reader (fleet nodes' tokens).
    projects: frozenset[str] | None = None

    def allows(self, role: str) -> bool:
        return _RANK[self.role] >= _RANK[role]


ANONYMOUS_ADMIN = Principal("anonymous (auth disabled)", "admin")


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def check_role(role: str) -> str:
    if role not in _RANK:
        raise ValueError(f"unknown role {role!r}; known: {', '.join(ROLES)}")
    return role


def create_token(db: Database, name: str, role: str,
                 projects: Mapping[str, str] | None = None, *, by: str | None = None) -> str:
    """Store a new token for ``name`` with ``role``; returns the plaintext (shown once).

    ``projects`` (project -> reader | maintainer | owner) gives the name those
    roles. Without it a ``submit`` token is a maintainer of the ``default``
    project, as every submit token was before projects; a ``read`` token gets
    no project role and reads every project (fleet nodes)."""
    check_role(role)
    name = name.strip()
    if not name or len(name) > _MAX_NAME_CHARS:
        raise ValueError(f"a token needs a name of 1 to {_MAX_NAME_CHARS} characters")
    implicit = projects is None
    if projects is None:
        projects = {m.DEFAULT_PROJECT: "maintainer"} if role == "submit" else {}
    for project, project_role in projects.items():
        if project_role not in m.PROJECT_ROLES:
            raise ValueError(f"unknown project role {project_role!r} for {project!r}; known: "
                             f"{', '.join(m.PROJECT_ROLES)}")
    token = TOKEN_PREFIX + secrets.token_urlsafe(32)
    with db.session() as s:
        s.add(m.ApiToken(name=name, token_hash=hash_token(token), role=role))
        for project, project_role in projects.items():
            if s.get(m.Project, project) is None:
                if project != m.DEFAULT_PROJECT:
                    known = ", ".join(s.scalars(select(m.Project.name))) or "none"
                    raise ValueError(f"no project {project!r}; projects: {known} (an admin "
                                     "creates one: farm project create NAME)")
                s.add(m.Project(name=project, created_by=by))
                s.flush()
            row = s.scalar(select(m.ProjectRole).where(m.ProjectRole.project == project,
                                                       m.ProjectRole.principal == name))
            if row is None:
                s.add(m.ProjectRole(project=project, principal=name, role=project_role,
                                    granted_by=by))
            elif not implicit:
                row.role, row.granted_by = project_role, by
    log.info("created %s token %r (projects: %s)", role, name, dict(projects) or "none")
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
        roles: dict[str, dict[str, str]] = {}
        for pr in s.scalars(select(m.ProjectRole)):
            roles.setdefault(pr.principal, {})[pr.project] = pr.role
        return [{"name": r.name, "role": r.role, "revoked": r.revoked,
                 "projects": roles.get(r.name, {}),
                 "created_at": r.created_at.isoformat()} for r in s.scalars(q)]


def list_roles(db: Database, name: str) -> dict[str, str]:
    """``name``'s role in each project it has one in."""
    with db.session() as s:
        return {k: v for k, v in s.execute(select(m.ProjectRole.project, m.ProjectRole.role)
                              .where(m.ProjectRole.principal == name))}


def lookup_token(db: Database, token_hash: str) -> Principal | None:
    with db.session() as s:
        row = s.scalar(select(m.ApiToken).where(m.ApiToken.token_hash == token_hash))
        if row is None or row.revoked:
            return None
        projects = frozenset(s.scalars(select(m.ProjectRole.project)
                                       .where(m.ProjectRole.principal == row.name)))
        return Principal(row.name, row.role, projects or None)


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
    "check_role", "create_token", "hash_token", "list_roles", "list_tokens", "lookup_token",
    "revoke_tokens",
]
