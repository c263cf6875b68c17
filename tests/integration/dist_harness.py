"""Run one Python script as N ranks of a single-host ``torch.distributed``
group (gloo, CPU), each a fresh process, and collect what each printed.

Reusable by every distributed test (DDP, DTensor tensor parallel): the script
reads the usual torchrun variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR``, ``MASTER_PORT``) and prints one JSON object as its last
stdout line; ``init_gloo()`` in the script starts the group from them.

    results = run_ranks(script, ["--model", "m"], world_size=2, env=farm.env)
    assert all(r["ok"] for r in results)

Separate processes rather than ``torch.multiprocessing.spawn``: each rank
imports torch and the farm's node code from scratch, as a fleet node does,
and nothing of the test process (its Dynamo caches, its imports) leaks in.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from farm.core.net import free_port
from tests.fixtures.node import node_python
from tests.slowdown import scaled

ROOT = Path(__file__).resolve().parents[2]


class RankFailed(AssertionError):
    """A rank exited non-zero, timed out, or printed no JSON line."""


def rank_env(rank: int, world_size: int, port: int,
             base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment torchrun would give ``rank``, the checkout importable.
    Threads are left as they are: the thread count is part of a CPU node's
    target, so a rank with OMP_NUM_THREADS=1 is another target than the
    farm's CPU worker and resolves no artifact built there."""
    env = dict(os.environ if base is None else base)
    env.update({
        "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p),
    })
    return env


def run_ranks(script: str | Path, args: Sequence[str] = (), *, world_size: int = 2,
              env: Mapping[str, str] | None = None, timeout: float = 300) -> list[dict[str, Any]]:
    """Start ``world_size`` copies of ``script`` at once (they rendezvous at a
    free port), wait for all, and return each rank's last JSON line, by rank.
    ``timeout`` is scaled by the machine's measured slowdown."""
    port = free_port()
    procs = [
        subprocess.Popen([*node_python(), str(script), *args], cwd=ROOT,
                         env=rank_env(rank, world_size, port, env),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for rank in range(world_size)
    ]
    outs: list[tuple[int, str, str]] = []
    try:
        for p in procs:
            try:
                stdout, stderr = p.communicate(timeout=scaled(timeout))
            except subprocess.TimeoutExpired:
                p.kill()
                stdout, stderr = p.communicate()
                outs.append((-9, stdout, stderr))
                continue
            outs.append((p.returncode, stdout, stderr))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    results = []
    for rank, (rc, stdout, stderr) in enumerate(outs):
        lines = [ln for ln in stdout.strip().splitlines() if ln.startswith("{")]
        if rc != 0 or not lines:
            raise RankFailed(f"rank {rank} of {world_size} exited {rc}\n--- stdout\n"
                             f"{stdout[-4000:]}\n--- stderr\n{stderr[-8000:]}")
        results.append(dict(json.loads(lines[-1])))
    return results


def init_gloo() -> tuple[int, int]:
    """In a rank's script: start the gloo group from the torchrun variables;
    returns (rank, world_size)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=int(os.environ["RANK"]),
                            world_size=int(os.environ["WORLD_SIZE"]))
    return dist.get_rank(), dist.get_world_size()


def finish_rank(result: dict[str, object]) -> None:
    """In a rank's script: print its result line, wait for the other ranks,
    and leave without tearing the gloo group down. Its teardown races at exit
    (a CI run saw rank 1 abort in it, 'terminate called without an active
    exception', before it printed): what the test compares is already out."""
    import json

    import torch.distributed as dist

    print(json.dumps(result), flush=True)
    dist.barrier()
    sys.stderr.flush()
    os._exit(0)
