"""Reads and small writes the API serves: job views, versions, aliases, models,
artifacts, misses and counts."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from farm.core.hints import per_block_hint
from farm.core.inputs import TensorSpec, format_inputs
from farm.core.specs import GradMode
from farm.core.target import Target
from registry import models as m
from registry.convert import artifact_to_record
from registry.db import Database
from registry.entities import ArtifactRecord
from registry.service.common import Clash, NotFound
from registry.service.lifecycle import (
    find_job_id,
    model_row,
    record_alias_event,
    unknown_ref,
    version_row,
)

log = logging.getLogger(__name__)


def _iso(d: datetime | None) -> str | None:
    return d.isoformat() if d else None


def job_view(db: Database, job_id: str) -> dict[str, Any]:
    """A job with its builds; ``job_id`` may be a unique prefix of the id."""
    with db.session() as s:
        job = s.get(m.Job, find_job_id(s, job_id))
        assert job is not None
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
            failed: dict[str, Any] = {}
            skipped: dict[str, Any] = {}
            for a in arts:
                failed.update(a.get("meta", {}).get("formats_failed") or {})
                skipped.update(a.get("meta", {}).get("formats_skipped") or {})
            builds.append(
                {
                    "id": b.id,
                    "target": b.target,
                    "build_key": b.build_key,
                    "code_digest": b.code_digest,
                    "state": b.state,
                    "stage": b.stage if b.state == "running" else None,
                    "stage_at": _iso(b.stage_at) if b.state == "running" else None,
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
                    "timings": b.timings,
                    # A format that was to be built and was not ({format:
                    # {"stage": compile|verify, "reason"}}), and those left out
                    # by design or by this host ({format: reason}): a succeeded
                    # build with one failed format is not a plain success.
                    "formats_failed": failed,
                    "formats_skipped": skipped,
                    "artifacts": arts,
                }
            )
        repeated = job.repeated_blocks or 0
        return {
            "id": job.id,
            "model": version.model.name,
            "version": version.version,
            "state": job.state,
            "spec": job.spec,
            "fingerprint": job.fingerprint,
            "code_digest": job.code_digest,
            "param_count": job.param_count,
            "param_bytes": job.param_bytes,
            "flops": job.flops,
            "trace_s": job.trace_s,
            # Calls of repeated blocks (transformer layers) the trace found:
            # what a per-block build compiles once per distinct block.
            "repeated_blocks": repeated,
            # What the user could do better, as lines of advice.
            "hints": [h for h in (per_block_hint(repeated, job.spec or {}),) if h],
            "error": job.error,
            "log": job.log,
            "submitted_by": job.submitted_by,
            # `farm submit --rebuild`: compiled even where artifacts existed.
            "rebuild": bool(job.rebuild),
            "created_at": _iso(job.created_at),
            "updated_at": _iso(job.updated_at),
            "builds": builds,
        }


def _version_row(s: Session, name: str, ref: str | None) -> m.ModelVersion:
    model = model_row(s, name)
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
    raise unknown_ref(s, model, ref)


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


def set_alias(db: Database, name: str, alias: str, version: str, *,
              actor: str | None = None) -> str | None:
    """Point ``alias`` at ``version``; returns the version it pointed at before
    (None for a new alias). Every move is kept (``alias_events``)."""
    with db.session() as s:
        model = model_row(s, name)
        v = version_row(s, model, version)
        if s.scalar(select(m.ModelVersion.id).where(m.ModelVersion.model_id == model.id,
                                                    m.ModelVersion.version == alias)):
            # A ref names a version before an alias: this alias could never be
            # used, and would hide what a node asking for it gets.
            raise Clash(f"alias {alias!r} is also a version of {name!r}: a version name "
                        "always wins, so the alias could never be used; pick another alias "
                        "name")
        row = s.scalar(select(m.Alias).where(m.Alias.model_id == model.id, m.Alias.name == alias))
        previous: str | None = None
        if row is None:
            s.add(m.Alias(model_id=model.id, name=alias, version_id=v.id))
        else:
            old = s.get(m.ModelVersion, row.version_id)
            previous = old.version if old is not None else None
            row.version_id = v.id
        if previous != version:
            record_alias_event(s, model=name, alias=alias, version=version, previous=previous,
                               actor=actor)
        return previous


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
            # Who bound each version: its first job's submitter.
            submitted_by: dict[int, str | None] = {}
            for vid, who in s.execute(
                    select(m.Job.version_id, m.Job.submitted_by)
                    .where(m.Job.version_id.in_(list(by_id)))
                    .order_by(m.Job.created_at, m.Job.id)):
                submitted_by.setdefault(vid, who)
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
                        "submitted_by": submitted_by.get(v.id),
                        "created_at": _iso(v.created_at),
                    }
                )
            out.append({"name": model.name, "project": model.project, "versions": vs,
                        "aliases": aliases})
        return out


def get_artifact(db: Database, digest: str) -> ArtifactRecord:
    with db.session() as s:
        row = s.scalar(
            select(m.Artifact).where(m.Artifact.digest == digest).order_by(m.Artifact.id)
        )
        if row is None:
            raise NotFound(f"no artifact {digest}")
        return artifact_to_record(row)


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


def build_stats_by_target(db: Database) -> list[dict[str, Any]]:
    """For metrics: per target and build state, how many builds and the sum
    of their compile seconds (the compile task's own duration)."""
    with db.session() as s:
        rows = s.execute(
            select(m.Build.target, m.Build.state, func.count(),
                   func.coalesce(func.sum(m.Build.compile_s), 0.0),
                   func.count(m.Build.compile_s))
            .group_by(m.Build.target, m.Build.state)).all()
    return [{"target": t, "state": st, "builds": int(n), "compile_s": float(sec or 0.0),
             "timed": int(timed)} for t, st, n, sec, timed in rows]


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

