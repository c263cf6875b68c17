"""The HTTP API: ``create_app()`` builds one from settings.

Run it with ``farm serve`` (uvicorn), or ``uvicorn --factory registry.api.app:create_app``.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

from fastapi import FastAPI
from sqlalchemy.exc import OperationalError
from starlette.concurrency import run_in_threadpool
from starlette.types import Receive, Scope, Send

from farm.core.settings import Settings, get_settings
from registry import dispatch
from registry.auth import Authenticator, AuthError, Principal, bearer_token
from registry.blobstore import BlobStore, open_blob_store
from registry.db import Database, DatabaseUnavailable

from . import (
    artifacts,
    attestations,
    cache,
    code,
    dashboard,
    errors,
    health,
    jobs,
    keys,
    lifecycle,
    models,
    projects,
    reports,
    resolve,
    targets,
    tokens,
)
from .metrics import Metrics
from .middleware import BodyLimit, RequestMetrics, ResponseCache
from .miss_builder import MissBuilder
from .read_model import ReadModel
from .report_sink import ReportSink
from .reports_fast import FastReports
from .resolve_fast import FastResolve
from .signer import NameSigner
from .state import AppState, Enqueue, TTLCache

log = logging.getLogger(__name__)

# While the database is unreachable, tokens seen this long ago at most are
# still admitted (resolves are answered from the read model meanwhile).
STALE_S = 300.0
DB_DOWN = (DatabaseUnavailable, OperationalError)

API_VERSION = "1"
RESOLVE_PATH = "/v1/resolve"
REPORTS_PATH = "/v1/reports"
DESCRIPTION = """\
Build farm and artifact registry for ahead-of-time compiled PyTorch programs.

Submit a model (a job); the farm traces it once and compiles it for every
target; fleet nodes **resolve** (model, version or alias, input specs, grad
mode, their own target) to an artifact, download it by digest, verify its
sha256 and Ed25519 signature, and load it.

Auth: `Authorization: Bearer <token>`. Roles: `read` (resolve, download,
list) < `submit` (submit jobs, set aliases) < `admin` (create tokens).
Errors are JSON: `{"detail": "<what went wrong>"}`.
"""


def default_enqueue(job_id: str) -> None:
    dispatch.enqueue_trace(job_id)


def _apply_access_log_setting(settings: Settings) -> None:
    """``FARM_ACCESS_LOG=off`` silences uvicorn's per-request access log.

    At a fleet's request rates the access log costs about a fifth of the
    server's CPU; the Prometheus metrics count and time every request anyway.
    Applied at start-up, after uvicorn has configured its loggers (so it holds
    for ``--workers N`` too); uvicorn decides per connection whether to log.
    """
    if not settings.farm_access_log:
        access = logging.getLogger("uvicorn.access")
        access.handlers.clear()
        access.propagate = False


def _open_store(settings: Settings) -> BlobStore:
    url = settings.resolved_blob_store_url()
    if url.startswith("s3://"):
        return open_blob_store(url, endpoint_url=settings.s3_endpoint_url or None)
    return open_blob_store(url)


def create_app(
    settings: Settings | None = None,
    *,
    enqueue: Enqueue | None = None,
    database: Database | None = None,
    blob_store: BlobStore | None = None,
    resolve_cache_s: float | None = None,
) -> FastAPI:
    """An API app.

    ``enqueue(job_id)`` sends the trace task (default: Celery, via
    ``workers.tasks.enqueue_trace``). ``database`` and ``blob_store`` default
    to the ones the settings name. ``resolve_cache_s`` is how stale a
    version's artifact list may be on the resolve path (0 turns the cache off;
    default: FARM_RESOLVE_CACHE_S, 1 s).
    """
    settings = settings or get_settings()
    if resolve_cache_s is None:
        resolve_cache_s = settings.farm_resolve_cache_s
    db = database or Database(settings.resolved_database_url())
    store = blob_store or _open_store(settings)
    state = AppState(
        settings=settings,
        db=db,
        store=store,
        enqueue=enqueue or default_enqueue,
        signer=NameSigner(settings),
        auth=Authenticator(db, enabled=settings.farm_auth, admin_token=settings.farm_admin_token,
                           stale_s=STALE_S),
        read_model=ReadModel(db, poll_s=settings.farm_read_model_poll_s),
        resolve_responses=TTLCache(resolve_cache_s, max_entries=4096),
    )
    # A whole answer must not outlive the candidates it was computed from.
    state.read_model.on_drop = state.resolve_responses.invalidate

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        _apply_access_log_setting(settings)
        try:
            # Refuse to serve a schema this code does not know (mlflow does the same).
            await run_in_threadpool(db.check_schema)
        except DatabaseUnavailable as exc:
            # Start anyway: requests answer 503 until the database is back.
            log.warning("database unreachable at start-up: %s", exc)
        await run_in_threadpool(_start_read_model, state.read_model)
        yield
        state.read_model.stop()
        state.reports.stop()
        if database is None:
            db.dispose()

    app = FarmAPI(title="torch-farm", version=API_VERSION, description=DESCRIPTION,
                  lifespan=lifespan)
    metrics = Metrics()
    metrics.attach(state)
    state.miss_builder = MissBuilder(state)
    state.reports = ReportSink(db, counter=metrics.reports, on_stored=state.miss_builder)
    app.state.farm = state
    app.state.metrics = metrics
    errors.install(app)
    for router in (jobs.router, code.router, lifecycle.router, models.router, resolve.router,
                   artifacts.router, attestations.router,
                   targets.router, tokens.router, keys.router, health.router,
                   dashboard.router, cache.router, reports.router, projects.router):
        app.include_router(router)
    # Added innermost first: timing wraps everything, the 413 included.
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes,
                       path_limits=(("/v1/code/", settings.code_pack_max_bytes,
                                     "CODE_PACK_MAX_BYTES"),))
    app.add_middleware(RequestMetrics, histogram=metrics.latency)
    # Repeated resolves are answered in front of all of it.
    hits, misses = metrics.resolves.labels("hit"), metrics.resolves.labels("miss")
    timed: dict[int, Any] = {}

    def on_replay(status: int) -> None:
        (hits if status == 200 else misses).inc()

    def observe(status: int, seconds: float) -> None:
        child = timed.get(status)
        if child is None:
            child = timed[status] = metrics.latency.labels("GET", RESOLVE_PATH, str(status))
        child.observe(seconds)

    readers = ReaderCheck(state.auth)

    def on_answer(seconds: float) -> None:
        hits.inc()
        observe(200, seconds)

    fast = FastResolve(partial(FastAPI.__call__, app), read_model=state.read_model,
                       admit=readers.cached, on_answer=on_answer)
    report_timer = metrics.latency.labels("POST", REPORTS_PATH, "202")
    app.reports_front = FastReports(partial(FastAPI.__call__, app), sink=lambda: state.reports,
                                    admit=readers.cached, max_bytes=settings.max_body_bytes,
                                    on_answer=report_timer.observe)
    app.front = ResponseCache(fast, path=RESOLVE_PATH,
                              cache=state.resolve_responses, admit=readers.cached,
                              admit_load=readers.load, on_replay=on_replay, observe=observe)
    return app


def _start_read_model(read_model: ReadModel) -> None:
    """Follow changes first, then read every model: what changes while the
    models are read is dropped again. A database that is down is read on
    demand later (each model when first asked for)."""
    try:
        read_model.start()
        read_model.preload()
    except DB_DOWN as exc:
        log.warning("read model: not preloaded, the database is unreachable: %s", exc)


class FarmAPI(FastAPI):
    """FastAPI with the resolve answer cache (``front``) ahead of its whole stack:
    a replay skips the framework's middleware, routing and dependencies."""

    front: ResponseCache | None = None
    # Node reports, read in plain ASGI ahead of the stack (reports_fast)
    reports_front: FastReports | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            path = scope["path"]
            if self.front is not None and path == self.front.path:
                await self.front(scope, receive, send)
                return
            if self.reports_front is not None and path == REPORTS_PATH:
                await self.reports_front(scope, receive, send)
                return
        await super().__call__(scope, receive, send)


class ReaderCheck:
    """Whether an Authorization header holds a token with the ``read`` role: the
    check every cached resolve answer passes (``ResponseCache``)."""

    def __init__(self, auth: Authenticator) -> None:
        self.auth = auth

    def cached(self, header: bytes) -> bool | None:
        """From memory alone: True, False, or None for a token not seen lately."""
        if not self.auth.enabled:
            return True
        try:
            token = bearer_token(header.decode("latin-1"))
        except AuthError:
            return False
        hit, principal = self.auth.cached(token)
        if not hit:
            return None
        return _replayable(principal)

    def load(self, header: bytes) -> bool:
        """Look the token up (blocking: call it in a worker thread)."""
        principal = self.auth.load(bearer_token(header.decode("latin-1")))
        return _replayable(principal)


def _replayable(principal: Principal | None) -> bool:
    """A cached answer goes to farm-wide readers (fleet nodes) and admins; a
    token confined to its projects takes the full path, which checks the
    model's project (registry.service.projects)."""
    return principal is not None and principal.allows("read") and (
        principal.projects is None or principal.allows("admin"))
