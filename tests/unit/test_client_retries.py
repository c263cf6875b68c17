"""The fleet client's retries: GETs again on connection errors and
502/503/504 with back-off and Retry-After; other methods exactly once."""

from __future__ import annotations

import re
import time

import httpx
import pytest

from farm.node.client import FarmClient
from farm.node.errors import FarmUnavailable


def client_over(handler: object, *, retries: int = 2) -> tuple[FarmClient, list[str]]:
    seen: list[str] = []

    def record(request: httpx.Request) -> httpx.Response:
        seen.append(request.method)
        return handler(request)  # type: ignore[operator]

    c = FarmClient("http://127.0.0.1:9", token="t", retries=retries,
                   transport=httpx.MockTransport(record))
    return c, seen


def test_get_is_retried_through_503s_and_honours_retry_after() -> None:
    answers = iter([httpx.Response(503, headers={"retry-after": "0.3"}, json={"detail": "busy"}),
                    httpx.Response(502, json={"detail": "bad gateway"}),
                    httpx.Response(200, json={"ok": True})])
    c, seen = client_over(lambda _: next(answers))
    t0 = time.monotonic()
    assert c.health() == {"ok": True}
    # 0.3 s (the server's Retry-After) then 0.4 s (the second back-off step).
    assert time.monotonic() - t0 >= 0.65
    assert seen == ["GET", "GET", "GET"]


def test_get_out_of_attempts_reports_the_last_answer() -> None:
    c, seen = client_over(lambda _: httpx.Response(503, json={"detail": "database down"}),
                          retries=1)
    with pytest.raises(FarmUnavailable, match="database down") as e:
        c.health()
    assert e.value.status == 503 and seen == ["GET", "GET"]


def test_connection_errors_are_retried_then_reported_plainly() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    c, seen = client_over(refuse, retries=2)
    with pytest.raises(FarmUnavailable, match=re.escape("cannot reach the farm at http://127.0.0.1:9")):
        c.health()
    assert seen == ["GET", "GET", "GET"]


def test_a_post_is_sent_once() -> None:
    c, seen = client_over(lambda _: httpx.Response(503, json={"detail": "busy"}))
    with pytest.raises(FarmUnavailable):
        c.submit({"name": "m", "version": "1", "inputs": ["float32[2,4]"],
                  "model": {"entrypoint": "farm.zoo.basic:mlp"}})
    assert seen == ["POST"]
