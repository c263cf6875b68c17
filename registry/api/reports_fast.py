"""``POST /v1/reports`` as plain ASGI: a fleet's telemetry kept off the resolve path's CPU.

10,000 nodes reporting every 10 s are 1,000 posts a second, and through
FastAPI (routing, dependencies, a pydantic model per report) each cost
several times what a resolve costs, on the same event loop and cores
(``bench/registry_load.py --distinct``, reports beside). The common batch
(a node whose token was seen lately, plain JSON, fields of the expected
types) is read, checked with the route's own rules (``reports._row``, whose
parsing is memoized: a fleet sends the same targets and shapes) and handed
to the ``ReportSink``, which writes in bulk from its own thread. Anything
else (a token not seen lately, a field the fast reader does not know or of
another type, a timestamp, a malformed report) is handed whole, body
included, to the FastAPI route, which answers as it always did (202, 401,
413, 422 with its message).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any, get_args

from annotated_types import MaxLen
from pydantic.fields import FieldInfo
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from farm.core.specs import SpecError
from farm.core.target import TargetError

from .middleware import send_json_bytes
from .report_sink import ReportSink
from .reports import ReportBatchIn, ReportIn, _row


def _max_length(field: FieldInfo) -> int:
    return next(c.max_length for c in field.metadata if isinstance(c, MaxLen))


# What the route's models accept (registry.api.reports.ReportIn, ReportBatchIn),
# read from them: the fast reader must never take what the route would refuse.
_FIELDS = ReportIn.model_fields
_ALLOWED = frozenset(_FIELDS)
_KINDS = frozenset(get_args(_FIELDS["kind"].annotation))
_GRAD_MODES = get_args(_FIELDS["grad_mode"].annotation)
_STR_FIELDS = {
    name: _max_length(_FIELDS[name])
    for name in ("model", "ref", "version", "target", "format", "digest", "code", "reason")
}
_OPTIONAL = tuple(name for name in _STR_FIELDS if not _FIELDS[name].is_required())
_MAX_INPUTS = _max_length(_FIELDS["inputs"])
_MAX_INPUT_LENGTH = _max_length(get_args(get_args(_FIELDS["inputs"].annotation)[0])[1])
_MAX_NODE = _max_length(ReportBatchIn.model_fields["node"])
_MAX_REPORTS = _max_length(ReportBatchIn.model_fields["reports"])


class _NotOrdinary(Exception):
    """Anything the FastAPI route should answer."""


def _report(raw: Any) -> SimpleNamespace:
    """``raw`` as ``ReportIn`` would hold it, for ``_row``; _NotOrdinary when
    pydantic might see it otherwise (it then decides)."""
    if not isinstance(raw, dict) or not raw.keys() <= _ALLOWED:
        raise _NotOrdinary
    kind, grad_mode = raw.get("kind"), raw.get("grad_mode", "inference")
    # A dict is not hashable: the type first, then the set.
    if not isinstance(kind, str) or kind not in _KINDS or grad_mode not in _GRAD_MODES:
        raise _NotOrdinary
    for name, limit in _STR_FIELDS.items():
        value = raw.get(name)
        if value is None and name in _OPTIONAL:
            continue
        if not isinstance(value, str) or len(value) > limit:
            raise _NotOrdinary
    inputs = raw.get("inputs")
    if (
        not isinstance(inputs, list)
        or not 1 <= len(inputs) <= _MAX_INPUTS
        or not all(isinstance(i, str) and len(i) <= _MAX_INPUT_LENGTH for i in inputs)
    ):
        raise _NotOrdinary
    seconds = raw.get("seconds")
    if seconds is not None and (
        isinstance(seconds, bool) or not isinstance(seconds, int | float) or not seconds >= 0
    ):
        raise _NotOrdinary
    if raw.get("at") is not None:  # pydantic's datetime parsing: the route's
        raise _NotOrdinary
    values = {name: raw.get(name) for name in _ALLOWED}
    values["grad_mode"] = raw.get("grad_mode", "inference")
    values["seconds"] = None if seconds is None else float(seconds)
    return SimpleNamespace(**values)


def rows_of(body: bytes) -> list[dict[str, Any]]:
    """The rows of an ordinary batch (``_NotOrdinary`` otherwise)."""
    try:
        batch = json.loads(body)
    except ValueError:
        raise _NotOrdinary from None
    if not isinstance(batch, dict) or not batch.keys() <= {"node", "reports"}:
        raise _NotOrdinary
    node = batch.get("node")
    reports = batch.get("reports")
    if node is not None and (not isinstance(node, str) or len(node) > _MAX_NODE):
        raise _NotOrdinary
    if not isinstance(reports, list) or not 1 <= len(reports) <= _MAX_REPORTS:
        raise _NotOrdinary
    try:
        return [_row(_report(r), node) for r in reports]  # type: ignore[arg-type]
    except (SpecError, TargetError, ValueError, TypeError):
        raise _NotOrdinary from None


class FastReports:
    """``fallback`` is the whole FastAPI app; ``admit(authorization header)``
    says from memory whether the token may post reports (True) or the route
    decides (False/None)."""

    def __init__(
        self,
        fallback: ASGIApp,
        *,
        sink: Callable[[], ReportSink],
        admit: Callable[[bytes], bool | None],
        max_bytes: int,
        on_answer: Callable[[float], None],
    ) -> None:
        self.fallback = fallback
        self.sink = sink
        self.admit = admit
        self.max_bytes = max_bytes
        self.on_answer = on_answer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        import time

        t0 = time.perf_counter()
        auth, declared, json_body = b"", None, False
        for name, value in scope["headers"]:
            if name == b"authorization":
                auth = value
            elif name == b"content-length":
                declared = value
            elif name == b"content-type":
                json_body = value.split(b";")[0].strip().lower() == b"application/json"
        if (
            scope["method"] != "POST"
            or declared is None
            or not json_body
            or not declared.isdigit()
            or int(declared) > self.max_bytes
            or self.admit(auth) is not True
        ):
            await self.fallback(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            chunks.append(chunk)
            if size > self.max_bytes:
                break
            if not message.get("more_body"):
                break
        body = b"".join(chunks)
        rows = None
        if size <= self.max_bytes:
            try:
                rows = rows_of(body)
            except _NotOrdinary:
                rows = None
        if rows is None:
            await self.fallback(scope, _replay(body, receive), send)
            return
        taken = self.sink().put(rows)
        out = json.dumps({"accepted": taken, "dropped": len(rows) - taken}).encode()
        scope["farm.route"] = "/v1/reports"
        await send_json_bytes(send, 202, out)
        self.on_answer(time.perf_counter() - t0)


def _replay(body: bytes, then: Receive) -> Receive:
    """A receive() that hands the route the body this already read, then
    whatever the connection says next (a disconnect)."""
    sent = False

    async def receive() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await then()

    return receive
