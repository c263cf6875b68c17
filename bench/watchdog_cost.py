"""What the sandbox's memory watchdog costs the worker that runs a build.

Every build child (trace, compile, verify) runs under ``farm.build.watchdog``'s
watchdog, which samples the resident set of the child's whole process tree
every 50 ms. Finding the tree's members means reading every process's
``/proc/<pid>/stat`` on the machine (psutil's parent map), so the cost grows
with the host's process count, not the build's. This times the worker side of
``run_isolated`` around a child that only sleeps, side by side in one run:

  every sample    the tree looked up at every sample (``_RESCAN_EVERY = 1``,
                  the watchdog before this measurement)
  every 10th      looked up every tenth sample or when a member exited (the
                  default), the known members' RSS read at every sample

with ``--procs`` idle processes added beside it (a busy worker host, or the
test suite's few hundred). Printed: the worker's CPU seconds per second of
watched child, and the ratio.

    .venv/bin/python bench/watchdog_cost.py                 # 0, 150 and 300 extra processes
    .venv/bin/python bench/watchdog_cost.py --child-s 20 --procs 500
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from farm.build import sandbox, watchdog

NAP = "import time\n\ndef nap(p):\n    time.sleep(p['s'])\n    return 1\n"


def worker_cpu_per_s(rescan_every: int, child_s: float, code: Path) -> float:
    watchdog._RESCAN_EVERY = rescan_every  # the knob under test
    t0, w0 = time.process_time(), time.monotonic()
    res = sandbox.run_isolated("farm_bench_nap:nap", {"s": child_s}, timeout_s=child_s + 60,
                               memory_mb=4000, import_paths=[code])
    assert res.ok, res.describe()
    return (time.process_time() - t0) / (time.monotonic() - w0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--procs", type=int, nargs="*", default=[0, 150, 300])
    ap.add_argument("--child-s", type=float, default=10.0)
    args = ap.parse_args()
    default = watchdog._RESCAN_EVERY
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        code = Path(tmp)
        (code / "farm_bench_nap.py").write_text(NAP)
        for extra in args.procs:
            idle = [subprocess.Popen(["sleep", "600"]) for _ in range(extra)]
            try:
                n = len(psutil.pids())
                every = worker_cpu_per_s(1, args.child_s, code)
                tenth = worker_cpu_per_s(default, args.child_s, code)
            finally:
                for p in idle:
                    p.kill()
                    p.wait()
            rows.append((n, every, tenth))
    print(f"worker CPU per second of a watched child ({args.child_s:.0f} s child, "
          f"python {sys.version.split()[0]}, {psutil.cpu_count()} cores)")
    print(f"{'processes on host':>18} {'every sample':>13} {'every 10th':>11} {'ratio':>6}")
    for n, every, tenth in rows:
        print(f"{n:>18} {every:>12.1%} {tenth:>10.1%} {tenth / every:>6.2f}")


if __name__ == "__main__":
    main()
