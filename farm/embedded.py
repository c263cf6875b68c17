"""The embedded farm: one machine, no services.

SQLite for metadata, a local directory for blobs and SQLite again as the
Celery broker (kombu's SQLAlchemy transport), all under ``FARM_HOME``; real
Celery worker processes (one trace worker, one compile worker for this
machine's CPU target) run beside the API and stop with it.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from farm.settings import Settings, get_settings

log = logging.getLogger(__name__)


def prepare(settings: Settings | None = None) -> Settings:
    """Create FARM_HOME, migrate the database and make the signing key."""
    from farm.signing import load_or_create_signing_key
    from registry.db import upgrade

    s = settings or get_settings()
    s.farm_home.mkdir(parents=True, exist_ok=True)
    upgrade(s.resolved_database_url())
    if not s.farm_signing_key:
        # Embedded: the farm makes its own key; a deployment configures one.
        load_or_create_signing_key(s.farm_home / "signing-key.pem")
    return s


def embedded_env(settings: Settings) -> dict[str, str]:
    """The environment that the API and the workers share."""
    env = dict(os.environ)
    env.setdefault("FARM_HOME", str(settings.farm_home))
    env.setdefault("DATABASE_URL", settings.resolved_database_url())
    env.setdefault("BROKER_URL", settings.resolved_broker_url())
    env.setdefault("BLOB_STORE_URL", settings.resolved_blob_store_url())
    env.setdefault("FARM_SIGNING_KEY", str(settings.farm_home / "signing-key.pem"))
    return env


@contextmanager
def worker_processes(
    env: dict[str, str], *, devices: tuple[str, ...] = ("cpu",), log_dir: Path | None = None
) -> Iterator[list[subprocess.Popen[bytes]]]:
    """Start one trace worker and one compile worker per device; stop them on exit."""
    procs: list[subprocess.Popen[bytes]] = []
    kinds = [("trace", None)] + [("compile", d) for d in devices]
    try:
        for kind, device in kinds:
            argv = [sys.executable, "-m", "farm.cli", "worker", kind]
            if device:
                argv += ["--device", device]
            out: Any = subprocess.DEVNULL
            if log_dir is not None:
                log_dir.mkdir(parents=True, exist_ok=True)
                name = f"worker-{kind}{'-' + device if device else ''}.log"
                out = open(log_dir / name, "ab")  # noqa: SIM115
            procs.append(
                subprocess.Popen(
                    argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
                )
            )
        yield procs
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + 15
        for p in procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def run_embedded(host: str = "127.0.0.1", port: int = 8000) -> None:
    """`farm serve --embedded`: API in this process, workers beside it."""
    import uvicorn

    s = prepare()
    env = embedded_env(s)
    os.environ.update({k: v for k, v in env.items() if k not in os.environ})
    if host in ("127.0.0.1", "localhost", "::1") and "FARM_AUTH" not in os.environ:
        # One user on one machine, bound to loopback: tokens would only get in the way.
        os.environ["FARM_AUTH"] = "false"
    get_settings.cache_clear()
    from registry.api.app import create_app

    # Which compile workers to start beside the API: this machine's CPU target
    # by default; "cuda" (or "cpu,cuda") on a GPU host.
    devices = tuple(
        d.strip() for d in os.environ.get("FARM_EMBEDDED_DEVICES", "cpu").split(",") if d.strip()
    )
    # uvicorn re-raises the SIGTERM it shut down on once it has restored the
    # handler it found: make that handler unwind this function, so the
    # workers below are stopped with the API rather than left running.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    with worker_processes(env, devices=devices, log_dir=s.farm_home / "logs"):
        print(f"torch-farm (embedded) on http://{host}:{port}  home={s.farm_home}", flush=True)
        uvicorn.run(create_app(), host=host, port=port, log_level="warning")
