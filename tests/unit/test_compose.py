"""docker-compose.yml against the code: no Docker engine runs here, so the
file is checked as data: its services, the farm commands they run (parsed by
the real CLI parser), and the environment (read by the real Settings)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from farm.app.cli import build_parser
from farm.core.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
FARM_SERVICES = ("migrate", "api", "trace-worker", "cpu-compile-worker", "gpu-compile-worker")


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    # What `docker compose` substitutes, with the variables a user sets.
    import os
    import re

    env = {"FARM_ADMIN_TOKEN": "t" * 32, "FARM_S3_HOST": "farm.example.net", **os.environ}

    def sub(m: re.Match[str]) -> str:
        name, op, default = m.group(1), m.group(2) or "", m.group(3) or ""
        if op.startswith(":?") and not env.get(name):
            raise AssertionError(f"{name} is required: {default}")
        return env.get(name) or (default if op.startswith(":-") else "")

    text = re.sub(r"\$\{(\w+)(:[-?])?([^}]*)\}", sub, (ROOT / "docker-compose.yml").read_text())
    data = yaml.safe_load(text)
    assert isinstance(data, dict)
    return data


def test_every_part_of_the_farm_is_a_service(compose: dict[str, Any]) -> None:
    assert set(compose["services"]) >= {
        "redis", "postgres", "minio", "minio-bucket", *FARM_SERVICES,
    }


@pytest.mark.parametrize("name", FARM_SERVICES)
def test_farm_commands_parse_with_the_real_cli(compose: dict[str, Any], name: str) -> None:
    command = compose["services"][name]["command"]
    args = build_parser().parse_args(command)
    assert callable(args.func)


def test_workers_consume_the_right_queues(compose: dict[str, Any]) -> None:
    s = compose["services"]
    assert s["trace-worker"]["command"] == ["worker", "trace"]
    assert s["cpu-compile-worker"]["command"][-2:] == ["--device", "cpu"]
    assert s["gpu-compile-worker"]["command"][-2:] == ["--device", "cuda"]
    devices = s["gpu-compile-worker"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]


def test_environment_is_what_the_code_reads(compose: dict[str, Any]) -> None:
    known = {name.upper() for name in Settings.model_fields}
    for name in FARM_SERVICES:
        env = compose["services"][name]["environment"]
        unknown = {k for k in env if k not in known and not k.startswith("AWS_")}
        assert not unknown, f"{name} sets variables nothing reads: {unknown}"
        # The settings the farm needs to be distributed, not embedded.
        assert env["DATABASE_URL"].startswith("postgresql+psycopg://")
        assert env["REDIS_URL"].startswith("redis://")
        assert env["BLOB_STORE_URL"].startswith("s3://")
        # Presigned URLs name this endpoint: a name nodes outside the compose
        # network resolve too, mapped to the host inside the containers.
        assert env["S3_ENDPOINT_URL"] == "http://farm.example.net:9000"
        assert "farm.example.net:host-gateway" in compose["services"][name]["extra_hosts"]
    # And Settings accepts them as they are.
    s = Settings(**{k.lower(): v for k, v in
                    compose["services"]["api"]["environment"].items() if k.upper() in known})
    assert s.resolved_database_url().endswith("@postgres:5432/farm")
    assert s.resolved_broker_url() == "redis://redis:6379/0"


def test_start_order_and_health(compose: dict[str, Any]) -> None:
    s = compose["services"]
    for backend in ("redis", "postgres", "minio", "api"):
        assert "healthcheck" in s[backend], backend
    assert s["migrate"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    for name in ("api", "trace-worker", "cpu-compile-worker", "gpu-compile-worker"):
        deps = s[name]["depends_on"]
        assert deps["migrate"]["condition"] == "service_completed_successfully", name
        assert deps["redis"]["condition"] == "service_healthy", name
    assert s["api"]["depends_on"]["minio-bucket"]["condition"] == "service_completed_successfully"
    # The bucket the farm writes to is the one the init step creates.
    bucket = s["api"]["environment"]["BLOB_STORE_URL"].removeprefix("s3://").split("/")[0]
    assert bucket in " ".join(s["minio-bucket"]["command"])


def test_gpu_worker_only_with_its_profile(compose: dict[str, Any]) -> None:
    s = compose["services"]
    assert s["gpu-compile-worker"]["profiles"] == ["gpu"]
    assert all("profiles" not in s[n] for n in FARM_SERVICES if n != "gpu-compile-worker")


def test_no_default_admin_token_and_minio_published(compose: dict[str, Any]) -> None:
    text = (ROOT / "docker-compose.yml").read_text()
    assert "change-me" not in text
    # Required: `docker compose up` without it stops and says what to set.
    assert "${FARM_ADMIN_TOKEN:?" in text
    assert "9000:9000" in compose["services"]["minio"]["ports"]


def test_secrets_are_git_ignored_and_python_is_pinned() -> None:
    import subprocess

    r = subprocess.run(["git", "check-ignore", "-q", "secrets/farm_name_key.pem"], cwd=ROOT)
    assert r.returncode == 0, "secrets/ must be git-ignored: the README puts the private key there"
    docker = (ROOT / "Dockerfile").read_text()
    assert "ARG PYTHON_VERSION=3.11.7" in docker and "FROM python:${PYTHON_VERSION}-slim" in docker
    assert "python:3.11-slim" not in docker


@pytest.mark.parametrize("name", ("trace-worker", "cpu-compile-worker", "gpu-compile-worker"))
def test_build_workers_may_make_the_sandbox_and_need_no_user_code_in_the_image(
        compose: dict[str, Any], name: str) -> None:
    svc = compose["services"][name]
    # bubblewrap needs namespaces, which Docker's default profiles forbid.
    assert "SYS_ADMIN" in svc.get("cap_add", []), svc
    assert "seccomp=unconfined" in svc.get("security_opt", []), svc
    # The sandbox is on by default: nothing turns it off in the deployment.
    assert "FARM_SANDBOX" not in svc["environment"]
    assert Settings(**{k.lower(): v for k, v in svc["environment"].items()
                       if k.lower() in Settings.model_fields}).farm_sandbox == "on"
    # Users' code travels as code packs through the bucket the API writes:
    # the same blob store, and no volume or image layer of user code.
    api = compose["services"]["api"]
    assert svc["environment"]["BLOB_STORE_URL"] == api["environment"]["BLOB_STORE_URL"]
    assert not svc.get("volumes"), svc.get("volumes")


def test_the_api_runs_no_model_code_and_gets_no_extra_privilege(compose: dict[str, Any]) -> None:
    api = compose["services"]["api"]
    assert not api.get("cap_add") and not api.get("security_opt")


def test_the_image_installs_bubblewrap() -> None:
    text = (ROOT / "Dockerfile").read_text()
    assert "bubblewrap" in text
