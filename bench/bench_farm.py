"""The registry benchmark's farm (bench/registry_load.py): a scratch database
migrated to head, a ``file://`` blob store, read tokens as fleet nodes hold
them, one model version whose build left a few artifacts (one a large blob),
and the API as ``farm serve --workers N`` with its CPU read from /proc.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from loadgen import HOST  # noqa: E402 - bench/ is the script's directory

from farm.core.net import free_port as _free_port  # noqa: E402 - after the path line above

PG_ADMIN_URL = os.environ.get("FARM_BENCH_PG_ADMIN_URL",
                              os.environ.get("FARM_TEST_PG_ADMIN_URL",
                                             "postgresql://postgres@127.0.0.1:5432/postgres"))
MODEL = "bench-llama"
VERSION = "1"
INPUTS = ("int64[1,128]",)
NODE_TARGET = "cpu/python=3.11.7/torch=2.13.0+cpu/isa=avx2/threads=2"
OTHER_TARGETS = (
    "cpu/python=3.11.7/torch=2.13.0+cpu/isa=avx512/threads=2",
    "cuda/gpu=NVIDIA%20H200/cc=9.0/cuda=13.0/triton=3.6/python=3.11.7/torch=2.13.0+cu130",
    "cuda/gpu=NVIDIA%20A100-SXM4-80GB/cc=8.0/cuda=13.0/triton=3.6/python=3.11.7/torch=2.13.0+cu130",
)


class ServerCPU:
    """CPU seconds used by the API server's processes (the parent and its workers)."""

    def __init__(self, pid: int) -> None:
        import psutil

        self.root = psutil.Process(pid)

    def seconds(self) -> float:
        import psutil

        total = 0.0
        procs = [self.root]
        with contextlib.suppress(psutil.Error):
            procs += self.root.children(recursive=True)
        for p in procs:
            with contextlib.suppress(psutil.Error):
                t = p.cpu_times()
                total += t.user + t.system
        return total


def _system_cpu_s() -> float:
    """CPU seconds all processes used since boot (/proc/stat: user .. steal)."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    except OSError:
        return 0.0
    busy = sum(int(x) for i, x in enumerate(fields[:8]) if i not in (3, 4))  # not idle, iowait
    return busy / os.sysconf("SC_CLK_TCK")


class Farm:
    """A scratch farm: database, blob store, tokens and one seeded model version."""

    def __init__(self, args: argparse.Namespace, work: Path, log: Any) -> None:
        self.args = args
        self.work = work
        self.log = log
        self.pg_db: str | None = None
        self.db_url = self._make_database(args.db)
        self.blob_dir = work / "blobs"
        self.admin_token = secrets.token_urlsafe(24)
        self.read_token = ""
        self.node_tokens: list[str] = []
        self.big_digest = ""
        self.big_path = ""
        self.big_size = 0

    def _make_database(self, which: str) -> str:
        if which in ("auto", "postgres"):
            try:
                import psycopg

                with psycopg.connect(PG_ADMIN_URL, autocommit=True, connect_timeout=3) as c:
                    name = f"farm_bench_{secrets.token_hex(4)}"
                    c.execute(f'CREATE DATABASE "{name}"')
                self.pg_db = name
                from sqlalchemy.engine import make_url

                url = make_url(PG_ADMIN_URL).set(drivername="postgresql+psycopg", database=name)
                self.db_kind = f"PostgreSQL (local, scratch database {name})"
                return url.render_as_string(hide_password=False)
            except Exception as exc:
                if which == "postgres":
                    raise SystemExit(f"PostgreSQL unreachable at {PG_ADMIN_URL}: {exc}") from None
                self.log(f"note: PostgreSQL unreachable ({str(exc).strip().splitlines()[0]}); "
                         "using SQLite")
        self.db_kind = "SQLite (WAL, one file)"
        return f"sqlite:///{self.work / 'farm.db'}"

    def drop(self) -> None:
        if self.pg_db is None:
            return
        with contextlib.suppress(Exception):
            import psycopg

            with psycopg.connect(PG_ADMIN_URL, autocommit=True, connect_timeout=3) as c:
                c.execute(f'DROP DATABASE IF EXISTS "{self.pg_db}" WITH (FORCE)')

    def seed(self) -> None:
        from farm.core.specs import JobSpec
        from farm.core.target import Target
        from registry import auth, service
        from registry.blobstore import LocalBlobStore
        from registry.db import Database, upgrade

        upgrade(self.db_url)
        db = Database(self.db_url)
        store = LocalBlobStore(self.blob_dir)
        try:
            self.read_token = auth.create_token(db, "fleet", "read")
            self.node_tokens = [auth.create_token(db, f"node-{i}", "read")
                                for i in range(self.args.node_tokens)]
            # The big blob: random bytes (nothing compresses or dedups them).
            big = self.work / "big.bin"
            left = self.args.blob_mb << 20
            with open(big, "wb") as f:
                while left > 0:
                    n = min(left, 16 << 20)
                    f.write(os.urandom(n))
                    left -= n
            big_info = store.put_file(big)
            big.unlink()
            self.big_digest, self.big_size = big_info.digest, big_info.size
            self.big_path = str(store.path_for(big_info.digest))
            targets = [NODE_TARGET, *OTHER_TARGETS]
            spec = JobSpec.from_json({
                "name": MODEL, "version": VERSION,
                "model": {"entrypoint": "farm.zoo.llama:tiny", "kwargs": {}, "kind": "factory"},
                "inputs": list(INPUTS), "grad_mode": "inference", "options": {},
                "targets": targets,
            })
            job = service.submit_job(db, spec, targets=[Target.parse(t) for t in targets])
            service.start_trace(db, job)
            dispatch = service.record_trace(db, job, {"fingerprint": "b" * 64, "param_count": 1})
            n_art = 0
            for d in dispatch:
                assert service.begin_compile(db, d.build_key, worker_id="bench:1",
                                             heartbeat_max_age_s=60).action == "run"
                infos = {}
                for fmt in ("aoti", "aot_compile"):
                    if d.target == NODE_TARGET and fmt == "aoti":
                        infos[fmt] = big_info
                    else:
                        infos[fmt] = store.put_bytes(os.urandom(1 << 20))
                service.finish_compile(
                    db, d.build_key, target=Target.parse(d.target), spec=spec,
                    fingerprint="b" * 64,
                    artifacts=[service.NewArtifact(
                        digest=i.digest, size=i.size, format=f, verified=True,
                        first_call_compiles=False, max_abs_err=0.0, first_call_s=0.01,
                        load_s=0.1, meta={}) for f, i in infos.items()],
                    compile_s=1.0)
                n_art += len(infos)
            view = service.job_view(db, job)
            if view["state"] != "succeeded":
                raise SystemExit(f"seeding failed: {view}")
            self.n_artifacts = n_art
        finally:
            db.dispose()

    def env(self, *, blob_store_url: str | None = None, extra: dict[str, str] | None = None
            ) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("FARM_", "DATABASE_", "BROKER_", "REDIS_", "BLOB_", "S3_"))}
        env.update({
            "FARM_HOME": str(self.work / "home"),
            "DATABASE_URL": self.db_url,
            "BLOB_STORE_URL": blob_store_url or self.blob_dir.resolve().as_uri(),
            "BROKER_URL": "memory://",
            "FARM_AUTH": "true",
            "FARM_ADMIN_TOKEN": self.admin_token,
            "FARM_NAME_KEY": str(self.work / "name-key.pem"),
            "PYTHONUNBUFFERED": "1",
        })
        env.update(extra or {})
        return env


class Server:
    def __init__(self, farm: Farm, *, workers: int, name: str,
                 blob_store_url: str | None = None, extra_env: dict[str, str] | None = None,
                 ready_timeout_s: float = 60.0) -> None:
        self.port = _free_port()
        self.log_path = farm.work / f"{name}.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        cmd = [sys.executable, "-m", "farm.app.cli", "serve", "--host", HOST,
               "--port", str(self.port), "--workers", str(workers)]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT,
                                     env=farm.env(blob_store_url=blob_store_url,
                                                  extra=extra_env),
                                     start_new_session=True)
        self.cpu = ServerCPU(self.proc.pid)
        self.token = farm.read_token
        self._wait_ready(workers, ready_timeout_s)

    def _wait_ready(self, workers: int, timeout_s: float) -> None:
        import httpx

        # Each API process reads its read model before it answers (a million
        # artifact rows take minutes on a loaded 2-core machine).
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"the API exited with {self.proc.returncode}; log:\n"
                                 f"{self.log_path.read_text()[-3000:]}")
            try:
                r = httpx.get(f"http://{HOST}:{self.port}/healthz", timeout=1, trust_env=False)
                if r.status_code < 500:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        else:
            self.stop()
            raise SystemExit(f"the API did not answer within {timeout_s:.0f} s; log at "
                             f"{self.log_path}")
        if workers > 1:  # each worker must be up, not just the first
            deadline = time.monotonic() + timeout_s
            text = ""
            while time.monotonic() < deadline:
                text = self.log_path.read_text(errors="replace")
                if text.count("Application startup complete") >= workers:
                    break
                time.sleep(0.2)

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=5)
        self._log.close()


def _resolve_path() -> str:
    from urllib.parse import urlencode

    params = [("model", MODEL), ("ref", VERSION), ("target", NODE_TARGET)]
    params += [("input", i) for i in INPUTS]
    return "/v1/resolve?" + urlencode(params)
