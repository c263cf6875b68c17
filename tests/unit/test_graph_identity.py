"""Compile work reused across builds (farm.build.graph_identity): a second
build of the same graph, in another sandboxed child with a copy of the first
one's Inductor cache (what the worker's shared compile cache does), is
answered by torch's AOTAutograd cache; and its artifact still verifies
against eager in a fresh process. Real children forked from a real zygote."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest

from farm.build import zygote
from farm.build.sandbox import build_isolation, isolation_unavailable, run_isolated
from farm.build.steps import compile_env
from farm.build.verify import verify_artifact
from farm.core.specs import JobSpec

pytestmark = pytest.mark.skipif(
    isolation_unavailable() is not None, reason="no bubblewrap sandbox on this machine"
)


def _spec(version: str) -> JobSpec:
    # Two versions of one program: the same graph under another build key.
    return JobSpec.from_json(
        {
            "name": "graph-identity",
            "version": version,
            "model": {
                "entrypoint": "farm.zoo.stack:stack",
                "kwargs": {"layers": 2, "width": 8, "changed": -1},
            },
            "inputs": ["float32[2,8]"],
            "grad_mode": "inference",
        }
    )


def _build(spec: JobSpec, work: Path) -> dict[str, Any]:
    res = run_isolated(
        "farm.build.steps:compile_step",
        {
            "spec": spec.to_json(),
            "device": "cpu",
            "out_dir": str(work / "out"),
            "aoti_unavailable": "this test builds aot_compile only",
        },
        timeout_s=600,
        memory_mb=8000,
        env_extra=compile_env(work),
        isolation=build_isolation(writable=(str(work),), mode="on"),
    )
    assert res.ok, (res.error, res.stderr_tail)
    (art,) = res.value["artifacts"]
    return dict(art)


def test_a_second_build_of_the_same_graph_hits_the_aotautograd_cache() -> None:
    with tempfile.TemporaryDirectory(prefix="graph-id-", dir=zygote.work_dir()) as tmp:
        first, second = Path(tmp) / "a", Path(tmp) / "b"
        first.mkdir()
        second.mkdir()
        a = _build(_spec("1"), first)
        assert a["meta"]["aot_autograd_cache"] == "miss", a["meta"]
        # The worker's prefill, in short: the first build's cache entries.
        shutil.copytree(first / "inductor-cache", second / "inductor-cache")
        b = _build(_spec("2"), second)
        assert b["meta"]["aot_autograd_cache"] == "hit", b["meta"]

        report = verify_artifact(
            _spec("2"), b["path"], "aot_compile", device="cpu", timeout_s=600, memory_mb=8000
        )
        assert report.ok, report.error
