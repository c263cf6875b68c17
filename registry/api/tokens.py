"""API tokens (admin only)."""

from __future__ import annotations

from typing import Any, Literal

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field, field_validator

from registry import auth

from .deps import Admin, State
from .schemas import PROTECTED

router = APIRouter(prefix="/v1/tokens", tags=["tokens"], responses=PROTECTED)


class TokenIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=128, description="who or what holds it")
    role: Literal["read", "submit", "admin"] = Field(
        description="read: resolve and download (fleet nodes); submit: also submit jobs "
                    "and set aliases; admin: also create tokens")

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
    token = auth.create_token(state.db, body.name, body.role)
    return {"name": body.name.strip(), "role": body.role, "token": token, "created_by": who.name}


@router.delete("/{name}")
def revoke_tokens(name: str, state: State, _: Admin) -> dict[str, Any]:
    """Revoke every token with this name (takes effect within a few seconds)."""
    n = auth.revoke_tokens(state.db, name)
    state.auth.forget()
    return {"name": name, "revoked": n}
