"""Listing jobs and deleting artifacts: what a user does between builds."""

from __future__ import annotations

import logging
from typing import Annotated, Any

from fastapi import APIRouter, Query

from farm.core.digests import InvalidDigest, validate_digest
from registry import service

from .deps import Admin, Reader, State
from .schemas import NAME_PATTERN, PROTECTED, err
from .state import AppState

log = logging.getLogger(__name__)

router = APIRouter(tags=["jobs"], responses=PROTECTED)


def forget(state: AppState, model: str | None = None) -> None:
    """Resolves see a change at once in this replica, before its own change
    notification arrives (the other replicas drop it when theirs does)."""
    state.read_model.drop(None if model is None else [model])
    state.resolve_responses.invalidate()


def remove_blobs(state: AppState, deleted: service.Deleted) -> dict[str, Any]:
    """After the commit: delete blobs no row names any more. A failure leaves
    an orphan blob (harmless: content-addressed), never a row without its blob."""
    failed = []
    for digest in deleted.blobs:
        try:
            state.store.delete(digest)
        except Exception as exc:
            log.warning("could not delete blob %s: %s", digest[:12], exc)
            failed.append(digest)
    return {**deleted.to_json(), "blobs_not_deleted": failed}


@router.get("/v1/jobs", responses={404: err("no such model"),
                                   422: err("unknown state")})
def list_jobs(
    state: State,
    _: Reader,
    job_state: Annotated[str | None, Query(alias="state", max_length=16,
                                           description=f"one of {', '.join(service.JOB_STATES)}"
                                           )] = None,
    model: Annotated[str | None, Query(max_length=128,
                                       json_schema_extra={"pattern": NAME_PATTERN})] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 50,
) -> dict[str, Any]:
    """Jobs, newest first, with each build's state and stage (``GET /v1/jobs/{id}``: the rest)."""
    return {"jobs": service.list_jobs(state.db, state=job_state, model=model, limit=limit)}


@router.delete("/v1/artifacts/{digest}", tags=["artifacts"],
               responses={404: err("no such artifact"), 422: err("malformed digest")})
def delete_artifact(digest: str, state: State, _: Admin) -> dict[str, Any]:
    """Delete an artifact (every row with this blob digest) and its blob (admin).
    The versions it served stop resolving to it; a new job builds it again."""
    try:
        digest = validate_digest(digest)
    except InvalidDigest as exc:
        raise service.InvalidRequest(str(exc)) from None
    deleted = service.delete_artifact(state.db, digest)
    forget(state)
    return {"digest": digest, **remove_blobs(state, deleted)}
