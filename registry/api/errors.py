"""Every error leaves as ``{"detail": "<one clear message>"}`` with the right status.

Domain errors are raised where they happen (``service.NotFound``, ``SpecError``,
``DatabaseUnavailable``, ...) and mapped here once, so routers stay free of
try/except ladders and no error can escape as a bare 500 with a traceback.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
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
from registry.service import Clash, InvalidRequest, NotFound

log = logging.getLogger(__name__)

RETRY_AFTER_S = "5"

Handler = Callable[[Request, Exception], Awaitable[JSONResponse]]


def error(status: int, detail: str, headers: dict[str, str] | None = None,
          **extra: Any) -> JSONResponse:
    return JSONResponse({"detail": detail, **extra}, status_code=status, headers=headers)


def _retry_later(detail: str) -> JSONResponse:
    """A 503 the client may retry: something the farm needs is down for now."""
    return error(503, detail, {"Retry-After": RETRY_AFTER_S})


# Errors answered with a status and a message and nothing else.
ANSWERS: tuple[tuple[type[Exception], int, Callable[[Any], str]], ...] = (
    (NotFound, 404, str),
    (Clash, 409, str),
    (BlobNotFound, 404, str),
    (InvalidRequest, 422, str),
    (SpecError, 422, str),
    (TargetError, 422, str),
    (SchemaOutOfDate, 503, str),
    (Conflict, 409, lambda exc: f"conflict: {_first_line(exc)}"),
    # A value the database cannot hold (a NUL character in a name, an id or a
    # message; a number out of range): the request's fault, and the
    # transaction was rolled back, so nothing changed.
    (DataError, 422, lambda exc: f"invalid value: {_first_line(exc.orig or exc)}"),
)


def _answer(status: int, message: Callable[[Any], str]) -> Handler:
    async def handler(_: Request, exc: Exception) -> JSONResponse:
        return error(status, message(exc))

    return handler


def _down(what: str, *, logged_as: str) -> Handler:
    """``what`` (a service the farm needs) is down: logged, and a 503 to retry."""

    async def handler(_: Request, exc: Exception) -> JSONResponse:
        log.warning("%s: %s", logged_as, exc)
        return _retry_later(f"{what} unavailable: {_first_line(exc)}")

    return handler


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

    for exc_type, status, message in ANSWERS:
        app.add_exception_handler(exc_type, _answer(status, message))

    # The database (or the blob store) is down or was cut: a 503 the client may
    # retry, never a 500. The engine's pool (pre-ping on PostgreSQL) reconnects
    # on the next request.
    app.add_exception_handler(DatabaseUnavailable,
                              _down("database", logged_as="database unavailable"))
    app.add_exception_handler(BlobStoreError, _down("blob store", logged_as="blob store error"))

    @app.exception_handler(OperationalError)
    async def _db_operational(_: Request, exc: OperationalError) -> JSONResponse:
        log.warning("database error: %s", _first_line(exc.orig or exc))
        return _retry_later(f"database unavailable: {_first_line(exc.orig or exc)}")

    @app.exception_handler(DBAPIError)
    async def _db_api(_: Request, exc: DBAPIError) -> JSONResponse:
        if exc.connection_invalidated:
            return _retry_later(f"database connection lost: {_first_line(exc.orig or exc)}")
        log.error("database error", exc_info=exc)
        return error(500, f"database error: {_first_line(exc.orig or exc)}")

    @app.exception_handler(Exception)
    async def _unhandled(request: Request, exc: Exception) -> JSONResponse:
        log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
        return error(500, f"internal error: {type(exc).__name__}: {_first_line(exc)}")
