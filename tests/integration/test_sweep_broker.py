"""The sweep re-sends only what is lost: a queued job or claim whose message
still waits in Redis, or was delivered and not yet acknowledged, is left
alone however long it waits; one whose message is gone is sent again. Real
PostgreSQL, real Redis, messages sent and taken by a real Celery app."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import timedelta

import pytest
import redis
from celery import Celery
from sqlalchemy import update

from farm.core.specs import JobSpec
from farm.core.target import Target
from registry import models as m
from registry import service
from registry.db import Database
from registry.dispatch import COMPILE_TASK, TRACE_QUEUE, TRACE_TASK
from registry.service.common import _now
from workers.broker_view import BrokerView

pytestmark = pytest.mark.integration

CPU = Target.parse("cpu/python=3.11/torch=2.13.0/isa=avx2")
WAITED_S = 3600.0  # queued this long: the sweep looks at it
REQUEUE_AFTER_S = 900.0


@pytest.fixture
def celery_app(redis_url: str) -> Iterator[Celery]:
    redis.Redis.from_url(redis_url).flushdb()
    app = Celery("sweep-test", broker=redis_url)
    yield app
    app.close()


def queued_claim(db: Database) -> str:
    key = uuid.uuid4().hex + uuid.uuid4().hex
    with db.session() as s:
        s.add(
            m.CompileClaim(
                build_key=key,
                target=str(CPU),
                state="queued",
                updated_at=_now() - timedelta(seconds=WAITED_S),
            )
        )
    return key


def queued_job(db: Database, name: str) -> str:
    spec = JobSpec.from_json(
        {
            "name": name,
            "version": "1",
            "model": {"entrypoint": "farm.zoo.basic:mlp", "kwargs": {}, "kind": "factory"},
            "inputs": ["float32[2,8]"],
            "grad_mode": "inference",
            "options": {},
            "targets": [str(CPU)],
        }
    )
    job_id = service.submit_job(db, spec, targets=[CPU])
    with db.session() as s:
        s.execute(
            update(m.Job)
            .where(m.Job.id == job_id)
            .values(updated_at=_now() - timedelta(seconds=WAITED_S))
        )
    return job_id


def sweep_claims(db: Database, view: BrokerView) -> set[str]:
    return {
        d.build_key
        for d in service.requeue_stale_claims(
            db, max_age_s=30, queued_max_age_s=REQUEUE_AFTER_S, still_queued=view.holds
        )
    }


def sweep_jobs(db: Database, view: BrokerView) -> set[str]:
    return set(
        service.requeue_stale_jobs(
            db, max_age_s=REQUEUE_AFTER_S, still_queued=lambda j: view.holds(TRACE_QUEUE, j)
        )
    )


def test_a_claim_waiting_in_the_queue_is_not_sent_again(
    database: Database, celery_app: Celery, redis_url: str
) -> None:
    waiting, lost = queued_claim(database), queued_claim(database)
    celery_app.send_task(COMPILE_TASK, args=(waiting, str(CPU)), queue=CPU.queue)
    assert sweep_claims(database, BrokerView(redis_url)) == {lost}
    # The message is still the only one: nothing was added for the waiting claim.
    assert redis.Redis.from_url(redis_url).llen(CPU.queue) == 1
    # Both stamps moved: neither is looked at again before another period.
    assert sweep_claims(database, BrokerView(redis_url)) == set()


def test_a_claim_delivered_and_not_acknowledged_is_not_sent_again(
    database: Database, celery_app: Celery, redis_url: str
) -> None:
    delivered, lost = queued_claim(database), queued_claim(database)
    celery_app.send_task(COMPILE_TASK, args=(delivered, str(CPU)), queue=CPU.queue)
    with celery_app.connection_for_read() as conn:
        q = conn.SimpleQueue(CPU.queue)
        msg = q.get(timeout=10)  # taken, not acked: kombu keeps it in "unacked"
        assert msg.payload is not None
        assert redis.Redis.from_url(redis_url).llen(CPU.queue) == 0
        assert sweep_claims(database, BrokerView(redis_url)) == {lost}
        msg.ack()


def test_a_lost_job_is_sent_again_and_a_waiting_one_is_not(
    database: Database, celery_app: Celery, redis_url: str
) -> None:
    waiting, lost = queued_job(database, "waiting"), queued_job(database, "lost")
    celery_app.send_task(TRACE_TASK, args=(waiting,), queue=TRACE_QUEUE)
    assert sweep_jobs(database, BrokerView(redis_url)) == {lost}


def test_a_broker_it_cannot_read_counts_everything_as_lost(database: Database) -> None:
    a, b = queued_claim(database), queued_claim(database)
    # Nothing listens there: the sweep re-sends, as it did before it could look.
    view = BrokerView("redis://127.0.0.1:1/0")
    assert sweep_claims(database, view) == {a, b}
    assert not view.readable
    # The embedded farm's SQLite broker is not read at all.
    assert not BrokerView("sqla+sqlite:////tmp/broker.db").holds(CPU.queue, a)
