"""Which jobs get an AOTI package (farm.build.compile.aoti_not_applicable):
a per-block job does not, saying why and what to do instead; a regional
job and a plain one do."""

from __future__ import annotations

from typing import Any

import pytest

from farm.build.compile import aoti_not_applicable
from farm.core.specs import JobSpec


def spec(**options: Any) -> JobSpec:
    return JobSpec.from_json({
        "name": "m", "version": "1", "model": {"entrypoint": "farm.zoo.stack:stack"},
        "inputs": ["float32[2,64]"], "options": options})


def test_a_per_block_job_gets_no_aoti_package_and_is_told_why() -> None:
    why = aoti_not_applicable(spec(per_block=True))
    assert why is not None
    assert "per_block" in why and "submit without --per-block" in why


@pytest.mark.parametrize("options", [{}, {"regional": True}, {"mode": "max-autotune"}])
def test_other_inductor_inference_jobs_get_one(options: dict[str, Any]) -> None:
    assert aoti_not_applicable(spec(**options)) is None
