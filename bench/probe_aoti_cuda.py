"""Why does a weight-free AOTI package crash at load on torch 2.11 (CUDA and
CPU), and which way of building or loading one works there?

    python bench/probe_aoti_cuda.py [--device cuda] [--out DIR]

Builds a small MLP's AOTI package in a few variants (weights in the package or
not), then loads each in a fresh process in a few ways (torch's
``aoti_load_package``, the farm's direct ``AOTIModelPackageLoader``; node
weights given ``user_managed`` or copied), with faulthandler on, and prints
one line per (variant, loader): ok and the max error against eager, or how it
died. Also times the imports an ``aot_compile`` artifact needs, alone.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = {"noconst": False, "const": True}
LOADERS = ("torch", "torch_user", "runner_user", "runner_copy")


def model(device: str):  # type: ignore[no-untyped-def]
    import torch

    torch.manual_seed(0)
    m = torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64)
    ).to(device)
    return m.eval()


def build(device: str, work: Path, variants: list[str]) -> None:
    import torch

    m = model(device)
    x = torch.randn(8, 64, device=device)
    with torch.no_grad():
        ep = torch.export.export(m, (x,), strict=False)
    for name in variants:
        in_so = VARIANTS[name]
        t0 = time.perf_counter()
        torch._inductor.aoti_compile_and_package(
            ep,
            package_path=str(work / f"{name}.pt2"),
            inductor_configs={
                "aot_inductor.package_constants_in_so": in_so,
                "always_keep_tensor_constants": True,
                "freezing": False,
            },
        )
        print(f"built {name} in {time.perf_counter() - t0:.1f} s", flush=True)


def load(device: str, path: Path, how: str) -> None:
    import faulthandler

    faulthandler.enable()
    import torch

    m = model(device)
    x = torch.randn(8, 64, device=device)
    with torch.no_grad():
        want = m(x)
    sd = {**dict(m.named_parameters()), **dict(m.named_buffers())}
    t0 = time.perf_counter()
    if how.startswith("torch"):
        pkg = torch._inductor.aoti_load_package(str(path))
        if how == "torch_user":
            pkg.load_constants(sd, check_full_update=True, user_managed=True)
        run = pkg
    else:
        idx = 0 if device == "cuda" else -1
        loader = torch._C._aoti.AOTIModelPackageLoader(str(path), "model", False, 1, idx)
        print("fqns", list(loader.get_constant_fqns()), flush=True)
        loader.load_constants(sd, False, True, how == "runner_user")

        def run(*a):  # type: ignore[no-untyped-def]
            return loader.boxed_run(list(a))[0]
    load_s = time.perf_counter() - t0
    with torch.no_grad():
        got = run(x)
        if isinstance(got, (list, tuple)):
            got = got[0]
    err = (got.float() - want.float()).abs().max().item()
    print(json.dumps({"ok": True, "max_abs_err": err, "load_s": round(load_s, 3)}), flush=True)


def time_warm_imports() -> None:
    t0 = time.perf_counter()
    import torch  # noqa: F401

    t1 = time.perf_counter()
    from farm.node.compiled import warm_imports

    s = warm_imports()
    print(json.dumps({"import_torch_s": round(t1 - t0, 2), "warm_imports_s": round(s, 2)}))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--work", type=Path, default=Path("/tmp/probe-aoti"))
    ap.add_argument("--child", nargs=2)
    ap.add_argument("--imports", action="store_true")
    ap.add_argument("--variants", nargs="*", default=list(VARIANTS))
    ap.add_argument("--loaders", nargs="*", default=list(LOADERS))
    ap.add_argument(
        "--tmpdirs", nargs="*", default=["default"],
        help="TMPDIR for the loading child (where the package is unpacked and its .so "
        "loaded from); 'default' leaves it alone",
    )
    ap.add_argument("--no-import-timing", action="store_true")
    a = ap.parse_args()
    if a.imports:
        time_warm_imports()
        return 0
    if a.child:
        load(a.device, Path(a.child[0]), a.child[1])
        return 0
    import torch

    print("torch", torch.__version__, flush=True)
    print(torch._C._aoti.AOTIModelPackageLoader.__init__.__doc__, flush=True)
    a.work.mkdir(parents=True, exist_ok=True)
    build(a.device, a.work, a.variants)
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}"}
    for tmpdir in a.tmpdirs:
        child_env = dict(env)
        if tmpdir != "default":
            Path(tmpdir).mkdir(parents=True, exist_ok=True)
            child_env["TMPDIR"] = tmpdir
        for name in a.variants:
            for how in a.loaders:
                p = subprocess.run(
                    [sys.executable, __file__, "--device", a.device, "--child",
                     str(a.work / f"{name}.pt2"), how],
                    capture_output=True, text=True, env=child_env, timeout=300,
                )
                tail = (p.stdout + p.stderr).strip().splitlines()[-12:]
                status = "ok" if p.returncode == 0 else f"rc={p.returncode}"
                print(f"== {a.device} {name} {how} TMPDIR={tmpdir}: {status}", flush=True)
                for line in tail:
                    print("   ", line[:300], flush=True)
    for _ in range(0 if a.no_import_timing else 2):
        p = subprocess.run([sys.executable, __file__, "--imports"], capture_output=True,
                           text=True, env=env, timeout=300)
        print("warm imports alone:", (p.stdout or p.stderr).strip()[-300:], flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
