"""Build on miss: per-model policies, and which reported misses become a build.

``decide`` (pure) says whether one reported miss is something the farm can
build, and what: a known version, an input shape that none of its artifacts
covers or a node target that none of them loads on, and a live compile
worker whose artifacts would load on that node. ``RateGate`` (pure, in
memory) drops a herd's repeats before they reach the database;
``take_slot`` (a conditional UPDATE) is the per-model rate limit every
API replica shares, and ``claim`` (a unique row) the deduplication: one job
per (model, version, inputs, grad mode, target), ever, unless it failed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from sqlalchemy import or_, select, update

from farm.core.inputs import TensorSpec
from farm.core.specs import GradMode
from farm.core.target import Target
from registry import models as m
from registry import resolver
from registry.db import Conflict, Database
from registry.entities import ArtifactRecord
from registry.service.common import NotFound, _now
from registry.service.coverage import VersionUse, target_serves

# A report kind that says the node ran without an artifact for what it asked.
MISS_KINDS = ("miss", "guard_failure")


# --- pure ---------------------------------------------------------------------


@dataclass(frozen=True)
class MissBuild(VersionUse):
    """The build one miss asks for."""

    target: Target  # a live compile worker's target, which the node loads

    def key(self) -> tuple[str, str, str, str, str]:
        return (*self.use_key(), str(self.target))


def decide(*, model: str, version: str | None, inputs: tuple[TensorSpec, ...],
           grad_mode: GradMode, node: Target, records: Sequence[ArtifactRecord],
           live: Sequence[Target]) -> tuple[MissBuild | None, str]:
    """``(build, why)``: the build this miss needs, or None and why not."""
    if not version:
        return None, "not a known version"
    result = resolver.resolve(records, target=node, inputs=inputs, grad_mode=grad_mode)
    if result.best is not None:
        return None, "already served (an artifact fits now)"
    fits = [t for t in live if target_serves(t, node)]
    if not fits:
        return None, f"no live compile worker builds for {node}"
    return MissBuild(model=model, version=version, inputs=inputs, grad_mode=grad_mode,
                     target=sorted(fits, key=str)[0]), "missing"


class RateGate:
    """At most one pass per ``interval_s`` per key, in this process.

    In front of the database's own limit: a herd of a thousand nodes
    reporting the same miss costs one query, not a thousand."""

    def __init__(self, interval_s: float, *, clock: Callable[[], float] = time.monotonic,
                 max_keys: int = 10_000) -> None:
        self.interval_s = interval_s
        self._clock = clock
        self._last: dict[Any, float] = {}
        self._lock = threading.Lock()
        self._max_keys = max_keys

    def allow(self, key: Any, interval_s: float | None = None) -> bool:
        wait = self.interval_s if interval_s is None else interval_s
        now = self._clock()
        with self._lock:
            last = self._last.get(key)
            if last is not None and now - last < wait:
                return False
            if len(self._last) >= self._max_keys:
                self._last.clear()
            self._last[key] = now
            return True


# --- over the database -------------------------------------------------------------


def get_policy(db: Database, model: str) -> dict[str, Any]:
    """The model's policy (the defaults when none was set)."""
    with db.session() as s:
        row = s.get(m.ModelPolicy, model)
        builds = s.scalars(select(m.MissBuild).where(m.MissBuild.model == model)
                           .order_by(m.MissBuild.id.desc()).limit(20)).all()
        recent = [{"version": b.version, "inputs": b.inputs, "grad_mode": b.grad_mode,
                   "target": b.target, "job_id": b.job_id,
                   "created_at": b.created_at.isoformat()} for b in builds]
        if row is None:
            return {"model": model, "build_on_miss": False, "min_interval_s": None,
                    "last_build_at": None, "updated_by": None, "updated_at": None,
                    "miss_builds": recent}
        return {"model": model, "build_on_miss": row.build_on_miss,
                "min_interval_s": row.min_interval_s,
                "last_build_at": row.last_build_at.isoformat() if row.last_build_at else None,
                "updated_by": row.updated_by, "updated_at": row.updated_at.isoformat(),
                "miss_builds": recent}


def set_policy(db: Database, model: str, *, build_on_miss: bool | None = None,
               min_interval_s: float | None = None, actor: str | None = None,
               default_interval_s: float = 60.0) -> dict[str, Any]:
    with db.session() as s:
        if s.scalar(select(m.Model.id).where(m.Model.name == model)) is None:
            raise NotFound(f"no model {model!r}: submit a version of it first (farm submit)")
        row = s.get(m.ModelPolicy, model)
        if row is None:
            row = m.ModelPolicy(model=model, build_on_miss=False,
                                min_interval_s=default_interval_s)
            s.add(row)
        if build_on_miss is not None:
            row.build_on_miss = build_on_miss
        if min_interval_s is not None:
            row.min_interval_s = min_interval_s
        row.updated_by = actor
        row.updated_at = _now()
    return get_policy(db, model)


def policies_on(db: Database) -> dict[str, float]:
    """Models with build on miss on -> their minimum seconds between builds."""
    with db.session() as s:
        rows = s.execute(select(m.ModelPolicy.model, m.ModelPolicy.min_interval_s)
                         .where(m.ModelPolicy.build_on_miss.is_(True))).all()
    return {model: float(interval) for model, interval in rows}


def _claim_row(build: MissBuild) -> Any:
    """The select of this miss's claim row (one per model, version, inputs,
    grad mode and target)."""
    model, version, inputs, grad_mode, target = build.key()
    return select(m.MissBuild).where(
        m.MissBuild.model == model, m.MissBuild.version == version,
        m.MissBuild.inputs == inputs, m.MissBuild.grad_mode == grad_mode,
        m.MissBuild.target == target)


def already_claimed(db: Database, build: MissBuild) -> bool:
    """A job was started for this miss and did not fail."""
    with db.session() as s:
        row = s.scalar(_claim_row(build))
        if row is None:
            return False
        job = s.get(m.Job, row.job_id) if row.job_id else None
        return job is None or job.state != "failed"


def take_slot(db: Database, model: str, interval_s: float) -> bool:
    """The model's rate limit: True for at most one caller per ``interval_s``,
    whichever replica it runs in."""
    now = _now()
    with db.session() as s:
        res = s.execute(update(m.ModelPolicy)
                        .where(m.ModelPolicy.model == model,
                               m.ModelPolicy.build_on_miss.is_(True),
                               or_(m.ModelPolicy.last_build_at.is_(None),
                                   m.ModelPolicy.last_build_at
                                   < now - timedelta(seconds=interval_s)))
                        .values(last_build_at=now))
        return bool(res.rowcount)  # type: ignore[attr-defined]


def claim(db: Database, build: MissBuild) -> bool:
    """Record that this miss gets a job; False when another caller has (a
    failed one's claim is taken over)."""
    model, version, inputs, grad_mode, target = build.key()
    try:
        with db.session() as s:
            s.add(m.MissBuild(model=model, version=version, inputs=inputs, grad_mode=grad_mode,
                              target=target))
        return True
    except Conflict:
        pass  # another caller's row: see whether its job failed
    with db.session() as s:
        row = s.scalar(_claim_row(build).with_for_update())
        if row is None:
            return False
        job = s.get(m.Job, row.job_id) if row.job_id else None
        if job is not None and job.state == "failed":
            row.job_id = None
            row.created_at = _now()
            return True
        return False


def set_claim_job(db: Database, build: MissBuild, job_id: str | None) -> None:
    with db.session() as s:
        row = s.scalar(_claim_row(build))
        if row is None:
            return
        if job_id is None:
            s.delete(row)  # the submission failed: the next miss may try again
        else:
            row.job_id = job_id


def miss_builds(db: Database, model: str | None = None) -> list[dict[str, Any]]:
    q = select(m.MissBuild).order_by(m.MissBuild.id)
    if model is not None:
        q = q.where(m.MissBuild.model == model)
    with db.session() as s:
        return [{"model": b.model, "version": b.version, "inputs": b.inputs,
                 "grad_mode": b.grad_mode, "target": b.target, "job_id": b.job_id,
                 "created_at": b.created_at.isoformat()} for b in s.scalars(q)]
