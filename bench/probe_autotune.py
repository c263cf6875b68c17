"""Why does a max-autotune artifact still compile on its first call after
loading? A GPU probe (issue 7): compile once, then load in fresh processes
with an empty Inductor cache and report what the first call wrote there.

    python bench/probe_autotune.py [--mode max-autotune-no-cudagraphs] [--model bench]

Variants: the farm's bundle as built (tuned ``.best_config`` files shipped),
and the bundle plus PyTorch's Mega-Cache bytes from the build process.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MODELS = {
    "bench": ("farm.zoo.basic:bench_transformer", "bfloat16[8,512,1024]"),
    "mlp": ("farm.zoo.basic:mlp", "float32[8,64]"),
}


def spec_for(model: str, mode: str):  # type: ignore[no-untyped-def]
    from farm.core.specs import JobSpec

    entry, inputs = MODELS[model]
    return JobSpec.from_json(
        {
            "name": "probe",
            "version": "1",
            "model": {"entrypoint": entry},
            "inputs": [inputs],
            "options": {"mode": mode},
        }
    )


def census(cache: Path, since: float | None = None) -> dict[str, int | list[str]]:
    counts: dict[str, int] = {}
    fresh: list[str] = []
    for p in cache.rglob("*"):
        if p.is_file():
            ext = p.suffix or p.name
            counts[ext] = counts.get(ext, 0) + 1
            if since is not None and p.suffix == ".best_config" and p.stat().st_mtime >= since:
                fresh.append(p.relative_to(cache).as_posix())
    return {**counts, "new_best_configs": fresh[:20], "new_best_config_count": len(fresh)}


def do_compile(out: Path, model: str, mode: str, device: str) -> None:
    import torch

    from farm.build.compile import compile_artifacts

    t0 = time.time()
    arts = compile_artifacts(spec_for(model, mode), device, out, formats=["aot_compile"])
    art = arts[0]
    saved = torch.compiler.save_cache_artifacts()
    if saved is not None:
        (out / "mega.bin").write_bytes(saved[0])
    tune = Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])
    print(
        json.dumps(
            {
                "step": "compile",
                "s": round(time.time() - t0, 1),
                "path": str(art.path),
                "autotune_configs": art.meta.get("autotune_configs"),
                "size": art.path.stat().st_size,
                "mega_bytes": len(saved[0]) if saved else None,
                "mega_info": str(saved[1])[:600] if saved else None,
                "build_cache_dir_env_at_end": os.environ.get("TORCHINDUCTOR_CACHE_DIR"),
                "build_cache": census(tune),
                "tmp_best_configs": len(list(Path(tempfile.gettempdir()).rglob("*.best_config"))),
            }
        ),
        flush=True,
    )


def do_load(out: Path, model: str, mode: str, device: str, variant: str) -> None:
    import torch

    from farm.core.modelref import apply_grad_mode, build_module, example_inputs
    from farm.core.specs import GradMode
    from farm.node.loader import load_artifact

    cache = Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])
    spec = spec_for(model, mode)
    mega_s = None
    if variant == "bundle+mega":
        t = time.time()
        torch.compiler.load_cache_artifacts((out / "mega.bin").read_bytes())
        mega_s = time.time() - t
    m = build_module(spec.model, device=device, seed=0)
    apply_grad_mode(m, GradMode.INFERENCE)
    xs = example_inputs(spec.inputs, device=device, mark_dynamic=False)
    t = time.time()
    fn = load_artifact(out / "aot_compile.bin", "aot_compile", module=m, trust_unverified=True)
    load_s = time.time() - t
    before = census(cache)
    t_first = time.time()
    with torch.no_grad():
        fn(*xs)
    if device == "cuda":
        torch.cuda.synchronize()
    first_s = time.time() - t_first
    t = time.time()
    with torch.no_grad():
        fn(*xs)
    if device == "cuda":
        torch.cuda.synchronize()
    second_s = time.time() - t
    from torch._dynamo.utils import counters

    print(
        json.dumps(
            {
                "step": "load",
                "variant": variant,
                "mega_load_s": mega_s,
                "load_s": round(load_s, 3),
                "first_call_s": round(first_s, 3),
                "second_call_s": round(second_s, 4),
                "cache_after_load": before,
                "cache_after_first_call": census(cache, since=t_first),
                "inductor_counters": {
                    k: dict(v) for k, v in counters.items() if v and k in ("inductor", "autotune")
                },
            }
        ),
        flush=True,
    )


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("step", nargs="?", default="all")
    ap.add_argument("--model", default="bench")
    ap.add_argument("--mode", default="max-autotune-no-cudagraphs")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dir")
    ap.add_argument("--variant", default="bundle")
    a = ap.parse_args()
    if a.step == "compile":
        do_compile(Path(a.dir), a.model, a.mode, a.device)
        return 0
    if a.step == "load":
        do_load(Path(a.dir), a.model, a.mode, a.device, a.variant)
        return 0
    work = Path(tempfile.mkdtemp(prefix="probe-"))
    common = ["--model", a.model, "--mode", a.mode, "--device", a.device, "--dir", str(work)]
    from farm.build.steps import compile_env

    subprocess.run(
        [sys.executable, __file__, "compile", *common],
        check=True,
        timeout=400,
        env={**os.environ, **compile_env(work)},
    )
    for variant in os.environ.get("PROBE_VARIANTS", "bundle,bundle+mega").split(","):
        cache = tempfile.mkdtemp(prefix="probe-node-")
        env = {
            **os.environ,
            "TORCHINDUCTOR_CACHE_DIR": cache,
            "TRITON_CACHE_DIR": f"{cache}/triton",
        }
        subprocess.run(
            [sys.executable, __file__, "load", *common, "--variant", variant], env=env, timeout=300
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
