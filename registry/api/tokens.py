"""API tokens (admin only)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query
from pydantic import BaseModel, ConfigDict, Field, field_validator

from registry import auth, service

from .deps import Admin, State
from .schemas import PROTECTED, err

router = APIRouter(prefix="/v1/tokens", tags=["tokens"], responses=PROTECTED)


class TokenIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=128, description="who or what holds it")
    role: Literal["read", "submit", "admin"] = Field(
        default="read",
        description="read: resolve and download (fleet nodes); submit: also submit jobs "
                    "and set aliases where the token is a project maintainer; admin: "
                    "everything, in every project")
    projects: dict[Annotated[str, Field(max_length=64, pattern="^[a-z][a-z0-9._-]{0,63}$")],
                   Literal["reader", "maintainer", "owner"]] | None = Field(
        default=None, max_length=64, examples=[{"payments": "maintainer"}],
        description="roles in projects; omitted: a submit token is a maintainer of "
                    "'default', a read token reads every project")

    @field_validator("name")
    @classmethod
    def _not_blank(cls, name: str) -> str:
        # The name is stored stripped: all whitespace would be an empty name.
        if not name.strip():
            raise ValueError("a token's name must not be empty or only whitespace")
        return name


@router.post("", status_code=201)
def create_token(body: TokenIn, state: State, who: Admin) -> dict[str, Any]:
    """A new token; the response is the only time it is shown (the farm keeps its hash)."""
    try:
        token = auth.create_token(state.db, body.name, body.role, body.projects, by=who.name)
    except ValueError as exc:
        raise service.NotFound(str(exc)) from None
    state.auth.forget()
    return {"name": body.name.strip(), "role": body.role, "token": token,
            "projects": auth.list_roles(state.db, body.name.strip()), "created_by": who.name}


@router.get("")
def list_tokens(state: State, _: Admin,
                revoked: Annotated[bool, Query(description="include revoked tokens")] = False,
                ) -> dict[str, Any]:
    """Every token's name, role and age; the tokens themselves are never kept."""
    return {"tokens": auth.list_tokens(state.db, include_revoked=revoked)}


@router.delete("/{name}", responses={404: err("no live token has this name")})
def revoke_tokens(name: str, state: State, _: Admin) -> dict[str, Any]:
    """Revoke every token with this name (takes effect within a few seconds)."""
    n = auth.revoke_tokens(state.db, name)
    state.auth.forget()
    if n == 0:
        names = sorted({str(t["name"]) for t in auth.list_tokens(state.db)})
        raise service.NotFound(f"no live token named {name!r}; live tokens: "
                               f"{', '.join(names) or 'none'}")
    return {"name": name, "revoked": n}
