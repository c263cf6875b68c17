"""Worker start-up and background duties: heartbeats and the claim sweep.

A compile worker registers its target with a heartbeat so the farm knows
which targets have live workers; a worker that stops beating is dead, and
the sweep (run by trace workers) re-enqueues what it was compiling.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from celery.signals import worker_ready, worker_shutdown

from registry import service
from workers import context

log = logging.getLogger(__name__)

_stop = threading.Event()
_identity: dict[str, Any] = {}


def configure(*, kind: str, queue: str, target: str | None) -> None:
    """Called by `farm worker` before Celery starts."""
    _identity.update(kind=kind, queue=queue, target=target)


def _beat_forever() -> None:
    from workers.tasks import enqueue_compile, enqueue_trace

    period = context.settings().heartbeat_s
    while not _stop.is_set():
        try:
            service.record_heartbeat(
                context.database(),
                worker_id=context.worker_id(),
                kind=_identity["kind"],
                queue=_identity["queue"],
                target=_identity["target"],
            )
            if _identity["kind"] == "trace":
                for d in service.requeue_stale_claims(
                    context.database(), max_age_s=context.heartbeat_max_age_s()
                ):
                    log.warning("re-enqueueing build %s of a dead worker", d.build_key[:12])
                    enqueue_compile(d)
                for job_id in service.requeue_stale_jobs(context.database()):
                    log.warning("re-enqueueing job %s that was never traced", job_id)
                    enqueue_trace(job_id)
        except Exception:  # a database blip must not kill the beat
            log.exception("heartbeat failed; retrying in %s s", period)
        _stop.wait(period)


@worker_ready.connect
def _on_ready(**_: Any) -> None:
    if not _identity:
        return
    threading.Thread(target=_beat_forever, name="farm-heartbeat", daemon=True).start()
    log.info(
        "worker %s ready: %s on %s", context.worker_id(), _identity["kind"], _identity["queue"]
    )


@worker_shutdown.connect
def _on_shutdown(**_: Any) -> None:
    _stop.set()
    if _identity:
        try:
            service.remove_worker(context.database(), context.worker_id())
        except Exception:
            log.exception("could not deregister worker")
