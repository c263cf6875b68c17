"""Why bench/loadgen.py speaks HTTP/1.1 over raw sockets instead of using httpx:
the client CPU each request costs (issue 11 asked for a measurement).

    .venv/bin/python bench/client_cost.py [--seconds 3] [--conns 64]

One uvicorn process (uvloop, httptools) answers ``GET /ok`` with a small JSON
body. Each client runs closed loop over ``--conns`` keep-alive connections in
its own process, one after the other: bench/loadgen.py's generator, then
``httpx.AsyncClient`` (the library the farm's client uses). The CPU each used
comes from RUSAGE_CHILDREN; on a 2-core machine whatever a client burns is
taken from the server it measures.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from farm.core.net import free_port  # noqa: E402 - after the path line above

HTTPX_CLIENT = """
import asyncio, json, sys, time
import httpx
port, seconds, conns = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
async def main():
    limits = httpx.Limits(max_connections=conns, max_keepalive_connections=conns)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", limits=limits) as c:
        n = 0
        end = time.perf_counter() + seconds
        async def worker():
            nonlocal n
            while time.perf_counter() < end:
                r = await c.get("/ok", headers={"Authorization": "Bearer x"})
                assert r.status_code == 200
                n += 1
        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(conns)))
        print(json.dumps({"answered": n, "wall_s": time.perf_counter() - t0}))
asyncio.run(main())
"""


def app():  # type: ignore[no-untyped-def]
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    async def ok(request):  # type: ignore[no-untyped-def]
        return JSONResponse({"ok": True, "artifact": {"digest": "0" * 64, "size": 123}})

    return Starlette(routes=[Route("/ok", ok)])


def child(cmd: list[str]) -> tuple[dict[str, float], float]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=True,
                         cwd=BENCH).stdout
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return json.loads(out.strip().splitlines()[-1]), cpu


def main() -> None:
    import httpx

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--conns", type=int, default=64)
    a = p.parse_args()
    port = free_port()
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{BENCH}"}
    srv = subprocess.Popen([sys.executable, "-m", "uvicorn", "--factory", "client_cost:app",
                            "--port", str(port), "--log-level", "warning", "--no-access-log"],
                           env=env, cwd=BENCH)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                httpx.get(f"http://127.0.0.1:{port}/ok", timeout=2)
                break
            except httpx.HTTPError:
                if time.monotonic() > deadline or srv.poll() is not None:
                    raise SystemExit("the server did not start") from None
                time.sleep(0.2)
        cfg = {"kind": "closed", "rate": 0, "tokens": ["x"], "port": port, "path": "/ok",
               "conns": a.conns, "warmup_s": 0.5, "duration_s": a.seconds}
        raw, raw_cpu = child([sys.executable, str(BENCH / "loadgen.py"), json.dumps(cfg)])
        hx, hx_cpu = child([sys.executable, "-c", HTTPX_CLIENT, str(port), str(a.seconds),
                            str(a.conns)])
    finally:
        srv.terminate()
        srv.wait(timeout=30)
    raw_n = raw.get("answered") or sum(raw.get("statuses", {}).values())
    print(f"closed loop, {a.conns} connections, {a.seconds:.0f} s each, load average "
          f"{os.getloadavg()[0]:.1f}")
    for name, n, wall, cpu in (
            ("bench/loadgen.py (raw sockets)", raw_n, a.seconds + 0.5, raw_cpu),
            ("httpx.AsyncClient", hx["answered"], hx["wall_s"], hx_cpu)):
        print(f"{name:32s} {n / wall:8,.0f} req/s   client CPU {1e6 * cpu / max(1, n):6.0f} us "
              "per request (process start included)")


if __name__ == "__main__":
    main()
