"""Shared compile caches: a target's salt (admin). ``farm cache salt TARGET``."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query
from pydantic import BaseModel, ConfigDict, Field

from registry.service.cache import cache_salt, new_cache_salt

from .deps import Admin, State
from .schemas import PROTECTED, err

router = APIRouter(prefix="/v1/cache", tags=["cache"], responses=PROTECTED)


class SaltIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    target: str = Field(min_length=1, max_length=512,
                        description="a full target string, as `farm targets` prints it")


@router.get("/salt", responses={422: err("not a target string")})
def get_salt(state: State, _: Admin,
             target: Annotated[str, Query(min_length=1, max_length=512)]) -> dict[str, Any]:
    """The salt in ``target``'s cache namespace now."""
    return {"target": target, "salt": cache_salt(state.db, target)}


@router.post("/salt", responses={422: err("not a target string")})
def rotate_salt(body: SaltIn, state: State, who: Admin) -> dict[str, Any]:
    """A new salt for ``target``: its builds stop using every entry written
    before (they stay in the store until they expire)."""
    return {**new_cache_salt(state.db, body.target, by=who.name), "updated_by": who.name}
