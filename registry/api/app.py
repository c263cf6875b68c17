"""The HTTP API: ``create_app()`` builds one from settings.

Run it with ``farm serve`` (uvicorn), or ``uvicorn --factory registry.api.app:create_app``.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from sqlalchemy.exc import OperationalError
from starlette.concurrency import run_in_threadpool

from farm.settings import Settings, get_settings
from registry.auth import Authenticator
from registry.blobstore import BlobStore, open_blob_store
from registry.db import Database, DatabaseUnavailable

from . import artifacts, errors, health, jobs, models, resolve, targets, tokens
from .metrics import Metrics
from .middleware import BodyLimit, RequestMetrics, ResponseCache
from .signer import Signer
from .state import AppState, Enqueue, TTLCache

log = logging.getLogger(__name__)

# While the database is unreachable, resolves are answered from what was
# known this long ago at most (tokens and version candidates).
STALE_S = 300.0
DB_DOWN = (DatabaseUnavailable, OperationalError)

API_VERSION = "1"
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
    """Send the trace task by name, as ``workers.tasks.enqueue_trace`` would.

    By name, so the API process never imports the task code (and the sandbox
    and model tooling behind it); imported on first use, so an API that never
    submits (a read replica, a test) never touches the broker.
    """
    from workers.app import app as celery_app
    from workers.routing import TRACE_QUEUE, TRACE_TASK

    celery_app.send_task(TRACE_TASK, args=(job_id,), queue=TRACE_QUEUE)


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
    resolve_cache_s: float = 1.0,
) -> FastAPI:
    """An API app.

    ``enqueue(job_id)`` sends the trace task (default: Celery, via
    ``workers.tasks.enqueue_trace``). ``database`` and ``blob_store`` default
    to the ones the settings name. ``resolve_cache_s`` is how stale a
    version's artifact list may be on the resolve path (0 turns the cache off).
    """
    settings = settings or get_settings()
    db = database or Database(settings.resolved_database_url())
    store = blob_store or _open_store(settings)
    state = AppState(
        settings=settings,
        db=db,
        store=store,
        enqueue=enqueue or default_enqueue,
        signer=Signer(settings),
        auth=Authenticator(db, enabled=settings.farm_auth, admin_token=settings.farm_admin_token,
                           stale_s=STALE_S),
        candidates=TTLCache(resolve_cache_s, stale_s=STALE_S, stale_on=DB_DOWN),
        resolve_responses=TTLCache(resolve_cache_s, max_entries=4096),
    )

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        try:
            # Refuse to serve a schema this code does not know (mlflow does the same).
            await run_in_threadpool(db.check_schema)
        except DatabaseUnavailable as exc:
            # Start anyway: requests answer 503 until the database is back.
            log.warning("database unreachable at start-up: %s", exc)
        yield
        if database is None:
            db.dispose()

    app = FastAPI(title="torch-farm", version=API_VERSION, description=DESCRIPTION,
                  lifespan=lifespan)
    metrics = Metrics()
    metrics.attach(state)
    app.state.farm = state
    app.state.metrics = metrics
    errors.install(app)
    for router in (jobs.router, models.router, resolve.router, artifacts.router,
                   targets.router, tokens.router, health.router):
        app.include_router(router)
    # Added innermost first: timing wraps everything, the 413 included.
    app.add_middleware(ResponseCache, path="/v1/resolve", cache=state.resolve_responses,
                       on_replay=lambda status: metrics.resolves.labels(
                           "hit" if status == 200 else "miss").inc())
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    app.add_middleware(RequestMetrics, histogram=metrics.latency)
    return app
