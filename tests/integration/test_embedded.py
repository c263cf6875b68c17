"""The embedded default: `farm serve --embedded` with no configuration is a
working farm on one machine (SQLite, a local blob directory, the SQLite
broker, real Celery worker processes beside the API), and stopping it stops
its workers."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from farm.core.target import detect_local_target
from farm.node.cache import ArtifactCache
from farm.node.client import FarmClient
from tests.fixtures.farm import ROOT, free_port
from tests.slowdown import scaled

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SERVICE_VARS = ("DATABASE_URL", "REDIS_URL", "BROKER_URL", "BLOB_STORE_URL", "S3_ENDPOINT_URL",
                "FARM_NAME_KEY", "FARM_BUILDER_KEY", "FARM_ROOT_KEY", "FARM_AUTH",
                "FARM_ADMIN_TOKEN", "FARM_TOKEN", "FARM_URL")


def _cmdline(p: psutil.Process) -> list[str]:
    # A killed worker stays a zombie until the farm reaps it: it has no cmdline.
    try:
        return list(p.cmdline())
    except psutil.Error:
        return []


def test_embedded_farm_builds_serves_and_stops_its_workers(tmp_path: Path) -> None:
    home = tmp_path / "home"
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in SERVICE_VARS}
    env.update({"FARM_HOME": str(home), "HEARTBEAT_S": "2", "PYTHONUNBUFFERED": "1"})
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "farm.app.cli", "serve", "--embedded", "--port", str(port)],
            env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT,
        )
    try:
        client = FarmClient(f"http://127.0.0.1:{port}",
                            cache=ArtifactCache(tmp_path / "node-cache", 1 << 30))
        # The compile worker checks its compiler with an AOTI build before it
        # takes work: minutes on a loaded machine.
        deadline = time.monotonic() + scaled(120)
        target = None
        while target is None and time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()[-3000:]
            try:
                workers = client.targets().get("workers", [])
                target = next((w["target"] for w in workers if w["kind"] == "compile"), None)
            except Exception:
                pass
            time.sleep(0.5)
        assert target == str(detect_local_target("cpu")), log.read_text()[-3000:]
        # Its first line says whether model code is isolated (this machine has
        # bubblewrap: scripts/bootstrap.sh installs it).
        first = log.read_text().splitlines()[0]
        assert first.startswith("torch-farm (embedded) starting on "), first
        assert "builds isolated (bubblewrap sandbox)" in first, first
        workers = [c for c in psutil.Process(proc.pid).children(recursive=True)
                   if "worker" in " ".join(c.cmdline())]
        assert len(workers) >= 2

        job = client.submit({"name": "emb", "version": "1",
                             "model": {"entrypoint": "farm.zoo.basic:mlp"},
                             "inputs": ["float32[2,64]"], "targets": ["cpu"]})
        done = client.wait(job["id"], timeout=600)
        assert done["state"] == "succeeded", done
        # Everything lives under FARM_HOME: SQLite, blobs by digest, the broker.
        assert (home / "farm.db").exists() and (home / "broker.db").exists()
        for art in done["builds"][0]["artifacts"]:
            d = art["digest"]
            assert (home / "blobs" / "sha256" / d[:2] / d[2:]).exists()
        resolved = client.resolve("emb", "1", ["float32[2,64]"], "inference",
                                  detect_local_target("cpu"))
        assert client.fetch(resolved).stat().st_size == resolved["artifact"]["size"]

        # A worker that dies (here: SIGKILL of its process group) is restarted
        # by the embedded farm, which then goes on building.
        dead = next(w for w in workers if "compile" in w.cmdline())
        os.killpg(dead.pid, signal.SIGKILL)
        deadline = time.monotonic() + 60
        fresh: list[psutil.Process] = []
        while not fresh and time.monotonic() < deadline:
            fresh = [c for c in psutil.Process(proc.pid).children(recursive=True)
                     if "compile" in _cmdline(c) and c.pid != dead.pid]
            time.sleep(0.5)
        assert fresh, log.read_text()[-3000:]
        job = client.submit({"name": "emb", "version": "2",
                             "model": {"entrypoint": "farm.zoo.basic:mlp"},
                             "inputs": ["float32[3,64]"], "targets": ["cpu"]})
        assert client.wait(job["id"], timeout=600)["state"] == "succeeded"
        assert "worker exited with -9; restarting it" in log.read_text()
        workers = [c for c in psutil.Process(proc.pid).children(recursive=True)
                   if "worker" in _cmdline(c)]
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
    # Its workers went with it.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(w.is_running() and w.status() != "zombie"
                                              for w in workers):
        time.sleep(0.5)
    assert not any(w.is_running() and w.status() != "zombie" for w in workers)
