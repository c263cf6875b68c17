"""The compile stage: claims begun, artifacts recorded, builds settled."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from farm.core.inputs import format_inputs
from farm.core.specs import JobSpec
from farm.core.target import Target
from registry import models as m
from registry.db import Database
from registry.service.common import TERMINAL_BUILD_STATES, _clip, _now
from registry.service.fleet import _worker_is_live
from registry.service.formats import missing_formats

log = logging.getLogger(__name__)


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
        arts = s.scalars(select(m.Artifact).where(m.Artifact.build_key == key)).all()
        if arts and not (_rebuild_asked(s, key) or missing_formats(arts)):
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


def _rebuild_asked(s: Session, key: str) -> bool:
    """Whether a build waiting on ``key`` belongs to a ``--rebuild`` job."""
    return bool(
        s.scalar(
            select(func.count())
            .select_from(m.Build)
            .join(m.Job)
            .where(
                m.Build.build_key == key,
                m.Build.state.in_(("queued", "running")),
                m.Job.rebuild.is_(True),
            )
        )
    )


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
    # The build statement the worker signed (DSSE envelope JSON).
    attestation: str | None = None


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
    timings: dict[str, Any] | None = None,
) -> list[str]:
    """Commit artifact rows (their blobs are already stored) and finish every
    build waiting on this key. Idempotent: a redelivered task that finds the
    rows already there only finishes the builds. A format that has a row
    keeps it, unless a ``--rebuild`` job waits on the key: then the new
    artifact takes the row's place (its id, so the versions it serves keep
    it). Returns the digests of blobs no row names (one replaced, or one
    stored for a format whose row was kept), for the caller to remove from
    the store after the commit."""
    dropped: set[str] = set()
    with db.session() as s:
        rebuild = _rebuild_asked(s, key)
        for a in artifacts:
            exists = s.scalar(
                select(m.Artifact).where(m.Artifact.build_key == key, m.Artifact.format == a.format)
            )
            if exists is not None and exists.digest != a.digest:
                dropped.add(exists.digest if rebuild else a.digest)
            if exists is not None and rebuild:
                # Its statement and measurements are this build's, even
                # where the bytes came out the same.
                _replace(exists, a)
            elif exists is not None:
                # Kept, but what this compile found about the other formats
                # (the one it was to add failed, say) is recorded on it: else
                # every resubmission would take that format for deleted.
                exists.meta = _with_format_news(exists.meta or {}, a.meta)
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
                    attestation=a.attestation,
                )
            )
        s.flush()
        claim = s.get(m.CompileClaim, key)
        if claim is not None:
            claim.state = "succeeded"
        _finish_builds_from_artifacts(
            s, key, compile_s=compile_s, log_text=log_text, timings=timings
        )
        s.flush()
        named = set(s.scalars(select(m.Artifact.digest).where(m.Artifact.digest.in_(dropped))))
        return sorted(dropped - named)


def _with_format_news(kept: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """``kept`` (an artifact row's meta) with the formats a later compile of
    its build key failed or skipped added (a new dict: the column is JSON)."""
    out = dict(kept)
    for field in ("formats_failed", "formats_skipped"):
        if new.get(field):
            out[field] = {**(out.get(field) or {}), **new[field]}
    return out


def _replace(row: m.Artifact, new: NewArtifact) -> None:
    """The row now describes ``new``: a rebuild's artifact of the same build
    key, format and target (so every column derived from those stays)."""
    row.digest, row.size = new.digest, new.size
    row.verified, row.first_call_compiles = new.verified, new.first_call_compiles
    row.max_abs_err, row.first_call_s, row.load_s = new.max_abs_err, new.first_call_s, new.load_s
    row.meta, row.attestation = new.meta, new.attestation
    row.created_at = _now()


def _finish_builds_from_artifacts(
    s: Session,
    key: str,
    *,
    compile_s: float | None = None,
    log_text: str | None = None,
    timings: dict[str, Any] | None = None,
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
        b.timings = timings
        _copy_metrics(b, arts)
        _link_version(s, b.job.version_id, arts)
        jobs.add(b.job_id)
    _settle_jobs(s, jobs)


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


def fail_compile(
    db: Database,
    key: str,
    *,
    error: str,
    log_text: str | None = None,
    timings: dict[str, Any] | None = None,
) -> None:
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
            b.timings = timings
            b.finished_at = _now()
            jobs.add(b.job_id)
        _settle_jobs(s, jobs)


def _settle_jobs(s: Session, job_ids: Iterable[Any]) -> None:
    """Flush the builds' new states, then settle each job they belong to."""
    s.flush()
    for job_id in job_ids:
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
