"""Registry under fleet load: resolve latency and throughput, blob download rate.

    .venv/bin/python bench/registry_load.py [--db auto|sqlite|postgres] [--workers 2]
        [--rates 250,500,1000] [--duration 10] [--blob-mb 256] [--no-access-log]
        [--s3] [--quick]    (bench/README.md says how to read the table)

Three kinds of process, so the numbers are those of a real deployment:

1. this one (the orchestrator): makes a scratch farm (database migrated to
   head, a ``file://`` blob store, a read token such as a fleet node holds, one
   model version whose build left a few artifacts, one of them a ~256 MB blob),
   then waits while the others work;
2. the API, started as ``farm serve --workers N`` (uvicorn; uvloop and httptools
   when installed, as they are with ``uvicorn[standard]``), auth on;
3. the load generator, a separate process per phase: ``wrk`` for closed-loop
   saturation when it is installed (C, one thread: it leaves the most CPU to
   the server), else, and always for the open-loop phases, an asyncio/uvloop
   generator in this file that speaks HTTP/1.1 keep-alive over raw sockets
   (httptools parses the answers).

Phases:

- open loop at each offered rate: requests leave on a fixed schedule whatever
  the answers do, each latency counted from its *scheduled* send time (no
  coordinated omission: a stalled server shows up as the queue it builds);
- saturation, closed loop: C connections each sending the next request as soon
  as the last one is answered, for wrk and for the Python generator, with the
  shared fleet token;
- first contacts: each of ``--node-tokens`` tokens (one per node) asks once;
- downloads: the large blob through the API (GET /v1/artifacts/{digest}/blob)
  against reading the same file with a plain read loop, alternated, both from
  the page cache (the file is read once first) and, where the page cache can
  be dropped for the file (posix_fadvise), both from disk; a raw loopback TCP
  reference (a forked sender doing only os.sendfile or send from a memory map,
  no HTTP); and the first download of a fresh server (which hashes the blob to
  verify it).
- ``--s3``: the same blob in S3 (moto's server, on this machine): the API's
  307 to a presigned URL, and the rate of fetching through it.

Goals (issue 4), on this 2-core machine: resolve p99 < 20 ms at an offered
1,000 requests/s; >= 3,000 resolves/s at saturation; downloads at >= half the
direct read rate. The generator shares the 2 cores with the server, and so
does whatever else runs on the machine: every row shows the CPU each used.

Every loop is bounded in count and time; everything listens on 127.0.0.1 only.
The table goes to stdout and to ``bench/results/registry_load-<date>.txt``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import os
import platform
import re
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from array import array
from collections import Counter, deque
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from farm.core.net import free_port as _free_port  # noqa: E402 - after the path line above

HOST = "127.0.0.1"
GOAL_P99_MS = 20.0
GOAL_P99_AT_RPS = 1000
GOAL_SATURATION_RPS = 3000.0
GOAL_DOWNLOAD_RATIO = 0.5
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
MAX_CONNS = 1024  # open loop: connections opened at most when the server falls behind
READ_BUF = 4 << 20
SLOW_S = 0.020  # answers slower than this are listed (when and how slow) in the JSON


# --- load generator (a separate process) ---------------------------------------------------


def _request(path: str, token: str, port: int) -> bytes:
    return (f"GET {path} HTTP/1.1\r\nHost: {HOST}:{port}\r\n"
            f"Authorization: Bearer {token}\r\nUser-Agent: farm-bench\r\n\r\n").encode()


class _Conn(asyncio.Protocol):
    """One keep-alive connection, one request in flight at a time (no pipelining:
    a fleet node asks once and waits)."""

    def __init__(self, gen: _Gen) -> None:
        import httptools

        self.gen = gen
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.t_sched = 0.0
        self.busy = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except Exception:  # a parse error: count it, drop the connection
            self.gen.failed(self)
            if self.transport is not None:
                self.transport.close()

    def on_message_complete(self) -> None:
        self.gen.completed(self, self.parser.get_status_code())

    def connection_lost(self, exc: Exception | None) -> None:
        self.gen.lost(self)

    def send(self, req: bytes, t_sched: float) -> None:
        self.t_sched = t_sched
        self.busy = True
        assert self.transport is not None
        self.transport.write(req)


class _Gen:
    """Open loop (``rate`` > 0) or closed loop (``rate`` == 0)."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        self.cfg = cfg
        self.reqs = [_request(cfg["path"], t, cfg["port"]) for t in cfg["tokens"]]
        self.n_req = 0
        self.idle: deque[_Conn] = deque()
        self.pending: deque[float] = deque()
        self.conns: set[_Conn] = set()
        self.opening = 0
        self.tasks: set[asyncio.Future[None]] = set()
        self.lat = array("d")
        self.statuses: Counter[int] = Counter()
        self.errors = 0
        self.measure_from = float("inf")
        self.measure_to = float("inf")
        self.outstanding = 0
        self.closed_loop = cfg["rate"] <= 0
        # Closed loop, each request (token) once: a rollout's first contacts.
        self.once = bool(cfg.get("once"))
        self.stop = False
        self.last_done = 0.0
        self.slow: list[tuple[float, float]] = []  # (seconds into the phase, ms) over SLOW_S

    def next_req(self) -> bytes:
        self.n_req += 1
        return self.reqs[self.n_req % len(self.reqs)]

    def completed(self, conn: _Conn, status: int) -> None:
        now = time.perf_counter()
        conn.busy = False
        self.outstanding -= 1
        if self.measure_from <= conn.t_sched < self.measure_to:
            self.lat.append(now - conn.t_sched)
            self.statuses[status] += 1
            if now - conn.t_sched > SLOW_S and len(self.slow) < 5000:
                self.slow.append((round(conn.t_sched - self.measure_from, 4),
                                  round((now - conn.t_sched) * 1e3, 1)))
        self.last_done = now
        if self.closed_loop:
            if self.once and self.n_req >= len(self.reqs):
                self.stop = True
            if not self.stop:
                self.outstanding += 1
                conn.send(self.next_req(), now)
            return
        if self.pending:
            self.outstanding += 1
            conn.send(self.next_req(), self.pending.popleft())
        else:
            self.idle.append(conn)

    def failed(self, conn: _Conn) -> None:
        if conn.busy:
            conn.busy = False
            self.outstanding -= 1
            self.errors += 1

    def lost(self, conn: _Conn) -> None:
        self.failed(conn)
        self.conns.discard(conn)
        with contextlib.suppress(ValueError):
            self.idle.remove(conn)

    async def open_conn(self) -> _Conn | None:
        loop = asyncio.get_running_loop()
        self.opening += 1
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(lambda: _Conn(self), HOST, self.cfg["port"]), 5.0)
        except (OSError, asyncio.TimeoutError):
            self.errors += 1
            return None
        finally:
            self.opening -= 1
        self.conns.add(conn)
        return conn

    async def _grow(self) -> None:
        conn = await self.open_conn()
        if conn is None:
            return
        if self.pending:
            self.outstanding += 1
            conn.send(self.next_req(), self.pending.popleft())
        else:
            self.idle.append(conn)

    def dispatch(self, t_sched: float) -> None:
        if self.idle:
            self.outstanding += 1
            self.idle.pop().send(self.next_req(), t_sched)
            return
        self.pending.append(t_sched)
        if len(self.conns) + self.opening < MAX_CONNS:
            task = asyncio.ensure_future(self._grow())
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    async def run(self) -> dict[str, Any]:
        cfg = self.cfg
        for conn in await asyncio.gather(*(self.open_conn() for _ in range(cfg["conns"]))):
            if conn is not None:
                self.idle.append(conn)
        if not self.idle:
            raise SystemExit("load generator: cannot connect to the API")
        warmup, duration = cfg["warmup_s"], cfg["duration_s"]
        t0 = time.perf_counter() + 0.01
        self.measure_from = t0 + warmup
        self.measure_to = self.measure_from + duration
        end = self.measure_to
        if self.once:
            self.measure_from, self.measure_to = t0, float("inf")
        if self.closed_loop:
            while self.idle and not (self.once and self.n_req >= len(self.reqs)):
                self.outstanding += 1
                self.idle.pop().send(self.next_req(), t0)
            if self.once:  # until every token has asked once (bounded by the duration)
                while self.outstanding > 0 and time.perf_counter() < t0 + duration:
                    await asyncio.sleep(0.005)
                duration = max(1e-6, self.last_done - t0)
            else:
                await asyncio.sleep(max(0.0, end - time.perf_counter()))
            self.stop = True
        else:
            rate = float(cfg["rate"])
            total = int(rate * (warmup + duration))
            i = 0
            while i < total:  # bounded: `total` sends, each at its time
                now = time.perf_counter()
                while i < total and t0 + i / rate <= now:
                    self.dispatch(t0 + i / rate)
                    i += 1
                if i < total:
                    await asyncio.sleep(max(0.0, t0 + i / rate - time.perf_counter()))
        # Drain what is still in flight, bounded: whatever is left counts as lost.
        drain_until = time.perf_counter() + cfg.get("drain_s", 10.0)
        while (self.outstanding > 0 or self.pending) and time.perf_counter() < drain_until:
            await asyncio.sleep(0.005)
        unanswered = self.outstanding + len(self.pending)
        for c in list(self.conns):
            if c.transport is not None:
                c.transport.close()
        lat = sorted(self.lat)
        return {
            "answered": len(lat), "unanswered": unanswered, "errors": self.errors,
            "statuses": dict(self.statuses), "duration_s": duration,
            "rps": len(lat) / duration, "conns_max": len(self.conns), "slow": self.slow,
            **_percentiles(lat, unanswered),
        }


def _percentiles(lat: list[float], unanswered: int) -> dict[str, float | None]:
    # Unanswered requests count as slower than anything answered.
    n = len(lat) + unanswered
    if n == 0:
        return {"p50_ms": None, "p90_ms": None, "p99_ms": None, "p999_ms": None, "max_ms": None}

    def q(p: float) -> float:
        k = min(n - 1, int(p * n))
        return lat[k] * 1e3 if k < len(lat) else float("inf")

    return {"p50_ms": q(0.50), "p90_ms": q(0.90), "p99_ms": q(0.99), "p999_ms": q(0.999),
            "max_ms": (lat[-1] * 1e3 if lat else None) if not unanswered else float("inf")}


def _http_get_to_null(port: int, path: str, token: str, *, timeout_s: float) -> dict[str, Any]:
    """GET over a plain socket, discarding the body into one reused buffer."""
    buf = bytearray(READ_BUF)
    mv = memoryview(buf)
    t0 = time.perf_counter()
    with socket.create_connection((HOST, port), timeout=timeout_s) as s:
        s.sendall(_request(path, token, port))
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = s.recv(65536)
            if not chunk:
                raise RuntimeError("connection closed before the headers")
            head += chunk
            if len(head) > 1 << 20:
                raise RuntimeError("headers too long")
        hdr, _, rest = head.partition(b"\r\n\r\n")
        lines = hdr.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = {k.strip().lower(): v.strip() for k, _, v in
                   (ln.partition(":") for ln in lines[1:])}
        length = int(headers.get("content-length", "0"))
        got = len(rest)
        deadline = t0 + timeout_s
        while got < length:
            n = s.recv_into(mv)
            if n == 0:
                break
            got += n
            if time.perf_counter() > deadline:
                break
    wall = time.perf_counter() - t0
    return {"status": status, "bytes": got, "length": length, "wall_s": wall,
            "location": headers.get("location")}


def _get_url_to_null(url: str, *, timeout_s: float) -> dict[str, Any]:
    import httpx

    t0 = time.perf_counter()
    got = 0
    with httpx.Client(trust_env=False, timeout=timeout_s) as c, c.stream("GET", url) as r:
        for chunk in r.iter_raw(READ_BUF):
            got += len(chunk)
            if time.perf_counter() - t0 > timeout_s:
                break
        status = r.status_code
    return {"status": status, "bytes": got, "wall_s": time.perf_counter() - t0}


def _drop_cache(path: str) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return True
    except (OSError, AttributeError):
        return False
    finally:
        os.close(fd)


def _read_file(path: str) -> dict[str, Any]:
    buf = bytearray(READ_BUF)
    mv = memoryview(buf)
    got = 0
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while True:
            n = f.readinto(mv)
            if not n:
                break
            got += n
    return {"bytes": got, "wall_s": time.perf_counter() - t0}


def _raw_tcp(path: str, mode: str, *, timeout_s: float) -> dict[str, Any]:
    """The file over a 127.0.0.1 TCP connection from a forked sender that does
    nothing else (``os.sendfile``, or ``send`` from a memory map), no HTTP: a
    reference for what this machine's loopback moves at all."""
    size = os.path.getsize(path)
    with socket.socket() as listener:
        listener.bind((HOST, 0))
        listener.listen(1)
        port = listener.getsockname()[1]
        pid = os.fork()
        if pid == 0:  # the sender; bounded by the deadline, never returns
            code = 0
            try:
                conn, _ = listener.accept()
                with conn, open(path, "rb") as f:
                    deadline = time.monotonic() + timeout_s
                    if mode == "sendfile":
                        off = 0
                        while off < size and time.monotonic() < deadline:
                            off += os.sendfile(conn.fileno(), f.fileno(), off, size - off)
                    else:
                        import mmap

                        view = memoryview(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
                        for off in range(0, size, 8 << 20):
                            if time.monotonic() > deadline:
                                break
                            conn.sendall(view[off:off + (8 << 20)])
            except BaseException:
                code = 1
            os._exit(code)
        buf = bytearray(READ_BUF)
        mv = memoryview(buf)
        got = 0
        t0 = time.perf_counter()
        try:
            with socket.create_connection((HOST, port), timeout=timeout_s) as s:
                while got < size:
                    n = s.recv_into(mv)
                    if not n:
                        break
                    got += n
        finally:
            wall = time.perf_counter() - t0
            _, status = os.waitpid(pid, 0)
    ok = got == size and status == 0
    return {"bytes": got, "wall_s": wall, "status": 200 if ok else 0, "mode": mode}


def loadgen_main(cfg: dict[str, Any]) -> dict[str, Any]:
    kind = cfg["kind"]
    if kind in ("open", "closed"):
        try:
            import uvloop

            uvloop.install()
            loop_name = "uvloop"
        except ImportError:
            loop_name = "asyncio"
        gen = asyncio.run(_Gen(cfg).run())
        gen["loop"] = loop_name
        return gen
    if kind == "transfer":
        # Alternated, so a machine that gets busier or quieter meanwhile
        # weighs on each kind alike.
        only = cfg.get("only", "read,api,raw").split(",")
        out: dict[str, Any] = {k: [] for k in only}
        for _ in range(cfg["repeat"]):
            for k in only:
                if cfg.get("cold"):
                    _drop_cache(cfg["file"])
                if k == "read":
                    out[k].append(_read_file(cfg["file"]))
                elif k == "api":
                    out[k].append(_http_get_to_null(cfg["port"], cfg["path"], cfg["token"],
                                                    timeout_s=cfg["timeout_s"]))
                elif k == "raw":
                    tries = [_raw_tcp(cfg["file"], m, timeout_s=cfg["timeout_s"])
                             for m in ("sendfile", "mmap")]
                    out[k].append(max(tries, key=lambda x: x["bytes"] / x["wall_s"]))
        return out
    if kind == "s3":
        redirects = []
        location = None
        for _ in range(cfg["redirects"]):  # each on a new connection, as nodes would
            r = _http_get_to_null(cfg["port"], cfg["path"], cfg["token"], timeout_s=10)
            if r["status"] != 307 or not r["location"]:
                raise SystemExit(f"expected a 307 to a presigned URL, got {r['status']}")
            redirects.append(r["wall_s"] * 1e3)
            location = r["location"]
        assert location is not None
        runs = [_get_url_to_null(location, timeout_s=cfg["timeout_s"])
                for _ in range(cfg["repeat"])]
        return {"runs": runs, "redirect_ms": redirects}
    raise SystemExit(f"unknown load generator kind {kind!r}")


# --- orchestration --------------------------------------------------------------------------



def _child_run(cmd: list[str], *, timeout_s: float) -> str:
    """Run ``cmd`` to its end (bounded); its stdout. The caller reads the CPU it
    used from RUSAGE_CHILDREN around the call (communicate() reaps it)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise SystemExit(f"load generator ran past {timeout_s:.0f} s: {cmd[:3]}") from None
    if proc.returncode != 0:
        raise SystemExit(f"load generator failed ({proc.returncode}): {err.decode()[-2000:]}")
    return out.decode()


def run_loadgen(cfg: dict[str, Any], *, timeout_s: float) -> tuple[dict[str, Any], float]:
    """A load-generator process; its result and the CPU seconds it used."""
    import resource

    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = _child_run([sys.executable, __file__, "_loadgen", json.dumps(cfg)],
                     timeout_s=timeout_s)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return json.loads(out.strip().splitlines()[-1]), cpu


def run_wrk(port: int, path: str, token: str, *, conns: int, duration_s: float
            ) -> tuple[dict[str, Any], float] | None:
    import resource

    wrk = shutil.which("wrk")
    if wrk is None:
        return None
    cmd = [wrk, "-t1", f"-c{conns}", f"-d{int(duration_s)}s", "--latency", "--timeout", "5s",
           "-H", f"Authorization: Bearer {token}", f"http://{HOST}:{port}{path}"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = _child_run(cmd, timeout_s=duration_s + 30)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    m = re.search(r"Requests/sec:\s+([0-9.]+)", out)
    if m is None:
        raise SystemExit(f"cannot read wrk's output:\n{out}")

    def pct(p: str) -> float | None:
        mm = re.search(rf"^\s+{p}%\s+([0-9.]+)(us|ms|s)\s*$", out, re.M)
        if mm is None:
            return None
        scale = {"us": 1e-3, "ms": 1.0, "s": 1e3}[mm.group(2)]
        return float(mm.group(1)) * scale

    non2xx = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", out)
    errs = re.search(r"Socket errors:.*", out)
    return {"rps": float(m.group(1)), "p50_ms": pct("50"), "p99_ms": pct("99"),
            "non2xx": int(non2xx.group(1)) if non2xx else 0,
            "socket_errors": errs.group(0) if errs else "", "raw": out}, cpu


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
            "FARM_SIGNING_KEY": str(self.work / "signing-key.pem"),
            "PYTHONUNBUFFERED": "1",
        })
        env.update(extra or {})
        return env


class Server:
    def __init__(self, farm: Farm, *, workers: int, name: str,
                 blob_store_url: str | None = None, extra_env: dict[str, str] | None = None
                 ) -> None:
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
        self._wait_ready(workers)

    def _wait_ready(self, workers: int) -> None:
        import httpx

        deadline = time.monotonic() + 60
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
            raise SystemExit(f"the API did not answer within 60 s; log at {self.log_path}")
        if workers > 1:  # each worker must be up, not just the first
            deadline = time.monotonic() + 60
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


def _server_env(args: argparse.Namespace) -> dict[str, str]:
    return {"FARM_ACCESS_LOG": "off"} if args.no_access_log else {}


def _resolve_path() -> str:
    from urllib.parse import urlencode

    params = [("model", MODEL), ("ref", VERSION), ("target", NODE_TARGET)]
    params += [("input", i) for i in INPUTS]
    return "/v1/resolve?" + urlencode(params)


def _check_api(server: Server, farm: Farm) -> None:
    import httpx

    base = f"http://{HOST}:{server.port}"
    h = {"Authorization": f"Bearer {farm.read_token}"}
    r = httpx.get(base + _resolve_path(), headers=h, timeout=10, trust_env=False)
    if r.status_code != 200:
        raise SystemExit(f"resolve answered {r.status_code}: {r.text[:500]}")
    body = r.json()
    if body["artifact"]["digest"] != farm.big_digest:
        raise SystemExit(f"resolve picked {body['artifact']['digest']}, not the seeded blob")
    r = httpx.get(base + f"/v1/artifacts/{farm.big_digest}/blob", timeout=10, trust_env=False,
                  headers={**h, "Range": "bytes=0-1023"})
    if r.status_code != 206 or len(r.content) != 1024:
        raise SystemExit(f"ranged download answered {r.status_code} ({len(r.content)} bytes)")
    r = httpx.get(base + _resolve_path(), timeout=10, trust_env=False)
    if r.status_code != 401:
        raise SystemExit(f"resolve without a token answered {r.status_code}, not 401")


def _mbps(run: dict[str, Any]) -> float:
    return run["bytes"] / run["wall_s"] / 1e6


def _fmt(v: float | None, nd: int = 1) -> str:
    if v is None:
        return "-"
    if v == float("inf"):
        return "inf"
    return f"{v:,.{nd}f}"


def _cpu_pct(cpu_s: float, wall_s: float) -> str:
    return f"{100 * cpu_s / wall_s:.0f}%" if wall_s > 0 else "-"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--db", choices=("auto", "sqlite", "postgres"), default="auto",
                   help="auto: the local PostgreSQL when it answers, else SQLite")
    p.add_argument("--workers", type=int, default=2, help="uvicorn workers (default 2)")
    p.add_argument("--rates", default="250,500,1000", help="offered resolve rates, req/s")
    p.add_argument("--duration", type=float, default=10.0, help="seconds measured per phase")
    p.add_argument("--warmup", type=float, default=2.0, help="seconds before measuring")
    p.add_argument("--conns", type=int, default=64,
                   help="connections (closed loop; the open loop starts with as many "
                        f"and opens more, up to {MAX_CONNS}, when the server falls behind)")
    p.add_argument("--node-tokens", type=int, default=1000,
                   help="distinct read tokens for the one-token-per-node saturation run")
    p.add_argument("--no-access-log", action="store_true",
                   help="run the API with FARM_ACCESS_LOG=off (uvicorn's per-request log off)")
    p.add_argument("--blob-mb", type=int, default=256)
    p.add_argument("--downloads", type=int, default=3, help="timed downloads (and reads)")
    p.add_argument("--s3", action="store_true",
                   help="also measure the presigned S3 hand-off (moto server on 127.0.0.1)")
    p.add_argument("--quick", action="store_true",
                   help="short phases (3 s) and a 64 MB blob: a smoke run, not a measurement")
    p.add_argument("--out", type=Path, default=None,
                   help="where to save the table (default bench/results/registry_load-DATE.txt)")
    p.add_argument("--wait-idle", type=float, default=30.0,
                   help="before each phase, wait up to this long for the rest of the machine "
                        "to use under a quarter of its CPUs (default 30 s)")
    p.add_argument("--keep", action="store_true", help="keep the scratch directory")
    args = p.parse_args(argv)
    if args.quick:
        args.duration, args.warmup, args.blob_mb, args.downloads = 3.0, 1.0, 64, 2
        args.wait_idle = 0.0
        args.node_tokens = min(args.node_tokens, 200)
    rates = [int(r) for r in args.rates.split(",") if r.strip()]
    if not rates or any(r <= 0 or r > 20000 for r in rates):
        raise SystemExit("--rates: positive rates up to 20000")
    args.duration = max(1.0, min(args.duration, 120.0))
    args.warmup = max(0.0, min(args.warmup, 30.0))
    args.conns = max(1, min(args.conns, MAX_CONNS))
    args.node_tokens = max(1, min(args.node_tokens, 10000))
    args.downloads = max(1, min(args.downloads, 20))
    args.wait_idle = max(0.0, min(args.wait_idle, 600.0))

    lines: list[str] = []

    def log(text: str = "") -> None:
        print(text, flush=True)
        lines.append(text)

    work = Path(tempfile.mkdtemp(prefix="farm-bench-"))
    farm = Farm(args, work, log)
    servers: list[Server] = []
    moto: subprocess.Popen[bytes] | None = None
    try:
        print(f"seeding a scratch farm in {work} ({farm.db_kind}) ...", flush=True)
        farm.seed()
        server = Server(farm, workers=args.workers, name="api", extra_env=_server_env(args))
        servers.append(server)
        _check_api(server, farm)
        results = _measure(args, rates, farm, server, log)
        if args.s3:
            moto, s3 = _measure_s3(args, farm, log)
            if s3 is not None:
                servers.append(s3.pop("server"))
                results["s3"] = s3
        _report(args, rates, farm, results, log)
    finally:
        for s in servers:
            s.stop()
        if moto is not None and moto.poll() is None:
            moto.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                moto.wait(timeout=10)
        farm.drop()
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    out = args.out or ROOT / "bench" / "results" / f"registry_load-{dt.date.today()}.txt"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print(f"\nsaved to {out}")
    return 0


class Phase:
    """One measured phase: its result and who used the CPU meanwhile."""

    def __init__(self, server: Server, fn: Any) -> None:
        me0 = os.times()
        s0, all0, t0 = server.cpu.seconds(), _system_cpu_s(), time.perf_counter()
        self.result, self.gen_cpu = fn()
        self.wall = time.perf_counter() - t0
        self.srv_cpu = server.cpu.seconds() - s0
        me1 = os.times()
        mine = (me1.user - me0.user) + (me1.system - me0.system)
        # Everything else on the machine: other users' work competes for the 2 cores.
        self.other_cpu = max(0.0, _system_cpu_s() - all0 - self.srv_cpu - self.gen_cpu - mine)

    def cpu(self) -> str:
        return (f"{_cpu_pct(self.srv_cpu, self.wall)} / {_cpu_pct(self.gen_cpu, self.wall)}"
                f" / {_cpu_pct(self.other_cpu, self.wall)}")


def _wait_idle(args: argparse.Namespace, log: Any, what: str) -> None:
    """Wait (at most ``--wait-idle`` seconds) for a second in which the rest of
    the machine uses under a quarter of its CPUs: other users' work on the same
    2 cores would otherwise decide the numbers. The table shows what they used."""
    deadline = time.monotonic() + args.wait_idle
    ncpu = os.cpu_count() or 1
    busy = 0.0
    while True:
        a = _system_cpu_s()
        time.sleep(1.0)
        busy = (_system_cpu_s() - a) / ncpu
        if busy < 0.25 or time.monotonic() >= deadline:
            break
    if busy >= 0.25:
        log(f"note: the machine was {100 * busy:.0f}% busy with other work before "
            f"'{what}' (waited {args.wait_idle:.0f} s for it to calm down)")


def _measure(args: argparse.Namespace, rates: list[int], farm: Farm, server: Server,
             log: Any) -> dict[str, Any]:
    path = _resolve_path()
    base = {"port": server.port, "path": path, "warmup_s": args.warmup,
            "duration_s": args.duration, "conns": args.conns}
    timeout = args.warmup + args.duration + 60
    res: dict[str, Any] = {"open": {}, "closed": {}, "loadavg": os.getloadavg()}

    # Downloads first, while the server is fresh: the first one verifies the blob.
    blob = f"/v1/artifacts/{farm.big_digest}/blob"
    xfer = {"kind": "transfer", "port": server.port, "path": blob, "token": farm.read_token,
            "file": farm.big_path, "timeout_s": 120}
    print("downloads ...", flush=True)
    run_loadgen({**xfer, "repeat": 1, "only": "read"}, timeout_s=120)  # into the page cache
    first, _ = run_loadgen({**xfer, "repeat": 1, "only": "api"}, timeout_s=180)
    res["dl_first"] = first["api"][0]
    _wait_idle(args, log, "downloads")
    res["warm"] = Phase(server, lambda: run_loadgen({**xfer, "repeat": args.downloads},
                                                    timeout_s=900))
    if _drop_cache(farm.big_path):
        _wait_idle(args, log, "cold downloads")
        res["cold"] = Phase(server, lambda: run_loadgen(
            {**xfer, "repeat": args.downloads, "cold": True, "only": "read,api"}, timeout_s=900))
        run_loadgen({**xfer, "repeat": 1, "only": "read"}, timeout_s=120)  # warm again

    for rate in rates:
        print(f"open loop at {rate} req/s ...", flush=True)
        _wait_idle(args, log, f"open loop at {rate}/s")
        res["open"][rate] = Phase(server, lambda r=rate: run_loadgen(
            {**base, "kind": "open", "rate": r, "tokens": [farm.read_token]}, timeout_s=timeout))
    print("saturation ...", flush=True)
    if shutil.which("wrk") is None:
        log("note: wrk is not installed (apt-get install wrk): saturation is measured with the "
            "Python generator only, which takes more of the 2 cores from the server")
    else:
        run_wrk(server.port, path, farm.read_token, conns=args.conns, duration_s=2)  # warm-up
        _wait_idle(args, log, "saturation (wrk)")
        res["closed"]["wrk"] = Phase(server, lambda: run_wrk(
            server.port, path, farm.read_token, conns=args.conns, duration_s=args.duration))
    _wait_idle(args, log, "saturation (Python)")
    res["closed"]["python"] = Phase(server, lambda: run_loadgen(
        {**base, "kind": "closed", "rate": 0, "tokens": [farm.read_token]}, timeout_s=timeout))
    _wait_idle(args, log, "first contacts")
    res["closed"]["python-nodes"] = Phase(server, lambda: run_loadgen(
        {**base, "kind": "closed", "rate": 0, "tokens": farm.node_tokens, "once": True,
         "warmup_s": 0.0, "duration_s": 60.0}, timeout_s=120))
    return res


def _measure_s3(args: argparse.Namespace, farm: Farm, log: Any
                ) -> tuple[subprocess.Popen[bytes] | None, dict[str, Any] | None]:
    try:
        import boto3
        import moto  # noqa: F401
    except ImportError as exc:
        log(f"note: --s3 needs boto3 and moto[server] ({exc}); skipped")
        return None, None
    from registry.blobstore import open_blob_store

    port = _free_port()
    aws = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_DEFAULT_REGION": "us-east-1", "AWS_REGION": "us-east-1"}
    moto_log = open(farm.work / "moto.log", "wb")  # noqa: SIM115
    moto_proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", HOST,
                                  "-p", str(port)], stdout=moto_log, stderr=subprocess.STDOUT,
                                 env={**os.environ, **aws}, start_new_session=True)
    endpoint = f"http://{HOST}:{port}"
    import httpx

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            httpx.get(f"{endpoint}/moto-api/", timeout=1, trust_env=False)
            break
        except httpx.HTTPError:
            time.sleep(0.2)
    else:
        log("note: moto server did not start; S3 skipped")
        return moto_proc, None
    os.environ.update(aws)
    import boto3

    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="farm-bench")
    url = "s3://farm-bench/blobs"
    store = open_blob_store(url, endpoint_url=endpoint)
    print("uploading the blob to moto ...", flush=True)
    with open(farm.big_path, "rb") as f:
        store.put_stream(f)
    server = Server(farm, workers=args.workers, name="api-s3", blob_store_url=url,
                    extra_env={**_server_env(args), **aws, "S3_ENDPOINT_URL": endpoint})
    print("S3 downloads ...", flush=True)
    out, _ = run_loadgen({"kind": "s3", "port": server.port, "token": farm.read_token,
                          "path": f"/v1/artifacts/{farm.big_digest}/blob", "redirects": 50,
                          "repeat": args.downloads, "timeout_s": 300}, timeout_s=900)
    return moto_proc, {"server": server, **out}


def _env_lines(args: argparse.Namespace, farm: Farm) -> list[str]:
    cpu = platform.processor() or "?"
    with contextlib.suppress(OSError):
        for ln in Path("/proc/cpuinfo").read_text().splitlines():
            if ln.startswith("model name"):
                cpu = ln.split(":", 1)[1].strip()
                break
    try:
        import uvloop  # noqa: F401

        loop = "uvloop"
    except ImportError:
        loop = "asyncio"
    try:
        import httptools  # noqa: F401

        http = "httptools"
    except ImportError:
        http = "h11"
    import uvicorn

    head = "?"
    with contextlib.suppress(Exception):
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                              capture_output=True, text=True, timeout=5).stdout.strip() or "?"
    return [
        f"registry load benchmark  {dt.datetime.now().isoformat(timespec='seconds')}  "
        f"(git {head}, working tree as is)",
        f"machine: {os.cpu_count()} cores ({cpu}); server and load generator share them",
        f"server: farm serve --workers {args.workers} (uvicorn {uvicorn.__version__}, {loop}, "
        f"{http}), access log {'off (FARM_ACCESS_LOG=off)' if args.no_access_log else 'on'}, "
        f"auth on, read token; database: {farm.db_kind}; blobs: file:// on local disk",
        f"data: {MODEL}@{VERSION}, {farm.n_artifacts} artifacts over 4 targets; "
        f"download blob {farm.big_size / 2**20:.0f} MiB",
        f"resolve: GET {_resolve_path()[:60]}...  (one query, as a rollout of one model "
        "sends; the API caches answers for 1 s)",
        f"phases: {args.warmup:.0f} s warm-up + {args.duration:.0f} s measured; open loop starts "
        f"{args.conns} keep-alive connections (more when the server falls behind)",
    ]


def _report(args: argparse.Namespace, rates: list[int], farm: Farm, res: dict[str, Any],
            log: Any) -> None:
    log()
    for ln in _env_lines(args, farm):
        log(ln)
    log()
    rows: list[tuple[str, str, str, str, str]] = []
    hdr = ("measurement", "result", "goal", "vs goal", "CPU: server / gen / others")

    for rate in rates:
        ph = res["open"][rate]
        r = ph.result
        bad = r["unanswered"] + r["errors"] + sum(v for k, v in r["statuses"].items()
                                                   if str(k) != "200")
        result = (f"p50 {_fmt(r['p50_ms'], 2)} ms, p99 {_fmt(r['p99_ms'], 2)} ms, "
                  f"p99.9 {_fmt(r['p999_ms'], 1)} ms; {r['rps']:,.0f}/s answered"
                  + (f"; {bad} failed or not 200" if bad else ""))
        if r["answered"]:
            result += f"; {1e6 * ph.srv_cpu / max(1, r['answered']):.0f} us server CPU each"
        goal = vs = ""
        if rate == GOAL_P99_AT_RPS:
            goal = f"p99 < {GOAL_P99_MS:.0f} ms"
            p99 = r["p99_ms"]
            ok = p99 is not None and p99 < GOAL_P99_MS and not bad
            vs = (f"{GOAL_P99_MS / p99:.1f}x margin" if p99 and p99 != float("inf")
                  else "-") + (" PASS" if ok else " FAIL")
        rows.append((f"resolve, open loop {rate:,}/s offered", result, goal, vs, ph.cpu()))

    def sat_row(label: str, key: str, goal: bool) -> None:
        if key not in res["closed"]:
            return
        ph = res["closed"][key]
        r = ph.result
        if key == "wrk":
            bad = r["non2xx"]
            extra = f"; {bad} not 2xx" if bad else ""
            extra += f"; {r['socket_errors']}" if r["socket_errors"] else ""
        else:
            bad = r["unanswered"] + r["errors"] + sum(v for k, v in r["statuses"].items()
                                                       if str(k) != "200")
            extra = f"; {bad} failed or not 200" if bad else ""
        result = (f"{r['rps']:,.0f} resolves/s (p50 {_fmt(r['p50_ms'], 1)} ms, "
                  f"p99 {_fmt(r['p99_ms'], 1)} ms){extra}")
        n = r["rps"] * (r.get("duration_s") or args.duration)
        if n > 0:
            result += f"; {1e6 * ph.srv_cpu / n:.0f} us server CPU each"
        g = vs = ""
        if goal:
            g = f">= {GOAL_SATURATION_RPS:,.0f}/s"
            vs = f"{r['rps'] / GOAL_SATURATION_RPS:.2f}x " + (
                "PASS" if r["rps"] >= GOAL_SATURATION_RPS and not bad else "FAIL")
        rows.append((label, result, g, vs, ph.cpu()))

    c = args.conns
    sat_row(f"saturation, wrk -t1 -c{c}, fleet token", "wrk", True)
    sat_row(f"saturation, Python gen -c{c}, fleet token", "python", "wrk" not in res["closed"])
    sat_row(f"first contacts: {args.node_tokens} node tokens, once each, -c{c}",
            "python-nodes", False)

    if "wrk" in res["closed"]:
        # What the CPU costs say the 2 cores could answer with nothing else running.
        ph = res["closed"]["wrk"]
        n = ph.result["rps"] * args.duration
        if n > 0:
            per = (ph.srv_cpu + ph.gen_cpu) / n
            rows.append(("  estimate for an idle machine (wrk run)",
                         f"{(os.cpu_count() or 1) / per:,.0f} resolves/s = {os.cpu_count()} cores"
                         f" / ({1e6 * ph.srv_cpu / n:.0f} us server + "
                         f"{1e6 * ph.gen_cpu / n:.0f} us wrk CPU per resolve)", "", "", ""))

    warm = res["warm"].result
    api_runs, read_runs = warm["api"], warm["read"]
    bad_dl = [x for x in [*api_runs, res["dl_first"]]
              if x["status"] != 200 or x["bytes"] != farm.big_size]
    dl_rate = statistics.median(_mbps(x) for x in api_runs)
    read_rate = statistics.median(_mbps(x) for x in read_runs)
    n_dl = len(api_runs)
    ratio = dl_rate / read_rate
    rows.append(("download via API, blob in page cache",
                 f"{dl_rate:,.0f} MB/s (median of {n_dl})"
                 + (f"; {len(bad_dl)} incomplete or not 200" if bad_dl else ""),
                 f">= {GOAL_DOWNLOAD_RATIO:.1f}x direct", f"{ratio:.2f}x of page-cache read " + (
                     "PASS" if ratio >= GOAL_DOWNLOAD_RATIO and not bad_dl else "FAIL"),
                 res["warm"].cpu()))
    rows.append(("  direct read of the file, page cache", f"{read_rate:,.0f} MB/s", "", "", ""))
    if warm.get("raw"):
        sf = statistics.median(_mbps(x) for x in warm["raw"])
        rows.append(("  raw loopback TCP, no HTTP (sendfile/mmap)", f"{sf:,.0f} MB/s", "",
                     f"API download at {dl_rate / sf:.2f}x of it", ""))
    if "cold" in res:
        cold = res["cold"].result
        rc = statistics.median(_mbps(x) for x in cold["read"])
        dc = statistics.median(_mbps(x) for x in cold["api"])
        rows.append(("  direct read from disk (page cache dropped)", f"{rc:,.0f} MB/s", "",
                     f"hot API download {dl_rate / rc:.2f}x of it " + (
                         "PASS" if dl_rate / rc >= GOAL_DOWNLOAD_RATIO else "FAIL"), ""))
        rows.append(("  download via API, page cache dropped", f"{dc:,.0f} MB/s", "",
                     f"{dc / rc:.2f}x of disk read", res["cold"].cpu()))
    rows.append(("  first download of a fresh server (verifies)",
                 f"{_mbps(res['dl_first']):,.0f} MB/s", "", "", ""))
    if "s3" in res:
        runs = res["s3"]["runs"]
        bad = [x for x in runs if x["status"] != 200 or x["bytes"] != farm.big_size]
        s3_rate = statistics.median(_mbps(x) for x in runs)
        redirects = sorted(res["s3"]["redirect_ms"])
        rows.append(("S3 hand-off: the API's 307 to a presigned URL",
                     f"p50 {statistics.median(redirects):.1f} ms, max {redirects[-1]:.1f} ms over "
                     f"{len(redirects)} (new connection each; no bytes through the API)",
                     "", "", ""))
        rows.append(("  GET of the presigned URL from moto",
                     f"{s3_rate:,.0f} MB/s" + (f"; {len(bad)} incomplete" if bad else ""),
                     "", f"{s3_rate / read_rate:.2f}x direct (moto's speed, not S3's)", ""))

    widths = [max(len(r[i]) for r in [hdr, *rows]) for i in range(5)]
    sep = "  "
    log(sep.join(h.ljust(w) for h, w in zip(hdr, widths, strict=True)).rstrip())
    log(sep.join("-" * w for w in widths))
    for r in rows:
        log(sep.join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip())
    log()
    log("CPU: percent of one core over the phase (200% = both cores) used by the API's "
        "processes, the load generator (wrk, C, 1 thread; or this file's uvloop/httptools "
        "client, own process) and everything else on the machine (other users' work competes "
        "for the same 2 cores; load average at the start: "
        f"{res['loadavg'][0]:.2f} {res['loadavg'][1]:.2f} {res['loadavg'][2]:.2f}).")


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "_loadgen":
        print(json.dumps(loadgen_main(json.loads(sys.argv[2]))), flush=True)
        sys.exit(0)
    sys.exit(main())
