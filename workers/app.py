"""The Celery application.

Delivery rules (DESIGN.md): tasks take ids, not objects; every task here is
idempotent, so ``acks_late`` with ``task_reject_on_worker_lost`` is safe and a
worker killed mid-task has its message delivered again. Results live in SQL,
not in a result backend.
"""

from __future__ import annotations

from celery import Celery
from kombu import Queue

from farm.core.settings import get_settings
from workers.routing import TASK_ROUTES, TRACE_QUEUE
from workers.task_events import SendTaskEventsAtOnce
from workers.timing import redis_transport_options


def make_celery() -> Celery:
    settings = get_settings()
    broker = settings.resolved_broker_url()
    if broker.startswith("sqla+sqlite:///"):
        settings.farm_home.mkdir(parents=True, exist_ok=True)
    app = Celery("torch_farm", broker=broker, include=["workers.tasks"])
    app.conf.update(
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        task_ignore_result=True,
        worker_prefetch_multiplier=1,
        task_default_queue=TRACE_QUEUE,
        task_queues=[Queue(TRACE_QUEUE)],
        task_routes=TASK_ROUTES,
        task_serializer="json",
        accept_content=["json"],
        broker_connection_retry_on_startup=True,
        broker_connection_max_retries=None,
        # Redis: how long a delivered, unacknowledged message waits before it is
        # given to another worker. Longer than the longest build, or a slow build
        # would run twice; a dead worker's build is picked up sooner by the
        # claim sweep (workers.tasks.sweep), which watches heartbeats.
        # (The SQLite broker hands transport options to create_engine, which
        # knows no visibility timeout: Redis only.)
        broker_transport_options=(
            redis_transport_options(settings) if broker.startswith(("redis", "rediss")) else {}
        ),
        worker_hijack_root_logger=False,
        # Task events (sent, started, succeeded, failed, retried) for Flower
        # and `celery events`; the farm's own metrics come from SQL and the
        # broker (registry.api.metrics), so a farm without a monitor loses nothing.
        worker_send_task_events=True,
        task_send_sent_event=True,
        worker_cancel_long_running_tasks_on_connection_loss=False,
    )
    app.steps["consumer"].add(SendTaskEventsAtOnce)
    return app


app = make_celery()
