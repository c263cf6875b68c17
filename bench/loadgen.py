"""The registry benchmark's load generator, run as its own process by
bench/registry_load.py (``loadgen.py CONFIG_JSON``; one JSON line out), so its
CPU is counted apart from the server's.

An asyncio/uvloop client that speaks HTTP/1.1 keep-alive over raw sockets
(httptools parses the answers): open loop at a fixed offered rate (each
latency from its scheduled send time) or closed loop over C connections; and
the download references (a blob through the API to /dev/null, a plain read of
the same file, a raw loopback TCP sender). Why raw sockets and not httpx:
bench/README.md ("the load generator") has the measurement.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import sys
import time
from array import array
from collections import Counter, deque
from typing import Any

HOST = "127.0.0.1"
MAX_CONNS = 1024  # open loop: connections opened at most when the server falls behind
READ_BUF = 4 << 20
SLOW_S = 0.020  # answers slower than this are listed (when and how slow) in the JSON


# --- load generator (a separate process) ---------------------------------------------------


def _request(path: str, token: str, port: int, body: bytes | None = None) -> bytes:
    if body is None:
        return (f"GET {path} HTTP/1.1\r\nHost: {HOST}:{port}\r\n"
                f"Authorization: Bearer {token}\r\nUser-Agent: farm-bench\r\n\r\n").encode()
    return (f"POST {path} HTTP/1.1\r\nHost: {HOST}:{port}\r\n"
            f"Authorization: Bearer {token}\r\nUser-Agent: farm-bench\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
            ).encode() + body


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
        # Requests in turn: one per token (one path), or, with "paths", one
        # per path (distinct questions: the issue 17 measurement, no two alike
        # in a row); with "bodies", POSTs of each body to "path".
        if cfg.get("bodies"):
            self.reqs = [_request(cfg["path"], cfg["tokens"][i % len(cfg["tokens"])],
                                  cfg["port"], json.dumps(b).encode())
                         for i, b in enumerate(cfg["bodies"])]
        elif cfg.get("paths"):
            self.reqs = [_request(p, cfg["tokens"][i % len(cfg["tokens"])], cfg["port"])
                         for i, p in enumerate(cfg["paths"])]
        else:
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
        self._serve_or_idle(conn)

    def _serve_or_idle(self, conn: _Conn) -> None:
        """Give a free connection the oldest scheduled request, or park it."""
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
        if conn is not None:
            self._serve_or_idle(conn)

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


if __name__ == "__main__":
    # "@FILE": the config is in FILE (10,000 distinct paths do not fit in one
    # argument: Linux takes at most 128 KiB per argument).
    arg = sys.argv[1]
    if arg.startswith("@"):
        with open(arg[1:]) as f:
            arg = f.read()
    result = json.dumps(loadgen_main(json.loads(arg)))
    # uvloop may leave stdout non-blocking: a line over the pipe's 64 KiB
    # would then be cut short (and the orchestrator could not parse it).
    os.set_blocking(sys.stdout.fileno(), True)
    print(result, flush=True)
