"""Models that attack the worker through what their compile child hands back,
submitted through the real farm (API, Celery workers, the bubblewrap sandbox,
S3): one rewrites its result JSON to name the builder's signing key as its
artifact, one replaces its artifact with a symlink to the key; both also make
their verifier report a pass. The worker believed both before: it uploaded
the path it was given as itself and signed it. Now each build fails, saying
what the child did, and the key's bytes are nowhere in the blob store, nor
downloadable with a read token."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.farm import Farm
from tests.fixtures.faults import farm_spec

pytestmark = pytest.mark.integration


def _submit(farm: Farm, name: str, how: str, key: Path) -> dict[str, Any]:
    spec = farm_spec(
        name,
        "1",
        "tests.models_env:result_thief",
        inputs=["float32[2,8]"],
        kwargs={"how": how, "key": str(key), "dim": 8},
    )
    return farm.wait_job(farm.submit(spec), timeout=600)


def _bucket_holds(farm: Farm, s3_client: Any, data: bytes) -> list[str]:
    bucket, _, prefix = farm.env["BLOB_STORE_URL"].removeprefix("s3://").partition("/")
    found = []
    for page in s3_client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for obj in page.get("Contents", []):
            if obj["Size"] == len(data):
                body = s3_client.get_object(Bucket=bucket, Key=obj["Key"])["Body"].read()
                if body == data:
                    found.append(obj["Key"])
    return found


@pytest.mark.parametrize(
    ("how", "needle"),
    [
        ("rewrite", "not at"),  # the JSON named another path
        ("symlink", "symlink"),  # the file was a link to the key
    ],
)
def test_a_model_that_points_its_result_at_the_builder_key_fails_its_build(
    farm: Farm, s3_client: Any, how: str, needle: str
) -> None:
    key = Path(farm.env["FARM_BUILDER_KEY"])
    key_bytes = key.read_bytes()
    job = _submit(farm, f"thief-{how}", how, key)
    assert job["state"] == "failed", json.dumps(job, indent=1)[:3000]
    (build,) = job["builds"]
    assert build["state"] == "failed", build
    error = build["error"] or ""
    # The worker says what the child did (proof the attack ran) and refused it.
    assert "refused the build's output" in error, error[:2000]
    assert needle in error, error[:2000]
    if how == "rewrite":
        assert str(key) in error, error[:2000]
    assert not build["artifacts"], build["artifacts"]
    # The key was never uploaded: not under its digest, nor anywhere in the bucket.
    digest = hashlib.sha256(key_bytes).hexdigest()
    with farm.http() as c:
        assert c.get(f"/v1/artifacts/{digest}").status_code == 404
        assert c.get(f"/v1/artifacts/{digest}/blob").status_code == 404
    assert _bucket_holds(farm, s3_client, key_bytes) == []
