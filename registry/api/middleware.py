"""Plain ASGI middleware: cheap enough for the resolve path.

``BodyLimit`` refuses a body over the limit twice: at once when its
Content-Length says so (nothing is read), and while it streams when it has no
Content-Length (chunked) or lies about it. ``RequestMetrics`` times every
request by its route template, so the histogram's labels stay few.
"""

from __future__ import annotations

import json
import time
from typing import Any

from fastapi import HTTPException
from prometheus_client import Histogram
from starlette.types import ASGIApp, Message, Receive, Scope, Send


def _too_large(limit: int) -> str:
    return f"request body too large: the limit is {limit} bytes (MAX_BODY_BYTES)"


class BodyLimit:
    def __init__(self, app: ASGIApp, *, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.max_bytes
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    await _send_json(send, 400, "malformed Content-Length header")
                    return
                if declared > limit:
                    await _send_json(send, 413, _too_large(limit))
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
                    raise HTTPException(413, _too_large(limit))
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


CachedResponse = tuple[int, list[tuple[bytes, bytes]], bytes]


class ResponseCache:
    """Answers repeated identical GETs of ``path`` from memory for a second or two.

    A rollout is thousands of nodes sending the same resolve query with the
    same token; only the first in each ``ttl_s`` goes through routing,
    validation, auth and the resolver. The key holds the whole query string,
    the Authorization header (so a cached answer only ever goes to the token
    that was admitted for it) and Host (which the download URL is built
    from). Only 200 and 404 answers are kept: errors are never replayed.
    ``on_replay(status)`` lets the caller count replays as it counts answers.
    """

    def __init__(self, app: ASGIApp, *, path: str, cache: Any,
                 on_replay: Any = None) -> None:
        self.app = app
        self.path = path
        self.cache = cache  # a state.TTLCache
        self.on_replay = on_replay

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] != "http" or scope["path"] != self.path or scope["method"] != "GET"
                or self.cache.ttl_s <= 0):
            await self.app(scope, receive, send)
            return
        auth = host = b""
        for name, value in scope["headers"]:
            if name == b"authorization":
                auth = value
            elif name == b"host":
                host = value
        key = (scope.get("query_string", b""), auth, host)
        hit, entry = self.cache.peek(key)
        if hit:
            status, headers, body = entry
            scope["farm.route"] = self.path
            if self.on_replay is not None:
                self.on_replay(status)
            await send({"type": "http.response.start", "status": status, "headers": headers})
            await send({"type": "http.response.body", "body": body})
            return
        start: dict[str, Any] = {}
        parts: list[bytes] = []

        async def capture(message: Message) -> None:
            if message["type"] == "http.response.start":
                start.update(message)
            elif message["type"] == "http.response.body":
                parts.append(message.get("body", b""))
                if not message.get("more_body") and start.get("status") in (200, 404):
                    self.cache.put(key, (start["status"], list(start.get("headers", [])),
                                         b"".join(parts)))
            await send(message)

        await self.app(scope, receive, capture)


class RequestMetrics:
    def __init__(self, app: ASGIApp, *, histogram: Histogram) -> None:
        self.app = app
        self.histogram = histogram

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
            self.histogram.labels(scope.get("method", ""), path, str(status[0])).observe(
                time.perf_counter() - start)
