"""What Inductor's ISA pick costs a process that compiles, with and without
this machine's recorded test compiles (farm.core.isa_checks).

First, this machine's checked pick is made the way a compile worker makes it
(``farm.core.cpu_isa.isa_check_env`` in a process of its own, with a cache
file of this run's own); then, alternating, fresh processes with what a
worker gives its build children, each with an Inductor cache of its own
(as a sandboxed child has), time ``pick_vec_isa()``:

  checks    TORCHINDUCTOR_VEC_ISA_OK as the worker gives it, no record:
            every extension check (BF16, VNNI, AMX) compiles and loads
  recorded  the same with FARM_ISA_CHECKS: the recorded answers

Each row also counts the compiler's runs (a wrapper around the real one).

    .venv/bin/python bench/isa_checks.py --rounds 3 --out FILE
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from farm.core.isa_checks import ISA_CHECKS_ENV, decode

PICK = "from torch._inductor.cpu_vec_isa import pick_vec_isa; print(pick_vec_isa())"
WORKER = ("import json; from farm.core.cpu_isa import isa_check_env, detect_cpu_isa; "
          "print(json.dumps({'env': isa_check_env(), 'isa': detect_cpu_isa()}))")
IMPORT = "import torch._inductor.cpu_vec_isa, farm.core.isa_checks"
REPLAY = "farm.core.isa_checks.replay_from_env()"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    real = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not real:
        raise SystemExit("no C++ compiler: Inductor has no ISA pick to make")
    with tempfile.TemporaryDirectory(prefix="isa-bench-") as tmp:
        d = Path(tmp)
        log = d / "compiler.log"
        cxx = d / "g++"
        cxx.write_text(f'#!/bin/sh\necho "$*" >> {log}\nexec {real} "$@"\n')
        cxx.chmod(0o755)
        base = {k: v for k, v in os.environ.items()
                if k not in ("TORCHINDUCTOR_VEC_ISA_OK", ISA_CHECKS_ENV)}
        base.update(CXX=str(cxx), FARM_ISA_CACHE=str(d / "cpu-isa.json"))
        t0 = time.perf_counter()
        out = subprocess.run([sys.executable, "-c", WORKER], capture_output=True, text=True,
                             env={**base, "TORCHINDUCTOR_CACHE_DIR": str(d / "worker")},
                             check=True, timeout=1200)
        worker_s = time.perf_counter() - t0
        worker = json.loads(out.stdout.strip().splitlines()[-1])
        child_env = dict(worker["env"])
        rows: dict[str, list[tuple[float, int, str]]] = {"checks": [], "recorded": []}
        for r in range(args.rounds):
            for name in rows:
                env = {**base, **child_env, "TORCHINDUCTOR_CACHE_DIR": str(d / f"{name}{r}")}
                if name == "checks":
                    env.pop(ISA_CHECKS_ENV, None)
                log.unlink(missing_ok=True)
                # The pick alone (the child's imports come first and are left
                # out), after what a build child's start does with
                # FARM_ISA_CHECKS (farm.build.sandbox.child_main).
                code = (f"import time; {IMPORT}; t = time.perf_counter(); {REPLAY}; {PICK}; "
                        "print(time.perf_counter() - t)")
                res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                                     text=True, check=True, timeout=1200)
                isa, secs = res.stdout.strip().splitlines()[-2:]
                runs = [x for x in (log.read_text().splitlines() if log.exists() else [])
                        if "--version" not in x]
                rows[name].append((float(secs), len(runs), isa))
    handed = child_env.get(ISA_CHECKS_ENV, "")  # "tag;id:1,..." (farm.core.isa_checks)
    lines = [
        "# bench/isa_checks.py: Inductor's ISA pick in a fresh process, alternating rows",
        f"# {platform.node()} {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} CPUs, torch {__import__('torch').__version__}, compiler {real}",
        f"# the worker's checked pick: {worker['isa']!r}; its process (start, imports, the pick) "
        f"took {worker_s:.1f} s, once per machine; "
        f"it hands children {sorted(child_env)}",
        f"# passed checks handed on: {len(decode(handed.partition(';')[2]))}",
        "row       median_s  runs_s                      compiler_runs  pick",
    ]
    for name, got in rows.items():
        secs = [s for s, _, _ in got]
        lines.append(f"{name:<9} {statistics.median(secs):8.2f}  "
                     f"{', '.join(f'{s:.2f}' for s in secs):<27} "
                     f"{'/'.join(str(n) for _, n, _ in got):<14} {got[-1][2]}")
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
