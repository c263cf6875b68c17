"""Where a CUDA node's seconds go when it loads a training (``aot_compile``)
artifact in a fresh process, step by step, with Triton's own cache empty,
warm, or the build's.

    python3 bench/cuda_train_load.py [--model farm.zoo.basic:bench_transformer] \
        [--input bfloat16[8,512,1024]] [--repeats 2] [--profile FILE] [--out FILE]

One build through the compile worker's own step (``compile_job`` in a child
with ``farm.build.steps.compile_env``), then per round, in fresh processes
side by side, each with an empty Inductor cache:

  eager                  import torch, build the model, one forward and backward
  artifact, Triton cache empty
                         the same, then the farm's warm imports, Triton's driver
                         start, ``load_artifact`` and one step, each timed: a
                         node's first process ever (Triton keeps its compiled
                         driver helpers in ``TRITON_CACHE_DIR``)
  artifact, Triton cache warm
                         the same with a ``TRITON_CACHE_DIR`` that one earlier
                         process on the machine used (what ``farm prefetch`` at
                         provisioning, or any earlier process, leaves)
  artifact, the build's Triton cache
                         the same with a copy of the build's whole Triton cache
                         (every file of every kernel, beyond the binaries the
                         artifact carries: farm.node.bundle)

With ``--profile FILE`` one more empty-cache load runs under cProfile and the
40 slowest calls by cumulative time are written to FILE.
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

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from farm.build.sandbox import run_isolated  # noqa: E402
from farm.build.steps import compile_env  # noqa: E402
from farm.core.specs import JobSpec  # noqa: E402

# The checkout first, then what this process had (a GPU host's carried wheels).
PYTHONPATH = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)

# The node's process: every step timed from the interpreter's start (argv[3]).
NODE = r"""
import json, sys, time
t0 = float(sys.argv[3]); marks = {}
def mark(name, since=[t0]):
    now = time.time(); marks[name] = round(now - since[0], 3); since[0] = now
import torch
mark("import torch")
from farm.core.modelref import apply_grad_mode, build_real, example_inputs
from farm.core.inputs import call_args
from farm.core.specs import GradMode, JobSpec
spec = JobSpec.from_json(json.loads(sys.argv[2]))
dev = sys.argv[4]
model = build_real(spec.model, device=dev, seed=0)
apply_grad_mode(model, GradMode.TRAINING)
args, kwargs = call_args(spec.inputs, example_inputs(spec.inputs, device=dev))
sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
sync()
mark("model build")
fn = model
if sys.argv[1] != "eager":
    from farm.node.compiled import warm_imports
    warm_imports()
    mark("warm imports")
    if dev == "cuda":
        import triton
        triton.runtime.driver.active.utils  # Triton's driver helpers: compiled, or from its cache
        mark("triton driver")
    import os
    from farm.build.compile_watch import CompileWatch
    from farm.node.loader import load_artifact
    watch = CompileWatch(os.environ["TRITON_CACHE_DIR"])
    watch.install()
    since = time.time()
    with watch.phase() as ev:
        fn = load_artifact(sys.argv[1], "aot_compile", module=model, trust_unverified=True)
    marks["load events"] = ev
    marks["load_artifact"] = round(time.time() - since, 3)  # without the watch's import
    mark("load+watch")
with torch.enable_grad():
    if sys.argv[1] != "eager":
        with watch.phase() as ev:
            fn(*args, **kwargs).float().sum().backward()
        marks["first step events"] = ev
    else:
        fn(*args, **kwargs).float().sum().backward()
sync()
mark("first step")
marks["first_s"] = round(time.time() - t0, 3)
print(json.dumps(marks))
"""

PROFILE = r"""
import cProfile, io, json, pstats, sys
import torch
from farm.core.modelref import build_real
from farm.core.specs import JobSpec
dev = sys.argv[4]
model = build_real(JobSpec.from_json(json.loads(sys.argv[2])).model, device=dev, seed=0)
pr = cProfile.Profile(); pr.enable()
from farm.node.compiled import warm_imports
warm_imports()
if dev == "cuda":
    import triton
    triton.runtime.driver.active.utils
from farm.node.loader import load_artifact
load_artifact(sys.argv[1], "aot_compile", module=model, trust_unverified=True)
pr.disable()
s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(40)
open(sys.argv[3], "w").write(s.getvalue())
"""


def node_env(cache: Path, triton_cache: Path) -> dict[str, str]:
    """A fresh node process's environment: its own Inductor and Triton caches."""
    return {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache),
            "TRITON_CACHE_DIR": str(triton_cache), "PYTHONPATH": PYTHONPATH}


def node(path: str, spec: JobSpec, cache: Path, triton_cache: Path, device: str
         ) -> dict[str, float]:
    out = subprocess.run([sys.executable, "-c", NODE, path, json.dumps(spec.to_json()),
                          repr(time.time()), device], env=node_env(cache, triton_cache),
                         capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise SystemExit(f"node process failed: {out.stderr[-3000:]}")
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="farm.zoo.basic:bench_transformer")
    ap.add_argument("--input", default="bfloat16[8,512,1024]")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--device", default="cuda", help="cpu: the same steps without Triton's")
    ap.add_argument("--profile", type=Path)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    spec = JobSpec.from_json({"name": "cuda-train-load", "version": "1",
                              "model": {"entrypoint": args.model}, "inputs": [args.input],
                              "grad_mode": "training"})
    with tempfile.TemporaryDirectory(prefix="cuda-train-load-") as tmp_s:
        tmp = Path(tmp_s)
        t = time.perf_counter()
        res = run_isolated("farm.build.compile:compile_job",
                           {"spec": spec.to_json(), "device": args.device,
                            "out_dir": str(tmp / "out"),
                            "formats": ["aot_compile"], "aoti_unavailable": None,
                            "cxx": os.environ.get("CXX")},
                           timeout_s=900, memory_mb=64000, env_extra=compile_env(tmp / "work"))
        if not res.ok:
            raise SystemExit(f"build failed: {res.describe()}\n{res.stderr_tail[-3000:]}")
        build_s = time.perf_counter() - t
        path = res.value["artifacts"][0]["path"]
        print(f"built in {build_s:.1f} s: {path}", flush=True)
        rows = ("eager", "artifact, Triton cache empty", "artifact, Triton cache warm",
                "artifact, the build's Triton cache")
        results: dict[str, list[dict[str, float]]] = {r: [] for r in rows}
        built = tmp / "work" / "triton-cache"  # the build's own (compile_env)
        for r in range(args.repeats):
            warm_triton = tmp / f"triton-warm-{r}"
            # One earlier process on this machine: Triton's driver helpers built there.
            if args.device == "cuda":
                subprocess.run([sys.executable, "-c",
                                "import triton; triton.runtime.driver.active.utils"],
                               env={**os.environ, "TRITON_CACHE_DIR": str(warm_triton)},
                               check=True, timeout=300)
            for i, name in enumerate(rows):
                cache = tmp / f"node-{r}-{i}"
                cache.mkdir()
                triton_cache = warm_triton if name.endswith("warm") else cache / "triton"
                if name.endswith("build's Triton cache") and built.is_dir():
                    shutil.copytree(built, triton_cache)
                got = node("eager" if name == "eager" else path, spec, cache, triton_cache,
                           args.device)
                results[name].append(got)
                shutil.rmtree(cache, ignore_errors=True)
                print(f"  round {r + 1}: {name}: {got}", flush=True)
        if args.profile:
            cache = tmp / "profile"
            cache.mkdir()
            subprocess.run([sys.executable, "-c", PROFILE, path, json.dumps(spec.to_json()),
                            str(args.profile), args.device],
                           env=node_env(cache, cache / "triton"), check=True, timeout=600)
    import torch

    base = statistics.median(x["first_s"] for x in results["eager"])
    steps = ("import torch", "model build", "warm imports", "triton driver", "load_artifact",
             "load+watch", "first step")
    lines = [
        f"# bench/cuda_train_load.py {time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC",
        f"# model {args.model} {args.input}, training; torch {torch.__version__}, python "
        f"{platform.python_version()}, "
        f"{torch.cuda.get_device_name() if args.device == 'cuda' else 'cpu'}, "
        f"{os.cpu_count()} CPUs; "
        f"build {build_s:.1f} s; median of {args.repeats}; seconds per step, in order",
        f"{'fresh process':<36} {'first s':>8} {'x eager':>8} "
        + " ".join(f"{s:>14}" for s in steps),
    ]
    for name in rows:
        med = statistics.median(x["first_s"] for x in results[name])
        cells = " ".join(
            f"{statistics.median(x[s] for x in results[name]):>14.2f}"
            if s in results[name][0] else f"{'-':>14}" for s in steps)
        lines.append(f"{name:<36} {med:>8.2f} {med / base:>8.2f} {cells}")
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
