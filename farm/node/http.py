"""One session with the farm's HTTP API: the base URL and token, TLS, plain
http refused off this machine, GETs retried through connection
errors and 502/503/504, and every error answer turned into a ``FarmError``
subclass that says what happened (``farm.node.errors``)."""

from __future__ import annotations

import contextlib
import threading
import time
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import httpx

from farm.node.arguments import is_loopback
from farm.node.errors import (
    AuthenticationError,
    FarmError,
    FarmUnavailable,
    NotFoundError,
    _detail_text,
)

if TYPE_CHECKING:
    from typing_extensions import Self  # typing's from Python 3.11

DEFAULT_TIMEOUT_S = 30.0
_RETRY_STATUSES = frozenset({502, 503, 504})


def origin(url: str) -> tuple[str, str]:
    parts = urlsplit(url)
    return parts.scheme.lower(), parts.netloc.lower()


class ApiSession:
    """``url`` and ``token`` default to ``FARM_URL`` and ``FARM_TOKEN``. Safe to
    share between threads (httpx's clients are)."""

    def __init__(
        self,
        url: str | None = None,
        token: str | None = None,
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        retries: int = 2,
        allow_http: bool | None = None,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        from farm.core.settings import get_settings

        settings = get_settings()
        self.url = (url or settings.farm_url).rstrip("/")
        allow = settings.farm_allow_http if allow_http is None else allow_http
        if urlsplit(self.url).scheme.lower() == "http" and not is_loopback(self.url) and not allow:
            # Tokens and answers in clear text, to any host on the path.
            raise FarmError(f"refusing plain http to {urlsplit(self.url).hostname}: use https "
                            "(docs/security.md, TLS), or set FARM_ALLOW_HTTP=1 on a network "
                            "you trust")
        self.token = settings.farm_token if token is None else token
        self.retries = retries
        t = httpx.Timeout(timeout, connect=min(timeout, 10.0))
        headers = {"User-Agent": "torch-farm-client"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        verify: Any = True
        if settings.farm_ca_bundle:
            import ssl

            # A private CA (docs/security.md, TLS); the system's CAs otherwise.
            verify = ssl.create_default_context(cafile=settings.farm_ca_bundle)
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=t,
                                  follow_redirects=False, transport=transport, verify=verify)
        # For presigned URLs on another origin: never carries the farm token.
        # Made on first use: each client loads the CA store (20 ms of a node's
        # start), and a farm that serves its blobs itself never redirects.
        self._bare_args: dict[str, Any] = dict(timeout=t, follow_redirects=False,
                                               transport=transport, verify=verify,
                                               headers={"User-Agent": "torch-farm-client"})
        self._bare_client: httpx.Client | None = None
        self._bare_lock = threading.Lock()

    @property
    def _bare(self) -> httpx.Client:
        with self._bare_lock:
            if self._bare_client is None:
                self._bare_client = httpx.Client(**self._bare_args)
            return self._bare_client

    def close(self) -> None:
        self._http.close()
        with self._bare_lock:
            if self._bare_client is not None:
                self._bare_client.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

    def _request(self, method: str, path: str, **kw: Any) -> Any:
        """JSON of a successful answer; a ``FarmError`` subclass otherwise.
        GETs are retried on connection errors and 502/503/504, honouring a
        Retry-After of up to 5 s; other methods are sent once. (A loop of its
        own, not tenacity: importing that took 0.1 s of every node's start.)"""
        attempts = 1 + (self.retries if method == "GET" else 0)
        for attempt in range(1, attempts + 1):
            try:
                r = self._http.request(method, path, **kw)
            except httpx.TransportError as exc:
                if attempt < attempts:
                    time.sleep(_backoff(attempt, None))
                    continue
                raise FarmUnavailable(
                    f"cannot reach the farm at {self.url}: {exc or type(exc).__name__}"
                ) from None
            if r.status_code in _RETRY_STATUSES and attempt < attempts:
                time.sleep(_backoff(attempt, r))
                continue
            # Out of attempts: the last answer (a 503 is reported as such below).
            break
        self._raise_for(r, f"{method} {path}")
        if r.status_code == 204 or not r.content:
            return None
        try:
            return r.json()
        except ValueError:
            raise FarmError(f"{method} {path}: the farm answered {r.status_code} with "
                            "something that is not JSON", status=r.status_code) from None

    def _raise_for(self, r: httpx.Response, what: str) -> None:
        if r.status_code < 400:
            return
        body: Any = None
        with contextlib.suppress(ValueError):
            body = r.json()
        detail = body.get("detail") if isinstance(body, dict) else None
        text = _detail_text(detail) if detail is not None else (
            r.text.strip().splitlines()[0][:300] if r.text.strip() else r.reason_phrase)
        status = r.status_code
        if status == 404:
            rejections = body.get("rejections", []) if isinstance(body, dict) else []
            raise NotFoundError(text, detail=body, rejections=rejections or [])
        if status in (401, 403):
            raise AuthenticationError(f"{text} (HTTP {status})", status=status, detail=body)
        if status >= 500:
            raise FarmUnavailable(f"farm error on {what}: {text} (HTTP {status})",
                                  status=status, detail=body)
        raise FarmError(f"{text} (HTTP {status})", status=status, detail=body)


def _retry_after(r: httpx.Response, default: float) -> float:
    try:
        return min(5.0, max(0.0, float(r.headers.get("retry-after", default))))
    except ValueError:
        return default


def _backoff(attempt: int, answer: httpx.Response | None) -> float:
    """0.2 s, 0.4 s, ... after attempt ``attempt`` (from 1); or the server's
    Retry-After (at most 5 s) on a 503."""
    default = 0.2 * 2 ** (attempt - 1)
    if answer is not None:
        return _retry_after(answer, default)
    return default
