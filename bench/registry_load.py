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
import contextlib
import datetime as dt
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench_farm import (  # noqa: E402
    Farm,
    Server,
    _resolve_path,
    _system_cpu_s,
)
from loadgen import HOST, MAX_CONNS, _drop_cache  # noqa: E402 - bench/ is the script's directory
from registry_report import _cpu_pct, _report  # noqa: E402

from farm.core.net import free_port as _free_port  # noqa: E402 - after the path line above

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

    text = json.dumps(cfg)
    if len(text) > 100_000:  # over what one argument may hold: through a file
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            f.write(text)
        text = "@" + f.name
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = _child_run([sys.executable, str(Path(__file__).with_name("loadgen.py")), text],
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


def _server_env(args: argparse.Namespace) -> dict[str, str]:
    return {"FARM_ACCESS_LOG": "off"} if args.no_access_log else {}


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
    p.add_argument("--distinct", action="store_true",
                   help="issue 17's measurement instead: 10,000 distinct resolve questions "
                        "against 100,000 artifact rows, resolve caches off, alone and with "
                        "node reports arriving at --report-rate beside them")
    p.add_argument("--artifact-rows", type=int, default=100_000,
                   help="with --distinct: artifact rows to seed (100 per model; the default "
                        "is issue 17's 100,000)")
    p.add_argument("--report-rate", type=int, default=1000,
                   help="with --distinct: node reports per second (10,000 nodes, one POST "
                        "/v1/reports every 10 s each = 1,000/s)")
    args = p.parse_args(argv)
    if args.distinct:
        return distinct_main(args)
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


# --- issue 17: distinct questions, uncached, with node reports beside --------------------


def _start_loadgen(cfg: dict[str, Any]) -> tuple[subprocess.Popen[bytes], Path]:
    """A load generator running in the background (read with ``_finish_loadgen``)."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        f.write(json.dumps(cfg))
    # Its answer (one JSON line, often over a pipe's 64 KiB) goes to a file.
    out = open(f.name + ".out", "wb")  # noqa: SIM115 - closed by _finish_loadgen
    proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("loadgen.py")),
                             "@" + f.name], stdout=out, stderr=subprocess.PIPE, cwd=ROOT)
    out.close()
    return proc, Path(f.name)


def _finish_loadgen(proc: subprocess.Popen[bytes], cfg_path: Path, *, timeout_s: float
                    ) -> tuple[dict[str, Any], float]:
    import resource

    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    try:
        _, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise SystemExit(f"report generator ran past {timeout_s:.0f} s") from None
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    out_path = Path(str(cfg_path) + ".out")
    out = out_path.read_text()
    cfg_path.unlink(missing_ok=True)
    out_path.unlink(missing_ok=True)
    if proc.returncode != 0:
        raise SystemExit(f"report generator failed: {err.decode()[-2000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return json.loads(out.strip().splitlines()[-1]), cpu


def _with_reports(args: argparse.Namespace, server: Server, bodies: list[dict[str, Any]],
                  cfg: dict[str, Any], timeout: float) -> Any:
    """Run the resolve generator ``cfg`` while another process posts node
    reports at ``--report-rate`` for the same time (its warm-up included)."""
    def run() -> tuple[dict[str, Any], float]:
        rep_cfg = {"kind": "open", "port": server.port, "path": "/v1/reports",
                   "bodies": bodies, "tokens": cfg["tokens"], "rate": args.report_rate,
                   "warmup_s": cfg["warmup_s"], "duration_s": cfg["duration_s"],
                   "conns": 32}
        proc, path = _start_loadgen(rep_cfg)
        res, cpu = run_loadgen(cfg, timeout_s=timeout)
        rep, rep_cpu = _finish_loadgen(proc, path, timeout_s=timeout)
        res["reports"] = rep
        return res, cpu + rep_cpu
    return run


def _stored_reports(db_url: str) -> int:
    from sqlalchemy import func, select

    from registry import models as m
    from registry.db import Database

    db = Database(db_url)
    try:
        with db.session() as s:
            return int(s.scalar(select(func.count()).select_from(m.NodeReport)) or 0)
    finally:
        db.dispose()


def distinct_main(args: argparse.Namespace) -> int:
    import distinct_seed

    # 100 artifact rows per model (10 versions x 10); the questions are
    # 10,000 of their versions whatever the row count.
    distinct_seed.MODELS = max(1000, args.artifact_rows // 100)
    args.blob_mb = 1
    args.node_tokens = min(args.node_tokens, 10)
    if args.db == "sqlite":
        raise SystemExit("--distinct measures PostgreSQL (the issue's setting): use --db "
                         "postgres or auto")
    rates = [int(r) for r in args.rates.split(",") if r.strip()] or [1000]
    lines: list[str] = []

    def log(text: str = "") -> None:
        print(text, flush=True)
        lines.append(text)

    work = Path(tempfile.mkdtemp(prefix="farm-bench-distinct-"))
    farm = Farm(args, work, log)
    if farm.pg_db is None:
        raise SystemExit("--distinct needs PostgreSQL; it is not reachable")
    server: Server | None = None
    try:
        print(f"seeding a scratch farm in {work} ({farm.db_kind}) ...", flush=True)
        farm.seed()
        t0 = time.perf_counter()
        # Past the 100,000 rows, a bulk load with the change triggers off.
        bulk = args.artifact_rows > 100_000
        counts = distinct_seed.seed(farm.db_url, triggers=not bulk)
        log(f"seeded {counts['artifacts']:,} artifact rows ({counts['versions']:,} versions "
            f"of {counts['models']:,} models) in {time.perf_counter() - t0:.0f} s"
            + (" (bulk: change triggers off while seeding)" if bulk else ""))
        paths = distinct_seed.questions()
        bodies = distinct_seed.report_bodies()
        t0 = time.perf_counter()
        server = Server(farm, workers=args.workers, name="api",
                        extra_env={**_server_env(args), "FARM_RESOLVE_CACHE_S": "0"},
                        ready_timeout_s=60 + args.artifact_rows / 1000)
        log(f"API up in {time.perf_counter() - t0:.1f} s; "
            f"{_rss_mb(server):,.0f} MB resident (all its processes)")
        for ln in server.log_path.read_text(errors="replace").splitlines():
            if "read model:" in ln:
                log("  " + ln.strip())
        _check_distinct(server, farm, paths)
        base = {"port": server.port, "paths": paths, "tokens": [farm.read_token],
                "warmup_s": args.warmup, "duration_s": args.duration, "conns": args.conns}
        timeout = args.warmup + args.duration + 120
        res: dict[str, Any] = {}
        for rate in rates:
            print(f"distinct, open loop at {rate}/s ...", flush=True)
            _wait_idle(args, log, f"open loop at {rate}/s")
            res[f"open {rate}"] = Phase(server, lambda r=rate: run_loadgen(
                {**base, "kind": "open", "rate": r}, timeout_s=timeout))
        print("distinct, saturation ...", flush=True)
        _wait_idle(args, log, "saturation")
        res["closed"] = Phase(server, lambda: run_loadgen({**base, "kind": "closed",
                                                           "rate": 0}, timeout_s=timeout))
        before = _stored_reports(farm.db_url)
        for rate in rates:
            print(f"distinct, open loop at {rate}/s with reports ...", flush=True)
            _wait_idle(args, log, f"open loop at {rate}/s with reports")
            res[f"open {rate} +reports"] = Phase(server, _with_reports(
                args, server, bodies, {**base, "kind": "open", "rate": rate}, timeout))
        print("distinct, saturation with reports ...", flush=True)
        _wait_idle(args, log, "saturation with reports")
        res["closed +reports"] = Phase(server, _with_reports(
            args, server, bodies, {**base, "kind": "closed", "rate": 0}, timeout))
        time.sleep(2.0)  # the API writes reports in bulk every 0.5 s
        stored = _stored_reports(farm.db_url) - before
        _distinct_report(args, farm, res, stored, log)
    finally:
        if server is not None:
            server.stop()
        farm.drop()
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    out = args.out or ROOT / "bench" / "results" / f"registry_distinct-{dt.date.today()}.txt"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print(f"\nsaved to {out}")
    return 0


def _rss_mb(server: Server) -> float:
    import psutil

    total = 0
    procs = [psutil.Process(server.proc.pid)]
    with contextlib.suppress(psutil.Error):
        procs += procs[0].children(recursive=True)
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            total += proc.memory_info().rss
    return total / 1e6


def _check_distinct(server: Server, farm: Farm, paths: list[str]) -> None:
    import httpx

    h = {"Authorization": f"Bearer {farm.read_token}"}
    for path in paths[:20]:
        r = httpx.get(f"http://{HOST}:{server.port}{path}", headers=h, timeout=10,
                      trust_env=False)
        if r.status_code != 200:
            raise SystemExit(f"{path} answered {r.status_code}: {r.text[:300]}")
        art = r.json()["artifact"]
        if "avx2" not in art["target"]:
            raise SystemExit(f"{path} got an artifact for {art['target']}")


def _distinct_label(key: str, args: argparse.Namespace) -> str:
    beside = f", reports {args.report_rate:,}/s beside" if key.endswith("+reports") else ""
    if key.startswith("closed"):
        return f"saturation (closed loop, {args.conns} conns){beside}"
    rate = int(key.split()[1])
    return f"open loop, {rate:,} resolves/s offered{beside}"


def _distinct_report(args: argparse.Namespace, farm: Farm, res: dict[str, Any], stored: int,
                     log: Any) -> None:
    from registry_report import _env_lines, _fmt

    log()
    for ln in _env_lines(args, farm):
        if not ln.startswith(("data:", "resolve:")):  # the one-question run's, not this one's
            log(ln)
    log("resolve answer caches off (FARM_RESOLVE_CACHE_S=0): 10,000 distinct (model, version, "
        f"inputs, target) questions in turn against {args.artifact_rows:,} artifact rows")
    log(f"load average when the run ended (1, 5, 15 min): "
        f"{', '.join(f'{x:.1f}' for x in os.getloadavg())}")
    log()
    hdr = ("measurement", "result", "goal", "CPU: server / gens / others",
           "server CPU per resolve")
    rows = []
    for key, ph in res.items():
        r = ph.result
        bad = r["unanswered"] + r["errors"] + sum(v for k, v in r["statuses"].items()
                                                   if str(k) != "200")
        result = (f"p50 {_fmt(r['p50_ms'], 2)} ms, p99 {_fmt(r['p99_ms'], 2)} ms; "
                  f"{r['rps']:,.0f} resolves/s answered"
                  + (f"; {bad} failed or not 200" if bad else ""))
        if "reports" in r:
            rep = r["reports"]
            rbad = rep["unanswered"] + rep["errors"] + sum(
                v for k, v in rep["statuses"].items() if str(k) != "202")
            result += (f"; reports {rep['rps']:,.0f}/s answered, p99 "
                       f"{_fmt(rep['p99_ms'], 2)} ms" + (f", {rbad} failed" if rbad else ""))
        goal = ""
        if key.startswith("open 1000"):
            goal = "p99 < 20 ms " + ("PASS" if r["p99_ms"] is not None and r["p99_ms"] < 20
                                     and not bad else "FAIL")
        elif key.startswith("closed"):
            goal = ">= 3,000/s " + ("PASS" if r["rps"] >= 3000 and not bad else "FAIL")
        label = _distinct_label(key, args)
        answered = r["rps"] * ph.wall
        # Over the phase's whole wall time (the generator's warm-up included,
        # as in the CPU column); with reports beside, their cost is in it.
        per = f"{ph.srv_cpu / answered * 1e3:.3f} ms" if answered else "-"
        rows.append((label, result, goal, ph.cpu(), per))
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(hdr)]
    log(" | ".join(h.ljust(w) for h, w in zip(hdr, widths, strict=True)))
    log("-|-".join("-" * w for w in widths))
    for row in rows:
        log(" | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)))
    log()
    log(f"node reports written to PostgreSQL during the report phases: {stored:,}")


if __name__ == "__main__":
    sys.exit(main())
