"""Seed for ``bench/registry_load.py --distinct`` (issue 17): 100,000 artifact
rows and 10,000 distinct resolve questions, plus the node reports that go with
them.

1,000 models x 10 versions; each version has 10 artifacts: 5 input shapes
(one of them a dynamic range) x 2 CPU targets (the node's AVX2 one and an
AVX-512 one the node must refuse). Rows are written with bulk INSERTs, as no
build could make 100,000 of them in a benchmark's time; their columns are
what a real build writes (``service.finish_compile``), so the resolve reads
and checks them the same way.

Each question asks one version for one of its shapes on the node's target
(the dynamic one at a size inside its range), so the 10,000 questions are
10,000 different (model, version, inputs, target) combinations, each
answered by its own version's rows.
"""

from __future__ import annotations

import hashlib
import random
from typing import Any
from urllib.parse import urlencode

from bench_farm import NODE_TARGET, OTHER_TARGETS

MODELS = 1000
VERSIONS = 10
# (what is built, what a node asks for)
SHAPES = (("int64[1,128]", "int64[1,128]"), ("int64[1,256]", "int64[1,256]"),
          ("int64[2..16,128]", "int64[7,128]"), ("int64[4,512]", "int64[4,512]"),
          ("int64[8,64]", "int64[8,64]"))
TARGETS = (NODE_TARGET, OTHER_TARGETS[0])
OPTIONS = '{"backend":"inductor","guard_filter":"drop-unserializable","mode":"default"}'


def _h(*parts: object) -> str:
    return hashlib.sha256("/".join(map(str, parts)).encode()).hexdigest()


def seed(db_url: str, *, triggers: bool = True) -> dict[str, Any]:
    """Insert the rows; returns how many of each. ``triggers=False``: a bulk
    load before any API runs (a million rows): the read model's change
    triggers are skipped for these sessions (``session_replication_role``,
    superuser only) and the generation is bumped once at the end; an API
    that starts afterwards reads everything anyway."""
    from datetime import datetime, timezone

    from sqlalchemy import event, insert, select, text

    from farm.core.target import Target
    from registry import models as m
    from registry.db import Database

    db = Database(db_url)
    if not triggers:
        @event.listens_for(db.engine, "connect")
        def _no_triggers(dbapi_connection: Any, _record: Any) -> None:
            with dbapi_connection.cursor() as cur:
                cur.execute("SET session_replication_role = replica")
            dbapi_connection.commit()
    now = datetime.now(timezone.utc)
    try:
        with db.session() as s:
            s.execute(insert(m.Model), [{"name": f"m{i:04d}", "created_at": now}
                                        for i in range(MODELS)])
            ids = dict(s.execute(select(m.Model.name, m.Model.id)).all())
            s.execute(insert(m.ModelVersion), [
                {"model_id": ids[f"m{i:04d}"], "version": str(v),
                 "entrypoint": "farm.zoo.llama:tiny", "kwargs": {}, "kind": "factory",
                 "created_at": now}
                for i in range(MODELS) for v in range(1, VERSIONS + 1)])
            versions = s.execute(select(m.ModelVersion.id, m.ModelVersion.model_id,
                                        m.ModelVersion.version)).all()
        rows = []
        for vid, model_id, version in versions:
            fp = _h("fp", model_id, version)
            for built, _ in SHAPES:
                for t in TARGETS:
                    tt = Target.parse(t)
                    key = _h("key", fp, built, t)
                    rows.append({
                        "digest": _h("blob", key), "size": 1 << 20, "format": "aot_compile",
                        "build_key": key, "fingerprint": fp, "inputs": built,
                        "grad_mode": "inference", "options": OPTIONS, "target": t,
                        "device": tt.device, "torch_version": tt.torch_version,
                        "python_version": tt.python_version, "cpu_isa": tt.cpu_isa,
                        "threads": tt.threads, "verified": True, "first_call_compiles": False,
                        "max_abs_err": 0.0, "first_call_s": 0.01, "load_s": 0.1,
                        "libstdcxx_needs": [], "meta": {}, "created_at": now,
                        "_version_id": vid})
        for i in range(0, len(rows), 5000):
            chunk = rows[i:i + 5000]
            with db.session() as s:
                art_ids = s.execute(insert(m.Artifact).returning(m.Artifact.id),
                                    [{k: v for k, v in r.items() if k != "_version_id"}
                                     for r in chunk]).scalars().all()
                s.execute(insert(m.VersionArtifact), [
                    {"version_id": r["_version_id"], "artifact_id": a}
                    for r, a in zip(chunk, art_ids, strict=True)])
        if not triggers:
            with db.session() as s:
                s.execute(text("UPDATE read_model_generation SET n = n + 1 WHERE id = 1"))
        return {"models": MODELS, "versions": len(versions), "artifacts": len(rows)}
    finally:
        db.dispose()


def questions(n: int = MODELS * VERSIONS, *, seed_: int = 17) -> list[str]:
    """``n`` distinct resolve paths (one per version, in a shuffled order)."""
    rng = random.Random(seed_)
    out = []
    for i in range(MODELS):
        for v in range(1, VERSIONS + 1):
            _, asked = SHAPES[rng.randrange(len(SHAPES))]
            out.append("/v1/resolve?" + urlencode([
                ("model", f"m{i:04d}"), ("ref", str(v)), ("target", NODE_TARGET),
                ("input", asked)]))
    rng.shuffle(out)
    return out[:n]


def report_bodies(n_nodes: int = 10_000, *, seed_: int = 17) -> list[dict[str, Any]]:
    """One POST /v1/reports body per node: what each of 10,000 nodes sends
    every 10 s (one report: mostly loads, some misses and guard failures)."""
    rng = random.Random(seed_)
    out = []
    for n in range(n_nodes):
        i, v = rng.randrange(MODELS), rng.randrange(1, VERSIONS + 1)
        kind = rng.choices(("load", "miss", "guard_failure"), weights=(90, 7, 3))[0]
        shape = SHAPES[rng.randrange(len(SHAPES))][1] if kind == "load" else "int64[3,96]"
        report: dict[str, Any] = {"kind": kind, "model": f"m{i:04d}", "version": str(v),
                                  "inputs": [shape], "grad_mode": "inference",
                                  "target": NODE_TARGET, "code": "inputs" if kind == "miss"
                                  else ("guard" if kind == "guard_failure" else None)}
        if kind == "load":
            report.update(format="aot_compile", seconds=0.8)
        out.append({"node": f"node-{n:05d}", "reports": [report]})
    return out
