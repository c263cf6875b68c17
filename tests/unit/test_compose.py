"""docker-compose.yml against the code and against what an operator needs.

No Docker engine runs here, so the file is checked three ways: by the compose
CLI itself (`docker compose config`, or Debian's docker-compose, which
validate without a daemon), as data (its services, the farm commands they
run, parsed by the real CLI parser, and the environment, read by the real
Settings), and by running the parts that can run outside a container (the
bucket step against an S3 server, the workers' healthcheck, make_secrets.sh).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from configparser import ConfigParser
from pathlib import Path
from typing import Any

import pytest
import yaml

from farm.app.cli import build_parser
from farm.core.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
FARM_SERVICES = ("migrate", "api", "trace-worker", "cpu-compile-worker", "gpu-compile-worker")
WORKERS = ("trace-worker", "cpu-compile-worker", "gpu-compile-worker")
# What runs until stopped (the others are one-shot steps).
LONG_RUNNING = ("redis", "postgres", "s3", "api", *WORKERS)
SECRET_FILES = (
    "postgres_password",
    "s3_identities.json",
    "s3_admin_credentials",
    "s3_farm_credentials",
    "farm_admin_token",
)


def _substitute(text: str, env: dict[str, str]) -> str:
    """What `docker compose` substitutes, with the variables a user sets."""

    def sub(m: re.Match[str]) -> str:
        name, op, default = m.group(1), m.group(2) or "", m.group(3) or ""
        if op.startswith(":?") and not env.get(name):
            raise AssertionError(f"{name} is required: {default}")
        return env.get(name) or (default if op.startswith(":-") else "")

    return re.sub(r"\$\{(\w+)(:[-?])?([^}]*)\}", sub, text)


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    env = {"FARM_S3_HOST": "farm.example.net"}
    data = yaml.safe_load(_substitute((ROOT / "docker-compose.yml").read_text(), env))
    assert isinstance(data, dict)
    return data


def _secret_path(compose: dict[str, Any], service: str, path: str) -> str:
    """The host file behind /run/secrets/NAME, which the service must mount."""
    name = path.removeprefix("/run/secrets/")
    assert path.startswith("/run/secrets/") and name in compose["services"][service]["secrets"], (
        service,
        path,
    )
    return str(compose["secrets"][name]["file"])


# --- the compose CLI ----------------------------------------------------------------


def _compose_cli() -> list[str]:
    if (
        shutil.which("docker")
        and subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0
    ):
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    raise AssertionError(
        "no compose CLI: scripts/bootstrap.sh installs Debian's docker-compose "
        "(apt-get install -y docker-compose)"
    )


@pytest.mark.parametrize("profile", ([], ["--profile", "gpu"]))
def test_the_compose_cli_accepts_the_file(profile: list[str]) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FARM_", "COMPOSE_"))}
    r = subprocess.run(
        [*_compose_cli(), "-f", "docker-compose.yml", *profile, "config"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    # And it reads what we read: the same services, the sandbox profile kept.
    resolved = yaml.safe_load(r.stdout)
    expected = set(LONG_RUNNING) | {"s3-bucket", "migrate"}
    # (Compose v1 lists profiled services whatever the profile; v2 does not.)
    least = expected if profile else expected - {"gpu-compile-worker"}
    assert least <= set(resolved["services"]) <= expected
    opts = resolved["services"]["trace-worker"]["security_opt"]
    assert any(o.endswith("deploy/seccomp-bwrap.json") for o in opts), opts
    assert not any(o.startswith("seccomp") and o.endswith("unconfined") for o in opts), opts


# --- services and commands ----------------------------------------------------------


def test_every_part_of_the_farm_is_a_service(compose: dict[str, Any]) -> None:
    assert set(compose["services"]) >= {"redis", "postgres", "s3", "s3-bucket", *FARM_SERVICES}


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


def test_gpu_worker_only_with_its_profile(compose: dict[str, Any]) -> None:
    s = compose["services"]
    assert s["gpu-compile-worker"]["profiles"] == ["gpu"]
    assert all("profiles" not in s[n] for n in FARM_SERVICES if n != "gpu-compile-worker")


def test_start_order(compose: dict[str, Any]) -> None:
    s = compose["services"]
    assert s["migrate"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    for name in ("api", *WORKERS):
        deps = s[name]["depends_on"]
        assert deps["migrate"]["condition"] == "service_completed_successfully", name
        assert deps["redis"]["condition"] == "service_healthy", name
    assert s["api"]["depends_on"]["s3-bucket"]["condition"] == "service_completed_successfully"
    assert s["s3-bucket"]["depends_on"]["s3"]["condition"] == "service_healthy"


# --- environment and secrets --------------------------------------------------------


def test_environment_is_what_the_code_reads(compose: dict[str, Any]) -> None:
    known = {name.upper() for name in Settings.model_fields}
    for name in FARM_SERVICES:
        env = compose["services"][name]["environment"]
        unknown = {k for k in env if k not in known and not k.startswith("AWS_")}
        assert not unknown, f"{name} sets variables nothing reads: {unknown}"
        assert env["DATABASE_URL"].startswith("postgresql+psycopg://")
        assert env["REDIS_URL"].startswith("redis://")
        assert env["BLOB_STORE_URL"].startswith("s3://")
        # Presigned URLs name this endpoint: a name nodes outside the compose
        # network resolve too, mapped to the host inside the containers.
        assert env["S3_ENDPOINT_URL"] == "http://farm.example.net:8333"
        assert "farm.example.net:host-gateway" in compose["services"][name]["extra_hosts"]
        assert "8333:8333" in compose["services"]["s3"]["ports"]


def test_settings_read_the_secret_files_the_services_mount(
    compose: dict[str, Any], tmp_path: Path
) -> None:
    # The files make_secrets.sh writes, read by the real Settings through the
    # paths the api service names.
    secrets = tmp_path / "secrets"
    subprocess.run(
        ["bash", "scripts/make_secrets.sh"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        env={**os.environ, "FARM_SECRETS_DIR": str(secrets)},
    )
    env = dict(compose["services"]["api"]["environment"])
    for key in ("DATABASE_PASSWORD_FILE", "FARM_ADMIN_TOKEN_FILE"):
        host = _secret_path(compose, "api", env[key])
        env[key] = str(secrets / Path(host).name)
    s = Settings(**{k.lower(): v for k, v in env.items() if k.lower() in Settings.model_fields})
    password = (secrets / "postgres_password").read_text().strip()
    token = (secrets / "farm_admin_token").read_text().strip()
    assert len(password) >= 32 and len(token) >= 32
    assert s.resolved_database_url() == f"postgresql+psycopg://farm:{password}@postgres:5432/farm"
    assert s.farm_admin_token == token
    assert s.resolved_broker_url() == "redis://redis:6379/0"
    # PostgreSQL reads the same file.
    pg = compose["services"]["postgres"]
    assert _secret_path(
        compose, "postgres", pg["environment"]["POSTGRES_PASSWORD_FILE"]
    ) == _secret_path(
        compose, "api", compose["services"]["api"]["environment"]["DATABASE_PASSWORD_FILE"]
    )


def test_a_missing_secret_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"cannot read the secret file .*nope"):
        Settings(
            database_url="postgresql+psycopg://farm@db/farm",
            database_password_file=str(tmp_path / "nope"),
        )
    with pytest.raises(ValueError, match="needs a DATABASE_URL with a user"):
        (tmp_path / "pw").write_text("x")
        Settings(
            database_url="postgresql+psycopg://db/farm", database_password_file=str(tmp_path / "pw")
        )


def test_no_password_or_key_is_written_in_the_file(compose: dict[str, Any]) -> None:
    text = (ROOT / "docker-compose.yml").read_text()
    for needle in (
        "POSTGRES_PASSWORD:",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_ACCESS_KEY_ID",
        "MINIO_ROOT",
        "FARM_ADMIN_TOKEN:",
        "secret-key",
        "change-me",
    ):
        assert needle not in text, needle
    for name, svc in compose["services"].items():
        for key, value in (svc.get("environment") or {}).items():
            if "@" in str(value) and "://" in str(value):
                # No user:password@ in a URL.
                assert ":" not in str(value).split("://", 1)[1].split("@")[0], (name, key)


@pytest.mark.parametrize("name", WORKERS)
def test_workers_get_no_admin_token_and_no_name_key(compose: dict[str, Any], name: str) -> None:
    svc = compose["services"][name]
    assert not any(k.startswith(("FARM_ADMIN_TOKEN", "FARM_NAME_KEY")) for k in svc["environment"])
    assert not {"farm_admin_token", "farm_name_key", "s3_admin_credentials", "s3_identities"} & set(
        svc["secrets"]
    )
    # The API has them.
    api = compose["services"]["api"]
    assert {"farm_admin_token", "farm_name_key"} <= set(api["secrets"])


def test_the_farm_uses_application_s3_keys_not_the_servers_admin(
    compose: dict[str, Any], tmp_path: Path
) -> None:
    for name in FARM_SERVICES:
        svc = compose["services"][name]
        path = svc["environment"]["AWS_SHARED_CREDENTIALS_FILE"]
        assert _secret_path(compose, name, path) == "./secrets/s3_farm_credentials", name
        assert "s3_admin_credentials" not in svc["secrets"]
    bucket_step = compose["services"]["s3-bucket"]
    assert (
        _secret_path(
            compose, "s3-bucket", bucket_step["environment"]["AWS_SHARED_CREDENTIALS_FILE"]
        )
        == "./secrets/s3_admin_credentials"
    )
    # What make_secrets.sh writes: the farm's identity may only read, write and
    # list the farm's bucket; its keys are the ones in the farm's credentials.
    secrets = tmp_path / "s"
    subprocess.run(
        ["bash", "scripts/make_secrets.sh"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        env={**os.environ, "FARM_SECRETS_DIR": str(secrets)},
    )
    ids = {
        i["name"]: i for i in json.loads((secrets / "s3_identities.json").read_text())["identities"]
    }
    bucket = compose["services"]["api"]["environment"]["BLOB_STORE_URL"].split("/")[2]
    assert sorted(ids["farm"]["actions"]) == sorted(
        f"{a}:{bucket}" for a in ("Read", "Write", "List")
    )
    assert "Admin" in ids["admin"]["actions"]
    for who, file in (("farm", "s3_farm_credentials"), ("admin", "s3_admin_credentials")):
        ini = ConfigParser()
        ini.read(secrets / file)
        cred = ids[who]["credentials"][0]
        assert ini["default"]["aws_access_key_id"] == cred["accessKey"]
        assert ini["default"]["aws_secret_access_key"] == cred["secretKey"]
    assert ids["farm"]["credentials"][0]["secretKey"] != ids["admin"]["credentials"][0]["secretKey"]
    # The seaweedfs server reads the identities file the script writes.
    s3 = compose["services"]["s3"]
    assert "-s3.config=/run/secrets/s3_identities" in s3["command"]
    assert compose["secrets"]["s3_identities"]["file"] == "./secrets/s3_identities.json"
    for f in SECRET_FILES:
        assert (secrets / f).stat().st_mode & 0o077 in (0, 0o040), f  # never world-readable
    # Kept on a second run: rotation is explicit.
    before = (secrets / "postgres_password").read_text()
    subprocess.run(
        ["bash", "scripts/make_secrets.sh"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        env={**os.environ, "FARM_SECRETS_DIR": str(secrets)},
    )
    assert (secrets / "postgres_password").read_text() == before


def test_every_secret_the_services_mount_is_declared(compose: dict[str, Any]) -> None:
    declared = set(compose["secrets"])
    for name, svc in compose["services"].items():
        assert set(svc.get("secrets") or []) <= declared, name
    for f in SECRET_FILES:
        assert any(s["file"].endswith("/" + f) for s in compose["secrets"].values()), f


def test_the_bucket_step_creates_the_bucket(
    compose: dict[str, Any], s3_server: str, tmp_path: Path
) -> None:
    step = compose["services"]["s3-bucket"]
    assert step["entrypoint"] == ["python", "-c"]
    (code,) = step["command"]
    creds = tmp_path / "creds"
    creds.write_text("[default]\naws_access_key_id = a\naws_secret_access_key = b\n")
    bucket = f"b-{uuid.uuid4().hex[:12]}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(
        S3_ENDPOINT_URL=s3_server,
        FARM_BUCKET=bucket,
        AWS_DEFAULT_REGION="us-east-1",
        AWS_SHARED_CREDENTIALS_FILE=str(creds),
    )
    for _ in range(2):  # and again, as at every `docker compose up`
        r = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
        )
        assert r.returncode == 0, r.stderr
        assert f"bucket {bucket} ready" in r.stdout
    import boto3

    s3 = boto3.client(
        "s3",
        endpoint_url=s3_server,
        aws_access_key_id="a",
        aws_secret_access_key="b",
        region_name="us-east-1",
    )
    assert bucket in [b["Name"] for b in s3.list_buckets()["Buckets"]]
    assert (
        step["environment"]["FARM_BUCKET"]
        == compose["services"]["api"]["environment"]["BLOB_STORE_URL"].split("/")[2]
    )


# --- images -------------------------------------------------------------------------


def test_images_are_pinned(compose: dict[str, Any]) -> None:
    pinned = re.compile(r"^[\w./-]+:(?!latest)[\w.-]*\d[\w.-]*(@sha256:[0-9a-f]{64})?$")
    for name, svc in compose["services"].items():
        image = svc["image"]
        if "build" in svc:
            assert image.startswith("torch-farm:"), name  # built here
            continue
        assert pinned.match(image), f"{name}: {image} is not pinned to a version"
        assert "minio" not in image, "MinIO's images are no longer published"
    docker = (ROOT / "Dockerfile").read_text()
    (base,) = re.findall(r"^ARG PYTHON_IMAGE=(\S+)$", docker, re.M)
    (version,) = re.findall(r"^ARG PYTHON_VERSION=(\S+)$", docker, re.M)
    # The patch version is part of every target: a floating tag would move it.
    assert re.match(rf"^python:{re.escape(version)}-slim(@sha256:[0-9a-f]{{64}})?$", base)
    assert version.count(".") == 2
    assert "FROM ${PYTHON_IMAGE}" in docker
    assert os.access(ROOT / "scripts/pin_images.sh", os.R_OK)


def test_the_image_runs_as_an_unprivileged_user(compose: dict[str, Any]) -> None:
    docker = (ROOT / "Dockerfile").read_text()
    users = re.findall(r"^USER\s+(\S+)", docker, re.M)
    assert users, "no USER: the containers would run as root"
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) >= 1000, users[-1]
    # Its home is FARM_HOME, where the volumes are.
    assert "--home-dir /var/lib/farm" in docker and "HOME=/var/lib/farm" in docker
    for name in FARM_SERVICES:
        assert str(compose["services"][name].get("user", uid)).split(":")[0] not in ("0", "root")
    assert "bubblewrap" in docker


def test_the_image_holds_what_its_services_and_builds_run(compose: dict[str, Any]) -> None:
    """What can be checked of the image without building it: every tool a
    service's healthcheck calls is installed, the build sandbox and compiler
    are, the packages pyproject ships are copied in, the entrypoint exists;
    and for the GPU worker, the CUDA wheel is pinned and what its AOTI
    packages would still need is written where operators read."""
    import tomllib

    docker = (ROOT / "Dockerfile").read_text()
    (apt,) = re.findall(r"apt-get install -y --no-install-recommends ([^\n&\\]+)", docker)
    packages = set(apt.split())
    # Inductor's C++ kernels and CPU AOTI packages; the sandbox; the API's healthcheck.
    assert {"g++", "bubblewrap", "curl"} <= packages, packages
    for name in FARM_SERVICES:
        check = compose["services"][name].get("healthcheck")
        if check:
            tool = check["test"][1]
            assert tool == "python" or tool in packages, (name, tool)
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["project"]["scripts"]["farm"] and 'ENTRYPOINT ["farm"]' in docker
    # Both distributions (the node's and torch-farm-server) are copied and
    # installed, the server with the extras the compose file's services use.
    server = tomllib.loads((ROOT / "server" / "pyproject.toml").read_text())
    copied = set(re.findall(r"^COPY (\w+) \1$", docker, re.M))
    shipped = {p.rstrip("*") for d in (project, server)
               for p in d["tool"]["setuptools"]["packages"]["find"]["include"]}
    assert shipped <= copied, shipped - copied
    assert "COPY server/pyproject.toml server/pyproject.toml" in docker
    (extras,) = re.findall(r'pip install --no-cache-dir \. "\./server\[([\w,]+)\]"', docker)
    assert set(extras.split(",")) <= set(server["project"]["optional-dependencies"])
    gpu = compose["services"]["gpu-compile-worker"]["build"]["args"]
    assert re.fullmatch(r"torch==\d+\.\d+\.\d+", gpu["TORCH_SPEC"]), gpu
    assert re.search(r"/whl/cu\d+$", gpu["TORCH_INDEX"]), gpu
    ops = (ROOT / "docs/operations.md").read_text()
    section = " ".join(ops.split("### The GPU worker's image", 1)[1].split("\n## ", 1)[0].split())
    for need in (
        "cuda_runtime_api.h",
        "libcudart",
        "-devel",
        "NVIDIA container toolkit",
        "do not load",
    ):
        assert need in section, need


def test_the_build_context_leaves_out_secrets_and_environments() -> None:
    ignored = set((ROOT / ".dockerignore").read_text().split())
    assert {".venv", ".git", "secrets", "*.whl", "*.deb"} <= ignored
    r = subprocess.run(["git", "check-ignore", "-q", "secrets/farm_name_key.pem"], cwd=ROOT)
    assert r.returncode == 0, "secrets/ must be git-ignored"


# --- privileges, state, limits, health ----------------------------------------------


@pytest.mark.parametrize("name", WORKERS)
def test_build_workers_sandbox_without_sys_admin(compose: dict[str, Any], name: str) -> None:
    svc = compose["services"][name]
    assert not svc.get("cap_add"), "no added capability: bubblewrap makes a user namespace"
    assert svc["cap_drop"] == ["ALL"]
    opts = svc["security_opt"]
    assert "seccomp=./deploy/seccomp-bwrap.json" in opts
    assert "seccomp=unconfined" not in opts
    assert (ROOT / "deploy/seccomp-bwrap.json").is_file()
    assert svc["pids_limit"] > 0
    # The sandbox is on by default: nothing turns it off in the deployment.
    assert "FARM_SANDBOX" not in svc["environment"]
    assert (
        Settings(
            **{
                k.lower(): v
                for k, v in svc["environment"].items()
                if k.lower() in Settings.model_fields and not k.endswith("_FILE")
            }
        ).farm_sandbox
        == "on"
    )


def test_the_api_runs_no_model_code_and_gets_no_extra_privilege(compose: dict[str, Any]) -> None:
    api = compose["services"]["api"]
    assert not api.get("cap_add") and not api.get("security_opt")


@pytest.mark.parametrize("name", WORKERS)
def test_worker_state_survives_restarts(compose: dict[str, Any], name: str) -> None:
    svc = compose["services"][name]
    home = svc["environment"]["FARM_HOME"]
    (volume,) = svc["volumes"]
    source, target = volume.split(":")[:2]
    # Code packs (FARM_HOME/code), code envs (FARM_HOME/code-env), the compile
    # cache directory and the compiler check (~/.cache, HOME = FARM_HOME).
    assert target == home == "/var/lib/farm"
    assert source in compose["volumes"], "a named volume, not a host path"
    others = [compose["services"][o]["volumes"][0].split(":")[0] for o in WORKERS if o != name]
    assert source not in others, "each pool its own state (their targets differ)"


@pytest.mark.parametrize("name", LONG_RUNNING)
def test_memory_limits_and_healthchecks(compose: dict[str, Any], name: str) -> None:
    svc = compose["services"][name]
    assert re.fullmatch(r"\d+[kmg]", str(svc["mem_limit"])), svc.get("mem_limit")
    assert svc["healthcheck"]["test"], name
    assert svc.get("restart") == "unless-stopped", name


def test_compile_workers_have_room_for_a_build(compose: dict[str, Any]) -> None:
    units = {"k": 2**10, "m": 2**20, "g": 2**30}
    for name in ("cpu-compile-worker", "gpu-compile-worker", "trace-worker"):
        limit = compose["services"][name]["mem_limit"]
        limit_b = int(limit[:-1]) * units[limit[-1]]
        assert limit_b > Settings().build_memory_mb * 2**20, (name, limit)


def test_the_api_healthcheck_is_liveness(compose: dict[str, Any]) -> None:
    test = compose["services"]["api"]["healthcheck"]["test"]
    assert test[-1] == "http://127.0.0.1:8000/livez"
    assert not any("readyz" in part for part in test)


@pytest.mark.parametrize("name", WORKERS)
def test_the_worker_healthcheck_reads_the_heartbeat_file(
    compose: dict[str, Any], name: str, tmp_path: Path
) -> None:
    svc = compose["services"][name]
    alive = svc["environment"]["FARM_WORKER_ALIVE_FILE"]
    test = svc["healthcheck"]["test"]
    assert test[0] == "CMD" and alive in test[-1]
    # Run it as the container would, with the file somewhere of our own.
    mine = tmp_path / "alive"
    argv = [sys.executable if a == "python" else a.replace(alive, str(mine)) for a in test[1:]]
    mine.touch()
    assert subprocess.run(argv).returncode == 0, "a fresh beat is healthy"
    old = time.time() - 3 * Settings().heartbeat_s - 5
    os.utime(mine, (old, old))
    assert subprocess.run(argv).returncode != 0, "three missed beats are not"
    mine.unlink()
    assert subprocess.run(argv, capture_output=True).returncode != 0, "no beat yet is not"


def _pin_images(repo: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", "scripts/pin_images.sh", *args],
        cwd=repo,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_pin_images_writes_a_digest_for_every_pulled_image(tmp_path: Path) -> None:
    # On a copy, with a `docker` that answers `buildx imagetools inspect` as
    # a registry would (no registry is reachable here).
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    (repo / "deploy").mkdir()
    for f in (
        "docker-compose.yml",
        "Dockerfile",
        "scripts/pin_images.sh",
        "deploy/seccomp-bwrap.json",
    ):
        shutil.copy(ROOT / f, repo / f)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "docker"
    fake.write_text('#!/bin/sh\necho "\\"sha256:$(printf %s "$6" | sha256sum | cut -c1-64)\\""\n')
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    # As shipped: versions, not digests; --check says so, naming each image.
    r = _pin_images(repo, env, "--check")
    assert r.returncode == 1 and "not pinned by digest" in r.stderr, r.stderr
    for image in ("redis:", "postgres:", "chrislusf/seaweedfs:", "python:3.11.7-slim"):
        assert image in r.stderr, image
    for _ in range(2):  # and again: a re-pin replaces the digest, never appends one
        r = _pin_images(repo, env)
        assert r.returncode == 0, r.stderr
    data = yaml.safe_load(
        _substitute((repo / "docker-compose.yml").read_text(), {"FARM_S3_HOST": "h"})
    )
    digest = re.compile(r"^[\w./-]+:[\w.-]+@sha256:[0-9a-f]{64}$")
    for name, svc in data["services"].items():
        if "build" not in svc:
            assert digest.match(svc["image"]), (name, svc["image"])
    docker = (repo / "Dockerfile").read_text()
    assert re.search(r"^ARG PYTHON_IMAGE=python:3\.11\.7-slim@sha256:[0-9a-f]{64}$", docker, re.M)
    r = _pin_images(repo, env, "--check")
    assert r.returncode == 0, r.stderr
    # The pinned file is still one the compose CLI and the tests accept.
    r = subprocess.run(
        [*_compose_cli(), "-f", "docker-compose.yml", "config", "-q"],
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("floating", ["redis:latest", "redis"])
def test_pin_images_refuses_a_floating_tag(tmp_path: Path, floating: str) -> None:
    """A digest of `latest` would pin whatever was newest that day: the script
    wants a version first. (test_images_are_pinned keeps the shipped file so.)"""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts/pin_images.sh", repo / "scripts/pin_images.sh")
    shutil.copy(ROOT / "Dockerfile", repo / "Dockerfile")
    text = (ROOT / "docker-compose.yml").read_text()
    (repo / "docker-compose.yml").write_text(
        text.replace("image: redis:7.4.1", f"image: {floating}")
    )
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "docker").write_text('#!/bin/sh\necho "\\"sha256:$(printf %064d 0)\\""\n')
    (bin_dir / "docker").chmod(0o755)
    r = _pin_images(repo, {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"})
    assert r.returncode != 0 and "pin a version first" in r.stderr, (r.stdout, r.stderr)
    assert floating in r.stderr
    # Refused before anything was pinned: the file is as it was.
    assert (repo / "docker-compose.yml").read_text() == text.replace(
        "image: redis:7.4.1", f"image: {floating}"
    )
