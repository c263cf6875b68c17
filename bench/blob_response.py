"""The API's blob download path against Starlette's FileResponse (issue 11).

    .venv/bin/python bench/blob_response.py [--mb 256] [--rounds 4]

One uvicorn process serves the same file two ways: ``/hand`` through
registry.api.artifacts' own stream (a verified file is sent from a memory map,
slices the page cache holds going straight to the socket; the first serve
hashes it), ``/file`` through ``starlette.responses.FileResponse`` (64 KB reads
in a worker thread, no digest check). A client here downloads each in turn,
round after round; the first round is left out of the medians (it warms the
page cache and verifies the file once). Server CPU is read from /proc for the
uvicorn process: on a 2-core machine that is what a download takes from the
resolves beside it.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def app():  # type: ignore[no-untyped-def]
    """The ASGI app of the server process (``uvicorn --factory``)."""
    from types import SimpleNamespace

    from starlette.applications import Starlette
    from starlette.responses import FileResponse, StreamingResponse
    from starlette.routing import Route

    from registry.api import artifacts

    path, digest = os.environ["BENCH_BLOB"], os.environ["BENCH_DIGEST"]
    state = SimpleNamespace(verified_files={})

    async def file_response(request):  # type: ignore[no-untyped-def]
        return FileResponse(path, media_type="application/octet-stream")

    async def hand(request):  # type: ignore[no-untyped-def]
        f, st = artifacts._open_local(path, digest)
        body = artifacts._stream_file(state, f, st, digest, start=0, length=st.st_size)  # type: ignore[arg-type]
        return StreamingResponse(body, media_type="application/octet-stream",
                                 headers={"Content-Length": str(st.st_size)})

    return Starlette(routes=[Route("/file", file_response), Route("/hand", hand)])


def main() -> None:
    import httpx
    import psutil

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=int, default=256)
    p.add_argument("--rounds", type=int, default=4)
    a = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="farm-bench-blob-") as d:
        blob = Path(d) / "blob.bin"
        h = hashlib.sha256()
        with open(blob, "wb") as f:
            for _ in range(a.mb):
                chunk = os.urandom(1 << 20)
                h.update(chunk)
                f.write(chunk)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = {**os.environ, "BENCH_BLOB": str(blob), "BENCH_DIGEST": h.hexdigest(),
               "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'bench'}"}
        srv = subprocess.Popen([sys.executable, "-m", "uvicorn", "--factory", "blob_response:app",
                                "--port", str(port), "--log-level", "warning",
                                "--no-access-log"], env=env, cwd=ROOT)
        try:
            proc = psutil.Process(srv.pid)
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 60
            while True:
                try:
                    httpx.get(url + "/missing", timeout=2)
                    break
                except httpx.HTTPError:
                    if time.monotonic() > deadline or srv.poll() is not None:
                        raise SystemExit("the server did not start") from None
                    time.sleep(0.2)
            rows: dict[str, list[tuple[float, float]]] = {"hand": [], "file": []}
            with httpx.Client(base_url=url, timeout=300) as c:
                for _ in range(a.rounds):
                    for route in rows:
                        cpu0 = sum(proc.cpu_times()[:2])
                        t0 = time.perf_counter()
                        n = 0
                        with c.stream("GET", "/" + route) as r:
                            for chunk in r.iter_raw(1 << 20):
                                n += len(chunk)
                        took = time.perf_counter() - t0
                        assert n == a.mb << 20, (route, n)
                        rows[route].append((n / took / 1e6, sum(proc.cpu_times()[:2]) - cpu0))
        finally:
            srv.terminate()
            srv.wait(timeout=30)
    print(f"{a.mb} MB blob, {a.rounds} rounds (first left out), load average "
          f"{os.getloadavg()[0]:.1f} at the end")
    for route, name in (("hand", "registry.api.artifacts (mmap)"), ("file", "FileResponse")):
        v = rows[route][1:] or rows[route]
        print(f"{name:32s} {statistics.median(x for x, _ in v):7.0f} MB/s   server CPU "
              f"{statistics.median(y for _, y in v) * 1000 / a.mb * 1024:6.0f} ms per GB")


if __name__ == "__main__":
    main()
