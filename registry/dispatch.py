"""The wire contract between the API and the workers: queue and task names,
and the one producer the API uses to start a job.

The API sends tasks by name, so it never imports the task code (nor the
sandbox and model tooling behind it); ``workers`` imports these names to
consume them. The producer is made on first use, so an API that never submits
(a read replica, a test) never touches the broker.
"""

from __future__ import annotations

import functools
import threading
from typing import Any

from farm.core.settings import get_settings

TRACE_QUEUE = "trace"
TRACE_TASK = "farm.trace"
COMPILE_TASK = "farm.compile"


_producer_lock = threading.Lock()


def _producer() -> Any:
    # Made once under a lock: the API's thread pool sends from many threads at
    # once, and concurrent first imports of celery's lazy module raced
    # ("cannot import name 'Celery'", seen under 200 concurrent submissions).
    with _producer_lock:
        return _make_producer()


@functools.lru_cache(maxsize=1)
def _make_producer() -> Any:
    from celery import Celery

    settings = get_settings()
    broker = settings.resolved_broker_url()
    if broker.startswith("sqla+sqlite:///"):
        settings.farm_home.mkdir(parents=True, exist_ok=True)
    return Celery("torch_farm_api", broker=broker)


def enqueue_trace(job_id: str) -> None:
    """Send the trace task for ``job_id`` by name."""
    _producer().send_task(TRACE_TASK, args=(job_id,), queue=TRACE_QUEUE)
