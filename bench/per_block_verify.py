"""A per-block artifact built and verified as a worker does, with the
verification's compile events: does a fresh node compile anything?

Builds ``tests.models.structured:hf_llama`` (transformers, 2 layers) with
``per_block: true`` in this process, in both formats, and verifies each in a
fresh process with an empty cache (``farm.build.verify.verify_artifact``),
printing the per-block meta and the verification's load and first-call
events (``load_compiled``: the node compiled something while loading).

``--full`` builds the same model without per_block after it (one more
``aot_compile`` artifact, in a process of its own) for comparison. ``--explain`` loads each
``aot_compile`` artifact once more in a fresh process of its own, with an
empty cache, and prints every Triton compile during the load: the kernel,
its config, which Inductor step asked for it and how long it took, and the
kernels torch's bundle served without one.

    .venv/bin/python bench/per_block_verify.py [--device cuda] [--full] [--explain] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from farm.build.compile import compile_artifacts  # noqa: E402
from farm.build.verify import verify_artifact  # noqa: E402
from farm.core.specs import JobSpec  # noqa: E402

FIELDS = ("max_abs_err", "load_s", "first_call_s", "first_call_compiled", "load_compiled",
          "error", "load_events", "first_call_events")


def job(per_block: bool) -> JobSpec:
    return JobSpec.from_json({
        "name": "per-block-verify", "version": "1",
        "model": {"entrypoint": "tests.models.structured:hf_llama", "kwargs": {"layers": 2}},
        "inputs": ["input_ids=int64[1,16]", "attention_mask=int64[1,16]{0..1}"],
        "options": {"per_block": per_block}})


def explain_load(spec_json: str, path: str, device: str) -> None:
    """In a fresh process (this one): load ``path`` as a node would, with
    every Triton compile and bundle load printed."""
    from farm.core.modelref import build_real
    from farm.node.loader import load_artifact

    spec = JobSpec.from_json(json.loads(spec_json))
    model = build_real(spec.model, device=device, seed=0)
    compiles: list[dict[str, Any]] = []
    from torch._inductor.runtime import triton_heuristics as th
    from torch._inductor.triton_bundler import TritonBundler

    orig = th.CachingAutotuner._precompile_config

    def binaries() -> int:
        root = os.environ["TRITON_CACHE_DIR"]
        return sum(1 for _, _, files in os.walk(root) for f in files if f.endswith(".cubin"))

    def precompile_config(self: Any, cfg: Any) -> Any:
        t0 = time.perf_counter()
        before = binaries()
        try:
            return orig(self, cfg)
        finally:
            callers = [f.name for f in traceback.extract_stack()[-8:-1]]
            compiles.append({"kernel": self.inductor_meta.get("kernel_name"),
                             "config": str(cfg), "s": round(time.perf_counter() - t0, 4),
                             "new_binaries": binaries() - before, "callers": callers})

    th.CachingAutotuner._precompile_config = precompile_config
    orig_load = TritonBundler.load_autotuners.__func__

    def load_autotuners(cls: Any, autotuners: Any) -> Any:
        names = orig_load(cls, autotuners)
        print("BUNDLE static autotuners loaded:", names, flush=True)
        return names

    TritonBundler.load_autotuners = classmethod(load_autotuners)  # type: ignore[method-assign]
    import logging

    logging.basicConfig(level=logging.WARNING, format="LOG %(name)s %(message)s")
    # Why a kernel has no static launcher ("Bypassing StaticallyLaunchedCudaKernel
    # due to ..."), at INFO.
    why = logging.getLogger("torch._inductor.runtime.triton_heuristics")
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("LOG %(name)s %(message)s"))
    handler.addFilter(lambda r: "Bypassing" in r.getMessage())
    why.addHandler(handler)
    why.setLevel(logging.INFO)
    t0 = time.perf_counter()
    load_artifact(path, "aot_compile", module=model, trust_unverified=True)
    print(f"LOAD {time.perf_counter() - t0:.3f} s, {len(compiles)} Triton compiles", flush=True)
    for c in compiles:
        print("COMPILE", json.dumps(c), flush=True)


def trace_build_kernels() -> list[dict[str, Any]]:
    """In the building process: each Triton kernel as Inductor's parent
    process gets it (compiled here or in its compile pool), with its Triton
    hash, whether it has a static launcher, and whether its binary is where
    the launcher and the farm's bundle look for it."""
    import torch._inductor.runtime.triton_heuristics as th
    from torch._inductor.runtime.cache_dir_utils import triton_cache_dir

    seen: list[dict[str, Any]] = []
    orig = th.CachingAutotuner.precompile

    def precompile(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = orig(self, *args, **kwargs)
        for r in self.compile_results or ():
            h = getattr(getattr(r, "kernel", None), "hash", None)
            # The name triton_heuristics itself uses (its module moved between releases).
            key = th.triton_hash_to_path_key(h) if h else None
            name = self.inductor_meta.get("kernel_name")
            root = triton_cache_dir(int(self.triton_meta.get("device", 0) or 0))
            seen.append({"kernel": name, "key": key, "result": type(r).__name__,
                         "binary_there": bool(key and os.path.exists(
                             os.path.join(root, key, f"{name}.cubin"))),
                         "pid": os.getpid()})
        return out

    th.CachingAutotuner.precompile = precompile
    return seen


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--full", action="store_true", help="also build without per_block")
    ap.add_argument("--explain", action="store_true",
                    help="load each aot_compile artifact again, printing its Triton compiles")
    ap.add_argument("--whole", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--explain-load", nargs=2, metavar=("SPEC_JSON", "PATH"),
                    help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if args.explain_load:
        explain_load(*args.explain_load, args.device)
        return
    lines = []
    built = trace_build_kernels() if args.explain else []
    for per_block in ((False,) if args.whole else (True,)):
        spec = job(per_block)
        arts = compile_artifacts(spec, args.device, Path(tempfile.mkdtemp()),
                                 formats=["aot_compile", "aoti"] if per_block else ["aot_compile"])
        for k in built:
            lines.append(f"BUILT {json.dumps(k)}")
        for art in arts:
            if args.explain and art.format == "aot_compile":
                import zipfile

                with zipfile.ZipFile(art.path) as z:
                    shipped = sorted({n.split("/")[1] for n in z.namelist()
                                      if n.startswith("triton/") and n.endswith(".cubin")})
                lines.append(f"SHIPPED triton keys {shipped}")
        print(*lines, sep="\n", flush=True)
        for art in arts:
            label = f"{art.format}{' per_block' if per_block else ' full'}"
            lines.append(f"ART {label} {json.dumps(art.meta.get('per_block'))}")
            rep = verify_artifact(spec, str(art.path), art.format, device=args.device,
                                  timeout_s=300, memory_mb=20000)
            got = {k: v for k, v in rep.to_json().items() if k in FIELDS}
            lines.append(f"REPORT {label} ok={rep.ok} {json.dumps(got)}")
            print(lines[-2], lines[-1], sep="\n", flush=True)
            if args.explain and art.format == "aot_compile":
                cache = tempfile.mkdtemp(prefix="explain-cache-")
                env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache,
                       "TRITON_CACHE_DIR": str(Path(cache) / "triton")}
                res = subprocess.run(
                    [sys.executable, __file__, "--device", args.device, "--explain-load",
                     json.dumps(spec.to_json()), str(art.path)],
                    env=env, capture_output=True, text=True, timeout=600)
                out = [f"EXPLAIN {label} {ln}" for ln in
                       (res.stdout + res.stderr).splitlines()
                       if ln.startswith(("BUNDLE", "LOAD", "COMPILE", "LOG", "Traceback"))
                       or "Error" in ln]
                lines += out
                print(*out, sep="\n", flush=True)
    if args.full:
        # In a process of its own: an aot_compile build after a per-block one
        # in the same process failed on torch 2.11 ("Missing required external
        # references: ['type']"); the farm runs every build in a fresh child.
        res = subprocess.run([sys.executable, __file__, "--device", args.device, "--whole",
                              *(["--explain"] if args.explain else [])],
                             capture_output=True, text=True, timeout=900)
        out = [ln for ln in res.stdout.splitlines()
               if ln.startswith(("ART", "REPORT", "EXPLAIN", "BUILT", "SHIPPED"))]
        if res.returncode:
            out.append(f"FULL BUILD FAILED rc={res.returncode}: {res.stderr[-2000:]}")
        lines += out
        print(*out, sep="\n", flush=True)
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
