"""What a user does to the registry after a build: list jobs, move and list
aliases (with their history), delete models, versions, aliases and artifacts,
and the stage a running build reports.

Deletes go through SQL ``DELETE`` statements, so the database's own cascades
(versions -> aliases, jobs -> builds, version links) run on PostgreSQL and
SQLite alike (SQLite with ``PRAGMA foreign_keys=ON``, see ``registry.db``).
"""

from __future__ import annotations

import difflib
import logging
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import delete, func, select
from sqlalchemy.orm import Session

from registry import models as m
from registry.db import Database
from registry.service.common import InvalidRequest, NotFound, _clip, _now

log = logging.getLogger(__name__)

JOB_STATES = ("queued", "tracing", "compiling", "succeeded", "failed", "partial")
# A job id prefix shorter than this matches too much to be a name for one job.
MIN_JOB_PREFIX = 4
STAGE_LOG_LINES = 200


def _iso(d: datetime | None) -> str | None:
    return d.isoformat() if d else None


# --- names that do not exist: say what does ---------------------------------------


def unknown_model(s: Session, name: str) -> NotFound:
    """``NotFound`` for a model name, with the nearest existing names."""
    names = list(s.scalars(select(m.Model.name)))
    close = difflib.get_close_matches(name, names, n=3, cutoff=0.6)
    if close:
        return NotFound(f"no model {name!r}; did you mean {', '.join(map(repr, close))}?")
    if not names:
        return NotFound(f"no model {name!r}: the farm has no models yet (submit one with "
                        "`farm submit`)")
    return NotFound(f"no model {name!r}; `farm models` lists the {len(names)} there are")


def model_row(s: Session, name: str) -> m.Model:
    model = s.scalar(select(m.Model).where(m.Model.name == name))
    if model is None:
        raise unknown_model(s, name)
    return model


def _version_names(s: Session, model: m.Model) -> list[str]:
    return list(s.scalars(select(m.ModelVersion.version)
                          .where(m.ModelVersion.model_id == model.id)
                          .order_by(m.ModelVersion.created_at, m.ModelVersion.id)))


def _alias_names(s: Session, model: m.Model) -> list[str]:
    return list(s.scalars(select(m.Alias.name).where(m.Alias.model_id == model.id)
                          .order_by(m.Alias.name)))


def unknown_ref(s: Session, model: m.Model, ref: str, *, what: str = "version or alias"
                ) -> NotFound:
    """``NotFound`` for a version or alias of ``model``, listing the existing ones."""
    versions = _version_names(s, model)
    aliases = _alias_names(s, model)
    close = difflib.get_close_matches(ref, versions + aliases, n=2, cutoff=0.6)
    parts = [f"model {model.name!r} has no {what} {ref!r}"]
    if close:
        parts.append(f"did you mean {', '.join(map(repr, close))}?")
    parts.append(f"versions: {', '.join(versions) or 'none'}")
    if what != "version":
        parts.append(f"aliases: {', '.join(aliases) or 'none'}")
    return NotFound("; ".join(parts))


def version_row(s: Session, model: m.Model, version: str) -> m.ModelVersion:
    v = s.scalar(select(m.ModelVersion).where(m.ModelVersion.model_id == model.id,
                                              m.ModelVersion.version == version))
    if v is None:
        raise unknown_ref(s, model, version, what="version")
    return v


# --- jobs ------------------------------------------------------------------------


def find_job_id(s: Session, job_id: str) -> str:
    """The full id of a job named by its id or a unique prefix of it (the
    8 characters the progress line shows)."""
    if s.get(m.Job, job_id) is not None:
        return job_id
    if len(job_id) >= MIN_JOB_PREFIX and all(c in "0123456789abcdef-" for c in job_id.lower()):
        hits = list(s.scalars(select(m.Job.id).where(m.Job.id.like(f"{job_id.lower()}%"))
                              .limit(6)))
        if len(hits) == 1:
            return hits[0]
        if hits:
            raise InvalidRequest(f"job id prefix {job_id!r} names {len(hits)}"
                                 f"{'+' if len(hits) > 5 else ''} jobs "
                                 f"({', '.join(h[:13] for h in hits[:5])}); give more of it")
    raise NotFound(f"no job {job_id}; `farm jobs` lists recent jobs")


def list_jobs(db: Database, *, state: str | None = None, model: str | None = None,
              limit: int = 50) -> list[dict[str, Any]]:
    """Jobs, newest first, each with its builds' states (not their logs)."""
    if state is not None and state not in JOB_STATES:
        raise InvalidRequest(f"unknown job state {state!r}; known: {', '.join(JOB_STATES)}")
    with db.session() as s:
        q = (select(m.Job, m.ModelVersion.version, m.Model.name)
             .join(m.ModelVersion, m.ModelVersion.id == m.Job.version_id)
             .join(m.Model, m.Model.id == m.ModelVersion.model_id))
        if state is not None:
            q = q.where(m.Job.state == state)
        if model is not None:
            model_row(s, model)  # an unknown name is an error, not an empty list
            q = q.where(m.Model.name == model)
        q = q.order_by(m.Job.created_at.desc(), m.Job.id.desc()).limit(max(1, min(limit, 1000)))
        out = []
        for job, version, name in s.execute(q).all():
            out.append({
                "id": job.id,
                "model": name,
                "version": version,
                "state": job.state,
                "inputs": job.inputs,
                "grad_mode": job.grad_mode,
                "submitted_by": job.submitted_by,
                "created_at": _iso(job.created_at),
                "updated_at": _iso(job.updated_at),
                "error": (job.error or "").strip().splitlines()[0][:300] if job.error else None,
                "builds": [{"target": b.target, "state": b.state,
                            "stage": b.stage if b.state == "running" else None}
                           for b in job.builds],
            })
        return out


def set_build_stage(db: Database, build_key: str, stage: str) -> None:
    """A running build says what it does now; its log gets a timestamped line,
    so ``farm status --log`` shows progress while the build runs."""
    now = _now()
    with db.session() as s:
        for b in s.scalars(select(m.Build).where(m.Build.build_key == build_key,
                                                 m.Build.state == "running")):
            b.stage = stage[:64]
            b.stage_at = now
            lines = (b.log or "").splitlines()[-(STAGE_LOG_LINES - 1):]
            lines.append(f"{now.strftime('%H:%M:%S')} {stage}")
            b.log = _clip("\n".join(lines))


# --- aliases --------------------------------------------------------------------


def record_alias_event(s: Session, *, model: str, alias: str, version: str | None,
                       previous: str | None, actor: str | None) -> None:
    project = s.scalar(select(m.Model.project).where(m.Model.name == model))
    s.add(m.AliasEvent(model=model, alias=alias, version=version, previous=previous,
                       actor=actor, project=project))


def list_aliases(db: Database, name: str, *, history: bool = True) -> dict[str, Any]:
    """The model's aliases now, and (``history``) every move of each, newest first."""
    with db.session() as s:
        model = model_row(s, name)
        by_id = {v.id: v.version for v in s.scalars(
            select(m.ModelVersion).where(m.ModelVersion.model_id == model.id))}
        now = [{"alias": a.name, "version": by_id.get(a.version_id),
                "updated_at": _iso(a.updated_at)}
               for a in s.scalars(select(m.Alias).where(m.Alias.model_id == model.id)
                                  .order_by(m.Alias.name))]
        out: dict[str, Any] = {"model": name, "project": model.project, "aliases": now}
        if history:
            out["history"] = [
                {"alias": e.alias, "version": e.version, "previous": e.previous,
                 "actor": e.actor, "project": e.project, "at": _iso(e.created_at)}
                for e in s.scalars(select(m.AliasEvent).where(m.AliasEvent.model == name)
                                   .order_by(m.AliasEvent.created_at.desc(),
                                             m.AliasEvent.id.desc()).limit(1000))]
        return out


def delete_alias(db: Database, name: str, alias: str, *, actor: str | None = None) -> str:
    """Remove an alias; returns the version it pointed at."""
    with db.session() as s:
        model = model_row(s, name)
        row = s.scalar(select(m.Alias).where(m.Alias.model_id == model.id, m.Alias.name == alias))
        if row is None:
            aliases = _alias_names(s, model)
            raise NotFound(f"model {name!r} has no alias {alias!r}; aliases: "
                           f"{', '.join(aliases) or 'none'}")
        v = s.get(m.ModelVersion, row.version_id)
        version = v.version if v is not None else "?"
        s.execute(delete(m.Alias).where(m.Alias.id == row.id))
        record_alias_event(s, model=name, alias=alias, version=None, previous=version,
                           actor=actor)
        return version


# --- deletes --------------------------------------------------------------------


@dataclass
class Deleted:
    """What a delete removed. ``blobs`` are digests no row names any more: the
    caller removes them from the blob store after the commit."""

    versions: list[str] = field(default_factory=list)
    aliases: list[str] = field(default_factory=list)
    jobs: int = 0
    artifacts: list[str] = field(default_factory=list)
    blobs: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"versions": self.versions, "aliases": self.aliases, "jobs": self.jobs,
                "artifacts": self.artifacts, "blobs": self.blobs}


def _drop_artifacts(s: Session, artifact_ids: list[int], out: Deleted) -> None:
    """Delete artifact rows and the compile claims of their build keys (else a
    later job with the same key would find a finished claim and never build),
    and note the blobs that no row names any more."""
    if not artifact_ids:
        return
    rows = s.execute(select(m.Artifact.id, m.Artifact.digest, m.Artifact.build_key)
                     .where(m.Artifact.id.in_(artifact_ids))).all()
    digests = {r.digest for r in rows}
    keys = {r.build_key for r in rows}
    s.execute(delete(m.Artifact).where(m.Artifact.id.in_(artifact_ids)))
    s.execute(delete(m.CompileClaim).where(m.CompileClaim.build_key.in_(keys)))
    still = set(s.scalars(select(m.Artifact.digest).where(m.Artifact.digest.in_(digests))))
    out.artifacts += sorted(digests)
    out.blobs += sorted(digests - still)


def _orphans_after(s: Session, version_ids: list[int]) -> list[int]:
    """Artifacts that only these versions use (none other links them)."""
    mine = set(s.scalars(select(m.VersionArtifact.artifact_id)
                         .where(m.VersionArtifact.version_id.in_(version_ids))))
    if not mine:
        return []
    shared = set(s.scalars(select(m.VersionArtifact.artifact_id).where(
        m.VersionArtifact.artifact_id.in_(mine),
        m.VersionArtifact.version_id.notin_(version_ids))))
    return sorted(mine - shared)


def _busy_jobs(s: Session, version_ids: list[int]) -> list[str]:
    return list(s.scalars(select(m.Job.id).where(
        m.Job.version_id.in_(version_ids),
        m.Job.state.in_(("queued", "tracing", "compiling")))))


def _delete_versions(s: Session, model: m.Model, versions: list[m.ModelVersion], *,
                     force: bool, actor: str | None, out: Deleted) -> None:
    ids = [v.id for v in versions]
    busy = _busy_jobs(s, ids)
    if busy and not force:
        raise InvalidRequest(
            f"{len(busy)} job(s) still build it ({', '.join(j[:8] for j in busy[:5])}); "
            "wait for them (`farm jobs --state compiling`) or delete with --force")
    names = {v.id: v.version for v in versions}
    for a in s.scalars(select(m.Alias).where(m.Alias.version_id.in_(ids))):
        out.aliases.append(a.name)
        record_alias_event(s, model=model.name, alias=a.name, version=None,
                           previous=names[a.version_id], actor=actor)
    orphans = _orphans_after(s, ids)
    out.jobs += int(s.scalar(select(func.count()).select_from(m.Job)
                             .where(m.Job.version_id.in_(ids))) or 0)
    # Cascades: aliases, jobs (and their builds), version links.
    s.execute(delete(m.ModelVersion).where(m.ModelVersion.id.in_(ids)))
    _drop_artifacts(s, orphans, out)
    out.versions += [v.version for v in versions]


def delete_version(db: Database, name: str, version: str, *, force: bool = False,
                   actor: str | None = None) -> Deleted:
    """Delete one version: its jobs, aliases that point at it, and the artifacts
    no other version uses (their blobs are the caller's to remove)."""
    out = Deleted()
    with db.session() as s:
        model = model_row(s, name)
        _delete_versions(s, model, [version_row(s, model, version)], force=force, actor=actor,
                         out=out)
    return out


def delete_model(db: Database, name: str, *, force: bool = False,
                 actor: str | None = None) -> Deleted:
    """Delete a model with every version (see ``delete_version``)."""
    out = Deleted()
    with db.session() as s:
        model = model_row(s, name)
        versions = list(s.scalars(select(m.ModelVersion)
                                  .where(m.ModelVersion.model_id == model.id)))
        if versions:
            _delete_versions(s, model, versions, force=force, actor=actor, out=out)
        s.execute(delete(m.Model).where(m.Model.id == model.id))
    return out


def delete_artifact(db: Database, digest: str) -> Deleted:
    """Delete every artifact row with this blob digest (a bad build, say): the
    versions it served no longer resolve to it, and a new job rebuilds it."""
    out = Deleted()
    with db.session() as s:
        ids = list(s.scalars(select(m.Artifact.id).where(m.Artifact.digest == digest)))
        if not ids:
            raise NotFound(f"no artifact {digest}; `farm models --json` lists their digests")
        _drop_artifacts(s, ids, out)
    return out
