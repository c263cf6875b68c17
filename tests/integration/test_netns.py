"""The compose file's topology on several "hosts" of one machine: the API,
Redis, PostgreSQL, the S3 server, the trace worker, each compile worker and a
fleet node each in a network namespace of its own, joined to a bridge by a
veth pair, with its own address and the service's usual port (docker-
compose.yml's services, as docs/operations.md spreads them over machines).
Every farm process reaches the others only through the bridge, by address;
the workers get no admin token, as in the compose file.

PostgreSQL is the machine's own server: the postgres host's address is served
by a proxy whose listening socket lives in that namespace (``Netns.listen_in``).
Redis, the S3 server (moto's) and the API are processes in their hosts.

Two faults, one build each:

- a compile host is lost in the middle of a build (every process of it killed
  at once, the namespace gone) and a new host takes its place: the build
  finishes once, on the new host, and the node then resolves, verifies and
  loads the artifact;
- a compile host's cable is pulled in the middle of a build (``ip link set
  ... down``: its packets go nowhere and nobody tells it): the farm sees its
  heartbeat stop and hands the build to the other compile host.

Needs root and iproute2; skipped, with the exact error, where namespaces
cannot be made.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from registry import auth
from tests.fixtures.farm import ADMIN_TOKEN, ROOT, _wait_http
from tests.fixtures.faults import (
    FaultFarm,
    Netns,
    RedisServer,
    TcpProxy,
    farm_spec,
    fault_timing,
    netns_unavailable,
    process_tree,
)
from tests.fixtures.s3 import wait_until_answering
from tests.machine_caches import MACHINE_CACHES
from tests.slowdown import scaled

pytestmark = [pytest.mark.integration, pytest.mark.slow]

NODE = Path(__file__).with_name("node_check.py")
# The hosts started with the farm; compile hosts come and go in the tests.
HOSTS = ("api", "redis", "postgres", "s3", "trace", "node")
PORTS = {"api": 8000, "redis": 6379, "postgres": 5432, "s3": 5000}


@dataclass
class Hosts:
    farm: FaultFarm
    net: Netns
    tag: str
    addr: dict[str, str]  # host -> its address
    keys: dict[str, str]
    node_token: str
    pg: TcpProxy
    tap: EventTap
    compile_hosts: list[str] = field(default_factory=list)

    def ns(self, host: str) -> str:
        return f"farm-{self.tag}-{host}"

    def add_compile_host(self, name: str) -> subprocess.Popen[bytes]:
        """A new machine with a compile worker: its own namespace, address,
        FARM_HOME and the builder key (and nothing of the API's)."""
        ns = self.ns(name)
        self.addr[name] = self.net.add_host(ns)
        home = self.farm.home / name
        home.mkdir()
        self.compile_hosts.append(name)
        return self.farm.start_worker(
            name,
            "compile",
            netns=ns,
            extra_env={
                "FARM_HOME": str(home),
                "FARM_BUILDER_KEY": self.keys["FARM_BUILDER_KEY"],
                "FARM_WORKER_ALIVE_FILE": str(home / "alive"),  # the compose healthcheck's
            },
        )

    def live_compile_hosts(self) -> list[str]:
        return [h for h in self.compile_hosts if self.farm.procs[h].poll() is None]

    def wait_for_compile_workers(self, names: list[str], timeout: float = 90) -> None:
        """Until the farm lists exactly these hosts' compile workers as live."""
        want = {self.farm.procs[n].pid for n in names}
        deadline = time.monotonic() + scaled(timeout)
        seen: set[int] = set()
        with self.farm.http() as c:
            while time.monotonic() < deadline:
                workers = c.get("/v1/targets").json()["workers"]
                seen = {int(w["id"].rsplit(":", 1)[1]) for w in workers if w["kind"] == "compile"}
                if seen == want:
                    return
                time.sleep(0.5)
        raise AssertionError(f"live compile workers {seen}, wanted {want}\n{self.farm.logs()}")

    def run_node(self, *args: str) -> dict[str, Any]:
        """A fleet node on its own host: it knows the API's address and a read
        token, nothing of the database, the broker or S3's keys (S3 only
        through the presigned URLs the API hands it)."""
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("DATABASE_", "REDIS_", "S3_", "AWS_", "BLOB_", "FARM_"))
        }
        env.update(
            FARM_URL=self.farm.url,
            FARM_TOKEN=self.node_token,
            FARM_ROOT_KEY=self.keys["FARM_ROOT_KEY"],
            CLIENT_CACHE_DIR=str(self.farm.home / "node-cache"),
            PYTHONUNBUFFERED="1",
            FARM_ALLOW_HTTP="1",  # plain http on the test's own bridge
            PYTHONPATH=str(ROOT),  # the model's code, which a node has installed
        )
        out = subprocess.run(
            ["ip", "netns", "exec", self.ns("node"), sys.executable, str(NODE), *args],
            env=env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=scaled(300),
        )
        assert out.returncode == 0, out.stdout + out.stderr[-6000:]
        return dict(json.loads(out.stdout.strip().splitlines()[-1]))


class EventTap:
    """Celery's task events as a monitor receives them (Flower, ``celery
    events``): a receiver on the broker host's Redis, in a thread of this
    process, from the fixture's start to its end."""

    def __init__(self, broker_url: str) -> None:
        from celery import Celery

        self.app = Celery(broker=broker_url)
        self.events: list[dict[str, Any]] = []
        self._receiver: Any = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="event-tap", daemon=True)
        self._thread.start()
        assert self._ready.wait(scaled(30)), "the event receiver did not start"

    def _run(self) -> None:
        with self.app.connection_for_read() as conn:
            self._receiver = self.app.events.Receiver(conn, handlers={"*": self.events.append})
            self._ready.set()
            # Until stop(): it looks at should_stop every second.
            self._receiver.capture(limit=None, timeout=None, wakeup=False)

    def of_tasks(self, name: str) -> dict[str, list[dict[str, Any]]]:
        """Task id -> its events, for the tasks named ``name``."""
        ids = {e["uuid"] for e in self.events if e.get("name") == name}
        out: dict[str, list[dict[str, Any]]] = {i: [] for i in ids}
        for e in self.events:
            if e.get("uuid") in out:
                out[e["uuid"]].append(e)
        return out

    def pids(self, name: str, kind: str, *, until: set[int], timeout: float = 30) -> set[int]:
        """The pids that sent a ``kind`` event ("task-started", ...) for a
        task named ``name``, once they include ``until`` or ``timeout`` (s,
        scaled) is up: an event reaches the monitor over the broker after
        what the task wrote to the database, so it may come after the job's
        state."""
        deadline = time.monotonic() + scaled(timeout)
        while True:
            got = {e["pid"] for evs in self.of_tasks(name).values() for e in evs
                   if e["type"] == kind}
            if until <= got or time.monotonic() > deadline:
                return got
            time.sleep(0.2)

    def stop(self) -> None:
        if self._receiver is not None:
            self._receiver.should_stop = True
        self._thread.join(timeout=10)


@pytest.fixture(scope="module")
def hosts(
    make_pg_database: Any, aws_credentials: None, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Hosts]:
    import boto3

    from registry.db import upgrade
    from tests.fixtures.keys import provision

    reason = netns_unavailable()
    if reason:
        pytest.skip(f"network namespaces are not available here: {reason}")
    tag = uuid.uuid4().hex[:4]
    net = Netns(tag=tag, subnet=f"10.{200 + int(tag[:2], 16) % 50}.{int(tag[2:], 16) % 250}")
    home = tmp_path_factory.mktemp("hosts")
    farm: FaultFarm | None = None
    pg: TcpProxy | None = None
    tap: EventTap | None = None
    try:
        net.create_bridge()
        addr = {h: net.add_host(f"farm-{tag}-{h}") for h in HOSTS}
        ns = {h: f"farm-{tag}-{h}" for h in HOSTS}
        # PostgreSQL: the machine's server, served at the postgres host's address.
        db_url = make_pg_database()
        upgrade(db_url)
        pg = TcpProxy(
            ("127.0.0.1", 5432),
            listener=net.listen_in(ns["postgres"], addr["postgres"], PORTS["postgres"]),
        )
        redis = RedisServer(
            home / "redis", port=PORTS["redis"], bind=(addr["redis"],), netns=ns["redis"]
        )
        redis.start()
        s3_url = f"http://{addr['s3']}:{PORTS['s3']}"
        s3_proc = net.spawn(
            ns["s3"],
            [sys.executable, "-m", "moto.server", "-H", addr["s3"], "-p", str(PORTS["s3"])],
            env=dict(os.environ),
            log=home / "s3.log",
        )
        wait_until_answering(s3_url, s3_proc, home / "s3.log")
        s3 = boto3.client("s3", endpoint_url=s3_url, region_name="us-east-1")
        bucket = "farm-hosts"
        s3.create_bucket(Bucket=bucket)
        keys = provision(home, db_url)
        # What every farm process reads (docker-compose.yml's x-farm-env):
        # the other hosts by address, nothing on this machine's loopback.
        # The session's per-machine caches stay: every host of this one
        # machine keeps them (without them each host's worker made the ISA
        # pick and filled precompiled headers under ~/.cache/torch-farm).
        everyone = {
            **{k: v for k, v in os.environ.items()
               if not k.startswith("FARM_") or k in MACHINE_CACHES},
            "DATABASE_URL": db_url.replace(
                "127.0.0.1:5432", f"{addr['postgres']}:{PORTS['postgres']}"
            ),
            "REDIS_URL": redis.url(host=addr["redis"]),
            "BLOB_STORE_URL": f"s3://{bucket}/artifacts",
            "S3_ENDPOINT_URL": s3_url,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
            "FARM_ROOT_KEY": keys["FARM_ROOT_KEY"],
            **fault_timing(),
            # Not the compile cache: a build that hit the first build's kernels
            # could end before its host is cut off.
            "FARM_COMPILE_CACHE": "off",
        }
        url = f"http://{addr['api']}:{PORTS['api']}"
        farm = FaultFarm(
            env=everyone, url=url, home=home, db_url=db_url, bucket=bucket, s3=s3, redis=redis
        )
        farm.procs["s3"] = s3_proc
        # The API's alone: the admin token and the name key.
        (home / "api").mkdir()
        api_env = {
            **everyone,
            "FARM_HOME": str(home / "api"),
            "FARM_ADMIN_TOKEN": ADMIN_TOKEN,
            "FARM_NAME_KEY": keys["FARM_NAME_KEY"],
        }
        farm.procs["api"] = net.spawn(
            ns["api"],
            [
                sys.executable,
                "-m",
                "farm.app.cli",
                "serve",
                "--host",
                addr["api"],
                "--port",
                str(PORTS["api"]),
            ],
            env=api_env,
            log=home / "api.log",
        )
        (home / "trace").mkdir()
        farm.start_worker(
            "trace",
            "trace",
            netns=ns["trace"],
            extra_env={
                "FARM_HOME": str(home / "trace"),
                "FARM_WORKER_ALIVE_FILE": str(home / "trace" / "alive"),
            },
        )
        from registry.db import Database

        db = Database(db_url)
        try:
            node_token = auth.create_token(db, "node", "read")
        finally:
            db.dispose()
        # What Flower would see of the workers, listening from the start.
        tap = EventTap(everyone["REDIS_URL"])
        h = Hosts(
            farm=farm,
            net=net,
            tag=tag,
            addr=addr,
            keys=keys,
            node_token=node_token,
            pg=pg,
            tap=tap,
        )
        h.add_compile_host("compile-a")
        _wait_http(url, farm.procs["api"], home / "api.log")
        h.wait_for_compile_workers(["compile-a"])
        assert not any(k.startswith(("FARM_ADMIN_TOKEN", "FARM_NAME_KEY")) for k in farm.env)
        yield h
    finally:
        if tap is not None:
            tap.stop()  # before the broker stops
        if farm is not None:
            farm.close()
        if pg is not None:
            pg.close()
        net.destroy()


# A build that is still running when its host is lost or cut off: its
# model waits in the compile stage (``slow_in``), at next to no CPU. (A
# linear layer's build took under 2 s once compile children forked warm with
# precompiled headers, and ended before the cut; 8 distinct training layers,
# the model these tests built before, cost each build tens of CPU-seconds.)
# Each test's own width: its own program, so the second test does not reuse
# the first one's build.
SLOW = "tests.models_env:slow_in"


def _slow_kwargs(width: int) -> dict[str, Any]:
    return {"at": "compile", "seconds": scaled(15), "dim": width, "out": width}


def _start_build(farm: FaultFarm, version: str, *, width: int) -> tuple[str, dict[str, Any]]:
    """A job of a model whose training build takes a while, and its build
    once a worker runs it."""
    spec = farm_spec(
        "hosts",
        version,
        SLOW,
        inputs=[f"float32[2,{width}]"],
        kwargs=_slow_kwargs(width),
        grad_mode="training",
    )
    job_id = farm.submit(spec)
    return job_id, farm.wait_build(job_id, lambda b: b["state"] == "running" and b["worker"])


def _into_the_build(pid: int) -> None:
    """Mid-build: once worker ``pid`` runs its sandboxed build child (after the
    code pack's download), and a moment into it."""
    deadline = time.monotonic() + scaled(60)
    while len(process_tree([pid])) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(1)


def _job_state(farm: FaultFarm, job_id: str) -> str:
    with farm.http() as c:
        return str(c.get(f"/v1/jobs/{job_id}").json()["state"])


def test_a_compile_host_lost_mid_build_is_replaced_and_nothing_is_lost(hosts: Hosts) -> None:
    farm, net = hosts.farm, hosts.net
    job_id, build = _start_build(farm, "1", width=13)
    pid = farm.procs["compile-a"].pid
    assert build["worker"].endswith(f":{pid}"), build
    _into_the_build(pid)
    killed = net.kill_host(hosts.ns("compile-a"))
    lost_at = time.monotonic()
    assert farm.procs["compile-a"].wait(timeout=30) == -9
    # The worker and what ran below it (its zygote, the build's sandboxed child).
    assert pid in killed and len(killed) >= 2, killed
    assert _job_state(farm, job_id) != "succeeded", "the build ended before its host was lost"

    # A new machine takes the lost one's place.
    hosts.add_compile_host("compile-b")
    job = farm.wait_job(job_id, timeout=240)
    took = time.monotonic() - lost_at
    assert job["state"] == "succeeded", json.dumps(job, indent=1)[:4000] + farm.logs()
    (b,) = job["builds"]  # built once
    assert b["worker"].endswith(f":{farm.procs['compile-b'].pid}"), b["worker"]
    assert b["attempts"] >= 2, b
    arts = farm.artifacts(b["build_key"])
    assert len(arts) == len({f for f, _ in arts}) >= 1, arts  # one artifact per format
    assert all(farm.blob_in_s3(d) for _, d in arts)
    # A monitor (task events, as Flower gets them) saw the lost host start
    # the compile, and the new one start and finish it.
    new = farm.procs["compile-b"].pid
    started = hosts.tap.pids("farm.compile", "task-started", until={pid, new})
    done = hosts.tap.pids("farm.compile", "task-succeeded", until={new})
    seen = [
        (e["type"], e["pid"], e.get("name"))
        for e in hosts.tap.events
        if e["type"].startswith("task-")
    ]
    assert {pid, new} <= started, (started, seen)
    assert done == {new}, (done, seen)

    # A node on its own host resolves, verifies and loads it.
    result = hosts.run_node(
        "--model",
        "hosts",
        "--ref",
        "1",
        "--entrypoint",
        SLOW,
        "--kwargs",
        json.dumps(_slow_kwargs(13)),
        "--input",
        "float32[2,13]",
        "--train",
    )
    assert (result["format"], result["digest"]) in arts, (result, arts)
    assert result["max_abs_err"] <= 1e-5 and result["max_grad_err"] <= 1e-5, result
    print(
        f"compile-a lost in its build ({len(killed)} processes killed); compile-b "
        f"finished it {took:.1f} s later ({b['attempts']} attempts); the node loaded "
        f"{result['format']} {result['digest'][:12]}"
    )


def test_a_link_cut_mid_compile_is_redelivered_to_another_host(hosts: Hosts) -> None:
    farm, net = hosts.farm, hosts.net
    for name in ("compile-c", "compile-d"):
        if len(hosts.live_compile_hosts()) < 2:
            hosts.add_compile_host(name)
    pair = hosts.live_compile_hosts()
    hosts.wait_for_compile_workers(pair)
    job_id, build = _start_build(farm, "2", width=14)
    victim = farm.name_of_pid(int(build["worker"].rsplit(":", 1)[1]))
    assert victim in pair, (build["worker"], pair)
    (survivor,) = set(pair) - {victim}
    ns = hosts.ns(victim)
    _into_the_build(farm.procs[victim].pid)
    net.cut(ns)
    cut_at = time.monotonic()
    try:
        # Inside: a failure here must still mend the link for the tests after.
        assert _job_state(farm, job_id) != "succeeded", "the build ended before its cable was cut"
        job = farm.wait_job(job_id, timeout=240)
        took = time.monotonic() - cut_at
        assert job["state"] == "succeeded", json.dumps(job, indent=1)[:4000]
        (b,) = job["builds"]
        assert b["worker"].endswith(f":{farm.procs[survivor].pid}"), (b["worker"], survivor)
        assert b["attempts"] >= 2, b
        key = b["build_key"]
        arts = farm.artifacts(key)
        assert len(arts) == len({f for f, _ in arts}) >= 1, arts
        assert all(farm.blob_in_s3(d) for _, d in arts)
        # The cut host is still running, just cut off: it is not dead, only
        # unreachable, and must not have committed anything.
        assert farm.procs[victim].poll() is None
    finally:
        net.mend(ns)
    mended_at = time.time()
    # Mended, the cut host beats again within seconds (a CI run once found its
    # heartbeat file over 30 s old after the mend, and the compose
    # healthcheck called it dead; registry.db bounds a database call stuck
    # in TCP's retransmit backoff).
    alive = farm.home / victim / "alive"
    deadline = time.monotonic() + scaled(30)
    while alive.stat().st_mtime < mended_at and time.monotonic() < deadline:
        time.sleep(0.2)
    assert alive.stat().st_mtime >= mended_at, f"{victim} has not beaten since its link was mended"
    beat_after = alive.stat().st_mtime - mended_at
    # And its late attempt (if it gets one in) adds no second artifact: one
    # per format, still.
    assert farm.artifacts(key) == arts
    print(
        f"{victim}'s link cut in its compile: the build finished on {survivor} "
        f"{took:.1f} s later ({b['attempts']} attempts), one artifact per format; mended, "
        f"it beat again {beat_after:.1f} s later"
    )


def test_every_part_runs_on_its_own_host_and_reaches_only_by_address(hosts: Hosts) -> None:
    """Each service's process is in its host's namespace, and a worker host
    reaches the services only at their hosts' addresses: this machine's
    PostgreSQL and Redis on the loopback are out of its reach."""
    farm, net = hosts.farm, hosts.net
    assert farm.redis is not None and farm.redis.proc is not None
    placed = {
        "api": farm.procs["api"].pid,
        "s3": farm.procs["s3"].pid,
        "redis": farm.redis.proc.pid,
        "trace": farm.procs["trace"].pid,
    }
    placed.update({h: farm.procs[h].pid for h in hosts.live_compile_hosts()})
    for host, pid in placed.items():
        assert net.host_of(pid) == hosts.ns(host), (host, pid)
    trace = hosts.ns("trace")
    for service in ("postgres", "redis", "s3", "api"):
        assert net.reaches(trace, hosts.addr[service], PORTS[service]), service
    assert not net.reaches(trace, "127.0.0.1", 5432)  # the machine's PostgreSQL
    assert not net.reaches(trace, "127.0.0.1", 6379)  # the machine's Redis
    node = hosts.ns("node")
    assert net.reaches(node, hosts.addr["api"], PORTS["api"])
    assert hosts.pg.accepted > 0  # the farm's database traffic came through the postgres host


def test_the_compose_healthcheck_passes_for_every_live_worker(hosts: Hosts) -> None:
    """docker-compose.yml's worker healthcheck, run as written against each
    real worker's heartbeat file (FARM_WORKER_ALIVE_FILE)."""
    import yaml

    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    check = compose["services"]["trace-worker"]["healthcheck"]["test"]
    alive = compose["services"]["trace-worker"]["environment"]["FARM_WORKER_ALIVE_FILE"]
    assert check[:2] == ["CMD", "python"], check
    for host in ("trace", *hosts.live_compile_hosts()):
        mine = hosts.farm.home / host / "alive"
        argv = [sys.executable, *(a.replace(alive, str(mine)) for a in check[2:])]
        r = subprocess.run(argv, capture_output=True, text=True, timeout=30)
        assert r.returncode == 0, (host, r.stderr)
        # It beats on: the file's time moves with the heartbeat (1 s here).
        before = mine.stat().st_mtime
        deadline = time.monotonic() + scaled(10)
        while mine.stat().st_mtime == before and time.monotonic() < deadline:
            time.sleep(0.2)
        assert mine.stat().st_mtime > before, host
