"""Per-call time of a per-block artifact against a full-graph one, and what
its guard checks cost: the farm's plain-torch Llama, 16 layers, on CPU or
(``--device cuda``) a GPU, where each timed call ends with a synchronize.

Builds ``farm.zoo.llama:llama`` both ways in this process (aot_compile,
``--kind inference``: a forward under no_grad, or ``training``: a forward
and backward), loads each with a fresh model, and times them side by side:
``--rounds`` rounds, each timing every variant for the median of
``--calls`` calls (after 5 warm-up calls in the first rounds), in turn,
each round starting one variant later: the
full graph, per-block, per-block through torch's own call of each block
(``AOTCompiledFunction.__call__``, which binds the arguments with
``inspect``; the node's ``farm.node.blocks.direct_call`` does not),
per-block loaded with ``disable_guard_check`` (what the 16 blocks' guard
checks cost; inference) and eager. Printed: each
variant's median over the rounds, and per-block against the full graph in
each round (its median, lowest and highest): on a shared 2-core machine one
process's load moves a single timing by tens of percent, and interleaved
rounds see the same load.

    .venv/bin/python bench/per_block_steady.py [--kind training] [--calls 100] [--rounds 5]
        [--dim 128] [--tokens 1,64] [--device cuda] [--cuda-graphs] [--profile CALLS]
        [--launches CALLS] [--out FILE]

``--cuda-graphs`` (GPU) adds the full graph and per-block each replayed
from CUDA graphs (``farm.node.cuda_graphs``, what a node's
``compiled(..., cuda_graphs=True)`` does; a training step replays its
forward and its backward), and compares per-block so replayed against the
full graph, replayed and as it is; then checks a replay on other tokens
against the artifact's own call (in training, its gradients too).

``--launches`` (GPU) says where a launch-bound call's time goes, for each
variant: CUDA kernels launched per call and the GPU's busy time per call
(the sum of its kernels' times; ``torch.profiler`` over CALLS calls), and
the host's time per call (until the call returns, before its synchronize;
3 interleaved rounds of CALLS calls, before any profiling).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="per-block-steady-"))

import torch  # noqa: E402
from timing import median_s  # noqa: E402

from farm.build.compile import compile_artifacts  # noqa: E402
from farm.core.inputs import parse_inputs  # noqa: E402
from farm.core.modelref import apply_grad_mode, build_real, example_inputs  # noqa: E402
from farm.core.specs import CompileOptions, GradMode, JobSpec, ModelRef  # noqa: E402
from farm.node import blocks  # noqa: E402
from farm.node.cuda_graphs import GraphedCalls  # noqa: E402
from farm.node.loader import load_artifact  # noqa: E402

TORCH_CALL = "per-block, torch's call"
GUARDS_OFF = "per-block, guard checks off"
GRAPHED = ", CUDA graphs"
KWARGS = {"vocab": 1024, "dim": 128, "n_layers": 16, "n_heads": 4, "n_kv_heads": 2,
          "ffn_dim": 352}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--kind", choices=("inference", "training"), default="inference")
    ap.add_argument("--calls", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dim", type=int, default=KWARGS["dim"],
                    help="the model's width (heads: dim/32, FFN: dim*11/4)")
    ap.add_argument("--tokens", default="1,64", metavar="BATCH,SEQ",
                    help="the token input's shape (a GPU call is launch-bound at 1,64)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--profile", type=int, default=0, metavar="CALLS",
                    help="afterwards, profile CALLS calls of the full graph and of per-block "
                         "(cProfile) and print where their Python time went")
    ap.add_argument("--launches", type=int, default=0, metavar="CALLS",
                    help="afterwards (GPU), count each variant's kernel launches and GPU busy "
                         "time per call over CALLS calls (torch.profiler)")
    ap.add_argument("--cuda-graphs", action="store_true",
                    help="(GPU) also time the full graph and per-block each replayed from "
                         "CUDA graphs (training: the forward and the backward)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    device = args.device
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    grad_mode = GradMode(args.kind)
    training = grad_mode is GradMode.TRAINING

    tokens = f"int64[{args.tokens}]"
    kwargs = {**KWARGS, "dim": args.dim, "n_heads": max(2, args.dim // 32),
              "n_kv_heads": max(1, args.dim // 64), "ffn_dim": args.dim * 11 // 4}

    def spec(per_block: bool) -> JobSpec:
        return JobSpec(name="steady", version="1",
                       model=ModelRef("farm.zoo.llama:llama", kwargs=kwargs),
                       inputs=parse_inputs([f"{tokens}{{0..1023}}"]),
                       grad_mode=grad_mode, options=CompileOptions(per_block=per_block))

    def model(s: JobSpec) -> Any:
        m = build_real(s.model, device=device, seed=0)
        apply_grad_mode(m, s.grad_mode)
        return m

    def step(f: Any, m: torch.nn.Module, x: torch.Tensor, synchronize: bool = True) -> None:
        one_call(f, x, training)
        if training:
            for p in m.parameters():
                p.grad = None
        if synchronize:
            sync()

    runs: dict[str, tuple[Any, torch.nn.Module, torch.Tensor]] = {}  # name -> (fn, model, x)
    for per_block in (False, True):
        s = spec(per_block)
        (art,) = compile_artifacts(s, device, Path(tempfile.mkdtemp()), formats=["aot_compile"])
        (x,) = example_inputs(s.inputs, device=device, mark_dynamic=False)
        name = "per-block" if per_block else "full graph"
        m = model(s)
        fn = load_artifact(art.path, "aot_compile", module=m, trust_unverified=True)
        runs[name] = (fn, m, x)
        if per_block:
            # Before the node's direct block call (farm.node.blocks.direct_call):
            # each block through torch's AOTCompiledFunction.__call__.
            m_torch = model(s)
            via_torch = through_torchs_call(
                load_artifact(art.path, "aot_compile", module=m_torch, trust_unverified=True))
            runs[TORCH_CALL] = (via_torch, m_torch, x)
        if per_block and not training:
            m_off = model(s)
            off = load_artifact(art.path, "aot_compile", module=m_off,
                                trust_unverified=True, disable_guard_check=True)
            runs[GUARDS_OFF] = (off, m_off, x)
    if args.cuda_graphs and device.startswith("cuda"):
        for name in ("full graph", "per-block"):
            fn, m, x = runs[name]
            runs[name + GRAPHED] = (GraphedCalls(fn, m, training=training), m, x)
    eager_model = model(spec(False))
    (x,) = example_inputs(spec(False).inputs, device=device, mark_dynamic=False)
    runs["eager"] = (eager_model, eager_model, x)
    # name -> a call of one step; and the same step without its synchronize
    # (--profile, --launches; guard checks off is only timed).
    variants = {name: functools.partial(step, *run) for name, run in runs.items()}
    unsynced = {name: functools.partial(step, *run, synchronize=False)
                for name, run in runs.items() if name != GUARDS_OFF}

    rounds: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for r in range(args.rounds):
        # Each round starts one variant later: no variant always runs right
        # after the same other one (a training step's backward leaves the
        # allocator and caches to whatever runs next).
        for name in names[r % len(names):] + names[:r % len(names)]:
            warm_up = 5 if r < len(names) else 1
            rounds[name].append(median_s(variants[name], calls=args.calls, warm_up=warm_up))
    got = {name: round(statistics.median(ts) * 1e3, 3) for name, ts in rounds.items()}
    def by_round(base: str, other: str) -> str:
        ratios = sorted(b / a - 1 for a, b in zip(rounds[base], rounds[other], strict=True))
        return (f"median {statistics.median(ratios):+.1%}, lowest {ratios[0]:+.1%}, "
                f"highest {ratios[-1]:+.1%}")

    line = (f"per_block_steady: farm.zoo.llama 16 layers dim {args.dim}, {tokens}, "
            f"{args.kind}, {_where(device)}, torch {torch.__version__}, "
            f"{torch.get_num_threads()} threads, "
            f"{args.rounds} rounds of the median of {args.calls} calls, load average "
            f"{os.getloadavg()[0]:.1f} at the end; ms: {json.dumps(got)}; per-block against "
            f"the full graph by round: {by_round('full graph', 'per-block')}; per-block "
            f"against per-block through torch's call: "
            f"{by_round(TORCH_CALL, 'per-block')}")
    if "per-block" + GRAPHED in rounds:
        line += (f"; with CUDA graphs, per-block against the full graph by round: "
                 f"{by_round('full graph' + GRAPHED, 'per-block' + GRAPHED)}; per-block "
                 f"replayed against the full graph as it is: "
                 f"{by_round('full graph', 'per-block' + GRAPHED)}")
        for name in ("full graph", "per-block"):
            graphed, _, x = runs[name + GRAPHED]
            if graphed.captured != 1 or graphed.reasons:
                raise SystemExit(f"{name} was not replayed: {graphed.reasons}")
            other = torch.randint_like(x, 0, KWARGS["vocab"])   # not the recorded tokens
            # A replay computes what the call does (in training, its gradients too).
            torch.testing.assert_close(*(outcome(f, runs[name][1], other, training)
                                         for f in (graphed, runs[name][0])))
    print(line)
    if args.out:
        args.out.write_text(line + "\n")
    if args.profile:
        for name in ("full graph", "per-block"):
            print(f"profile: {name}, {args.profile} calls")
            profile(unsynced[name], args.profile, sync)
    if args.launches and device.startswith("cuda"):
        # The host's times first, in interleaved rounds and before any
        # profiler session: taken one variant at a time after the profiler
        # had run, they came out above whole synchronized calls.
        host: dict[str, list[float]] = {name: [] for name in unsynced}
        for _ in range(3):
            for name, call in unsynced.items():
                host[name].append(host_s(call, args.launches, sync))
        for name, call in unsynced.items():
            report = {**launches(call, args.launches, sync),
                      "host ms per call (median of 3 rounds)":
                          round(statistics.median(host[name]) * 1e3, 3)}
            print(f"launches: {name}: {json.dumps(report)}")
            if args.out:
                with args.out.open("a") as f:
                    f.write(f"launches: {name}: {json.dumps(report)}\n")


def one_call(f: Any, x: torch.Tensor, training: bool) -> torch.Tensor:
    """One call of ``f`` as the bench times it: without grad, or in
    training with the backward of its output's sum; the output."""
    if not training:
        with torch.no_grad():
            return f(x)
    y = f(x)
    y = y if isinstance(y, torch.Tensor) else y[0]
    y.float().sum().backward()
    return y


def outcome(f: Any, m: torch.nn.Module, x: torch.Tensor, training: bool) -> list[torch.Tensor]:
    """What one call of ``f`` gives: its output, and in training the
    parameters' gradients of the bench's loss (then cleared)."""
    y = one_call(f, x, training)
    if not training:
        return [y]
    grads = [p.grad for p in m.parameters() if p.grad is not None]
    for p in m.parameters():
        p.grad = None
    return [y.detach(), *grads]


def through_torchs_call(loaded: Any) -> Any:
    """``loaded`` (a per-block artifact) with each block calling its function
    as the node did before ``direct_call``: ``fn(block, *inputs)``."""
    import operator

    blockwise = loaded.fn
    for name, fn in blockwise.functions.items():
        block = operator.attrgetter(name)(blockwise.module)
        block.forward = blocks.through_torchs_call(fn, block)
    return loaded


def profile(call: Any, calls: int, sync: Any) -> None:
    """Where ``calls`` calls of ``call`` spend their time, by function (own
    time): what a block call adds on top of its kernels (guard checks,
    argument binding, AOTAutograd's wrapper)."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        call()
        sync()
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(30)


def host_s(call: Any, calls: int, sync: Any) -> float:
    """The host's time until ``call`` (one step without its synchronize)
    returns: the median of ``calls``, each synchronized after its timing.
    Where it exceeds the GPU's busy time, the call is launch-bound: the GPU
    waits on Python and launches."""
    sync()
    return median_s(call, calls=calls, warm_up=0, after=sync)


def launches(call: Any, calls: int, sync: Any, top_kernels: int = 8) -> dict[str, Any]:
    """Per call of ``call`` (one step without its synchronize): CUDA kernels
    and copies run, the GPU's busy time (their times added up), and the
    ``top_kernels`` kernels (by name) that took it."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity

    sync()
    with torch.profiler.profile(activities=[ProfilerActivity.CPU,
                                            ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            call()
        sync()
    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    busy_us = sum(e.time_range.elapsed_us() for e in kernels)
    by_name: dict[str, float] = {}
    for e in kernels:
        by_name[e.name[:60]] = by_name.get(e.name[:60], 0.0) + e.time_range.elapsed_us()
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:top_kernels]
    return {"GPU ops per call": round(len(kernels) / calls, 1),
            "GPU busy ms per call": round(busy_us / calls / 1e3, 3),
            "top kernels, ms per call": {n: round(us / calls / 1e3, 3) for n, us in top}}


def _where(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return "CPU"


if __name__ == "__main__":
    main()
