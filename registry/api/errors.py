"""Every error leaves as ``{"detail": "<one clear message>"}`` with the right status.

Domain errors are raised where they happen (``service.NotFound``, ``SpecError``,
``DatabaseUnavailable``, ...) and mapped here once, so routers stay free of
try/except ladders and no error can escape as a bare 500 with a traceback.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import DataError, DBAPIError, OperationalError

from farm.core.specs import SpecError
from farm.core.target import TargetError
from farm.core.text import first_line as _first_line
from registry.auth import AuthError
from registry.blobstore import BlobNotFound, BlobStoreError
from registry.db import Conflict, DatabaseUnavailable, SchemaOutOfDate
from registry.service import InvalidRequest, NotFound

log = logging.getLogger(__name__)

RETRY_AFTER_S = "5"


def error(status: int, detail: str, headers: dict[str, str] | None = None,
          **extra: Any) -> JSONResponse:
    return JSONResponse({"detail": detail, **extra}, status_code=status, headers=headers)


def _validation_message(exc: RequestValidationError) -> str:
    parts = []
    for e in exc.errors():
        loc = ".".join(str(p) for p in e.get("loc", ()) if p != "body") or "body"
        msg = str(e.get("msg", "invalid"))
        # A ValueError raised by our own validators reads "Value error, <ours>".
        msg = msg.removeprefix("Value error, ")
        parts.append(f"{loc}: {msg}")
    return "invalid request: " + "; ".join(parts) if parts else "invalid request"


def install(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = jsonable_encoder(exc.errors(), custom_encoder={Exception: str})
        for e in errors:
            # Echoing a whole (possibly large) body back helps nobody.
            e.pop("input", None)
        return error(422, _validation_message(exc), errors=errors)

    @app.exception_handler(AuthError)
    async def _auth(_: Request, exc: AuthError) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
        return error(exc.status, exc.message, headers)

    @app.exception_handler(NotFound)
    async def _not_found(_: Request, exc: NotFound) -> JSONResponse:
        return error(404, str(exc))

    @app.exception_handler(BlobNotFound)
    async def _blob_not_found(_: Request, exc: BlobNotFound) -> JSONResponse:
        return error(404, str(exc))

    @app.exception_handler(InvalidRequest)
    async def _invalid(_: Request, exc: InvalidRequest) -> JSONResponse:
        return error(422, str(exc))

    @app.exception_handler(SpecError)
    async def _spec(_: Request, exc: SpecError) -> JSONResponse:
        return error(422, str(exc))

    @app.exception_handler(TargetError)
    async def _target(_: Request, exc: TargetError) -> JSONResponse:
        return error(422, str(exc))

    @app.exception_handler(Conflict)
    async def _conflict(_: Request, exc: Conflict) -> JSONResponse:
        return error(409, f"conflict: {_first_line(exc)}")

    # The database is down or was cut: a 503 the client may retry, never a 500.
    # The engine's pool (pre-ping on PostgreSQL) reconnects on the next request.
    @app.exception_handler(DatabaseUnavailable)
    async def _db_down(_: Request, exc: DatabaseUnavailable) -> JSONResponse:
        log.warning("database unavailable: %s", exc)
        return error(503, f"database unavailable: {_first_line(exc)}",
                     {"Retry-After": RETRY_AFTER_S})

    @app.exception_handler(OperationalError)
    async def _db_operational(_: Request, exc: OperationalError) -> JSONResponse:
        log.warning("database error: %s", _first_line(exc.orig or exc))
        return error(503, f"database unavailable: {_first_line(exc.orig or exc)}",
                     {"Retry-After": RETRY_AFTER_S})

    @app.exception_handler(DBAPIError)
    async def _db_api(_: Request, exc: DBAPIError) -> JSONResponse:
        if exc.connection_invalidated:
            return error(503, f"database connection lost: {_first_line(exc.orig or exc)}",
                         {"Retry-After": RETRY_AFTER_S})
        log.error("database error", exc_info=exc)
        return error(500, f"database error: {_first_line(exc.orig or exc)}")

    # A value the database cannot hold (a NUL character in a name, an id or a
    # message; a number out of range): the request's fault, and the
    # transaction was rolled back, so nothing changed.
    @app.exception_handler(DataError)
    async def _db_data(_: Request, exc: DataError) -> JSONResponse:
        return error(422, f"invalid value: {_first_line(exc.orig or exc)}")

    @app.exception_handler(SchemaOutOfDate)
    async def _schema(_: Request, exc: SchemaOutOfDate) -> JSONResponse:
        return error(503, str(exc))

    @app.exception_handler(BlobStoreError)
    async def _blob_store(_: Request, exc: BlobStoreError) -> JSONResponse:
        log.warning("blob store error: %s", exc)
        return error(503, f"blob store unavailable: {_first_line(exc)}",
                     {"Retry-After": RETRY_AFTER_S})

    @app.exception_handler(Exception)
    async def _unhandled(request: Request, exc: Exception) -> JSONResponse:
        log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
        return error(500, f"internal error: {type(exc).__name__}: {_first_line(exc)}")
