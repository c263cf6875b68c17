"""Liveness, readiness and metrics: no token needed.

``/livez``: the process answers (a container's liveness check).
``/healthz``: the API and what it stands on (database, blob store) answer.
``/readyz``: the farm can take a job now, which also needs a live compile
worker (without one, a job with no named target has nothing to build for).
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sqlalchemy import text

from farm.core.text import first_line
from registry import service

from .deps import State
from .schemas import err
from .state import AppState

log = logging.getLogger(__name__)

router = APIRouter(tags=["health"])


def _first_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {first_line(exc, '')}".rstrip(": ")


def _check_database(state: AppState) -> str:
    try:
        with state.db.session() as s:
            s.execute(text("SELECT 1"))
        return "ok"
    except Exception as exc:
        return _first_line(exc)


def _check_blob_store(state: AppState) -> str:
    try:
        # A digest that is never stored: answers "no" through the whole path
        # (S3 credentials, bucket, network) without reading anything.
        state.store.exists("0" * 64)
        return "ok"
    except Exception as exc:
        return _first_line(exc)


def _check_compile_workers(state: AppState) -> str:
    try:
        live = service.live_targets(state.db, max_age_s=state.heartbeat_max_age_s)
    except Exception as exc:
        return _first_line(exc)
    if not live:
        return ("no compile worker is live yet (starting, or none runs: "
                "`farm worker compile`); jobs cannot be given a target until one is")
    return "ok"


def _answer(checks: dict[str, Any]) -> JSONResponse:
    down = [k for k, v in checks.items() if v != "ok"]
    if down:
        log.info("health check: %s", checks)
        return JSONResponse({"status": "unavailable", "detail": f"{', '.join(down)} not ready: "
                             + "; ".join(f"{k}: {checks[k]}" for k in down),
                             "checks": checks}, status_code=503)
    return JSONResponse({"status": "ok", "checks": checks})


@router.get("/livez")
def livez() -> dict[str, str]:
    """200 while the process serves requests: what a container's liveness
    check asks, whatever the database, blob store or workers do."""
    return {"status": "ok"}


@router.get("/healthz", responses={503: err("a part is down; `checks` says which")})
def healthz(state: State) -> JSONResponse:
    """200 when the database and the blob store answer; 503 naming what does not."""
    return _answer({"database": _check_database(state),
                    "blob_store": _check_blob_store(state)})


@router.get("/readyz", responses={503: err("not ready for jobs; `checks` says why")})
def readyz(state: State) -> JSONResponse:
    """200 when the farm can take a job: database, blob store and at least one
    live compile worker."""
    return _answer({"database": _check_database(state),
                    "blob_store": _check_blob_store(state),
                    "compile_workers": _check_compile_workers(state)})


@router.get("/metrics", response_class=Response,
            responses={200: {"content": {CONTENT_TYPE_LATEST: {}}}})
def metrics(request: Request) -> Response:
    """Prometheus text format."""
    return Response(generate_latest(request.app.state.metrics.registry),
                    media_type=CONTENT_TYPE_LATEST)
