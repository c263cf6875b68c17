"""Compile workers: heartbeats, which are live, and the targets a job may build for."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from datetime import timedelta, timezone
from typing import Any

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from farm.core.target import Target, TargetError, TargetSelector
from registry import models as m
from registry.db import Database
from registry.service.common import InvalidRequest, _now

log = logging.getLogger(__name__)


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
                "start one with `farm worker compile` or name a full target (a farm that "
                "has just started may still be starting its worker: GET /readyz says when "
                "it can take a job)"
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
