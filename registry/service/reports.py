"""Node reports over SQL: store a batch, list and summarise what the fleet missed.

The reports are what nodes did with the farm's answers (``farm.node.reports``):
``miss`` (the resolve found nothing), ``guard_failure`` (a call the artifact's
guards refused, with that call's inputs), ``fallback`` (an artifact was found
but not used: a load, class or integrity failure) and ``load`` (it ran). The
dashboard and the CLI read them through the functions here.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import datetime, timedelta
from typing import Any, TypeVar

from sqlalchemy import Select, case, func, insert, select

from registry import models as m
from registry.db import Database
from registry.service.common import _now

KINDS = ("miss", "guard_failure", "fallback", "load")
# What counts as the fleet not getting an artifact (every kind but a load).
NOT_SERVED = ("miss", "guard_failure", "fallback")
COLUMNS = ("reported_at", "kind", "model", "ref", "version", "inputs", "grad_mode", "target",
           "format", "digest", "code", "reason", "node", "seconds")


def store_reports(db: Database, rows: Sequence[dict[str, Any]]) -> int:
    """Insert ``rows`` (dicts of ``COLUMNS``, ``received_at`` optional) in one
    statement; returns how many."""
    if not rows:
        return 0
    now = _now()
    if db.url.get_backend_name() == "postgresql":
        # COPY: a fleet's reports are a thousand rows a second, written from a
        # thread of the API process; an INSERT's per-row Python (parameters
        # compiled row by row) held the GIL the resolves need for tens of ms.
        columns = (*COLUMNS, "received_at")
        with db.session() as s:
            raw = s.connection().connection.driver_connection
            assert raw is not None
            with raw.cursor() as cur, cur.copy(
                    f"COPY node_reports ({', '.join(columns)}) FROM STDIN") as copy:
                for r in rows:
                    copy.write_row([*(r.get(c) for c in COLUMNS), r.get("received_at") or now])
        return len(rows)
    values = [{**{c: r.get(c) for c in COLUMNS}, "received_at": r.get("received_at") or now}
              for r in rows]
    with db.session() as s:
        s.execute(insert(m.NodeReport), values)
    return len(values)


def _since(since_s: float | None) -> datetime | None:
    return None if since_s is None else _now() - timedelta(seconds=since_s)


_Q = TypeVar("_Q", bound=Select)


def _of(q: _Q, *, model: str | None, since_s: float | None) -> _Q:
    """``q`` narrowed to ``model``'s reports (None: every model) received in
    the last ``since_s`` seconds (None: ever)."""
    if model is not None:
        q = q.where(m.NodeReport.model == model)
    cutoff = _since(since_s)
    return q if cutoff is None else q.where(m.NodeReport.received_at >= cutoff)


def list_reports(db: Database, *, model: str | None = None,
                 kinds: Iterable[str] = NOT_SERVED, since_s: float | None = None,
                 limit: int = 100) -> list[dict[str, Any]]:
    """The newest reports, newest first."""
    q = select(m.NodeReport).where(m.NodeReport.kind.in_(tuple(kinds)))
    q = _of(q, model=model, since_s=since_s)
    with db.session() as s:
        rows = s.scalars(q.order_by(m.NodeReport.id.desc()).limit(limit)).all()
        return [_report_json(r) for r in rows]


def _report_json(r: m.NodeReport) -> dict[str, Any]:
    return {
        "id": r.id, "received_at": r.received_at.isoformat(),
        "reported_at": r.reported_at.isoformat() if r.reported_at else None,
        **{c: getattr(r, c) for c in COLUMNS if c != "reported_at"},
    }


def miss_summary(db: Database, *, model: str | None = None, since_s: float | None = None,
                 kinds: Iterable[str] = NOT_SERVED, limit: int = 200) -> list[dict[str, Any]]:
    """What the fleet did not get, grouped: one row per (model, version or
    ref, inputs, grad mode, target, kind, code) with its count, the nodes
    that reported it and when last; most frequent first."""
    r = m.NodeReport
    keys = (r.model, r.version, r.ref, r.inputs, r.grad_mode, r.target, r.kind, r.code)
    q = (select(*keys, func.count().label("n"),
                func.count(func.distinct(r.node)).label("nodes"),
                func.max(r.received_at).label("last_at"), func.max(r.reason).label("reason"))
         .where(r.kind.in_(tuple(kinds))))
    q = _of(q, model=model, since_s=since_s)
    q = q.group_by(*keys).order_by(func.count().desc(), func.max(r.received_at).desc())
    with db.session() as s:
        rows = s.execute(q.limit(limit)).all()
    return [{"model": x.model, "version": x.version, "ref": x.ref, "inputs": x.inputs,
             "grad_mode": x.grad_mode, "target": x.target, "kind": x.kind, "code": x.code,
             "count": int(x.n), "nodes": int(x.nodes), "last_at": x.last_at.isoformat()
             if hasattr(x.last_at, "isoformat") else str(x.last_at), "reason": x.reason}
            for x in rows]


def not_served_count(db: Database, *, model: str | None = None,
                     since_s: float | None = None) -> int:
    """How many reports say a node was not served (``NOT_SERVED``): the one
    notion of a miss the dashboard counts, and the rows its misses page lists."""
    q = select(func.count()).select_from(m.NodeReport).where(
        m.NodeReport.kind.in_(NOT_SERVED))
    q = _of(q, model=model, since_s=since_s)
    with db.session() as s:
        return int(s.scalar(q) or 0)


def report_counts(db: Database, model: str, *, since_s: float | None = None) -> dict[str, int]:
    """Reports of ``model`` by kind (every kind present, zero when none)."""
    q = _of(select(m.NodeReport.kind, func.count()), model=model, since_s=since_s)
    with db.session() as s:
        got = dict(s.execute(q.group_by(m.NodeReport.kind)).all())
    return {k: int(got.get(k, 0)) for k in KINDS}


def requested(db: Database, *, model: str | None = None, since_s: float | None = None,
              limit: int = 5000) -> list[dict[str, Any]]:
    """What nodes asked for, distinct: (model, ref, version, inputs, grad
    mode, target) with how many reports and whether any was served (a load).
    Coverage and upgrade plans start from this."""
    r = m.NodeReport
    keys = (r.model, r.ref, r.version, r.inputs, r.grad_mode, r.target)
    served = func.sum(case((r.kind == "load", 1), else_=0)).label("served")
    q = select(*keys, func.count().label("n"), served)
    q = _of(q, model=model, since_s=since_s)
    with db.session() as s:
        rows = s.execute(q.group_by(*keys).order_by(func.count().desc()).limit(limit)).all()
    return [{"model": x.model, "ref": x.ref, "version": x.version, "inputs": x.inputs,
             "grad_mode": x.grad_mode, "target": x.target, "count": int(x.n),
             "served": int(x.served or 0)} for x in rows]
