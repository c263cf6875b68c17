"""Several hosts on one machine: the API, Redis, PostgreSQL and S3 in the root
network namespace, each worker on a "host" of its own (a network namespace
joined to a bridge by a veth pair, with its own address). A compile host's
cable is pulled in the middle of a build (``ip link set ... down``: its
packets go nowhere and nobody tells it); the farm sees its heartbeat stop,
hands the build to the other compile host, and the job finishes with one
artifact per format.

Needs root and iproute2; skipped, with the exact error, where namespaces
cannot be made.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Iterator

import pytest

from tests.fixtures.faults import (
    FaultFarm,
    MakeFarm,
    Netns,
    RedisServer,
    TcpProxy,
    farm_spec,
    netns_unavailable,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

HOSTS = ("trace", "compile-a", "compile-b")


@pytest.fixture(scope="module")
def hosts(make_farm: MakeFarm, s3_server: str,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[FaultFarm, Netns]]:
    reason = netns_unavailable()
    if reason:
        pytest.skip(f"network namespaces are not available here: {reason}")
    tag = uuid.uuid4().hex[:4]
    net = Netns(tag=tag, subnet=f"10.{200 + int(tag[:2], 16) % 50}.{int(tag[2:], 16) % 250}")
    proxies: list[TcpProxy] = []
    farm: FaultFarm | None = None
    try:
        net.create_bridge()
        for h in HOSTS:
            net.add_host(f"farm-{tag}-{h}")
        hub = net.hub_ip
        # The services as the other hosts see them: on the bridge's address.
        redis = RedisServer(tmp_path_factory.mktemp("netns-redis"), bind=("127.0.0.1", hub))
        redis.start()
        farm = make_farm("netns", redis=redis, workers=(),
                         env={"HEARTBEAT_S": "1", "BUILD_TIMEOUT_S": "120"})
        pg = TcpProxy(("127.0.0.1", 5432), listen_host=hub)
        s3_host, _, s3_port = s3_server.removeprefix("http://").partition(":")
        s3 = TcpProxy((s3_host, int(s3_port)), listen_host=hub)
        proxies += [pg, s3]
        remote = {
            "DATABASE_URL": farm.env["DATABASE_URL"].replace("127.0.0.1:5432", pg.address),
            "REDIS_URL": redis.url(host=hub),
            "S3_ENDPOINT_URL": f"http://{s3.address}",
            # Every host its own FARM_HOME, as on separate machines.
        }
        for h in HOSTS:
            ns = f"farm-{tag}-{h}"
            assert net.reaches(ns, hub, redis.port), f"{ns} cannot reach Redis on {hub}"
            home = farm.home / h
            home.mkdir()
            farm.start_worker(h, "trace" if h == "trace" else "compile", netns=ns,
                              extra_env={**remote, "FARM_HOME": str(home)})
        farm.wait_for_targets(2)
        yield farm, net
    finally:
        if farm is not None:
            farm.close()
        for p in proxies:
            p.close()
        net.destroy()


def test_link_cut_mid_compile_is_redelivered_to_another_host(
    hosts: tuple[FaultFarm, Netns],
) -> None:
    farm, net = hosts
    job_id = farm.submit(farm_spec("netns", "1", "tests.models.broken:linear",
                                   inputs=["float32[2,13]"],
                                   kwargs={"in_features": 13, "out_features": 4},
                                   grad_mode="training"))
    build = farm.wait_build(job_id, lambda b: b["state"] == "running" and b["worker"])
    pid = int(build["worker"].rsplit(":", 1)[1])
    victim = farm.name_of_pid(pid)
    assert victim in ("compile-a", "compile-b"), (build["worker"], farm.procs)
    ns = farm.netns_of[victim]
    time.sleep(2)  # mid-compile
    net.cut(ns)
    cut_at = time.monotonic()
    try:
        job = farm.wait_job(job_id, timeout=240)
        took = time.monotonic() - cut_at
        assert job["state"] == "succeeded", json.dumps(job, indent=1)[:4000]
        (b,) = job["builds"]
        survivor = "compile-b" if victim == "compile-a" else "compile-a"
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
    # Mended, the cut host's late attempt (if it gets one in) adds no second
    # artifact: one per format, still.
    time.sleep(2)
    assert farm.artifacts(key) == arts
    print(f"{victim}'s link cut {2} s into its compile: the build finished on {survivor} "
          f"{took:.1f} s later ({b['attempts']} attempts), one artifact per format")


def test_hosts_are_really_apart(hosts: tuple[FaultFarm, Netns]) -> None:
    """The workers cannot reach the services' loopback addresses: they go
    through the bridge, as from another machine."""
    farm, net = hosts
    ns = farm.netns_of["trace"]
    port = int(farm.url.rsplit(":", 1)[1])
    assert not net.reaches(ns, "127.0.0.1", port)  # the API on the root's loopback
    assert farm.redis is not None and net.reaches(ns, net.hub_ip, farm.redis.port)
    assert os.path.exists(f"/run/netns/{ns}")
