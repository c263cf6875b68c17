"""Load: 200 job submissions at once, most of them identical (a rollout
submitting the same few models from many places), against one trace worker
and two CPU compile workers. Every job must complete, and each distinct build
must compile exactly once.
"""

from __future__ import annotations

import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from sqlalchemy import func, select

from registry import models as m
from tests.fixtures.farm import models_pack
from tests.fixtures.faults import MakeFarm, farm_spec
from tests.slowdown import scaled

pytestmark = [pytest.mark.integration, pytest.mark.slow]

N_JOBS = 200
DISTINCT = 3  # distinct programs: 66 or 67 identical submissions of each
CONCURRENCY = 32  # submissions in flight at once


def spec(k: int) -> dict[str, Any]:
    dim = 20 + k
    return farm_spec(f"load-{k}", "1", "tests.models.broken:linear", inputs=[f"float32[2,{dim}]"],
                     kwargs={"in_features": dim, "out_features": 4}, grad_mode="training")


def test_200_concurrent_submissions_complete_and_compile_once(make_farm: MakeFarm) -> None:
    f = make_farm("load", workers=(("trace", "trace"), ("compile", "compile"),
                                   ("compile2", "compile")))
    try:
        # The test models travel as a code pack, as farm submit ships them.
        code = f.upload_pack(models_pack())
        specs = [{**spec(i % DISTINCT), "code_digest": code} for i in range(N_JOBS)]
        t0 = time.monotonic()
        limits = httpx.Limits(max_connections=CONCURRENCY, max_keepalive_connections=CONCURRENCY)
        with httpx.Client(base_url=f.url, headers=f.headers, timeout=60, limits=limits) as c, \
                ThreadPoolExecutor(CONCURRENCY) as pool:
            answers = list(pool.map(lambda s: c.post("/v1/jobs", json=s), specs))
        submit_s = time.monotonic() - t0
        bad = [(r.status_code, r.text[:200]) for r in answers if r.status_code != 201]
        assert not bad, bad[:5]
        not_sent = [r.json().get("warning") for r in answers if not r.json()["enqueued"]]
        assert not not_sent, (len(not_sent), not_sent[:3], f.logs()[-6000:])
        ids = [r.json()["id"] for r in answers]
        assert len(set(ids)) == N_JOBS

        deadline = time.monotonic() + scaled(300)
        states: dict[str, int] = {}
        while time.monotonic() < deadline:
            with f.db.session() as s:
                states = {str(st): int(n) for st, n in s.execute(
                    select(m.Job.state, func.count()).group_by(m.Job.state))}
            if sum(states.get(x, 0) for x in ("succeeded", "failed", "partial")) == N_JOBS:
                break
            time.sleep(1)
        total_s = time.monotonic() - t0
        assert states == {"succeeded": N_JOBS}, (states, f.logs())

        with f.db.session() as s:
            jobs = s.scalars(select(m.Job)).all()
            keys = Counter(b.build_key for j in jobs for b in j.builds)
            build_states = Counter(b.state for j in jobs for b in j.builds)
            traced = sum(1 for j in jobs if "trace_shared_from" not in (j.log or ""))
            claims = {c.build_key: c.attempts for c in s.scalars(select(m.CompileClaim))}
            arts = Counter((a.build_key, a.format) for a in s.scalars(select(m.Artifact)))
        assert len(keys) == DISTINCT and sum(keys.values()) == N_JOBS, keys
        # Each distinct build compiled exactly once: one claim taken once, one
        # artifact per format.
        assert claims == dict.fromkeys(keys, 1), claims
        assert set(arts.values()) == {1} and {k for k, _ in arts} == set(keys), arts
        assert build_states["succeeded"] + build_states["reused"] == N_JOBS, build_states
        print(f"{N_JOBS} jobs ({DISTINCT} distinct) submitted in {submit_s:.1f} s "
              f"({N_JOBS / submit_s:.0f}/s); all done in {total_s:.1f} s; "
              f"{traced} traces ran, {N_JOBS - traced} jobs took an identical job's trace; "
              f"{len(claims)} compiles; builds {dict(build_states)}")
    finally:
        f.close()
