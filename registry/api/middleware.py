"""Plain ASGI middleware: cheap enough for the resolve path.

``BodyLimit`` refuses a body over the limit twice: at once when its
Content-Length says so (nothing is read), and while it streams when it has no
Content-Length (chunked) or lies about it. ``RequestMetrics`` times every
request by its route template, so the histogram's labels stay few.
``ResponseCache`` answers repeated resolves from memory, in front of the app.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import Any

from fastapi import HTTPException
from prometheus_client import Histogram
from starlette.concurrency import run_in_threadpool
from starlette.types import ASGIApp, Message, Receive, Scope, Send


def _too_large(limit: int, setting: str = "MAX_BODY_BYTES") -> str:
    return f"request body too large: the limit is {limit} bytes ({setting})"


class BodyLimit:
    """``path_limits``: (path prefix, limit, setting name) for the few routes
    whose bodies are larger by design (code packs)."""

    def __init__(self, app: ASGIApp, *, max_bytes: int,
                 path_limits: tuple[tuple[str, int, str], ...] = ()) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.path_limits = path_limits

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit, setting = self.max_bytes, "MAX_BODY_BYTES"
        path = scope.get("path", "")
        for prefix, value, name in self.path_limits:
            if path.startswith(prefix):
                limit, setting = value, name
                break
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    await _send_json(send, 400, "malformed Content-Length header")
                    return
                if declared > limit:
                    await _send_json(send, 413, _too_large(limit, setting))
                    return
        seen = 0

        async def capped_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    # An HTTPException, so FastAPI's body reader lets it through
                    # (any other error there becomes a 400) and the exception
                    # middleware answers 413.
                    raise HTTPException(413, _too_large(limit, setting))
            return message

        await self.app(scope, capped_receive, send)


async def _send_json(send: Send, status: int, detail: str) -> None:
    body = json.dumps({"detail": detail}).encode()
    await send({
        "type": "http.response.start",
        "status": status,
        "headers": [(b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"connection", b"close")],
    })
    await send({"type": "http.response.body", "body": body})


async def send_json_bytes(send: Send, status: int, body: bytes) -> None:
    """A JSON answer already serialized (the plain-ASGI routes' answers)."""
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def auth_and_host(scope: Scope) -> tuple[bytes, bytes, bool]:
    """(Authorization, Host, whether the request has a body) from the headers."""
    auth = host = b""
    for name, value in scope["headers"]:
        if name == b"authorization":
            auth = value
        elif name == b"host":
            host = value
        elif name in _BODY_HEADERS:
            return auth, host, True
    return auth, host, False


CachedResponse = tuple[int, list[tuple[bytes, bytes]], bytes]
# Request headers that mean the request has a body: such a request is never
# answered from memory (BodyLimit and the router see it as usual).
_BODY_HEADERS = (b"content-length", b"transfer-encoding")


class ResponseCache:
    """Answers repeated identical GETs of ``path`` from memory for a second or two.

    A rollout is thousands of nodes sending the same resolve query; only the
    first in each ``ttl_s`` goes through routing, validation, auth and the
    resolver. The key is the whole query string and Host (which the download
    URL is built from): the answer does not depend on who asks. Who asks is
    still checked on every replay: ``admit(authorization_header)`` says from
    memory alone whether it is a token the authenticator admitted lately (and
    has not seen revoked since): yes, no, or None for a token it has not seen
    lately, which ``admit_load`` then looks up (a node's first contact costs
    one token lookup, not a whole resolve). Anything not admitted takes the
    full path, which answers 401 or 403 as usual. Only 200 and 404 answers
    are kept: errors are never replayed, nor is anything sent to a request
    with a body.

    When an entry has expired, the first request to see it refreshes it
    through the full path while the others are answered with the old one
    (for at most ``ttl_s`` more): a fleet never waits in line behind the
    refresh's database query.

    Meant to sit in front of the whole app (``FarmAPI``): a replay costs a
    dictionary lookup and two ``send`` calls. ``on_replay(status)`` counts
    replays as the endpoint counts answers; ``observe(status, seconds)``
    times them as ``RequestMetrics`` times the rest.
    """

    def __init__(self, app: ASGIApp, *, path: str, cache: Any,
                 admit: Callable[[bytes], bool | None] | None = None,
                 admit_load: Callable[[bytes], bool] | None = None,
                 on_replay: Callable[[int], None] | None = None,
                 observe: Callable[[int, float], None] | None = None) -> None:
        self.app = app
        self.path = path
        self.cache = cache  # a state.TTLCache
        self.admit = admit
        self.admit_load = admit_load
        self.on_replay = on_replay
        self.observe = observe
        # Token lookups in flight: when a token's cached verdict expires (every
        # few seconds) a fleet sharing it waits for one lookup, rather than
        # queueing one per request in the thread pool.
        self._loading: dict[bytes, asyncio.Future[bool]] = {}

    async def _load_once(self, auth: bytes) -> bool:
        pending = self._loading.get(auth)
        if pending is not None:
            return await asyncio.shield(pending)
        assert self.admit_load is not None
        future: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._loading[auth] = future
        verdict = False  # on any failure (the database is down...) the full path says why
        try:
            verdict = await run_in_threadpool(self.admit_load, auth)
        except Exception:
            pass
        finally:
            self._loading.pop(auth, None)
            if not future.done():  # cancelled too: the waiters take the full path
                future.set_result(verdict)
        return verdict

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        cache = self.cache
        if (scope["type"] != "http" or scope["path"] != self.path or scope["method"] != "GET"
                or cache.ttl_s <= 0):
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        auth, host, has_body = auth_and_host(scope)
        if has_body:
            await self.app(scope, receive, send)
            return
        key = (scope.get("query_string", b""), host)
        admitted = True if self.admit is None else self.admit(auth)
        if admitted is None:
            # A token not seen lately (a node's first contact): when there is
            # an answer to give, look the token up alone (in a worker thread)
            # rather than send the request down the whole resolve path.
            admitted = False
            if self.admit_load is not None and cache.has(key):
                admitted = await self._load_once(auth)
        if admitted:
            entry, _ = cache.lookup(key)  # (None, _): this request refreshes it
            if entry is not None:
                status, headers, body = entry
                scope["farm.route"] = self.path
                await send({"type": "http.response.start", "status": status,
                            "headers": headers})
                await send({"type": "http.response.body", "body": body})
                if self.on_replay is not None:
                    self.on_replay(status)
                if self.observe is not None:
                    self.observe(status, time.perf_counter() - t0)
                return
            generation = None
        else:
            # The full path decides (401, 403, or it loads the token). A 200 or
            # 404 from it means the token was admitted, and the answer does
            # not depend on who asked: it is kept like any other.
            generation = cache.generation
        start: dict[str, Any] = {}
        parts: list[bytes] = []
        fresh: list[CachedResponse] = []

        async def capture(message: Message) -> None:
            if message["type"] == "http.response.start":
                start.update(message)
            elif message["type"] == "http.response.body":
                parts.append(message.get("body", b""))
                if not message.get("more_body") and start.get("status") in (200, 404):
                    fresh.append((start["status"], list(start.get("headers", [])),
                                  b"".join(parts)))
            await send(message)

        try:
            await self.app(scope, receive, capture)
        finally:
            cache.refreshed(key, fresh[0] if fresh else None, generation=generation)


class RequestMetrics:
    def __init__(self, app: ASGIApp, *, histogram: Histogram) -> None:
        self.app = app
        self.histogram = histogram
        # Labelled children by (method, route, status): labels() costs more
        # than the rest of a cached resolve.
        self._children: dict[tuple[str, str, int], Any] = {}

    def observe(self, method: str, route: str, status: int, seconds: float) -> None:
        key = (method, route, status)
        child = self._children.get(key)
        if child is None:
            if len(self._children) > 1000:  # methods come from clients: keep it bounded
                self._children.clear()
            child = self._children[key] = self.histogram.labels(method, route, str(status))
        child.observe(seconds)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = [500]

        async def send_status(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            route: Any = scope.get("route")
            path = getattr(route, "path", None) or scope.get("farm.route") or "unmatched"
            self.observe(scope.get("method", ""), path, status[0], time.perf_counter() - start)
