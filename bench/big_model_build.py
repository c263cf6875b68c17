"""Build a model larger than the build process's GPU memory, and verify it elsewhere.

    .venv/bin/python bench/big_model_build.py               # CUDA: 2 GiB weights, 1 GiB limit
    .venv/bin/python bench/big_model_build.py --weights-gib 4 --limit-gib 1
    .venv/bin/python bench/big_model_build.py --device cpu  # dry run, no GPU (see below)

The build runs in a child process limited with
``torch.cuda.set_per_process_memory_fraction`` to ``--limit-gib`` (less than the
model's weights), through the compile worker's own code path
(``farm.build.compile.compile_artifacts``, options as a job gives them:
``weights: auto``, so the fit check finds the weights do not fit under the limit
and the build compiles with fake weights, ``farm.build.fake_weights``). Then
``farm.build.verify.verify_artifact`` runs the artifact in another fresh
process that builds the real model (and so holds the real weights), checks it
against the artifact's weights manifest, and compares with eager. A second
build of the same job with ``weights: empty`` under the same limit shows what
happens without fake weights (the early failure, with the numbers).

Table: weights GiB, build limit GiB, compile s (the build child, wall),
peak GPU memory the build allocated (``torch.cuda.max_memory_allocated``) and
reserved, verified, max abs error against eager.

The model (``--model``): ``mlp`` (default; ``farm.zoo.basic:mlp`` in bf16,
d_in = d_out = 8192, hidden sized to ``--weights-gib``: two GEMMs, the H200
probe's shape scaled up) or ``transformer`` (``farm.zoo.basic:bench_transformer``,
d=2048, layers sized to ``--weights-gib``).

``--device cpu``: a dry run of the same path without a GPU: no memory
fraction (there is none on CPU), ``weights: fake`` asked for explicitly (``auto``
is fake only on CUDA), a small model (``--weights-gib`` default 0.25), and the
build child's peak RSS beside the weights' size instead of GPU memory.
Without a GPU and without ``--device cpu`` it stops at once and says so.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
GIB = 1024**3


def model_ref(args: argparse.Namespace) -> tuple[str, dict[str, Any], list[str], int]:
    """(entrypoint, kwargs, input specs, weight bytes) for ``--weights-gib``."""
    target = args.weights_gib * GIB
    if args.model == "mlp":
        d = 8192 if args.device == "cuda" else 2048
        dtype, size = ("bfloat16", 2) if args.device == "cuda" else ("float32", 4)
        hidden = max(256, int(target / (2 * d * size)) // 256 * 256)
        kwargs = {"d_in": d, "hidden": hidden, "d_out": d, "dtype": dtype}
        nbytes = (2 * d * hidden + hidden + d) * size
        return "farm.zoo.basic:mlp", kwargs, [f"{dtype}[8,{d}]"], nbytes
    dim = 2048 if args.device == "cuda" else 256
    dtype, size = ("bfloat16", 2) if args.device == "cuda" else ("float32", 4)
    per_layer = 12 * dim * dim * size  # attention 4 d^2, MLP 8 d^2 (biases and norms aside)
    layers = max(1, round(target / per_layer))
    kwargs = {"layers": layers, "dim": dim, "heads": 16, "dtype": dtype}
    return ("farm.zoo.basic:bench_transformer", kwargs, [f"{dtype}[2,128,{dim}]"],
            layers * per_layer)


def spec_json(args: argparse.Namespace, weights: str) -> dict[str, Any]:
    entry, kwargs, inputs, _ = model_ref(args)
    return {"name": "big-model", "version": "1", "model": {"entrypoint": entry, "kwargs": kwargs},
            "inputs": inputs, "grad_mode": "inference", "options": {"weights": weights}}


# --- the build child ---------------------------------------------------------------------


def build_child(args: argparse.Namespace) -> dict[str, Any]:
    """Runs in its own process: limit, build, report (never raises)."""
    import torch

    out: dict[str, Any] = {"weights": args.child_weights}
    if args.device == "cuda":
        total = torch.cuda.get_device_properties(0).total_memory
        fraction = args.limit_gib * GIB / total
        # Before anything allocates: the limit is this process's, not the GPU's.
        torch.cuda.set_per_process_memory_fraction(fraction, 0)
        torch.cuda.reset_peak_memory_stats(0)
        out.update(gpu_total_gib=total / GIB, fraction=fraction,
                   fit_check_sees_limit=hasattr(torch.cuda, "get_per_process_memory_fraction"))
    from farm.build.compile import compile_artifacts
    from farm.core.specs import JobSpec

    spec = JobSpec.from_json(spec_json(args, args.child_weights))
    t0 = time.perf_counter()
    try:
        # The compile worker's call (farm.build.steps.compile_step); no AOTI
        # package asked here: the aot_compile artifact is what this measures
        # (a fake-weight build skips AOTI anyway, and says why).
        (art, *_) = compile_artifacts(
            spec, args.device, Path(args.child_out),
            aoti_unavailable="big_model_build measures the aot_compile path")
        out.update(ok=True, path=str(art.path), meta=art.meta)
    except Exception as exc:
        out.update(ok=False, error=f"{type(exc).__name__}: {exc}")
    out["compile_s"] = round(time.perf_counter() - t0, 2)
    if args.device == "cuda":
        out["peak_allocated_bytes"] = int(torch.cuda.max_memory_allocated(0))
        out["peak_reserved_bytes"] = int(torch.cuda.max_memory_reserved(0))
    # ru_maxrss is KiB on Linux.
    out["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return out


def run_build(args: argparse.Namespace, weights: str, out_dir: Path) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", "--device", args.device, "--model", args.model,
           "--weights-gib", str(args.weights_gib), "--limit-gib", str(args.limit_gib),
           "--child-weights", weights, "--child-out", str(out_dir)]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           # The build's own Inductor cache, as a compile worker gives its child.
           "TORCHINDUCTOR_CACHE_DIR": str(out_dir / "inductor-cache"),
           "TRITON_CACHE_DIR": str(out_dir / "triton-cache")}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
    wall = time.perf_counter() - t0
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"weights": weights, "ok": False, "compile_s": round(wall, 2),
                "error": f"build child exited {proc.returncode}: {proc.stderr[-1500:]}"}
    res: dict[str, Any] = json.loads(lines[-1])
    res["process_s"] = round(wall, 2)
    return res


# --- the parent ----------------------------------------------------------------------------


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--model", choices=("mlp", "transformer"), default="mlp")
    p.add_argument("--weights-gib", type=float, default=None,
                   help="size of the model's weights (default: 2 on CUDA, 0.25 on CPU)")
    p.add_argument("--limit-gib", type=float, default=1.0,
                   help="the build process's GPU memory limit (CUDA only)")
    p.add_argument("--timeout", type=float, default=540)
    p.add_argument("--fake", action="store_true",
                   help="ask for weights: fake instead of auto (where this torch has no "
                        "torch.cuda.get_per_process_memory_fraction, the fit check cannot see "
                        "the limit)")
    p.add_argument("--no-empty", action="store_true",
                   help="skip the weights: empty build that shows the early failure")
    p.add_argument("--out", default=None, help="result file (default bench/results/...)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--child-weights", default="auto", help=argparse.SUPPRESS)
    p.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.weights_gib is None:
        args.weights_gib = 2.0 if args.device == "cuda" else 0.25
    if args.child:
        print(json.dumps(build_child(args)))
        return 0

    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("big_model_build: no CUDA GPU is visible here (torch.cuda.is_available() is "
              "False). A CUDA build needs the GPU, not its memory: run this on the GPU machine, "
              "or `--device cpu` for a dry run of the same path.", file=sys.stderr)
        return 2
    if args.device == "cuda" and args.limit_gib >= args.weights_gib:
        print(f"big_model_build: --limit-gib {args.limit_gib} must be below --weights-gib "
              f"{args.weights_gib} to show anything", file=sys.stderr)
        return 2

    from farm.build.verify import verify_artifact
    from farm.core.specs import JobSpec
    from farm.node.weight_check import MANIFEST_KEY

    _, kwargs, inputs, nbytes = model_ref(args)
    # On CUDA "auto" is what a job gets: fake because the weights do not fit.
    # On CPU auto never fakes, so the dry run asks for it.
    fake_mode = "auto" if args.device == "cuda" and not args.fake else "fake"
    rows: list[dict[str, Any]] = []
    notes: list[str] = []
    with tempfile.TemporaryDirectory(prefix="big-model-") as tmp:
        builds = [fake_mode] + ([] if args.no_empty or args.device == "cpu" else ["empty"])
        for weights in builds:
            res = run_build(args, weights, Path(tmp) / weights)
            row: dict[str, Any] = {"weights": weights, "compile_s": res.get("compile_s"),
                                   "peak_alloc": res.get("peak_allocated_bytes"),
                                   "peak_reserved": res.get("peak_reserved_bytes"),
                                   "peak_rss": res.get("peak_rss_bytes"),
                                   "built": bool(res.get("ok")), "verified": None, "err": None}
            if not res.get("ok"):
                notes.append(f"weights {weights}: build failed: {res.get('error')}")
            else:
                meta = res["meta"]
                row["made"] = meta.get("weights", {}).get("mode")
                notes.append(f"weights {weights}: built with {row['made']} weights "
                             f"({meta.get('weights', {}).get('why')})")
                spec = JobSpec.from_json(spec_json(args, weights))
                # A fresh process that builds the real model: it, not the
                # build child, holds the weights.
                t0 = time.perf_counter()
                report = verify_artifact(spec, res["path"], "aot_compile", device=args.device,
                                         timeout_s=args.timeout,
                                         memory_mb=max(16384, 4 * nbytes / 2**20),
                                         weights_manifest=meta.get(MANIFEST_KEY))
                row.update(verified=report.ok, err=report.max_abs_err, tol=report.tol,
                           verify_s=round(time.perf_counter() - t0, 2))
                notes.append(f"weights {weights}: verify {report.summary().splitlines()[0]}")
            rows.append(row)

    gib = lambda b: "-" if b is None else f"{b / GIB:.3f}"  # noqa: E731
    limit = f"{args.limit_gib:.2f}" if args.device == "cuda" else "none (cpu)"
    head = (f"big_model_build {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, "
            f"device {args.device}, torch {torch.__version__}, model {args.model} {kwargs}, "
            f"inputs {inputs}")
    mem_col = "peak GPU alloc GiB (reserved)" if args.device == "cuda" else "build peak RSS GiB"
    lines = [head, "",
             f"| weights option | weights GiB | build limit GiB | compile s | {mem_col} "
             "| verified | max abs err |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        mem = (f"{gib(r['peak_alloc'])} ({gib(r['peak_reserved'])})" if args.device == "cuda"
               else gib(r["peak_rss"]))
        verified = {None: "not built", True: "yes", False: "NO"}[r["verified"]]
        err = "-" if r["err"] is None else f"{r['err']:.3g}"
        lines.append(f"| {r['weights']} | {nbytes / GIB:.3f} | {limit} | {r['compile_s']} | "
                     f"{mem} | {verified} | {err} |")
    lines += ["", *notes]
    if args.device == "cpu":
        lines.append("RSS note: the build child's peak RSS counts torch, dynamo and inductor "
                     f"too, against {nbytes / GIB:.3f} GiB of weights. On CPU it shows only that "
                     "the build never touched memory for the weights (to_empty pages that are "
                     "never written would not be resident either): the CUDA run's allocator "
                     "peak under a limit below the weights is the measure.")
    text = "\n".join(lines)
    print(text)
    out = Path(args.out) if args.out else (
        ROOT / "bench" / "results" /
        f"big_model_build-{args.device}-{datetime.datetime.now(datetime.UTC):%Y%m%d-%H%M}.txt")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text + "\n")
    print(f"\nwritten to {out}")
    fake_row = rows[0]
    return 0 if fake_row["verified"] else 1


if __name__ == "__main__":
    sys.exit(main())
