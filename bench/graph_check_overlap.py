"""The compile step with its graph check in a fork beside the compile, against
the check first and the compile after (farm.build.graph_check), on a
16-layer transformers Llama on CPU, as a warm compile child runs it.

    TORCH_FARM_PCH_STORE=~/.cache/torch-farm/pch TORCHINDUCTOR_VEC_ISA_OK=1 \\
      .venv/bin/python bench/graph_check_overlap.py [--rounds 2]

Each run is a fresh process with an empty Inductor cache: warm-up compile
(as a zygote's), the trace stage's fingerprint, then ``compile_step`` timed.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LLAMA = {"vocab": 1024, "hidden": 128, "layers": 16, "heads": 4, "kv_heads": 2,
         "intermediate": 352, "max_positions": 256}


def child(mode: str) -> None:
    sys.path.insert(0, ROOT)
    import torch

    from farm.build import graph_check, stage_times
    from farm.build.steps import compile_step
    from farm.build.trace import trace
    from farm.build.zygote import warm_up_compiler
    from farm.core import precompiled_headers
    from farm.core.specs import JobSpec

    precompiled_headers.install_from_env()
    warm_up_compiler()
    if mode == "series":
        graph_check._fork_safe = lambda: False  # type: ignore[assignment]
    spec = JobSpec.from_json({"name": "s", "version": "1",
                              "model": {"entrypoint": "farm.zoo.hf:llama", "kwargs": LLAMA},
                              "inputs": ["int64[1,64]{0..1023}"]})
    fp = trace(spec).fingerprint
    torch._dynamo.reset()
    stage_times.reset()
    t = time.perf_counter()
    compile_step({"spec": spec.to_json(), "device": "cpu", "out_dir": tempfile.mkdtemp(),
                  "fingerprint": fp, "aoti_unavailable": "aot_compile only"})
    print(f"{mode:7} compile_step {time.perf_counter() - t:5.2f} s; "
          f"{stage_times.describe(stage_times.snapshot())}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child)
        return
    print(f"bench/graph_check_overlap.py: {os.cpu_count()} CPUs, load average "
          f"{os.getloadavg()[0]:.2f}", flush=True)
    for _ in range(args.rounds):
        for mode in ("series", "fork"):
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": tempfile.mkdtemp()}
            out = subprocess.run([sys.executable, __file__, "--child", mode], env=env,
                                 capture_output=True, text=True, check=True)
            print(out.stdout.strip().splitlines()[-1], flush=True)


if __name__ == "__main__":
    main()
