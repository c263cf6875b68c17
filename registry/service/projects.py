"""Projects and the roles token holders have in them.

A model belongs to one project. A role in a project is one of::

    reader      resolve and read the project's models
    maintainer  + submit jobs (add versions), move and delete aliases
    owner       + grant and revoke roles in the project

Farm admins (a token of global role ``admin``) may do all of it in every
project, and only they create projects. A token with no project role at all
(the read tokens fleet nodes hold, and every token made before projects)
reads every project and changes none. Roles are keyed by the token's name,
as revocation is: every token of one name has that name's roles.
"""

from __future__ import annotations

import re
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from registry import models as m
from registry.auth import AuthError, Principal
from registry.db import Database
from registry.service.common import Clash, InvalidRequest, NotFound

DEFAULT = m.DEFAULT_PROJECT
ROLES = m.PROJECT_ROLES
_RANK = {role: i for i, role in enumerate(ROLES)}
_NAME_RE = re.compile(r"^[a-z][a-z0-9._-]{0,63}$")


def check_name(name: str) -> str:
    if not _NAME_RE.match(name):
        raise InvalidRequest(
            f"bad project name {name!r}: a lower-case letter, then lower-case "
            "letters, digits, '.', '_' or '-' (at most 64)"
        )
    return name


def check_role(role: str) -> str:
    if role not in _RANK:
        raise InvalidRequest(f"unknown project role {role!r}; known: {', '.join(ROLES)}")
    return role


def ensure_project(s: Session, name: str, *, by: str | None = None) -> None:
    """Create ``default`` on first use (a database made from the models, not
    the migrations, has none); any other project must exist."""
    if s.get(m.Project, name) is not None:
        return
    if name != DEFAULT:
        raise NotFound(
            f"no project {name!r}; projects: {', '.join(_names(s)) or 'none'} "
            "(an admin creates one: farm project create NAME)"
        )
    s.add(m.Project(name=name, created_by=by))
    s.flush()


def _names(s: Session) -> list[str]:
    return list(s.scalars(select(m.Project.name).order_by(m.Project.name)))


def create_project(
    db: Database, name: str, *, by: str | None, owner: str | None = None
) -> dict[str, Any]:
    check_name(name)
    with db.session() as s:
        if s.get(m.Project, name) is not None:
            raise Clash(f"project {name!r} exists already")
        s.add(m.Project(name=name, created_by=by))
        s.flush()
        if owner:
            s.add(m.ProjectRole(project=name, principal=owner, role="owner", granted_by=by))
    return {"project": name, "created_by": by, "owner": owner}


def grant(
    db: Database, project: str, principal: str, role: str, *, by: str | None
) -> dict[str, Any]:
    """Give ``principal`` (a token name) ``role`` in ``project``, replacing its
    role there; returns the role it had before (None)."""
    check_role(role)
    principal = principal.strip()
    if not principal or len(principal) > 128:
        raise InvalidRequest("a role needs a token name of 1 to 128 characters")
    with db.session() as s:
        ensure_project(s, project)
        row = s.scalar(
            select(m.ProjectRole).where(
                m.ProjectRole.project == project, m.ProjectRole.principal == principal
            )
        )
        previous = None if row is None else row.role
        if row is None:
            s.add(m.ProjectRole(project=project, principal=principal, role=role, granted_by=by))
        else:
            row.role, row.granted_by = role, by
    return {"project": project, "principal": principal, "role": role, "previous": previous}


def revoke(db: Database, project: str, principal: str) -> dict[str, Any]:
    with db.session() as s:
        ensure_project(s, project)
        row = s.scalar(
            select(m.ProjectRole).where(
                m.ProjectRole.project == project, m.ProjectRole.principal == principal
            )
        )
        if row is None:
            raise NotFound(f"{principal!r} has no role in project {project!r}")
        role = row.role
        s.delete(row)
    return {"project": project, "principal": principal, "revoked": role}


def roles_of(db: Database, principal: str) -> dict[str, str]:
    """``principal``'s role in each project it has one in."""
    with db.session() as s:
        return {
            k: v
            for k, v in s.execute(
                select(m.ProjectRole.project, m.ProjectRole.role).where(
                    m.ProjectRole.principal == principal
                )
            )
        }


def list_projects(db: Database) -> list[dict[str, Any]]:
    with db.session() as s:
        models = {
            k: v
            for k, v in s.execute(
                select(m.Model.project, func.count(m.Model.id)).group_by(m.Model.project)
            )
        }
        members: dict[str, list[dict[str, Any]]] = {}
        for r in s.scalars(select(m.ProjectRole).order_by(m.ProjectRole.principal)):
            members.setdefault(r.project, []).append(
                {"principal": r.principal, "role": r.role, "granted_by": r.granted_by}
            )
        return [
            {
                "project": p.name,
                "created_by": p.created_by,
                "created_at": p.created_at.isoformat(),
                "models": models.get(p.name, 0),
                "roles": members.get(p.name, []),
            }
            for p in s.scalars(select(m.Project).order_by(m.Project.name))
        ]


def project_of(db: Database, model: str) -> str | None:
    """The project ``model`` belongs to; None: no such model (yet)."""
    with db.session() as s:
        return s.scalar(select(m.Model.project).where(m.Model.name == model))


# --- who may do what -------------------------------------------------------------


def _refuse(who: Principal, project: str, need: str, has: str | None) -> AuthError:
    held = f"role {has!r}" if has else "no role"
    return AuthError(
        403,
        f"token {who.name!r} has {held} in project {project!r}; this needs "
        f"role {need!r} or higher there (a project owner grants it: farm "
        f"project grant {project} {who.name} {need})",
    )


def require(db: Database, who: Principal, project: str, need: str) -> None:
    """Refuse (403) unless ``who`` holds ``need`` or higher in ``project``.

    Read from the database, not the token cache: a revoked role stops
    writes at once."""
    if who.allows("admin"):
        return
    has = roles_of(db, who.name).get(project)
    if has is None or _RANK[has] < _RANK[need]:
        raise _refuse(who, project, need, has)


def require_on_model(db: Database, who: Principal, model: str, need: str) -> str:
    """``require`` on the project ``model`` belongs to; returns the project.
    An unknown model passes: the call it guards answers 404."""
    project = project_of(db, model)
    if project is not None:
        require(db, who, project, need)
    return project or DEFAULT


def may_read(who: Principal, project: str | None) -> bool:
    """From the token's cached roles (resolves are the hot path)."""
    if project is None or who.allows("admin") or who.projects is None:
        return True
    return project in who.projects


def require_read(who: Principal, project: str | None) -> None:
    if not may_read(who, project):
        assert project is not None
        raise _refuse(who, project, "reader", None)
