"""Projects and roles in them: admins create projects; a project's owners
(and admins) grant and revoke roles; anyone with a token lists them."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Path
from pydantic import BaseModel, ConfigDict, Field

from registry.service import projects

from .deps import Admin, Reader, State
from .schemas import PROTECTED, err

router = APIRouter(prefix="/v1/projects", tags=["projects"], responses=PROTECTED)

PROJECT_PATTERN = "^[a-z][a-z0-9._-]{0,63}$"
ProjectName = Annotated[str, Path(max_length=64, json_schema_extra={"pattern": PROJECT_PATTERN})]
Role = Literal["reader", "maintainer", "owner"]


class ProjectIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(max_length=64, pattern=PROJECT_PATTERN, description="the project's name")
    owner: str | None = Field(
        default=None,
        min_length=1,
        max_length=128,
        description="a token name to make its first owner",
    )


class GrantIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Role = Field(
        description="reader: resolve and read; maintainer: also submit "
        "versions and move aliases; owner: also grant roles"
    )


@router.get("")
def list_projects(state: State, _: Reader) -> dict[str, Any]:
    """Every project with its model count and who holds which role."""
    return {"projects": projects.list_projects(state.db)}


@router.post("", status_code=201, responses={409: err("the project exists")})
def create_project(body: ProjectIn, state: State, who: Admin) -> dict[str, Any]:
    """A new project (admin only)."""
    return projects.create_project(state.db, body.name, by=who.name, owner=body.owner)


@router.put(
    "/{project}/roles/{principal}",
    responses={403: err("the token is no owner of the project"), 404: err("no such project")},
)
def grant(
    project: ProjectName,
    principal: Annotated[str, Path(max_length=128)],
    body: GrantIn,
    state: State,
    who: Reader,
) -> dict[str, Any]:
    """Give a token name a role in the project (its owners, or an admin)."""
    projects.require(state.db, who, project, "owner")
    out = projects.grant(state.db, project, principal, body.role, by=who.name)
    state.auth.forget()
    return {**out, "granted_by": who.name}


@router.delete(
    "/{project}/roles/{principal}",
    responses={
        403: err("the token is no owner of the project"),
        404: err("no such project, or no role to revoke"),
    },
)
def revoke(
    project: ProjectName, principal: Annotated[str, Path(max_length=128)], state: State, who: Reader
) -> dict[str, Any]:
    """Take a token name's role in the project away (takes effect at once for
    writes, within a few seconds for reads)."""
    projects.require(state.db, who, project, "owner")
    out = projects.revoke(state.db, project, principal)
    state.auth.forget()
    return {**out, "revoked_by": who.name}
