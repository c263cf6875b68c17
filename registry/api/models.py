"""Models, their versions, aliases and artifacts."""

from __future__ import annotations

import re
from typing import Annotated, Any

from fastapi import APIRouter, Path
from pydantic import BaseModel, ConfigDict, Field

from registry import service

from .deps import Reader, State, Submitter
from .schemas import ALIAS_PATTERN, NAME_PATTERN, PROTECTED, VERSION_PATTERN, err

router = APIRouter(prefix="/v1/models", tags=["models"], responses=PROTECTED)

_ALIAS_RE = re.compile(r"^[A-Za-z][A-Za-z0-9._-]{0,63}$")

ModelName = Annotated[str, Path(max_length=128, json_schema_extra={"pattern": NAME_PATTERN})]


class AliasIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    version: str = Field(max_length=64, description="the version the alias points at",
                         json_schema_extra={"pattern": VERSION_PATTERN})


def _model(state: State, name: str) -> dict[str, Any]:
    for model in service.list_models(state.db):
        if model["name"] == name:
            return model
    raise service.NotFound(f"no model {name!r}")


@router.get("")
def list_models(state: State, _: Reader) -> dict[str, Any]:
    """Every model with its versions (and how many artifacts each has) and aliases."""
    return {"models": service.list_models(state.db)}


@router.get("/{name}", responses={404: err("no such model")})
def get_model(name: ModelName, state: State, _: Reader) -> dict[str, Any]:
    """One model: versions with their artifacts, and aliases."""
    model = _model(state, name)
    for v in model["versions"]:
        _version, records = service.version_candidates(state.db, name, v["version"])
        v["artifacts"] = [r.to_json() for r in sorted(records, key=lambda r: r.id)]
    return model


@router.put("/{name}/aliases/{alias}",
            responses={404: err("no such model or version"),
                       422: err("bad alias name, or an alias that is also a version")})
def set_alias(name: ModelName,
              alias: Annotated[str, Path(max_length=64,
                                         json_schema_extra={"pattern": ALIAS_PATTERN})],
              body: AliasIn,
              state: State, _: Submitter) -> dict[str, Any]:
    """Point ``alias`` (e.g. ``prod``) at a version; resolves see it within a second or two."""
    if not _ALIAS_RE.match(alias):
        raise service.InvalidRequest(
            f"bad alias {alias!r}: a letter, then letters, digits, '.', '_' or '-' (at most 64)")
    model = _model(state, name)
    if any(v["version"] == alias for v in model["versions"]):
        # A ref names a version before an alias, so this alias could never be used.
        raise service.InvalidRequest(f"alias {alias!r} is also a version of {name!r}; "
                                     "a version name always wins, pick another alias")
    service.set_alias(state.db, name, alias, body.version)
    state.candidates.invalidate(lambda key: key[0] == name)
    state.resolve_responses.invalidate()
    return {"model": name, "alias": alias, "version": body.version}
