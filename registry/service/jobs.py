"""Submission and the trace stage: versions, jobs, shared traces, compile claims and
the sweeps that re-send work whose worker died."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta, timezone
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from farm.core.inputs import format_inputs
from farm.core.specs import JobSpec, build_key, canonical_json
from farm.core.target import Target
from registry import models as m
from registry.db import Database
from registry.models import DEFAULT_PROJECT
from registry.service.builds import _copy_metrics, _link_version, _settle_job
from registry.service.common import (
    TERMINAL_BUILD_STATES,
    Clash,
    InvalidRequest,
    NotFound,
    _clip,
    _now,
)
from registry.service.fleet import _worker_is_live
from registry.service.formats import missing_formats
from registry.service.projects import ensure_project

log = logging.getLogger(__name__)


def _binding(spec: JobSpec) -> tuple[str, str, str, str | None]:
    mj = spec.model.to_json()
    return (mj["entrypoint"], canonical_json(mj["kwargs"]), mj["kind"], spec.code_digest)


def _version_binding(v: m.ModelVersion) -> tuple[str, str, str, str | None]:
    return (v.entrypoint, canonical_json(v.kwargs or {}), v.kind, v.code_digest)


def _rebind_blocker(s: Session, version: m.ModelVersion) -> str | None:
    """Why ``version`` cannot be bound to another program (None: it can).

    A version names one program once anything was built for it; until then
    (every build of every job failed: a typo'd entrypoint, a bad kwarg, code
    that does not trace) the fix may take the same name@version."""
    linked = s.scalar(select(m.VersionArtifact.id)
                      .where(m.VersionArtifact.version_id == version.id).limit(1))
    if linked is not None:
        return "it has artifacts"
    jobs = s.scalars(select(m.Job).where(m.Job.version_id == version.id)).all()
    busy = [j.id for j in jobs if j.state in ("queued", "tracing", "compiling")]
    if busy:
        return f"job {busy[0][:8]} still builds it"
    if any(b.state in ("succeeded", "reused") for j in jobs for b in j.builds):
        return "one of its builds succeeded"
    return None


def version_rebind_blocker(db: Database, name: str, version: str) -> str | None:
    """Why ``name@version`` cannot take another program (None: it can, being
    new or having no build that did not fail). For the name binding check of
    the API, which must agree with the database on this."""
    with db.session() as s:
        v = s.scalar(select(m.ModelVersion).join(m.Model).where(
            m.Model.name == name, m.ModelVersion.version == version))
        return None if v is None else _rebind_blocker(s, v)


def _get_or_create_version(s: Session, spec: JobSpec,
                           project: str | None = None) -> m.ModelVersion:
    model = s.scalar(select(m.Model).where(m.Model.name == spec.name))
    if model is None:
        ensure_project(s, project or DEFAULT_PROJECT)
        model = m.Model(name=spec.name, project=project or DEFAULT_PROJECT)
        s.add(model)
        s.flush()
    elif project is not None and model.project != project:
        raise Clash(f"model {spec.name!r} belongs to project {model.project!r}, not "
                    f"{project!r}: a model name is the farm's, one project's; pick another "
                    "name for your model")
    version = s.scalar(
        select(m.ModelVersion).where(
            m.ModelVersion.model_id == model.id, m.ModelVersion.version == spec.version
        ).with_for_update()
    )
    mj = spec.model.to_json()
    if version is None and s.scalar(select(m.Alias.id).where(m.Alias.model_id == model.id,
                                                             m.Alias.name == spec.version)):
        # A ref names a version before an alias: this version would take over
        # every node that asks for the alias, without the alias moving.
        raise Clash(f"version {spec.version!r} is also an alias of {spec.name!r}: a version "
                    "named like an alias would shadow it (nodes asking for "
                    f"{spec.name}@{spec.version} would get this build); pick another version "
                    "name")
    if version is None:
        version = m.ModelVersion(
            model_id=model.id,
            version=spec.version,
            entrypoint=mj["entrypoint"],
            kwargs=mj["kwargs"],
            kind=mj["kind"],
            code_digest=spec.code_digest,
        )
        s.add(version)
        s.flush()
    elif _version_binding(version) != _binding(spec):
        blocker = _rebind_blocker(s, version)
        if blocker is not None:
            # A version names one program; silently rebinding it would serve
            # two different programs under one name.
            code = f" and code {version.code_digest[:12]}" if version.code_digest else ""
            raise InvalidRequest(
                f"{spec.name}@{spec.version} already exists with entrypoint "
                f"{version.entrypoint}, kwargs {canonical_json(version.kwargs or {})}{code}, "
                f"and {blocker}; submit a new version")
        log.info("%s@%s rebound from %s to %s: every earlier build of it failed", spec.name,
                 spec.version, version.entrypoint, mj["entrypoint"])
        version.entrypoint = mj["entrypoint"]
        version.kwargs = mj["kwargs"]
        version.kind = mj["kind"]
        version.code_digest = spec.code_digest
    return version


def submit_job(
    db: Database, spec: JobSpec, *, targets: Sequence[Target], submitted_by: str | None = None,
    project: str | None = None, rebuild: bool = False,
) -> str:
    """Record a job and one pending build per target; returns the job id.

    The caller enqueues the trace task only after this has committed, so a
    worker never sees a job id that is not in the database. ``rebuild``:
    compile even where the build's artifacts exist, and replace them.
    """
    if not targets:
        raise InvalidRequest("a job needs at least one target")
    job_id = str(uuid.uuid4())
    with db.session() as s:
        version = _get_or_create_version(s, spec, project)
        job = m.Job(
            id=job_id,
            version_id=version.id,
            spec=spec.to_json(),
            inputs=format_inputs(spec.inputs),
            grad_mode=spec.grad_mode.value,
            options=spec.options.canonical(),
            code_digest=spec.code_digest,
            state="queued",
            submitted_by=submitted_by,
            rebuild=rebuild,
        )
        s.add(job)
        for t in targets:
            s.add(m.Build(id=str(uuid.uuid4()), job_id=job_id, target=str(t), state="pending",
                          code_digest=spec.code_digest))
    return job_id


def job_spec(db: Database, job_id: str) -> JobSpec:
    with db.session() as s:
        job = s.get(m.Job, job_id)
        if job is None:
            raise NotFound(f"no job {job_id}")
        return JobSpec.from_json(job.spec)


def start_trace(db: Database, job_id: str, *, worker_id: str | None = None) -> JobSpec | None:
    """Mark a job as tracing (by ``worker_id``, whose heartbeat the sweep
    watches); None when it is already past that (a redelivery)."""
    with db.session() as s:
        # Locked: a trace shared from an identical job (record_trace_for_identical)
        # must not race this into tracing a job it has just settled.
        job = s.get(m.Job, job_id, with_for_update=True)
        if job is None:
            raise NotFound(f"no job {job_id}")
        if job.state not in ("queued", "tracing"):
            return None
        job.state = "tracing"
        job.trace_worker = worker_id
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
    program (model entrypoint, kwargs and kind; code pack; inputs; grad mode;
    options).

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
        mine = JobSpec.from_json(job.spec)
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
            other = JobSpec.from_json(sib.spec)
            # The same program: the same model ref and the same code pack.
            if (other.model, other.code_digest) != (mine.model, mine.code_digest):
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
    job.repeated_blocks = int(report.get("regions") or 0)
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
            project=spec.project,
        )
        b.build_key = key
        arts = s.scalars(select(m.Artifact).where(m.Artifact.build_key == key)).all()
        if arts and not job.rebuild and not missing_formats(arts):
            _link_version(s, job.version_id, arts)
            b.state = "reused"
            b.finished_at = _now()
            _copy_metrics(b, arts)
            continue
        # No artifact yet; or a format of the build was deleted (the compile
        # adds it beside the ones kept); or `--rebuild` (the compile replaces
        # them): a finished claim is opened again for those two.
        b.state = "queued"
        b.queued_at = _now()
        if _take_claim(s, key, b.target, reopen=bool(arts)):
            dispatch.append(CompileDispatch(key, b.target, Target.parse(b.target).queue))
    _settle_job(job)
    return dispatch


def _take_claim(s: Session, key: str, target: str, *, reopen: bool = False) -> bool:
    """Insert (or re-open a failed) claim; True when this transaction owns it.
    ``reopen``: a succeeded claim is opened again too (a rebuild)."""
    try:
        with s.begin_nested():
            s.add(m.CompileClaim(build_key=key, target=target, state="queued"))
            s.flush()
        return True
    except IntegrityError:
        pass
    done = ("failed", "succeeded") if reopen else ("failed",)
    res = s.execute(
        update(m.CompileClaim)
        .where(m.CompileClaim.build_key == key, m.CompileClaim.state.in_(done))
        .values(state="queued", worker=None, updated_at=_now())
    )
    return bool(res.rowcount)  # type: ignore[attr-defined]


def requeue_stale_claims(
    db: Database, *, max_age_s: float, queued_max_age_s: float = 900.0,
    still_queued: Callable[[str, str], bool] | None = None,
) -> list[CompileDispatch]:
    """Claims running on a worker that stopped heartbeating (killed, or its
    host cut off), and claims queued for so long that their message was
    probably never sent (a crash between commit and enqueue). For a periodic
    sweep; returns what must be enqueued again. A duplicate message is
    harmless: ``begin_compile`` lets only one run. ``still_queued(queue,
    build_key)``, when given, says whether the broker still holds a queued
    claim's message: such a claim merely waits and is not sent again (its
    stamp moves, so it is asked about once per ``queued_max_age_s``)."""
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
            queue = Target.parse(c.target).queue
            lost = not (c.state == "queued" and still_queued is not None
                        and still_queued(queue, c.build_key))
            c.state = "queued"
            c.updated_at = _now()
            if lost:
                out.append(CompileDispatch(c.build_key, c.target, queue))
    return out


def requeue_stale_jobs(
    db: Database, *, max_age_s: float = 900.0, tracing_max_age_s: float | None = None,
    heartbeat_max_age_s: float | None = None,
    still_queued: Callable[[str], bool] | None = None,
) -> list[str]:
    """Jobs still queued long after submission: their trace message was
    probably never sent (the broker was down when the API committed them, or
    lost it in a restart). With ``heartbeat_max_age_s``, also jobs tracing on
    a worker whose heartbeat is older than that: it died (``kill -9``, its host
    cut off) and the broker may not hand the message out again for a long time
    (Redis: its visibility timeout). With ``tracing_max_age_s`` (longer than
    any trace may run: the trace time limit and a margin), jobs whose trace
    started that long ago and never ended, whoever traces them: the one way
    to see a lost trace whose worker was never recorded. For the periodic
    sweep; a duplicate trace is harmless, since dispatch goes through compile
    claims. ``still_queued(job_id)``, when given, says whether the broker
    still holds a queued job's trace message: that job is not sent again."""
    now = _now()
    stale = (m.Job.state == "queued") & (m.Job.updated_at < now - timedelta(seconds=max_age_s))
    if tracing_max_age_s is not None:
        stale = stale | (
            (m.Job.state == "tracing")
            & (m.Job.updated_at < now - timedelta(seconds=tracing_max_age_s))
        )
    with db.session() as s:
        jobs = list(s.scalars(select(m.Job).where(stale).limit(1000)).all())
        if heartbeat_max_age_s is not None:
            # A trace younger than one heartbeat age may have a worker whose
            # first beat has not landed yet: left alone until it is older.
            tracing = s.scalars(select(m.Job).where(
                (m.Job.state == "tracing") & m.Job.trace_worker.is_not(None)
                & (m.Job.updated_at < now - timedelta(seconds=heartbeat_max_age_s))
            ).limit(1000)).all()
            seen = {j.id for j in jobs}
            jobs += [j for j in tracing if j.id not in seen
                     and not _worker_is_live(s, j.trace_worker, heartbeat_max_age_s)]
        out = []
        for job in jobs:
            job.updated_at = _now()  # one re-send (or look) per period, not one per sweep
            if not (job.state == "queued" and still_queued is not None and still_queued(job.id)):
                out.append(job.id)
        return out
