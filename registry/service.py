"""The farm's state machine over SQL: jobs, builds, compile claims, artifacts.

The HTTP API and the Celery tasks both call these functions; neither touches
ORM rows directly. Every function runs in one transaction, so a crash between
two calls leaves the database in a state the next call (or a redelivered
task) can continue from.

Job:    queued -> tracing -> compiling -> succeeded | failed | partial
Build:  pending -> queued -> running -> succeeded | reused | failed
Claim:  queued -> running -> succeeded | failed     (one per build key)
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

from sqlalchemy import delete, func, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from farm.core.specs import (
    CompileOptions,
    GradMode,
    JobSpec,
    SpecError,
    TensorSpec,
    build_key,
    canonical_json,
    format_inputs,
)
from farm.core.target import Target, TargetError, TargetSelector
from registry import models as m
from registry.convert import artifact_to_record
from registry.db import Database
from registry.entities import ArtifactRecord

log = logging.getLogger(__name__)

TERMINAL_BUILD_STATES = frozenset({"succeeded", "reused", "failed"})
LOG_LIMIT = 64_000  # characters of a log or traceback kept in SQL


class NotFound(LookupError):
    """The named model, version, alias, job or artifact does not exist."""


class InvalidRequest(ValueError):
    """A request that is well-formed but cannot be served; the message says why."""


def _now() -> datetime:
    return datetime.now(timezone.utc)


def _clip(text: str | None) -> str | None:
    if text is None or len(text) <= LOG_LIMIT:
        return text
    # Keep the end: the traceback's last frames and the error are what matter.
    return "[... clipped ...]\n" + text[-LOG_LIMIT:]


# --- targets ---------------------------------------------------------------


def choose_targets(selectors: Sequence[str], live: Sequence[Target]) -> list[Target]:
    """Turn a job's target selectors into concrete targets.

    A full target is taken as it is (its build waits in its queue until a
    worker for it starts). A partial selector (``cpu``) expands to every live
    target it matches and is an error when none does, since nothing could
    ever build it. No selectors means every live target.
    """
    if not selectors:
        if not live:
            raise InvalidRequest(
                "no compile workers are live, so no target can be chosen; "
                "start one with `farm worker compile` or name a full target"
            )
        return sorted(set(live), key=str)
    chosen: set[Target] = set()
    for text in selectors:
        try:
            chosen.add(Target.parse(text))
            continue
        except TargetError:
            pass
        try:
            sel = TargetSelector.parse(text)
        except TargetError as exc:
            raise InvalidRequest(str(exc)) from None
        hits = [t for t in live if sel.matches(t)]
        if not hits:
            known = ", ".join(str(t) for t in live) or "none"
            raise InvalidRequest(
                f"no live compile worker matches target {text!r}; live targets: {known}"
            )
        chosen.update(hits)
    return sorted(chosen, key=str)


def record_heartbeat(
    db: Database, *, worker_id: str, kind: str, queue: str, target: str | None
) -> None:
    with db.session() as s:
        row = s.get(m.WorkerHeartbeat, worker_id)
        if row is None:
            s.add(
                m.WorkerHeartbeat(
                    id=worker_id,
                    kind=kind,
                    queue=queue,
                    target=target,
                    started_at=_now(),
                    last_seen=_now(),
                )
            )
        else:
            row.last_seen = _now()
            row.queue = queue
            row.target = target


def remove_worker(db: Database, worker_id: str) -> None:
    with db.session() as s:
        s.execute(delete(m.WorkerHeartbeat).where(m.WorkerHeartbeat.id == worker_id))


def live_workers(db: Database, *, max_age_s: float) -> list[dict[str, Any]]:
    cutoff = _now() - timedelta(seconds=max_age_s)
    with db.session() as s:
        rows = s.scalars(select(m.WorkerHeartbeat).where(m.WorkerHeartbeat.last_seen >= cutoff))
        return [
            {
                "id": r.id,
                "kind": r.kind,
                "queue": r.queue,
                "target": r.target,
                "started_at": r.started_at.isoformat(),
                "last_seen": r.last_seen.isoformat(),
            }
            for r in rows
        ]


def live_targets(db: Database, *, max_age_s: float) -> list[Target]:
    return sorted(
        {
            Target.parse(w["target"])
            for w in live_workers(db, max_age_s=max_age_s)
            if w["kind"] == "compile" and w["target"]
        },
        key=str,
    )


def _worker_is_live(s: Session, worker_id: str | None, max_age_s: float) -> bool:
    if worker_id is None:
        return False
    row = s.get(m.WorkerHeartbeat, worker_id)
    if row is None:
        return False
    last = row.last_seen if row.last_seen.tzinfo else row.last_seen.replace(tzinfo=timezone.utc)
    return last >= _now() - timedelta(seconds=max_age_s)


# --- submit ----------------------------------------------------------------


def _get_or_create_version(s: Session, spec: JobSpec) -> m.ModelVersion:
    model = s.scalar(select(m.Model).where(m.Model.name == spec.name))
    if model is None:
        model = m.Model(name=spec.name)
        s.add(model)
        s.flush()
    version = s.scalar(
        select(m.ModelVersion).where(
            m.ModelVersion.model_id == model.id, m.ModelVersion.version == spec.version
        )
    )
    mj = spec.model.to_json()
    if version is None:
        version = m.ModelVersion(
            model_id=model.id,
            version=spec.version,
            entrypoint=mj["entrypoint"],
            kwargs=mj["kwargs"],
            kind=mj["kind"],
        )
        s.add(version)
        s.flush()
    elif (version.entrypoint, canonical_json(version.kwargs or {}), version.kind) != (
        mj["entrypoint"],
        canonical_json(mj["kwargs"]),
        mj["kind"],
    ):
        # A version names one model; silently rebinding it would serve two
        # different programs under one name.
        raise InvalidRequest(
            f"{spec.name}@{spec.version} already exists with entrypoint {version.entrypoint} "
            f"and kwargs {canonical_json(version.kwargs or {})}; submit a new version"
        )
    return version


def submit_job(
    db: Database, spec: JobSpec, *, targets: Sequence[Target], submitted_by: str | None = None
) -> str:
    """Record a job and one pending build per target; returns the job id.

    The caller enqueues the trace task only after this has committed, so a
    worker never sees a job id that is not in the database.
    """
    if not targets:
        raise InvalidRequest("a job needs at least one target")
    job_id = str(uuid.uuid4())
    with db.session() as s:
        version = _get_or_create_version(s, spec)
        job = m.Job(
            id=job_id,
            version_id=version.id,
            spec=spec.to_json(),
            inputs=format_inputs(spec.inputs),
            grad_mode=spec.grad_mode.value,
            options=spec.options.canonical(),
            state="queued",
            submitted_by=submitted_by,
        )
        s.add(job)
        for t in targets:
            s.add(m.Build(id=str(uuid.uuid4()), job_id=job_id, target=str(t), state="pending"))
    return job_id


def job_spec(db: Database, job_id: str) -> JobSpec:
    with db.session() as s:
        job = s.get(m.Job, job_id)
        if job is None:
            raise NotFound(f"no job {job_id}")
        return JobSpec.from_json(job.spec)


def start_trace(db: Database, job_id: str) -> JobSpec | None:
    """Mark a job as tracing; None when it is already past that (a redelivery)."""
    with db.session() as s:
        # Locked: a trace shared from an identical job (record_trace_for_identical)
        # must not race this into tracing a job it has just settled.
        job = s.get(m.Job, job_id, with_for_update=True)
        if job is None:
            raise NotFound(f"no job {job_id}")
        if job.state not in ("queued", "tracing"):
            return None
        job.state = "tracing"
        # Stamped even when it was tracing already (a redelivery): the sweep
        # re-sends a job whose trace started longer ago than any trace may run.
        job.updated_at = _now()
        return JobSpec.from_json(job.spec)


def fail_job(db: Database, job_id: str, *, error: str, log_text: str | None = None) -> None:
    with db.session() as s:
        job = s.get(m.Job, job_id)
        if job is None:
            return
        job.state = "failed"
        job.error = _clip(error)
        job.log = _clip(log_text)
        for b in job.builds:
            if b.state not in TERMINAL_BUILD_STATES:
                b.state = "failed"
                b.error = (
                    "trace failed: " + error.splitlines()[0][:500] if error else "trace failed"
                )
                b.finished_at = _now()


@dataclass(frozen=True)
class CompileDispatch:
    build_key: str
    target: str
    queue: str


def record_trace(db: Database, job_id: str, report: dict[str, Any]) -> list[CompileDispatch]:
    """Store the trace report, settle builds that need no compile, and claim the rest.

    Returns the compile tasks the caller must enqueue (after this commits):
    only those whose claim this call took, so two identical jobs in flight
    compile once.
    """
    with db.session() as s:
        job = s.get(m.Job, job_id)
        if job is None:
            raise NotFound(f"no job {job_id}")
        return _apply_trace(s, job, report)


def record_trace_for_identical(
    db: Database, job_id: str, report: dict[str, Any], *, limit: int = 1000
) -> tuple[list[str], list[CompileDispatch]]:
    """Give ``job_id``'s trace to every job still queued for the very same
    program (model entrypoint, kwargs and kind; inputs; grad mode; options).

    A fleet rollout submits the same job many times; tracing each copy costs
    a process and seconds, and gives the same fingerprint: a queued job would
    have been traced later than this trace ran anyway, so taking this result
    is what tracing it would have given. Jobs locked by a trace worker that is
    starting them are skipped (they trace themselves). Returns the jobs
    settled and the compile tasks to enqueue after the commit.
    """
    dispatch: list[CompileDispatch] = []
    settled: list[str] = []
    with db.session() as s:
        job = s.get(m.Job, job_id)
        if job is None:
            raise NotFound(f"no job {job_id}")
        model = JobSpec.from_json(job.spec).model
        siblings = s.scalars(
            select(m.Job)
            .where(
                m.Job.state == "queued",
                m.Job.id != job_id,
                m.Job.inputs == job.inputs,
                m.Job.grad_mode == job.grad_mode,
                m.Job.options == job.options,
            )
            .order_by(m.Job.created_at)
            .limit(limit)
            .with_for_update(skip_locked=True)
        ).all()
        for sib in siblings:
            if JobSpec.from_json(sib.spec).model != model:
                continue
            dispatch += _apply_trace(s, sib, {**report, "trace_shared_from": job_id})
            settled.append(sib.id)
    return settled, dispatch


def _apply_trace(s: Session, job: m.Job, report: dict[str, Any]) -> list[CompileDispatch]:
    fingerprint = str(report["fingerprint"])
    dispatch: list[CompileDispatch] = []
    spec = JobSpec.from_json(job.spec)
    job.fingerprint = fingerprint
    job.param_count = report.get("param_count")
    job.param_bytes = report.get("param_bytes")
    job.flops = report.get("flops")
    job.trace_s = report.get("trace_s")
    job.log = _clip(canonical_json({k: v for k, v in report.items() if k != "fingerprint"}))
    job.state = "compiling"
    for b in job.builds:
        if b.state in TERMINAL_BUILD_STATES:
            continue
        key = build_key(
            fingerprint=fingerprint,
            inputs=spec.inputs,
            grad_mode=spec.grad_mode,
            options=spec.options,
            target=b.target,
        )
        b.build_key = key
        arts = s.scalars(select(m.Artifact).where(m.Artifact.build_key == key)).all()
        if arts:
            _link_version(s, job.version_id, arts)
            b.state = "reused"
            b.finished_at = _now()
            _copy_metrics(b, arts)
            continue
        b.state = "queued"
        b.queued_at = _now()
        if _take_claim(s, key, b.target):
            dispatch.append(CompileDispatch(key, b.target, Target.parse(b.target).queue))
    _settle_job(job)
    return dispatch


def _take_claim(s: Session, key: str, target: str) -> bool:
    """Insert (or re-open a failed) claim; True when this transaction owns it."""
    try:
        with s.begin_nested():
            s.add(m.CompileClaim(build_key=key, target=target, state="queued"))
            s.flush()
        return True
    except IntegrityError:
        pass
    res = s.execute(
        update(m.CompileClaim)
        .where(m.CompileClaim.build_key == key, m.CompileClaim.state == "failed")
        .values(state="queued", worker=None, updated_at=_now())
    )
    return bool(res.rowcount)  # type: ignore[attr-defined]


def requeue_stale_claims(
    db: Database, *, max_age_s: float, queued_max_age_s: float = 900.0
) -> list[CompileDispatch]:
    """Claims running on a worker that stopped heartbeating (killed, or its
    host cut off), and claims queued for so long that their message was
    probably never sent (a crash between commit and enqueue). For a periodic
    sweep; returns what must be enqueued again. A duplicate message is
    harmless: ``begin_compile`` lets only one run."""
    out: list[CompileDispatch] = []
    now = _now()
    with db.session() as s:
        for c in s.scalars(
            select(m.CompileClaim).where(
                m.CompileClaim.state.in_(("queued", "running")),
                m.CompileClaim.updated_at < now - timedelta(seconds=max_age_s),
            )
        ):
            updated = (
                c.updated_at if c.updated_at.tzinfo else c.updated_at.replace(tzinfo=timezone.utc)
            )
            if c.state == "running" and _worker_is_live(s, c.worker, max_age_s):
                continue
            if c.state == "queued" and updated > now - timedelta(seconds=queued_max_age_s):
                continue
            c.state = "queued"
            c.updated_at = _now()
            out.append(CompileDispatch(c.build_key, c.target, Target.parse(c.target).queue))
    return out


def requeue_stale_jobs(
    db: Database, *, max_age_s: float = 900.0, tracing_max_age_s: float | None = None
) -> list[str]:
    """Jobs still queued long after submission: their trace message was
    probably never sent (the broker was down when the API committed them, or
    lost it in a restart). With ``tracing_max_age_s`` (longer than any trace
    may run: the trace time limit and a margin), also jobs whose trace started
    that long ago and never ended: their trace worker died (``kill -9``, its
    host cut off) and the broker may not hand the message out again for a
    long time (Redis: its visibility timeout). For the periodic sweep; a
    duplicate trace is harmless, since dispatch goes through compile claims."""
    now = _now()
    stale = (m.Job.state == "queued") & (m.Job.updated_at < now - timedelta(seconds=max_age_s))
    if tracing_max_age_s is not None:
        stale = stale | (
            (m.Job.state == "tracing")
            & (m.Job.updated_at < now - timedelta(seconds=tracing_max_age_s))
        )
    with db.session() as s:
        jobs = s.scalars(select(m.Job).where(stale).limit(1000)).all()
        for job in jobs:
            job.updated_at = _now()  # one re-send per period, not one per sweep
        return [j.id for j in jobs]


# --- compile ---------------------------------------------------------------


@dataclass(frozen=True)
class ClaimDecision:
    action: str  # "run" | "done" | "busy"
    spec: JobSpec | None = None
    fingerprint: str | None = None


def begin_compile(
    db: Database, key: str, *, worker_id: str, heartbeat_max_age_s: float
) -> ClaimDecision:
    """Decide what a delivered compile task does.

    "done": the artifact exists or no build waits for it (finish quietly).
    "busy": another live worker is compiling it (a redelivery while the owner
    is alive; the task retries later rather than dropping the message).
    "run": this worker now owns the claim.
    """
    with db.session() as s:
        claim = s.get(m.CompileClaim, key, with_for_update=True)
        if claim is None:
            return ClaimDecision("done")
        if s.scalar(
            select(func.count()).select_from(m.Artifact).where(m.Artifact.build_key == key)
        ):
            _finish_builds_from_artifacts(s, key)
            claim.state = "succeeded"
            return ClaimDecision("done")
        if claim.state in ("succeeded", "failed"):
            return ClaimDecision("done")
        if (
            claim.state == "running"
            and claim.worker != worker_id
            and _worker_is_live(s, claim.worker, heartbeat_max_age_s)
        ):
            return ClaimDecision("busy")
        build = s.scalar(
            select(m.Build)
            .where(m.Build.build_key == key, m.Build.state.in_(("queued", "running")))
            .order_by(m.Build.queued_at)
        )
        if build is None:
            claim.state = "failed"
            return ClaimDecision("done")
        claim.state = "running"
        claim.worker = worker_id
        claim.attempts += 1
        claim.updated_at = _now()
        for b in s.scalars(
            select(m.Build).where(
                m.Build.build_key == key, m.Build.state.in_(("queued", "running"))
            )
        ):
            b.state = "running"
            b.worker = worker_id
            b.started_at = _now()
            b.attempts += 1
        job = build.job
        return ClaimDecision("run", JobSpec.from_json(job.spec), job.fingerprint)


@dataclass(frozen=True)
class NewArtifact:
    digest: str
    size: int
    format: str
    verified: bool
    first_call_compiles: bool
    max_abs_err: float | None
    first_call_s: float | None
    load_s: float | None
    meta: dict[str, Any]


def finish_compile(
    db: Database,
    key: str,
    *,
    target: Target,
    spec: JobSpec,
    fingerprint: str,
    artifacts: Sequence[NewArtifact],
    compile_s: float,
    log_text: str | None = None,
) -> list[ArtifactRecord]:
    """Commit artifact rows (their blobs are already stored) and finish every
    build waiting on this key. Idempotent: a redelivered task that finds the
    rows already there only finishes the builds."""
    with db.session() as s:
        for a in artifacts:
            exists = s.scalar(
                select(m.Artifact).where(m.Artifact.build_key == key, m.Artifact.format == a.format)
            )
            if exists is not None:
                continue
            s.add(
                m.Artifact(
                    digest=a.digest,
                    size=a.size,
                    format=a.format,
                    build_key=key,
                    fingerprint=fingerprint,
                    inputs=format_inputs(spec.inputs),
                    grad_mode=spec.grad_mode.value,
                    options=spec.options.canonical(),
                    target=str(target),
                    device=target.device,
                    gpu_name=target.gpu_name,
                    capability=target.capability,
                    torch_version=target.torch_version,
                    triton_version=target.triton_version,
                    python_version=target.python_version,
                    cuda_version=target.cuda_version,
                    cpu_isa=target.cpu_isa,
                    threads=target.threads,
                    verified=a.verified,
                    first_call_compiles=a.first_call_compiles,
                    max_abs_err=a.max_abs_err,
                    first_call_s=a.first_call_s,
                    load_s=a.load_s,
                    meta=a.meta,
                )
            )
        s.flush()
        claim = s.get(m.CompileClaim, key)
        if claim is not None:
            claim.state = "succeeded"
        _finish_builds_from_artifacts(s, key, compile_s=compile_s, log_text=log_text)
        rows = s.scalars(select(m.Artifact).where(m.Artifact.build_key == key)).all()
        return [artifact_to_record(r) for r in rows]


def _finish_builds_from_artifacts(
    s: Session, key: str, *, compile_s: float | None = None, log_text: str | None = None
) -> None:
    arts = s.scalars(select(m.Artifact).where(m.Artifact.build_key == key)).all()
    jobs: set[str] = set()
    for b in s.scalars(select(m.Build).where(m.Build.build_key == key)):
        if b.state in TERMINAL_BUILD_STATES:
            continue
        b.state = "succeeded"
        b.finished_at = _now()
        b.compile_s = compile_s
        b.log = _clip(log_text)
        _copy_metrics(b, arts)
        _link_version(s, b.job.version_id, arts)
        jobs.add(b.job_id)
    s.flush()
    for job_id in jobs:
        job = s.get(m.Job, job_id)
        if job is not None:
            _settle_job(job)


def release_claim(db: Database, key: str, *, worker_id: str) -> bool:
    """Give back a claim this worker holds but will not finish now (its task
    failed with an infrastructure error and will be retried): whichever
    worker the retry reaches may run it. Left running, it would read as
    "busy" to every other worker for as long as this one stays alive."""
    with db.session() as s:
        res = s.execute(
            update(m.CompileClaim)
            .where(
                m.CompileClaim.build_key == key,
                m.CompileClaim.state == "running",
                m.CompileClaim.worker == worker_id,
            )
            .values(state="queued", worker=None, updated_at=_now())
        )
        if not res.rowcount:  # type: ignore[attr-defined]
            return False
        s.execute(
            update(m.Build)
            .where(m.Build.build_key == key, m.Build.state == "running")
            .values(state="queued", worker=None)
        )
        return True


def fail_compile(db: Database, key: str, *, error: str, log_text: str | None = None) -> None:
    with db.session() as s:
        claim = s.get(m.CompileClaim, key)
        if claim is not None:
            claim.state = "failed"
        jobs = set()
        for b in s.scalars(select(m.Build).where(m.Build.build_key == key)):
            if b.state in TERMINAL_BUILD_STATES:
                continue
            b.state = "failed"
            b.error = _clip(error)
            b.log = _clip(log_text)
            b.finished_at = _now()
            jobs.add(b.job_id)
        s.flush()
        for job_id in jobs:
            job = s.get(m.Job, job_id)
            if job is not None:
                _settle_job(job)


def _copy_metrics(b: m.Build, arts: Sequence[m.Artifact]) -> None:
    if not arts:
        return
    main = sorted(arts, key=lambda a: a.format)[0]
    b.artifact_bytes = sum(a.size for a in arts)
    b.verified = all(a.verified for a in arts)
    b.max_abs_err = max((a.max_abs_err or 0.0) for a in arts)
    b.first_call_s = main.first_call_s
    b.first_call_compiles = any(a.first_call_compiles for a in arts)


def _link_version(s: Session, version_id: int, arts: Iterable[m.Artifact]) -> None:
    for a in arts:
        exists = s.scalar(
            select(m.VersionArtifact).where(
                m.VersionArtifact.version_id == version_id, m.VersionArtifact.artifact_id == a.id
            )
        )
        if exists is None:
            s.add(m.VersionArtifact(version_id=version_id, artifact_id=a.id))


def _settle_job(job: m.Job) -> None:
    states = [b.state for b in job.builds]
    if (
        job.state in ("failed",)
        or not states
        or any(st not in TERMINAL_BUILD_STATES for st in states)
    ):
        return
    ok = [st in ("succeeded", "reused") for st in states]
    job.state = "succeeded" if all(ok) else ("failed" if not any(ok) else "partial")


# --- reads -----------------------------------------------------------------


def _iso(d: datetime | None) -> str | None:
    return d.isoformat() if d else None


def job_view(db: Database, job_id: str) -> dict[str, Any]:
    with db.session() as s:
        job = s.get(m.Job, job_id)
        if job is None:
            raise NotFound(f"no job {job_id}")
        version = s.get(m.ModelVersion, job.version_id)
        assert version is not None
        builds = []
        for b in job.builds:
            arts = []
            if b.build_key:
                arts = [
                    artifact_to_record(a).to_json()
                    for a in s.scalars(
                        select(m.Artifact).where(m.Artifact.build_key == b.build_key)
                    )
                ]
            builds.append(
                {
                    "id": b.id,
                    "target": b.target,
                    "build_key": b.build_key,
                    "state": b.state,
                    "attempts": b.attempts,
                    "worker": b.worker,
                    "queued_at": _iso(b.queued_at),
                    "started_at": _iso(b.started_at),
                    "finished_at": _iso(b.finished_at),
                    "compile_s": b.compile_s,
                    "artifact_bytes": b.artifact_bytes,
                    "verified": b.verified,
                    "max_abs_err": b.max_abs_err,
                    "first_call_s": b.first_call_s,
                    "first_call_compiles": b.first_call_compiles,
                    "error": b.error,
                    "log": b.log,
                    "artifacts": arts,
                }
            )
        return {
            "id": job.id,
            "model": version.model.name,
            "version": version.version,
            "state": job.state,
            "spec": job.spec,
            "fingerprint": job.fingerprint,
            "param_count": job.param_count,
            "param_bytes": job.param_bytes,
            "flops": job.flops,
            "trace_s": job.trace_s,
            "error": job.error,
            "log": job.log,
            "submitted_by": job.submitted_by,
            "created_at": _iso(job.created_at),
            "updated_at": _iso(job.updated_at),
            "builds": builds,
        }


def _version_row(s: Session, name: str, ref: str | None) -> m.ModelVersion:
    model = s.scalar(select(m.Model).where(m.Model.name == name))
    if model is None:
        raise NotFound(f"no model {name!r}")
    if ref is None:
        alias = s.scalar(
            select(m.Alias).where(m.Alias.model_id == model.id, m.Alias.name == "latest")
        )
        if alias is not None:
            v = s.get(m.ModelVersion, alias.version_id)
            assert v is not None
            return v
        v = s.scalar(
            select(m.ModelVersion)
            .where(m.ModelVersion.model_id == model.id)
            .order_by(m.ModelVersion.created_at.desc(), m.ModelVersion.id.desc())
        )
        if v is None:
            raise NotFound(f"model {name!r} has no versions")
        return v
    v = s.scalar(
        select(m.ModelVersion).where(
            m.ModelVersion.model_id == model.id, m.ModelVersion.version == ref
        )
    )
    if v is not None:
        return v
    alias = s.scalar(select(m.Alias).where(m.Alias.model_id == model.id, m.Alias.name == ref))
    if alias is not None:
        v = s.get(m.ModelVersion, alias.version_id)
        assert v is not None
        return v
    raise NotFound(f"model {name!r} has no version or alias {ref!r}")


def version_candidates(
    db: Database, name: str, ref: str | None
) -> tuple[str, list[ArtifactRecord]]:
    """The artifacts that serve (name, version-or-alias); ``ref`` None means the
    ``latest`` alias or else the newest version."""
    with db.session() as s:
        v = _version_row(s, name, ref)
        rows = s.scalars(
            select(m.Artifact)
            .join(m.VersionArtifact, m.VersionArtifact.artifact_id == m.Artifact.id)
            .where(m.VersionArtifact.version_id == v.id)
        ).all()
        return v.version, [artifact_to_record(r) for r in rows]


def set_alias(db: Database, name: str, alias: str, version: str) -> None:
    with db.session() as s:
        model = s.scalar(select(m.Model).where(m.Model.name == name))
        if model is None:
            raise NotFound(f"no model {name!r}")
        v = s.scalar(
            select(m.ModelVersion).where(
                m.ModelVersion.model_id == model.id, m.ModelVersion.version == version
            )
        )
        if v is None:
            raise NotFound(f"model {name!r} has no version {version!r}")
        row = s.scalar(select(m.Alias).where(m.Alias.model_id == model.id, m.Alias.name == alias))
        if row is None:
            s.add(m.Alias(model_id=model.id, name=alias, version_id=v.id))
        else:
            row.version_id = v.id


def list_models(db: Database) -> list[dict[str, Any]]:
    with db.session() as s:
        out = []
        for model in s.scalars(select(m.Model).order_by(m.Model.name)):
            versions = s.scalars(
                select(m.ModelVersion)
                .where(m.ModelVersion.model_id == model.id)
                .order_by(m.ModelVersion.created_at, m.ModelVersion.id)
            ).all()
            by_id = {v.id: v.version for v in versions}
            aliases = {
                a.name: by_id.get(a.version_id)
                for a in s.scalars(select(m.Alias).where(m.Alias.model_id == model.id))
            }
            vs = []
            for v in versions:
                n = s.scalar(
                    select(func.count())
                    .select_from(m.VersionArtifact)
                    .where(m.VersionArtifact.version_id == v.id)
                )
                vs.append(
                    {
                        "version": v.version,
                        "entrypoint": v.entrypoint,
                        "kwargs": v.kwargs,
                        "kind": v.kind,
                        "artifacts": n,
                        "created_at": _iso(v.created_at),
                    }
                )
            out.append({"name": model.name, "versions": vs, "aliases": aliases})
        return out


def get_artifact(db: Database, digest: str) -> ArtifactRecord:
    with db.session() as s:
        row = s.scalar(
            select(m.Artifact).where(m.Artifact.digest == digest).order_by(m.Artifact.id)
        )
        if row is None:
            raise NotFound(f"no artifact {digest}")
        return artifact_to_record(row)


def set_signature(db: Database, artifact_id: int, signature: str) -> None:
    with db.session() as s:
        row = s.get(m.Artifact, artifact_id)
        if row is not None and row.signature is None:
            row.signature = signature


def record_miss(
    db: Database,
    *,
    model: str,
    version: str | None,
    inputs: Sequence[TensorSpec],
    grad_mode: GradMode,
    target: Target,
    reasons: list[Any],
) -> None:
    with db.session() as s:
        s.add(
            m.ResolveMiss(
                model=model,
                version=version,
                inputs=format_inputs(inputs),
                grad_mode=grad_mode.value,
                target=str(target),
                reasons=reasons,
            )
        )


def counts(db: Database) -> dict[str, Any]:
    """For metrics: jobs and builds by state, artifacts, misses."""
    with db.session() as s:
        jobs = dict(s.execute(select(m.Job.state, func.count()).group_by(m.Job.state)).all())
        builds = dict(s.execute(select(m.Build.state, func.count()).group_by(m.Build.state)).all())
        artifacts = s.scalar(select(func.count()).select_from(m.Artifact)) or 0
        misses = s.scalar(select(func.count()).select_from(m.ResolveMiss)) or 0
        compile_s = s.scalar(select(func.coalesce(func.sum(m.Build.compile_s), 0.0))) or 0.0
        return {
            "jobs": jobs,
            "builds": builds,
            "artifacts": artifacts,
            "misses": misses,
            "compile_seconds": float(compile_s),
        }


__all__ = [
    "ClaimDecision",
    "CompileDispatch",
    "CompileOptions",
    "InvalidRequest",
    "NewArtifact",
    "NotFound",
    "SpecError",
    "begin_compile",
    "choose_targets",
    "fail_compile",
    "fail_job",
    "finish_compile",
    "job_view",
    "live_targets",
    "record_trace",
    "start_trace",
    "submit_job",
]
