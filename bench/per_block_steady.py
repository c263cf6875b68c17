"""Per-call time of a per-block artifact against a full-graph one, and what
its guard checks cost: the farm's plain-torch Llama, 16 layers, on CPU or
(``--device cuda``) a GPU, where each timed call ends with a synchronize.

Builds ``farm.zoo.llama:llama`` both ways in this process (aot_compile,
``--kind inference``: a forward under no_grad, or ``training``: a forward
and backward), loads each with a fresh model, and times them side by side:
``--rounds`` rounds, each timing every variant for the median of
``--calls`` calls (after 5 warm-up calls in the first round), in turn: the
full graph, per-block, per-block loaded with ``disable_guard_check`` (what
the 16 blocks' guard checks cost; inference) and eager. Printed: each
variant's median over the rounds, and per-block against the full graph in
each round (its median, lowest and highest): on a shared 2-core machine one
process's load moves a single timing by tens of percent, and interleaved
rounds see the same load.

    .venv/bin/python bench/per_block_steady.py [--kind training] [--calls 100] [--rounds 5]
        [--dim 128] [--tokens 1,64] [--device cuda] [--profile CALLS] [--out FILE]
"""

from __future__ import annotations

import argparse
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
from farm.node.loader import load_artifact  # noqa: E402

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
                    help="afterwards, profile CALLS per-block calls (cProfile) and print where "
                         "their Python time went")
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

    def step(f: Any, m: torch.nn.Module, x: torch.Tensor) -> None:
        if not training:
            with torch.no_grad():
                f(x)
            sync()
            return
        y = f(x)
        (y if isinstance(y, torch.Tensor) else y[0]).float().sum().backward()
        for p in m.parameters():
            p.grad = None
        sync()

    variants: dict[str, Any] = {}  # name -> a call of one step
    for per_block in (False, True):
        s = spec(per_block)
        (art,) = compile_artifacts(s, device, Path(tempfile.mkdtemp()), formats=["aot_compile"])
        (x,) = example_inputs(s.inputs, device=device, mark_dynamic=False)
        name = "per-block" if per_block else "full graph"
        m = model(s)
        fn = load_artifact(art.path, "aot_compile", module=m, trust_unverified=True)
        variants[name] = lambda fn=fn, m=m, x=x: step(fn, m, x)
        if per_block and not training:
            m_off = model(s)
            off = load_artifact(art.path, "aot_compile", module=m_off,
                                trust_unverified=True, disable_guard_check=True)
            variants["per-block, guard checks off"] = lambda f=off, m=m_off, x=x: step(f, m, x)
    eager_model = model(spec(False))
    (x,) = example_inputs(spec(False).inputs, device=device, mark_dynamic=False)
    variants["eager"] = lambda: step(eager_model, eager_model, x)

    rounds: dict[str, list[float]] = {name: [] for name in variants}
    for r in range(args.rounds):
        for name, call in variants.items():
            rounds[name].append(median_s(call, calls=args.calls, warm_up=5 if r == 0 else 1))
    got = {name: round(statistics.median(ts) * 1e3, 3) for name, ts in rounds.items()}
    ratios = sorted(b / a - 1 for a, b in zip(rounds["full graph"], rounds["per-block"],
                                                strict=True))
    line = (f"per_block_steady: farm.zoo.llama 16 layers dim {args.dim}, {tokens}, "
            f"{args.kind}, {_where(device)}, torch {torch.__version__}, "
            f"{torch.get_num_threads()} threads, "
            f"{args.rounds} rounds of the median of {args.calls} calls, load average "
            f"{os.getloadavg()[0]:.1f} at the end; ms: {json.dumps(got)}; per-block against "
            f"the full graph by round: median {statistics.median(ratios):+.1%}, lowest "
            f"{ratios[0]:+.1%}, highest {ratios[-1]:+.1%}")
    print(line)
    if args.out:
        args.out.write_text(line + "\n")
    if args.profile:
        profile(variants["per-block"], args.profile)


def profile(call: Any, calls: int) -> None:
    """Where ``calls`` calls of ``call`` spend their time, by function (own
    time): what a block call adds on top of its kernels (guard checks,
    argument binding, AOTAutograd's wrapper)."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        call()
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(20)


def _where(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return "CPU"


if __name__ == "__main__":
    main()
