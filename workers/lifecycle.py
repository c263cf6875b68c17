"""Worker start-up and background duties: heartbeats and the claim sweep.

A compile worker registers its target with a heartbeat so the farm knows
which targets have live workers; a worker that stops beating is dead, and
the sweep (run by trace workers) re-enqueues what it was compiling.
"""

from __future__ import annotations

import functools
import logging
import math
import threading
import time
from pathlib import Path
from typing import Any

from celery.signals import worker_ready, worker_shutdown

from farm.core.settings import get_settings
from registry import service
from registry.dispatch import TRACE_QUEUE
from workers import context
from workers.broker_view import BrokerView

log = logging.getLogger(__name__)

_stop = threading.Event()
_identity: dict[str, Any] = {}


def configure(*, kind: str, queue: str, target: str | None) -> None:
    """Called by `farm worker` before Celery starts."""
    _identity.update(kind=kind, queue=queue, target=target)


def requeue_after_s() -> float:
    """How long a job or claim may sit queued before the sweep looks for its
    message in the broker, and sends it again if it is not there (the broker
    was down, or restarted without persistence)."""
    return get_settings().farm_requeue_after_s


def trace_stale_after_s() -> float:
    """A job tracing for longer than this has lost its trace worker: the
    sandbox ends every trace by the trace time limit (plus its kill grace)."""
    s = context.settings()
    return float(s.trace_timeout_s) + max(5.0, 2.0 * context.heartbeat_max_age_s())


def _touch_alive_file() -> None:
    """After a recorded beat: the container healthcheck reads this file's age
    (a solo worker busy with a build cannot answer a Celery ping)."""
    path = context.settings().farm_worker_alive_file
    if not path:
        return
    try:
        Path(path).touch()
    except OSError as exc:
        log.warning("cannot touch the alive file %s: %s", path, exc)


def _beat_forever() -> None:
    from workers.tasks import enqueue_compile, enqueue_trace

    period = context.settings().heartbeat_s
    # After this worker could not reach the database, every other worker
    # probably could not either: their heartbeats are stale for a reason that
    # is not death. Sweeping then would hand live workers' builds to others.
    last_failure = -math.inf
    while not _stop.is_set():
        try:
            service.record_heartbeat(
                context.database(),
                worker_id=context.worker_id(),
                kind=_identity["kind"],
                queue=_identity["queue"],
                target=_identity["target"],
            )
        except Exception:  # a database blip must not kill the beat
            last_failure = time.monotonic()
            log.exception("heartbeat failed; retrying in %s s", period)
            _stop.wait(period)
            continue
        _touch_alive_file()
        recovered = time.monotonic() - last_failure > 2 * context.heartbeat_max_age_s()
        try:
            if _identity["kind"] == "trace" and recovered:
                # Queued work whose message the broker still holds only waits:
                # re-sent is only what is lost (workers.broker_view).
                broker = BrokerView(context.settings().resolved_broker_url())
                for d in service.requeue_stale_claims(
                    context.database(),
                    max_age_s=context.heartbeat_max_age_s(),
                    queued_max_age_s=requeue_after_s(),
                    still_queued=broker.holds,
                ):
                    log.warning("re-enqueueing build %s of a dead worker", d.build_key[:12])
                    enqueue_compile(d)
                for job_id in service.requeue_stale_jobs(
                    context.database(),
                    max_age_s=requeue_after_s(),
                    tracing_max_age_s=trace_stale_after_s(),
                    heartbeat_max_age_s=context.heartbeat_max_age_s(),
                    still_queued=functools.partial(broker.holds, TRACE_QUEUE),
                ):
                    log.warning("re-enqueueing job %s whose trace was lost", job_id)
                    enqueue_trace(job_id)
        except Exception:  # nor a broker outage the sweep
            log.exception("sweep failed; retrying in %s s", period)
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
