"""The registry benchmark's table (bench/registry_load.py): what ran where,
then one row per phase with the CPU each process used.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench_farm import MODEL, VERSION, Farm, _resolve_path  # noqa: E402

GOAL_P99_MS = 20.0
GOAL_P99_AT_RPS = 1000
GOAL_SATURATION_RPS = 3000.0
GOAL_DOWNLOAD_RATIO = 0.5


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
