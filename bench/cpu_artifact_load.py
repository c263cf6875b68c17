"""How long a CPU node takes to load an ``aot_compile`` artifact in a fresh
process with an empty Inductor cache, with and without the kernel libraries
the build ships (``farm.node.bundle``), and with and without Inductor's ISA
test compiles (``farm.core.cpu_isa.isa_checks_redundant``).

    .venv/bin/python bench/cpu_artifact_load.py [--model farm.zoo.basic:mlp] \
        [--input float32[4,64]] [--repeats 3] [--out FILE]

One build through the compile worker's own step (``compile_job`` in a child
with ``farm.build.steps.compile_env``), then, per row and round, a fresh
``python`` that imports torch and the farm's loader, builds the module and
loads the artifact into an empty ``TORCHINDUCTOR_CACHE_DIR`` and runs one call.
Rows, side by side in each round:

  torch's bytes only        the artifact without its libraries, as before
                            the bundle: the node compiles every kernel and
                            test-compiles every ISA
  bundle, ISA checks on     the libraries installed, no per-machine ISA answer
  bundle, ISA answer known  the libraries installed, the machine's checked
                            pick cached (what a node or verifier sees after
                            its first process)

Printed: median seconds from process start to the first result, the ratio
to the first row, and the libraries the load compiled (``.so`` files in its
cache that the artifact did not ship).
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
from farm.node.bundle import read_bundle  # noqa: E402

NODE = r"""
import json, sys, time
t0 = float(sys.argv[3])
import torch
from farm.core.modelref import build_real, example_inputs
from farm.core.inputs import call_args
from farm.core.specs import JobSpec
from farm.node.loader import load_artifact
spec = JobSpec.from_json(json.loads(sys.argv[2]))
model = build_real(spec.model, device="cpu", seed=0).eval()
fn = load_artifact(sys.argv[1], "aot_compile", module=model, trust_unverified=True)
args, kwargs = call_args(spec.inputs, example_inputs(spec.inputs, device="cpu"))
with torch.no_grad():
    fn(*args, **kwargs)
print(json.dumps({"first_s": time.time() - t0}))
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="farm.zoo.basic:mlp")
    ap.add_argument("--input", default="float32[4,64]")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    spec = JobSpec.from_json({"name": "cpu-load", "version": "1",
                              "model": {"entrypoint": args.model}, "inputs": [args.input]})
    with tempfile.TemporaryDirectory(prefix="cpu-artifact-load-") as tmp_s:
        tmp = Path(tmp_s)
        isa_cache = tmp / "cpu-isa.json"
        env = {**os.environ, "FARM_ISA_CACHE": str(isa_cache)}
        env.pop("TORCHINDUCTOR_VEC_ISA_OK", None)
        os.environ["FARM_ISA_CACHE"] = str(isa_cache)
        t = time.perf_counter()
        res = run_isolated("farm.build.compile:compile_job",
                           {"spec": spec.to_json(), "device": "cpu", "out_dir": str(tmp / "out"),
                            "formats": ["aot_compile"]},
                           timeout_s=900, memory_mb=8000, env_extra=compile_env(tmp / "work"))
        if not res.ok:
            raise SystemExit(f"build failed: {res.describe()}\n{res.stderr_tail[-3000:]}")
        build_s = time.perf_counter() - t
        art = res.value["artifacts"][0]
        bundled = Path(art["path"])
        payload, sections, _ = read_bundle(bundled)
        plain = tmp / "plain.bin"
        plain.write_bytes(payload)
        rows = [("torch's bytes only", plain, False), ("bundle, ISA checks on", bundled, False),
                ("bundle, ISA answer known", bundled, True)]
        results: dict[str, list[dict[str, float]]] = {name: [] for name, _, _ in rows}
        for r in range(args.repeats):
            for i, (name, path, known) in enumerate(rows):
                cache = tmp / f"node-{r}-{i}"
                cache.mkdir()
                isa_cache.unlink(missing_ok=True)
                if known:
                    from farm.core.cpu_isa import detect_cpu_isa

                    detect_cpu_isa()  # the checked pick, cached as a first process leaves it
                run_env = {**env, "TORCHINDUCTOR_CACHE_DIR": str(cache),
                           "PYTHONPATH": str(ROOT)}
                out = subprocess.run(
                    [sys.executable, "-c", NODE, str(path), json.dumps(spec.to_json()),
                     repr(time.time())], env=run_env, capture_output=True, text=True, timeout=900)
                if out.returncode != 0:
                    raise SystemExit(f"{name}: {out.stderr[-3000:]}")
                got = json.loads(out.stdout.strip().splitlines()[-1])
                # Libraries the load compiled: those in its cache not shipped.
                shipped = set(sections["kernels/"]) if path == bundled else set()
                got["cpp_builds"] = len({p.relative_to(cache).as_posix()
                                         for p in cache.rglob("*.so")} - shipped)
                results[name].append(got)
                shutil.rmtree(cache, ignore_errors=True)
                print(f"  round {r + 1}: {name}: {results[name][-1]}", flush=True)
    base = statistics.median(x["first_s"] for x in results[rows[0][0]])
    lines = [
        f"# bench/cpu_artifact_load.py {time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC",
        f"# model {args.model} {args.input}; torch {__import__('torch').__version__}, "
        f"python {platform.python_version()}, {os.cpu_count()} CPUs, load average "
        f"{os.getloadavg()[0]:.1f}; build {build_s:.1f} s, "
        f"{len(sections['kernels/'])} libraries shipped; median of {args.repeats}",
        f"{'load in a fresh process, empty cache':<38} {'first s':>8} {'vs plain':>9} "
        f"{'compiled':>9}",
    ]
    for name, _, _ in rows:
        med = statistics.median(x["first_s"] for x in results[name])
        runs = statistics.median(x["cpp_builds"] for x in results[name])
        lines.append(f"{name:<38} {med:>8.2f} {med / base:>9.2f} {runs:>9.0f}")
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
