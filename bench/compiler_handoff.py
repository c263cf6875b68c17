"""What an isolated CPU inference build costs with and without the worker's
compiler choice in its payload (``"cxx"``, ``workers.tasks``).

A sandboxed compile child sees neither the worker's cached answer of
``farm.build.aoti_check`` nor its home. Without ``cxx`` it runs the whole
check again (a tiny AOTI build with torch's precompiled header, then a load
in another process) before its own build: what every isolated build did
before the payload carried the choice. Both cases run here side by side,
alternating, in the worker's real compile step
(``farm.build.steps:compile_step``, bubblewrap when available), both
formats (aot_compile and an AOTI package).

    .venv/bin/python bench/compiler_handoff.py [--rounds 2]
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from farm.build.sandbox import build_isolation, run_isolated  # noqa: E402
from farm.build.steps import compile_env  # noqa: E402
from farm.build.toolchain import compiler_for  # noqa: E402
from farm.core.specs import JobSpec  # noqa: E402

SPEC = JobSpec.from_json({
    "name": "handoff", "version": "1",
    "model": {"entrypoint": "farm.zoo.basic:mlp", "kwargs": {}},
    "inputs": ["float32[4,64]"], "grad_mode": "inference"})


def build(work: Path, cxx: str | None) -> tuple[float, list[str]]:
    work.mkdir(parents=True)
    payload: dict[str, Any] = {"spec": SPEC.to_json(), "device": "cpu",
                               "out_dir": str(work / "out"), "aoti_unavailable": None}
    if cxx is not None:
        payload["cxx"] = cxx
    t0 = time.perf_counter()
    res = run_isolated("farm.build.steps:compile_step", payload, timeout_s=1800,
                       memory_mb=16000, env_extra=compile_env(work),
                       isolation=build_isolation(writable=(str(work),), mode="auto"))
    wall = time.perf_counter() - t0
    if not res.ok or res.value is None:
        raise SystemExit(f"compile failed: {res.describe()}\n{res.stderr_tail[-2000:]}")
    return wall, sorted(a["format"] for a in res.value["artifacts"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    import torch

    # The worker's answer (cached per machine; measured once here if not yet).
    chosen = compiler_for("cpu").cxx
    if chosen is None:
        raise SystemExit("no compiler builds loadable AOTI packages here")
    times: dict[str, list[float]] = {"before (no cxx)": [], "after (worker's cxx)": []}
    print(f"# bench/compiler_handoff.py {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC; "
          f"torch {torch.__version__}, python {platform.python_version()}, "
          f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}; model farm.zoo.basic:mlp "
          f"float32[4,64], both formats; compiler {chosen}", flush=True)
    with tempfile.TemporaryDirectory(prefix="handoff-") as tmp:
        for r in range(args.rounds):
            for i, (case, cxx) in enumerate((("before (no cxx)", None),
                                             ("after (worker's cxx)", chosen))):
                wall, formats = build(Path(tmp) / f"r{r}-{i}", cxx)
                times[case].append(wall)
                print(f"round {r + 1}: {case:<22} {wall:7.1f} s  {', '.join(formats)}",
                      flush=True)
    before = statistics.median(times["before (no cxx)"])
    print(f"{'case':<24} {'median s':>9} {'vs before':>10}")
    for case, walls in times.items():
        median = statistics.median(walls)
        print(f"{case:<24} {median:>9.1f} {median / before:>10.2f}")


if __name__ == "__main__":
    main()
