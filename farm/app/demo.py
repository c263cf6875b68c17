"""`farm demo`: the whole loop on one machine with nothing but the package.

1. starts an embedded farm (SQLite, a local blob directory, a SQLite broker,
   real Celery workers) in a fresh FARM_HOME;
2. submits the small transformer shipped in ``farm.zoo.basic`` for this
   machine's CPU target and shows the build's progress;
3. acts as a fleet node in new processes: resolves, fetches, verifies, loads
   and runs the farm's artifact; and, for comparison, eager and JIT
   ``torch.compile`` from a cold cache;
4. prints how long each took from process start to its first result, and
   whether the outputs match eager.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from farm.core.net import free_port as _free_port

ENTRYPOINT = "farm.zoo.basic:small_transformer"
INPUT = "float32[4,64,128]"
MODEL = "demo-transformer"


# How often a long wait says what it is waiting for.
SAY_EVERY_S = 10.0


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# --- a fleet node, in a fresh process ----------------------------------------------------


def node(argv: list[str]) -> int:
    """One way to a first result; prints one JSON line. Times from process start."""
    import psutil

    started = psutil.Process().create_time()
    p = argparse.ArgumentParser(prog="farm.app.demo node")
    p.add_argument("--mode", choices=("eager", "jit", "farm"), required=True)
    p.add_argument("--url")
    a = p.parse_args(argv)

    import torch

    from farm.core.inputs import TensorSpec
    from farm.core.modelref import build_module
    from farm.core.specs import ModelRef

    handle = None
    if a.mode == "farm":
        # Resolve, download and verify in the background while the node loads
        # its weights, as a fleet node would.
        from farm.node.client import FarmClient
        from farm.node.compiled import prefetch_compiled

        handle = prefetch_compiled(
            model=MODEL,
            ref="1",
            example_inputs=[INPUT],
            grad_mode="inference",
            device="cpu",
            client=FarmClient(a.url),
        )
    model = build_module(ModelRef(ENTRYPOINT), device="cpu", seed=0)
    assert isinstance(model, torch.nn.Module)
    model.eval()
    spec = TensorSpec.parse(INPUT)
    x = torch.randn(spec.shape, generator=torch.Generator().manual_seed(1))
    source = a.mode
    reason = None
    with torch.no_grad():
        if a.mode == "eager":
            fn: Any = model
        elif a.mode == "jit":
            fn = torch.compile(model, fullgraph=True)
        else:
            assert handle is not None
            fn = handle.bind(model)
            source = getattr(fn, "source", "farm")
            reason = getattr(fn, "reason", None)
        out = fn(x)
        first = time.time() - started
        ref = model(x)
    print(
        json.dumps(
            {
                "mode": a.mode,
                "source": source,
                "reason": reason,
                "first_result_s": first,
                "max_abs_err": float((out - ref).abs().max()),
                "checksum": float(ref.double().sum()),
            }
        ),
        flush=True,
    )
    return 0


def _run_node(mode: str, url: str, work: Path) -> dict[str, Any]:
    cache = Path(tempfile.mkdtemp(prefix=f"node-{mode}-", dir=work))
    env = {
        **os.environ,
        # A cold node: nothing compiled or downloaded yet.
        "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"),
        "CLIENT_CACHE_DIR": str(cache / "artifacts"),
        "FARM_HOME": str(cache / "farm"),
    }
    out = subprocess.run(
        [sys.executable, "-m", "farm.app.demo", "node", "--mode", mode, "--url", url],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    if out.returncode != 0:
        return {"mode": mode, "error": (out.stderr or out.stdout).strip().splitlines()[-1:]}
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


# --- the demo ------------------------------------------------------------------------------


def _start_farm(home: Path, port: int) -> subprocess.Popen[bytes]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k
        not in (
            "DATABASE_URL",
            "REDIS_URL",
            "BROKER_URL",
            "BLOB_STORE_URL",
            "FARM_NAME_KEY",
            "FARM_BUILDER_KEY",
            "FARM_ROOT_KEY",
            "FARM_AUTH",
        )
    }
    env.update({"FARM_HOME": str(home), "FARM_EMBEDDED_DEVICES": "cpu", "PYTHONUNBUFFERED": "1"})
    log = open(home / "serve.log", "ab")  # noqa: SIM115
    return subprocess.Popen(
        [sys.executable, "-m", "farm.app.cli", "serve", "--embedded", "--port", str(port)],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def _port_free(port: int) -> bool:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _serve_log_tail(home: Path) -> str:
    try:
        lines = (home / "serve.log").read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return lines[-1][:120] if lines else ""


def _wait_target(client: Any, proc: subprocess.Popen[bytes], home: Path) -> str:
    start = time.monotonic()
    deadline = start + 180
    said = start
    while time.monotonic() < deadline:
        if time.monotonic() - said >= SAY_EVERY_S:
            # A farm's first start migrates its database and starts workers
            # that import torch: say so rather than sit silent for a minute.
            said = time.monotonic()
            tail = _serve_log_tail(home)
            _say(
                f"      still starting ({said - start:.0f} s): API, trace and compile workers "
                f"importing torch" + (f"; last: {tail}" if tail else "")
            )
        if proc.poll() is not None:
            raise RuntimeError(
                "the embedded farm exited:\n" + (home / "serve.log").read_text()[-3000:]
            )
        try:
            for w in client.targets().get("workers", []):
                if w.get("kind") == "compile" and w.get("target"):
                    return str(w["target"])
        except Exception:
            pass
        time.sleep(0.5)
    raise RuntimeError("no compile worker came up; see " + str(home / "logs"))


def _table(rows: list[dict[str, Any]]) -> str:
    jit = next(
        (r["first_result_s"] for r in rows if r.get("mode") == "jit" and "error" not in r), None
    )
    lines = [
        f"{'path to first result (fresh process, cold caches)':<52} {'seconds':>8} "
        f"{'x JIT':>6}  output vs eager",
        "-" * 90,
    ]
    names = {
        "eager": "eager (no compile)",
        "jit": "JIT torch.compile (cold Inductor cache)",
        "farm": "torch-farm artifact (resolve, fetch, verify, load)",
    }
    for r in rows:
        label = names[r["mode"]]
        if "error" in r:
            lines.append(f"{label:<52} {'FAILED':>8}  {r['error']}")
            continue
        ratio = f"{r['first_result_s'] / jit:.2f}" if jit else "-"
        match = "matches" if r["max_abs_err"] <= 1e-4 else "DIFFERS"
        note = f" (served by {r['source']}: {r['reason']})" if r.get("reason") else ""
        lines.append(
            f"{label:<52} {r['first_result_s']:>8.2f} {ratio:>6}  "
            f"{match} (max abs err {r['max_abs_err']:.1e}){note}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["node"]:
        return node(argv[1:])
    p = argparse.ArgumentParser(prog="farm demo", description=__doc__.splitlines()[0])
    p.add_argument(
        "--home", type=Path, help="FARM_HOME for the demo farm (default: a new temporary directory)"
    )
    p.add_argument(
        "--port", type=int, default=None, help="port for the demo farm's API (default: a free one)"
    )
    p.add_argument("--keep", action="store_true", help="keep the demo's FARM_HOME")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    a = p.parse_args(argv)

    from farm.node.client import FarmClient

    work = Path(tempfile.mkdtemp(prefix="farm-demo-"))
    home = a.home or work / "home"
    home.mkdir(parents=True, exist_ok=True)
    port = a.port or _free_port()
    if a.port and not _port_free(a.port):
        _say(
            f"farm demo: port {a.port} is in use on 127.0.0.1: pick another (--port) or leave "
            "it out for a free one"
        )
        shutil.rmtree(work, ignore_errors=True)
        return 1
    url = f"http://127.0.0.1:{port}"
    _say(f"[1/4] starting an embedded farm at {url} (FARM_HOME={home})")
    proc = _start_farm(home, port)
    ok = False
    try:
        client = FarmClient(url)
        target = _wait_target(client, proc, home)
        _say(f"      compile worker for {target}")
        _say(f"[2/4] submitting {ENTRYPOINT} {INPUT} for that target")
        job = client.submit(
            {
                "name": MODEL,
                "version": "1",
                "model": {"entrypoint": ENTRYPOINT},
                "inputs": [INPUT],
                "targets": [target],
            }
        )
        t0 = time.monotonic()
        last = [""]
        said = [t0]

        def progress(j: dict[str, Any]) -> None:
            states = ", ".join(f"{b['state']}" for b in j.get("builds", []))
            line = f"      {time.monotonic() - t0:5.0f} s  job {j['state']}  build {states}"
            now = time.monotonic()
            if line.split("s  ", 1)[1] != last[0] or now - said[0] >= SAY_EVERY_S:
                last[0], said[0] = line.split("s  ", 1)[1], now
                _say(line)

        job = client.wait(job["id"], timeout=1200, on_progress=progress)
        if job["state"] != "succeeded":
            b = (job.get("builds") or [{}])[0]
            _say(f"build failed: {job.get('error') or b.get('error')}")
            return 1
        b = job["builds"][0]
        _say(
            f"      built in {b['compile_s']:.0f} s: "
            + ", ".join(f"{x['format']} {x['size'] / 1e6:.2f} MB" for x in b["artifacts"])
            + f"; verified in a fresh process (max abs err {b['max_abs_err']:.1e})"
        )
        _say("[3/4] fleet node in new processes: eager, JIT, and the farm's artifact")
        rows = []
        for mode in ("eager", "jit", "farm"):
            r = _run_node(mode, url, work)
            rows.append(r)
            _say(
                f"      {mode}: "
                + (f"{r['first_result_s']:.2f} s" if "error" not in r else f"failed: {r['error']}")
            )
        _say("[4/4] results")
        if a.json:
            print(json.dumps({"target": target, "job": job["id"], "nodes": rows}, indent=1))
        else:
            print(_table(rows))
        ok = all("error" not in r and r["max_abs_err"] <= 1e-4 for r in rows)
        return 0 if ok else 1
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        if a.keep or not ok:
            _say(f"demo files kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
