"""What Inductor's optimisation level for an AOTI package's wrapper buys and
costs: torch compiles the wrapper (``AOTInductorModel::run_impl``) at
``aot_inductor.compile_wrapper_opt_level``, ``O1`` by default, and its
kernels (CPU) at ``O3``. For each level given, the package of
``farm.zoo.stack:stack`` (16 residual layers) is compiled in a process of its
own, with an Inductor cache of its own (so no level reuses another's
kernels), and its wall time and its compiler's CPU seconds printed; then
every package is loaded in this one process and timed side by side:
``--rounds`` rounds, each the mean of ``--calls`` calls of every package in
turn, with each call's result checked against eager first. On a shared
2-core machine one process's load moves a single timing by tens of
percent; interleaved rounds see the same load.

    .venv/bin/python bench/aoti_wrapper_opt.py [--levels O1,O0] [--device cpu]
        [--width 64] [--batch 8] [--rounds 7] [--calls 300] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from farm.zoo.stack import stack  # noqa: E402


def _model(width: int) -> torch.nn.Module:
    """The same weights in every process: a package holds its child's."""

    torch.manual_seed(0)
    return stack(layers=16, width=width).eval()


def _compile_one(level: str, device: str, width: int, batch: int, package: str) -> None:
    """In a child: compile the package at ``level``; print its costs as JSON."""
    from torch._inductor import config

    config.aot_inductor.compile_wrapper_opt_level = level
    m = _model(width).to(device)
    ep = torch.export.export(m, (torch.randn(batch, width, device=device),))
    c0, t0 = resource.getrusage(resource.RUSAGE_CHILDREN), time.monotonic()
    torch._inductor.aoti_compile_and_package(ep, package_path=package)
    c1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    print(json.dumps({"compile_s": round(time.monotonic() - t0, 2),
                      "compiler_cpu_s": round(c1.ru_utime + c1.ru_stime
                                              - c0.ru_utime - c0.ru_stime, 2)}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--levels", default="O1,O0")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--child", help=argparse.SUPPRESS)  # LEVEL:PACKAGE
    a = ap.parse_args()
    if a.child:
        level, package = a.child.split(":", 1)
        _compile_one(level, a.device, a.width, a.batch, package)
        return
    levels = a.levels.split(",")
    work = Path(tempfile.mkdtemp(prefix="aoti-wrapper-opt-"))
    built: dict[str, dict[str, float]] = {}
    for level in levels:
        package = str(work / f"{level}.pt2")
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(work / f"cache-{level}")}
        out = subprocess.run([sys.executable, __file__, "--device", a.device, "--width",
                              str(a.width), "--batch", str(a.batch), "--child",
                              f"{level}:{package}"],
                             env=env, capture_output=True, text=True, check=True)
        built[level] = json.loads(out.stdout.strip().splitlines()[-1])
        print(level, built[level], flush=True)

    def sync() -> None:
        if a.device.startswith("cuda"):
            torch.cuda.synchronize()

    m = _model(a.width).to(a.device)
    x = torch.randn(a.batch, a.width, device=a.device)
    runners = {lv: torch._inductor.aoti_load_package(str(work / f"{lv}.pt2")) for lv in levels}
    per_call: dict[str, list[float]] = {lv: [] for lv in levels}
    with torch.no_grad():
        ref = m(x)
        for lv, r in runners.items():
            err = (r(x) - ref).abs().max().item()
            assert err <= 1e-4, f"{lv}: max abs err {err}"
        for i in range(a.rounds):
            for lv in levels[i % len(levels):] + levels[:i % len(levels)]:
                r = runners[lv]
                for _ in range(20):
                    r(x)
                sync()
                t0 = time.perf_counter()
                for _ in range(a.calls):
                    r(x)
                sync()
                per_call[lv].append((time.perf_counter() - t0) / a.calls * 1e6)
    base = levels[0]
    lines = [f"aoti_wrapper_opt: farm.zoo.stack 16 layers width {a.width}, float32"
             f"[{a.batch},{a.width}], {a.device}, torch {torch.__version__}, "
             f"{a.rounds} rounds of the mean of {a.calls} calls"]
    for lv in levels:
        by_round = [f"{v / b - 1:+.1%}" for v, b in zip(per_call[lv], per_call[base], strict=True)]
        lines.append(f"{lv}: compile {built[lv]['compile_s']} s, compiler CPU "
                     f"{built[lv]['compiler_cpu_s']} s; per call us median "
                     f"{statistics.median(per_call[lv]):.1f}"
                     + ("" if lv == base else f"; against {base} by round {by_round}"))
    text = "\n".join(lines)
    print(text)
    if a.out:
        a.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
