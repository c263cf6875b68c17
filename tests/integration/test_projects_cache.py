"""What one project's builds leave behind never reaches another project's
artifact: the shared compile cache is per project by default (wired as the
compile worker wires it, ``workers.tasks._shared_cache``, on real Redis and
the real database), and an identical build of another project is built
again rather than reused (the project is part of the build key).

The attacker here is project A's build: a sandboxed child that writes a
native kernel under the name torch would give a kernel of B's model; the
worker harvests it after A's build passes verification, as it would any
kernel A's build compiled."""

from __future__ import annotations

import uuid
from dataclasses import replace
from pathlib import Path

import pytest

from farm.core.settings import Settings
from farm.core.specs import JobSpec
from registry import service
from registry.db import Database
from registry.service import projects
from tests.integration.test_api import CPU
from workers import context, tasks

pytestmark = pytest.mark.integration

# Where a CPU aot_compile bundle takes its kernels from: Inductor's cache.
PLANTED = "inductor-cache/xy/cxy0123456789abcdef.so"
KERNEL = b"\x7fELF planted by project a"


def _settings(tmp_path: Path, redis_url: str, db_url: str, scope: str | None) -> Settings:
    values: dict[str, object] = {
        "farm_home": tmp_path / "home",
        "database_url": db_url,
        "redis_url": redis_url,
        "farm_compile_cache": "redis",
        "farm_compile_cache_url": "",  # the farm's Redis, not the session's shared directory
        "farm_compile_cache_prefix": f"farm:ccache:test-{uuid.uuid4().hex[:8]}",
    }
    if scope is not None:
        values["farm_compile_cache_scope"] = scope
    return Settings(**values)  # type: ignore[arg-type]


def _build_dir(tmp_path: Path, name: str) -> Path:
    d = tmp_path / name
    d.mkdir()
    return d


@pytest.mark.parametrize("scope", [None, "target"])
def test_a_kernel_planted_by_one_project_is_absent_from_anothers_build(
    scope: str | None,
    database: Database,
    db_url: str,
    redis_url: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    settings = _settings(tmp_path, redis_url, db_url, scope)
    monkeypatch.setattr(context, "settings", lambda: settings)
    monkeypatch.setattr(context, "database", lambda: database)

    # Project a's build: the child compiled (or planted) a kernel; it passed
    # verification, and the worker shares what the child added.
    a_dir = _build_dir(tmp_path, "a")
    a = tasks._shared_cache(CPU, a_dir, model="alpha", project="team-a")
    assert a is not None
    planted = a_dir / PLANTED
    planted.parent.mkdir(parents=True)
    planted.write_bytes(KERNEL)
    tasks._harvest(a)
    assert a.stats["shared"] == 1

    # Project b's build of its own model, on the same target, next.
    b_dir = _build_dir(tmp_path, "b")
    b = tasks._shared_cache(CPU, b_dir, model="beta", project="team-b")
    assert b is not None
    # Project a's next build still gets it: the cache works within a project.
    a2_dir = _build_dir(tmp_path, "a2")
    tasks._shared_cache(CPU, a2_dir, model="alpha", project="team-a")
    assert (a2_dir / PLANTED).read_bytes() == KERNEL
    if scope is None:
        # The default (project): b's build starts without it, so b's
        # artifact cannot ship it.
        assert not (b_dir / PLANTED).exists()
        assert b.stats["prefilled"] == 0
    else:
        # FARM_COMPILE_CACHE_SCOPE=target, the admin's explicit choice to
        # share across projects: exactly the risk docs/security.md names.
        assert (b_dir / PLANTED).read_bytes() == KERNEL


def _traced(db: Database, spec: JobSpec, fingerprint: str) -> tuple[str, list[str]]:
    job_id = service.submit_job(db, spec, targets=[CPU], project=spec.project)
    service.start_trace(db, job_id)
    dispatch = service.record_trace(db, job_id, {"fingerprint": fingerprint, "param_count": 1})
    return job_id, [d.build_key for d in dispatch]


def test_an_identical_build_of_another_project_is_not_reused(database: Database) -> None:
    for name in ("team-a", "team-b"):
        projects.create_project(database, name, by="test")
    a = JobSpec.from_json(
        {
            "name": "alpha",
            "version": "1",
            "project": "team-a",
            "model": {"entrypoint": "farm.zoo.stack:stack"},
            "inputs": ["float32[2,16]"],
        }
    )
    fp = "c" * 64
    job_a, (key_a,) = _traced(database, a, fp)
    assert (
        service.begin_compile(database, key_a, worker_id="w:1", heartbeat_max_age_s=30).action
        == "run"
    )
    service.finish_compile(
        database,
        key_a,
        target=CPU,
        spec=a,
        fingerprint=fp,
        compile_s=1.0,
        # Both formats a default build makes: a resubmission with one
        # missing would rebuild it (farm submit's missing formats).
        artifacts=[
            service.NewArtifact(
                digest=d * 64,
                size=10,
                format=fmt,
                verified=True,
                first_call_compiles=False,
                max_abs_err=0.0,
                first_call_s=0.01,
                load_s=0.1,
                meta={},
            )
            for d, fmt in (("d", "aoti"), ("e", "aot_compile"))
        ],
    )
    assert service.job_view(database, job_a)["state"] == "succeeded"

    # The same program, graph, inputs and target in project a: reused.
    _, keys = _traced(database, replace(a, version="2"), fp)
    assert keys == []
    # In project b (and in default): a build of its own, under another key.
    job_b, keys_b = _traced(database, replace(a, name="beta", project="team-b"), fp)
    assert len(keys_b) == 1 and keys_b[0] != key_a
    assert [b["state"] for b in service.job_view(database, job_b)["builds"]] == ["queued"]
    _, keys_d = _traced(database, replace(a, name="gamma", project=None), fp)
    assert len(keys_d) == 1 and keys_d[0] not in (key_a, keys_b[0])
