"""What a build zygote's warm-up compile costs once, and what it saves each
child that forks from it (``FARM_ZYGOTE_WARM_UP``, farm.build.zygote).

    TORCH_FARM_PCH_STORE=~/.cache/torch-farm/pch TORCHINDUCTOR_VEC_ISA_OK=1 \\
      .venv/bin/python bench/zygote_warm_up.py [--rounds 2] [--layers 4]

Each round runs two fresh processes, side by side: both import what a build
zygote imports and answer Inductor's ISA pick, as a zygote does; one then
runs the zygote's warm-up compile (``warm_up_compiler``, timed), the other
does not. Each then forks a child, as a zygote does for a build, and the
child runs the compile step of a small stack of layers (``farm.zoo.stack``)
with an empty Inductor cache of its own; its time is the build's.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def child(mode: str, layers: int) -> None:
    sys.path.insert(0, ROOT)
    import importlib

    from farm.build import zygote

    for name in zygote.PRELOADS["build"]:
        importlib.import_module(name)
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    from farm.core import precompiled_headers

    precompiled_headers.install_from_env()
    pick_vec_isa()
    warm_s = 0.0
    if mode == "warm":
        t = time.perf_counter()
        zygote.warm_up_compiler()
        warm_s = time.perf_counter() - t
    # The build, in a fork with a cache of its own, as a zygote's child.
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        code = 1
        try:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp()
            from farm.build.steps import compile_step
            from farm.core.specs import JobSpec

            spec = JobSpec.from_json({
                "name": "s", "version": "1",
                "model": {"entrypoint": "farm.zoo.stack:stack",
                          "kwargs": {"layers": layers, "width": 64}},
                "inputs": ["float32[8,64]"]})
            t = time.perf_counter()
            compile_step({"spec": spec.to_json(), "device": "cpu",
                          "out_dir": tempfile.mkdtemp(),
                          "aoti_unavailable": "aot_compile only"})
            os.write(w, f"{time.perf_counter() - t:.2f}".encode())
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    build_s = os.read(r, 64).decode()
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0 or not build_s:
        raise SystemExit(f"the {mode} child's build failed")
    warm = f"warm-up {warm_s:4.2f} s, " if mode == "warm" else "no warm-up,     "
    print(f"{mode:5} zygote: {warm}then a child's build {float(build_s):4.2f} s", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.layers)
        return
    print(f"bench/zygote_warm_up.py: {os.cpu_count()} CPUs, load average "
          f"{os.getloadavg()[0]:.2f}; farm.zoo.stack layers={args.layers} width=64",
          flush=True)
    for _ in range(args.rounds):
        for mode in ("cold", "warm"):
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": tempfile.mkdtemp()}
            out = subprocess.run([sys.executable, __file__, "--child", mode,
                                  "--layers", str(args.layers)],
                                 env=env, capture_output=True, text=True)
            if out.returncode != 0:
                raise SystemExit(out.stderr[-3000:])
            print(out.stdout.strip().splitlines()[-1], flush=True)


if __name__ == "__main__":
    main()
