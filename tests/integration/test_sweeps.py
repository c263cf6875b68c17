"""The sweep's choice of lost traces, on both databases: a job tracing on a
worker whose heartbeat stopped is re-sent after one heartbeat age, not after
the trace time limit; a live worker's trace is left alone until that limit."""

from __future__ import annotations

from datetime import timedelta

import pytest
from sqlalchemy import update

from farm.core.specs import JobSpec
from farm.core.target import Target
from registry import models as m
from registry import service
from registry.db import Database
from registry.service.common import _now

pytestmark = pytest.mark.integration

CPU = Target.parse("cpu/python=3.11/torch=2.13.0/isa=avx2")
HEARTBEAT_AGE_S = 3.0
TRACE_LIMIT_S = 600.0


def tracing_job(db: Database, name: str, *, worker: str | None, started_s_ago: float) -> str:
    spec = JobSpec.from_json({
        "name": name, "version": "1",
        "model": {"entrypoint": "farm.zoo.basic:mlp", "kwargs": {}, "kind": "factory"},
        "inputs": ["float32[2,8]"], "grad_mode": "inference", "options": {},
        "targets": [str(CPU)]})
    job_id = service.submit_job(db, spec, targets=[CPU])
    assert service.start_trace(db, job_id, worker_id=worker) is not None
    with db.session() as s:
        s.execute(update(m.Job).where(m.Job.id == job_id)
                  .values(updated_at=_now() - timedelta(seconds=started_s_ago)))
    return job_id


def beat(db: Database, worker: str, *, s_ago: float) -> None:
    service.record_heartbeat(db, worker_id=worker, kind="trace", queue="trace", target=None)
    with db.session() as s:
        s.execute(update(m.WorkerHeartbeat).where(m.WorkerHeartbeat.id == worker)
                  .values(last_seen=_now() - timedelta(seconds=s_ago)))


def sweep(db: Database) -> set[str]:
    return set(service.requeue_stale_jobs(db, max_age_s=900, tracing_max_age_s=TRACE_LIMIT_S,
                                          heartbeat_max_age_s=HEARTBEAT_AGE_S))


def test_a_dead_trace_workers_job_is_resent_after_one_heartbeat_age(database: Database) -> None:
    beat(database, "host:dead", s_ago=30)
    beat(database, "host:live", s_ago=0)
    dead = tracing_job(database, "on-dead", worker="host:dead", started_s_ago=10)
    live = tracing_job(database, "on-live", worker="host:live", started_s_ago=10)
    never_beat = tracing_job(database, "never-beat", worker="host:gone", started_s_ago=10)
    just_started = tracing_job(database, "just-started", worker="host:new", started_s_ago=0)
    assert sweep(database) == {dead, never_beat}
    # Re-sent once per period: the stamp moved, so the next sweep waits again.
    assert sweep(database) == set()
    assert just_started not in sweep(database) and live not in sweep(database)


def test_a_trace_past_the_time_limit_is_resent_whoever_traces_it(database: Database) -> None:
    beat(database, "host:live", s_ago=0)
    stuck = tracing_job(database, "stuck", worker="host:live", started_s_ago=TRACE_LIMIT_S + 5)
    unrecorded = tracing_job(database, "unrecorded", worker=None, started_s_ago=TRACE_LIMIT_S + 5)
    young_unrecorded = tracing_job(database, "young", worker=None, started_s_ago=10)
    assert sweep(database) == {stuck, unrecorded}
    assert young_unrecorded not in sweep(database)
