"""Compile time of a 16-layer Llama-shaped model, full graph against regional.

    .venv/bin/python bench/compile_time.py [--device cpu|cuda] [--layers 16] [--hidden 128]
        [--kinds inference,training] [--out bench/results/compile_time-cpu-DATE.txt]

The model is ``transformers``' ``LlamaForCausalLM`` from a ``LlamaConfig``
(``farm.zoo.hf:llama``, small width, random weights, nothing downloaded); where
transformers is not installed (the H200 image) it is the farm's own Llama in
plain torch (``farm.zoo.llama:llama``, same shape), and the output says so.

Each of the builds (inference and training, each full-graph and
``regional: true``, or with ``--modes`` also ``per_block: true``) runs in a
fresh process with its own empty Inductor cache, through the farm's own
compile path (``farm.build.compile.compile_artifacts``,
the ``aot_compile`` format, backend inductor): compile seconds are
``aot_compile`` (Dynamo, AOTAutograd, Inductor and its C++/Triton builds),
``meta.trace_and_lower_s``. The process then builds the model for real
(seeded), loads the artifact it wrote, and times steady calls: a forward
under ``no_grad`` for inference, a forward and backward for training (median
of ``--calls`` after warm-up), eager alongside.

Goal (issue 14): regional compiles at least 4x faster, with steady per-call
time within 10% of the full graph.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

GOAL_RATIO = 4.0
GOAL_STEADY = 0.10
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def have_transformers() -> bool:
    import importlib.util

    return importlib.util.find_spec("transformers") is not None


def model_ref(args: argparse.Namespace) -> tuple[str, dict[str, Any], str]:
    """(entrypoint, factory kwargs, description) of the benchmark's model."""
    heads, kv = max(2, args.hidden // 32), max(1, args.hidden // 64)
    ffn = args.hidden * 11 // 4
    if have_transformers() and not args.zoo:
        return ("farm.zoo.hf:llama",
                {"vocab": args.vocab, "hidden": args.hidden, "layers": args.layers,
                 "heads": heads, "kv_heads": kv, "intermediate": ffn,
                 "max_positions": 4 * args.seq, "dtype": args.dtype},
                "transformers LlamaForCausalLM (LlamaConfig)")
    why = "--zoo given" if args.zoo else "transformers is not installed here"
    return ("farm.zoo.llama:llama",
            {"vocab": args.vocab, "dim": args.hidden, "n_layers": args.layers,
             "n_heads": heads, "n_kv_heads": kv, "ffn_dim": ffn, "dtype": args.dtype},
            f"farm.zoo.llama (plain-torch Llama, same shape; {why})")


def child(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from timing import median_s  # bench/timing.py, beside this file

    from farm.build.compile import compile_artifacts
    from farm.core.inputs import parse_inputs
    from farm.core.modelref import apply_grad_mode, build_real, example_inputs, grad_context
    from farm.core.specs import CompileOptions, GradMode, JobSpec, ModelRef
    from farm.node.loader import load_artifact

    if args.threads:
        torch.set_num_threads(args.threads)
    from farm.build import stage_times
    from farm.build.zygote import warm_up_compiler
    from farm.core import precompiled_headers

    # As a compile worker's child starts: forked from a zygote that compiled
    # a sample (farm.build.zygote), with this machine's precompiled headers.
    precompiled_headers.install_from_env()
    warm_up_compiler()
    stage_times.reset()
    torch._dynamo.utils.compilation_time_metrics.clear()
    entry, kwargs, _ = model_ref(args)
    training = args.child_kind == "training"
    regional = args.child_mode == "regional"
    per_block = args.child_mode == "per_block"
    spec = JobSpec(
        name="compile-time", version="1", model=ModelRef(entry, kwargs=kwargs),
        inputs=parse_inputs([f"int64[{args.batch},{args.seq}]{{0..{args.vocab - 1}}}"]),
        grad_mode=GradMode.TRAINING if training else GradMode.INFERENCE,
        options=CompileOptions(regional=regional, per_block=per_block),
    )
    out = tempfile.mkdtemp(prefix="compile-time-")
    t0 = time.perf_counter()
    (art,) = compile_artifacts(spec, args.device, __import__("pathlib").Path(out),
                               formats=["aot_compile"])
    wall = time.perf_counter() - t0
    from torch._dynamo.utils import compilation_time_metrics as metrics

    # Taken before the load: loading a CPU artifact builds its C++ again.
    phases = {name: round(sum(metrics.get(name, ())), 3) for name in (
        "bytecode_tracing", "create_aot_dispatcher_function", "compile_file")}
    model = build_real(spec.model, device=args.device, seed=0)
    assert isinstance(model, torch.nn.Module)
    apply_grad_mode(model, spec.grad_mode)
    fn = load_artifact(art.path, "aot_compile", module=model, trust_unverified=True)
    (x,) = example_inputs(spec.inputs, device=args.device, mark_dynamic=False)

    def sync() -> None:
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()

    def step(f: Any) -> None:
        with grad_context(spec.grad_mode):
            y = f(x)
            if training:
                y.float().sum().backward()
                for p in model.parameters():
                    p.grad = None
        sync()

    def steady(f: Any) -> float:
        return median_s(lambda: step(f), calls=args.calls, warm_up=3)

    return {
        "headers": dict(precompiled_headers.counts),
        # The same compile split into exclusive stages (farm.build.stage_times),
        # as a build's log shows them.
        "stages": stage_times.snapshot(),
        # Where the compile went: Dynamo's bytecode tracing (what regions
        # shorten: the block is traced once), and the backend (AOTAutograd,
        # Inductor's lowering and its kernel builds: C++ files on CPU).
        "dynamo_s": phases["bytecode_tracing"],
        "backend_s": phases["create_aot_dispatcher_function"],
        "kernel_build_s": phases["compile_file"],
        "kind": args.child_kind, "mode": args.child_mode,
        "compile_s": art.meta["trace_and_lower_s"], "build_wall_s": round(wall, 3),
        "regional": art.meta.get("regional") or art.meta.get("per_block"),
        "steady_ms": steady(fn) * 1e3, "eager_ms": steady(model) * 1e3,
        "torch": torch.__version__,
    }


def run_child(args: argparse.Namespace, kind: str, mode: str) -> dict[str, Any]:
    cmd = [sys.executable, os.path.abspath(__file__), "--child-kind", kind, "--child-mode", mode,
           "--device", args.device, "--layers", str(args.layers), "--hidden", str(args.hidden),
           "--vocab", str(args.vocab), "--seq", str(args.seq), "--batch", str(args.batch),
           "--dtype", args.dtype, "--calls", str(args.calls), "--threads", str(args.threads)]
    if args.zoo:
        cmd.append("--zoo")
    cache = tempfile.mkdtemp(prefix="compile-time-cache-")
    from farm.build.steps import toolchain_env

    # What a compile worker gives its children: the chosen compiler, the ISA
    # answer, this machine's precompiled headers (farm.build.pch), so both
    # modes compile alike. (Before, torch built its own header in the first
    # child, under /tmp, and later children used it: the first mode paid it.)
    env = {**os.environ, **toolchain_env(), "TORCHINDUCTOR_CACHE_DIR": cache,
           "TRITON_CACHE_DIR": os.path.join(cache, "triton"),
           "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{kind}/{mode} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return dict(json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("{")][-1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--kinds", default="inference,training")
    ap.add_argument("--modes", default="regional",
                    help="what each kind's full-graph build is compared with: regional, "
                         "per_block, or both (regional,per_block)")
    ap.add_argument("--threads", type=int, default=0,
                    help="torch threads in each build process (0: torch's default); 1 keeps a "
                         "shared, loaded machine's timings from thread oversubscription")
    ap.add_argument("--zoo", action="store_true", help="use farm.zoo.llama even with transformers")
    ap.add_argument("--out", help="also write the table to this file")
    ap.add_argument("--no-header-store", action="store_true",
                    help="compile kernels without this machine's precompiled headers")
    ap.add_argument("--child-kind", help=argparse.SUPPRESS)
    ap.add_argument("--child-mode", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.no_header_store:
        os.environ["FARM_PCH_STORE"] = "off"
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    if args.child_kind:
        print(json.dumps(child(args)))
        return

    _, _, described = model_ref(args)
    lines: list[str] = []

    def say(text: str = "") -> None:
        print(text, flush=True)
        lines.append(text)
        if args.out:  # after every line: a run cut short keeps its rows
            with open(args.out, "w") as fh:
                fh.write("\n".join(lines) + "\n")

    load = os.getloadavg()[0]
    say(f"compile_time: {described}, {args.layers} layers, hidden {args.hidden}, vocab "
        f"{args.vocab}, {args.dtype}, tokens int64[{args.batch},{args.seq}], device "
        f"{args.device}, backend inductor, aot_compile; {os.cpu_count()} CPUs, torch threads "
        f"{args.threads or 'default'}, load average "
        f"{load:.2f} at start; {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC")
    from farm.build import pch

    t0 = time.perf_counter()
    # Its builds are aot_compile only: the kernels' headers, no AOTI sample.
    filled = pch.fill_store(aoti=False)
    say("precompiled headers: " + ("off" if args.no_header_store else
        pch.describe_fill(filled, time.perf_counter() - t0) + ", before the builds"))
    from farm.build import bytecode

    say("bytecode for build children: " + bytecode.fill_now())
    if not have_transformers() and not args.zoo:
        say("NOTE: transformers is not installed here: the model is farm.zoo.llama instead")
    header = (f"{'kind':10}{'mode':10}{'compile s':>11}{'ratio':>8}{'dynamo s':>10}"
              f"{'backend s':>11}{'C++ s':>8}{'steady ms':>11}{'vs full':>9}{'eager ms':>10}")
    say()
    say(header)
    say("-" * len(header))
    verdicts = []
    for kind in args.kinds.split(","):
        full = run_child(args, kind, "full")
        others = [run_child(args, kind, mode) for mode in args.modes.split(",")]
        for r in (full, *others):
            ratio = full["compile_s"] / r["compile_s"]
            delta = r["steady_ms"] / full["steady_ms"] - 1
            is_full = r is full
            say(f"{kind:10}{r['mode']:10}{r['compile_s']:11.1f}"
                f"{('' if is_full else f'{ratio:.2f}x'):>8}{r.get('dynamo_s', 0):10.1f}"
                f"{r.get('backend_s', 0):11.1f}{r.get('kernel_build_s', 0):8.1f}"
                f"{r['steady_ms']:11.2f}"
                f"{('' if is_full else f'{delta:+.1%}'):>9}{r['eager_ms']:10.2f}")
            if is_full:
                continue
            verdicts.append(
                f"{kind}: {r['mode']} compiles {ratio:.2f}x faster (goal >= {GOAL_RATIO}x: "
                f"{'met' if ratio >= GOAL_RATIO else 'NOT met'}), steady {delta:+.1%} "
                f"(goal within {GOAL_STEADY:.0%}: "
                f"{'met' if abs(delta) <= GOAL_STEADY else 'NOT met'})")
        from farm.build.stage_times import describe

        for r in (full, *others):
            if r is not full:
                say(f"{'':20}{r['mode']} blocks: {r['regional']}")
            if r.get("stages"):
                say(f"{'':20}{r['mode']} stages: {describe(r['stages'])}")
            say(f"{'':20}{r['mode']} kernel compiles with a precompiled header: "
                f"{r['headers']['used']}, without: {r['headers']['missing']}")
    say()
    for v in verdicts:
        say(v)
    say(f"torch {full['torch']}; compile s = aot_compile (Dynamo + AOTAutograd + Inductor), "
        "fresh process and Inductor cache per build; dynamo s = Dynamo's bytecode tracing, "
        "backend s = AOTAutograd + Inductor, C++ s = Inductor's C++ kernel builds (CPU; "
        "inside backend s)")


if __name__ == "__main__":
    main()
