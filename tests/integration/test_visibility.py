"""A compile task that runs longer than the broker's visibility timeout is
not run twice at once: real Redis, two real compile worker processes, the
timeout shrunk through FARM_VISIBILITY_TIMEOUT_S. Redis hands the
unacknowledged message to the idle worker while the first still compiles;
that worker finds the claim held by a live worker and stands down."""

from __future__ import annotations

import pytest

from tests.fixtures.faults import MakeFarm, farm_spec
from tests.slowdown import scaled

pytestmark = [pytest.mark.integration, pytest.mark.slow]

VISIBILITY_S = 2
# Past the visibility timeout and the idle worker's restore scan (every
# second here). The compile step calls the factory twice: in the compile
# child and in its graph-check fork (farm.build.graph_check), side by side.
COMPILE_S = scaled(12)


def test_a_build_longer_than_the_visibility_timeout_runs_once(make_farm: MakeFarm) -> None:
    f = make_farm(
        "visibility",
        env={"FARM_VISIBILITY_TIMEOUT_S": str(VISIBILITY_S), "FARM_UNACKED_RESTORE_S": "1",
             # The model records its stages in the test's files: unisolated.
             "FARM_SANDBOX": "off", "FARM_BUILD_ZYGOTE": "off"},
        workers=(("trace", "trace"), ("compile", "compile"), ("compile2", "compile")),
    )
    try:
        record = f.home / "compile-stage.log"
        job_id = f.submit(farm_spec(
            "slow-compile", "1", "tests.models_env:slow_in", inputs=["float32[2,8]"],
            kwargs={"at": "compile", "seconds": COMPILE_S, "record": str(record)}))
        job = f.wait_job(job_id, timeout=600)
        assert job["state"] == "succeeded", job
        (build,) = job["builds"]
        key = str(build["build_key"])
        # One compile child (and its own graph-check fork), never a second
        # child beside it or after it; every call of the factory ended.
        lines = [line.split() for line in record.read_text().splitlines()]
        pids = {pid for _, pid, _ in lines}
        children = {pid for _, pid, ppid in lines if ppid not in pids}
        assert lines and len(children) == 1, lines
        for pid in pids:
            assert [w for w, p, _ in lines if p == pid] == ["start", "end"], lines
        assert f.claim_attempts(key) == 1
        # The message was handed out again while it ran: the other worker
        # got it and stood down (the claim's owner was alive).
        logs = (f.home / "compile.log").read_text() + (f.home / "compile2.log").read_text()
        assert "retry: Retry in" in logs, logs[-4000:]
    finally:
        f.close()
