"""Models, their versions, aliases and artifacts."""

from __future__ import annotations

import re
from typing import Annotated, Any

from fastapi import APIRouter, Path, Query
from pydantic import BaseModel, ConfigDict, Field

from registry import service
from registry.service import projects

from . import names
from .deps import Admin, Reader, State, Submitter
from .lifecycle import forget, remove_blobs
from .schemas import ALIAS_PATTERN, NAME_PATTERN, PROTECTED, VERSION_PATTERN, err

router = APIRouter(prefix="/v1/models", tags=["models"], responses=PROTECTED)

_ALIAS_RE = re.compile(r"^[A-Za-z][A-Za-z0-9._-]{0,63}$")

ModelName = Annotated[str, Path(max_length=128, json_schema_extra={"pattern": NAME_PATTERN})]
AliasName = Annotated[str, Path(max_length=64, json_schema_extra={"pattern": ALIAS_PATTERN})]
VersionName = Annotated[str, Path(max_length=64, json_schema_extra={"pattern": VERSION_PATTERN})]
Force = Annotated[bool, Query(description="delete even while jobs of it still build")]


class AliasIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    version: str = Field(max_length=64, description="the version the alias points at",
                         json_schema_extra={"pattern": VERSION_PATTERN})


def _model(state: State, name: str) -> dict[str, Any]:
    for model in service.list_models(state.db):
        if model["name"] == name:
            return model
    # The same message (with its "did you mean") as every other lookup.
    service.list_aliases(state.db, name, history=False)
    raise service.NotFound(f"no model {name!r}")  # pragma: no cover - raised above


@router.get("")
def list_models(state: State, who: Reader) -> dict[str, Any]:
    """Every model the token may read, with its versions (and how many
    artifacts each has) and aliases."""
    return {"models": [m for m in service.list_models(state.db)
                       if projects.may_read(who, m.get("project"))]}


@router.get("/{name}", responses={404: err("no such model")})
def get_model(name: ModelName, state: State, who: Reader) -> dict[str, Any]:
    """One model: versions with their artifacts, and aliases."""
    model = _model(state, name)
    projects.require_read(who, model.get("project"))
    for v in model["versions"]:
        _version, records = service.version_candidates(state.db, name, v["version"])
        v["artifacts"] = [r.to_json() for r in sorted(records, key=lambda r: r.id)]
    return model


@router.put("/{name}/aliases/{alias}",
            responses={403: err("the token is no maintainer of the model's project"),
                       404: err("no such model or version"),
                       409: err("an alias named like a version of the model"),
                       422: err("bad alias name")})
def set_alias(name: ModelName,
              alias: Annotated[str, Path(max_length=64,
                                         json_schema_extra={"pattern": ALIAS_PATTERN})],
              body: AliasIn,
              state: State, who: Submitter) -> dict[str, Any]:
    """Point ``alias`` (e.g. ``prod``) at a version; resolves see it within a second or two."""
    if not _ALIAS_RE.match(alias):
        raise service.InvalidRequest(
            f"bad alias {alias!r}: a letter, then letters, digits, '.', '_' or '-' (at most 64)")
    model = _model(state, name)
    project = projects.require_on_model(state.db, who, name, "maintainer")
    if any(v["version"] == alias for v in model["versions"]):
        # A ref names a version before an alias, so this alias could never be used.
        raise service.Clash(f"alias {alias!r} is also a version of {name!r}: a version name "
                            "always wins, so the alias could never be used; pick another "
                            "alias name")
    # Signed before the alias moves, for the version this request names.
    names.bind_alias(state, name, alias, body.version, set_by=who.name, project=project)
    previous = service.set_alias(state.db, name, alias, body.version, actor=who.name)
    forget(state, name)
    return {"model": name, "alias": alias, "version": body.version, "previous": previous,
            "project": project, "set_by": who.name}


@router.get("/{name}/aliases", responses={404: err("no such model")})
def list_aliases(name: ModelName, state: State, who: Reader,
                 history: Annotated[bool, Query(description="every move, newest first")] = True,
                 ) -> dict[str, Any]:
    """The model's aliases, and every move of each (who moved it, from which version)."""
    out = service.list_aliases(state.db, name, history=history)
    projects.require_read(who, out.get("project"))
    return out


@router.delete("/{name}/aliases/{alias}", responses={404: err("no such model or alias")})
def delete_alias(name: ModelName, alias: AliasName, state: State,
                 who: Submitter) -> dict[str, Any]:
    """Remove an alias (the move is kept in its history)."""
    projects.require_on_model(state.db, who, name, "maintainer")
    version = service.delete_alias(state.db, name, alias, actor=who.name)
    forget(state, name)
    return {"model": name, "alias": alias, "deleted": True, "version": version}


@router.delete("/{name}/versions/{version}",
               responses={404: err("no such model or version"),
                          422: err("jobs of the version still build (use force)")})
def delete_version(name: ModelName, version: VersionName, state: State, who: Submitter,
                   force: Force = False) -> dict[str, Any]:
    """Delete a version: its jobs, the aliases on it, and the artifacts (and
    blobs) that no other version uses."""
    projects.require_on_model(state.db, who, name, "maintainer")
    deleted = service.delete_version(state.db, name, version, force=force, actor=who.name)
    forget(state, name)
    return {"model": name, "version": version, **remove_blobs(state, deleted)}


@router.delete("/{name}", responses={404: err("no such model"),
                                     422: err("jobs of it still build (use force)")})
def delete_model(name: ModelName, state: State, who: Admin,
                 force: Force = False) -> dict[str, Any]:
    """Delete a model with all its versions (admin)."""
    deleted = service.delete_model(state.db, name, force=force, actor=who.name)
    forget(state, name)
    return {"model": name, **remove_blobs(state, deleted)}
