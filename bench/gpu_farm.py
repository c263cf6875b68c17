"""Issue 7 in one run on a GPU host: an embedded farm with a CUDA compile
worker builds the benchmark transformer and a ``transformers`` Llama
(default and max-autotune, inference and training), verifies each artifact in
a fresh process, and prints one table of the builds.

    python bench/gpu_farm.py [--out DIR] [--only NAME ...] [--timeout 420]

``scripts/gpu_check.sh`` runs this and then ``bench/coldstart.py --device cuda``
against the same farm, on the device, in one call.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from farm.core.net import free_port  # noqa: E402 - after the path line above

JOBS: dict[str, dict[str, Any]] = {
    # A seconds-long job for a dry run of this script on a CPU host (--device cpu).
    "smoke-mlp": {
        "model": {"entrypoint": "farm.zoo.basic:mlp"},
        "inputs": ["float32[8,64]"],
    },
    "smoke-mlp-train": {
        "model": {"entrypoint": "farm.zoo.basic:mlp"},
        "inputs": ["float32[8,64]"],
        "grad_mode": "training",
    },
    # bench/coldstart.py --device cpu --model transformer --farm-url ... serves this.
    "transformer-cpu": {
        "model": {"entrypoint": "farm.zoo.basic:small_transformer"},
        "inputs": ["float32[4,64,128]"],
    },
    # ...and this its training row (bench/coldstart.py --farm-train-models).
    "transformer-cpu-train": {
        "model": {"entrypoint": "farm.zoo.basic:small_transformer"},
        "inputs": ["float32[4,64,128]"],
        "grad_mode": "training",
    },
    "bench-default": {
        "model": {"entrypoint": "farm.zoo.basic:bench_transformer"},
        "inputs": ["bfloat16[8,512,1024]"],
    },
    "bench-autotune": {
        "model": {"entrypoint": "farm.zoo.basic:bench_transformer"},
        "inputs": ["bfloat16[8,512,1024]"],
        "options": {"mode": "max-autotune-no-cudagraphs"},
    },
    "bench-train": {
        "model": {"entrypoint": "farm.zoo.basic:bench_transformer"},
        "inputs": ["bfloat16[8,512,1024]"],
        "grad_mode": "training",
    },
    "llama-default": {
        "model": {"entrypoint": "farm.zoo.hf:llama"},
        "inputs": ["int64[8,512]"],
    },
    "llama-train": {
        "model": {"entrypoint": "farm.zoo.hf:llama"},
        "inputs": ["int64[2,512]"],
        "grad_mode": "training",
    },
}



def start_farm(
    home: Path, port: int, device: str, *, workers: int = 1
) -> tuple[subprocess.Popen[bytes], dict[str, str]]:
    env = {
        **os.environ,
        "FARM_HOME": str(home),
        # The device named once per compile worker: that many build side by side.
        "FARM_EMBEDDED_DEVICES": ",".join([device] * workers),
        "FARM_AUTH": "false",
        "FARM_URL": f"http://127.0.0.1:{port}",
        "BUILD_TIMEOUT_S": os.environ.get("BUILD_TIMEOUT_S", "420"),
        "BUILD_MEMORY_MB": os.environ.get("BUILD_MEMORY_MB", "64000"),
        "HEARTBEAT_S": "2",
        "PYTHONUNBUFFERED": "1",
    }
    for k in ("DATABASE_URL", "REDIS_URL", "BROKER_URL", "BLOB_STORE_URL"):
        env.pop(k, None)
    home.mkdir(parents=True, exist_ok=True)
    log = open(home / "serve.log", "ab")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "farm.app.cli", "serve", "--embedded", "--port", str(port)],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        cwd=ROOT,
    )
    return proc, env


def wait_ready(
    client: Any, proc: subprocess.Popen[bytes], home: Path, timeout: float, device: str
) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit("farm exited:\n" + (home / "serve.log").read_text()[-4000:])
        try:
            workers = client.targets()
            for w in workers.get("workers", []):
                if w.get("kind") == "compile" and str(w.get("target", "")).startswith(device):
                    return str(w["target"])
        except Exception:
            pass
        time.sleep(1)
    raise SystemExit(
        f"no {device} compile worker registered:\n" + (home / "serve.log").read_text()[-4000:]
    )


def rows_of(name: str, job: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per artifact format the build stored (a build whose AOTI package
    failed keeps its aot_compile artifact: the log line says why)."""
    b = job["builds"][0] if job.get("builds") else {}
    error = (job.get("error") or b.get("error") or "")[:300]
    dropped = " | ".join(
        line[len("dropped: "):][:200]
        for line in (b.get("log") or "").splitlines()
        if line.startswith("dropped: ")
    )
    out = []
    for art in b.get("artifacts") or [{}]:
        meta = art.get("meta") or {}
        verify = meta.get("verify") or {}
        out.append({
            "job": name,
            "format": art.get("format", "-"),
            "state": job["state"],
            "compile_s": meta.get("compile_s") or b.get("compile_s"),
            "bytes": art.get("size"),
            "verified": art.get("verified"),
            "max_abs_err": art.get("max_abs_err"),
            "tol": verify.get("tol") or verify.get("tolerance"),
            "load_s": art.get("load_s"),
            "first_call_s": art.get("first_call_s"),
            "first_call_compiles": art.get("first_call_compiles"),
            # What the package's .so needs from the node's libstdc++ (newest
            # GLIBCXX version), and the compiler that built it.
            "libstdcxx_max": max(
                (v for v in meta.get("libstdcxx_needs") or [] if v.startswith("GLIBCXX_")),
                key=lambda v: [int(x) for x in v.split("_")[1].split(".") if x.isdigit()],
                default=None),
            "cxx": meta.get("cxx"),
            "error": error or (f"dropped: {dropped}" if dropped else ""),
        })
    return out


def fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 0.01 else f"{v:.2f}"
    return str(v)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--out", type=Path, default=Path(os.environ.get("OUT", ROOT / "bench" / "results"))
    )
    p.add_argument("--home", type=Path, default=Path("/tmp/farm-gpu"))
    p.add_argument("--only", nargs="*", default=None)
    p.add_argument("--timeout", type=float, default=420)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--keep", action="store_true", help="leave the farm running (pid in home)")
    p.add_argument("--workers", type=int, default=0,
                   help="compile workers side by side (default: one per job, at most 4)")
    a = p.parse_args(argv)

    from farm.node.client import FarmClient

    # `timeout` (scripts/gpu_check.sh) sends SIGTERM: run the finally below
    # (partial table, or the farm stopped) instead of dying where we stand.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))
    port = free_port()
    default = [n for n in JOBS if not n.startswith(("smoke", "transformer-cpu"))]
    names = [n for n in JOBS if n in (a.only or default)]
    # Serial builds of the three bench jobs with their AOTI packages took
    # longer than one device call (600 s); side by side they share the GPU's
    # 139 GB and the host's 16 cores. Autotune timings then see the other
    # builds' kernels too: fine for a benchmark of load and first call.
    workers = a.workers or max(1, min(4, len(names)))
    proc, env = start_farm(a.home, port, a.device, workers=workers)
    if a.keep:
        # Written at once: a run killed while it waits still names its farm.
        (a.home / "serve.pid").write_text(str(proc.pid))
        (a.home / "url").write_text(env["FARM_URL"])
    os.environ.update({"FARM_URL": env["FARM_URL"], "FARM_HOME": env["FARM_HOME"]})
    client = FarmClient(env["FARM_URL"])
    t0 = time.monotonic()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    target = "?"
    rows: list[dict[str, Any]] = []
    try:
        target = wait_ready(client, proc, a.home, 180, a.device)
        print(
            f"{workers} {a.device} compile worker(s): {target}  "
            f"(first ready after {time.monotonic() - t0:.0f} s)",
            flush=True,
        )
        ids = {}
        for n in names:
            spec = {"name": n, "version": "1", "targets": [a.device], **JOBS[n]}
            ids[n] = client.submit(spec)["id"]
        deadline = time.monotonic() + a.timeout
        for n in names:
            left = max(5.0, deadline - time.monotonic())
            try:
                job = client.wait(ids[n], timeout=left)
            except Exception as exc:  # report and go on: partial results still count
                job = {"state": f"unfinished ({exc.__class__.__name__})", "builds": []}
            for r in rows_of(n, job):
                rows.append(r)
                print(json.dumps(r), flush=True)
            write_table(a.out, stamp, target, rows)
        print(write_table(a.out, stamp, target, rows), flush=True)
        # Non-zero when a build did not end well: gpu_check.sh must not
        # measure a cold start beside a worker that is still compiling.
        return 0 if rows and all(r["state"] == "succeeded" for r in rows) else 3
    finally:
        if not a.keep:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)


def write_table(out: Path, stamp: str, target: str, rows: list[dict[str, Any]]) -> str:
    """The builds so far as a table (.txt) and rows (.json); returns the table."""
    cols = ["job", "format", "state", "compile_s", "bytes", "verified", "max_abs_err", "tol",
            "load_s", "first_call_s", "first_call_compiles", "libstdcxx_max", "cxx", "error"]
    lines = [f"bench/gpu_farm.py on {target}", "  ".join(cols)]
    lines += ["  ".join(fmt(r.get(c)) for c in cols) for r in rows]
    text = "\n".join(lines)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"gpu_farm-{stamp}.txt").write_text(text + "\n")
    (out / f"gpu_farm-{stamp}.json").write_text(json.dumps(rows, indent=1))
    return text


if __name__ == "__main__":
    raise SystemExit(main())
