"""Dependencies, as ``Annotated`` types the routers declare."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.concurrency import run_in_threadpool

from registry.auth import ANONYMOUS_ADMIN, Principal, bearer_token

from .state import AppState

# Declared so the OpenAPI document shows the scheme; the check itself is ours
# (auto_error=False), so every failure reads the same and says what to send.
bearer_scheme = HTTPBearer(auto_error=False, description="an API token: `Bearer <token>`")


async def get_state(request: Request) -> AppState:
    # async: a plain def dependency would cost a thread-pool hop per request.
    state: AppState = request.app.state.farm
    return state


State = Annotated[AppState, Depends(get_state)]


def require(role: str) -> Callable[..., Awaitable[Principal]]:
    """A dependency that admits a token of ``role`` or higher.

    Async so that the common case (a token seen in the last seconds) is
    answered on the event loop; only a cache miss goes to the database, in
    the thread pool.
    """

    async def dependency(
        request: Request,
        _: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer_scheme)],
    ) -> Principal:
        auth = request.app.state.farm.auth
        if not auth.enabled:
            return ANONYMOUS_ADMIN
        token = bearer_token(request.headers.get("authorization"))
        hit, principal = auth.cached(token)
        if not hit:
            principal = await run_in_threadpool(auth.load, token)
        return auth.authorize(principal, role)

    dependency.__name__ = f"require_{role}"
    return dependency


Reader = Annotated[Principal, Depends(require("read"))]
Submitter = Annotated[Principal, Depends(require("submit"))]
Admin = Annotated[Principal, Depends(require("admin"))]
