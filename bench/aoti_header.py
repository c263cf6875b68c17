"""What a precompiled header would save an AOTI package's build (CPU).

The farm compiles AOTI packages with torch's header precompile off
(``farm.build.aoti_compile``): a package's bytes must not depend on whether
a header was there. This measures what that costs, with torch's own
mechanism in this one process: the 16-layer stack of ``bench/build_cost.py``
exported once, then ``aoti_compile_and_package`` again and again (torch
caches no part of an AOTI build): a first, untimed compile without a header
(the process's one-time costs: Inductor's ISA checks and imports), one
without a header, one with the header (built there if torch has none yet;
untimed), one with the header already built, and one without again.

    .venv/bin/python bench/aoti_header.py [--layers 16] [--width 64] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    import torch
    from torch._inductor.utils import clear_caches

    from farm.zoo.stack import stack

    model = stack(layers=args.layers, width=args.width).eval()
    with torch.no_grad():
        ep = torch.export.export(model, (torch.randn(8, args.width),), strict=False)
    base = tempfile.mkdtemp(prefix="aoti-header-")
    lines = [f"# bench/aoti_header.py: farm.zoo.stack layers={args.layers} width={args.width}, "
             f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU; one process"]

    def build(label: str | None, header: bool, cache: str) -> None:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
        clear_caches()
        configs = {"aot_inductor.package_constants_in_so": False,
                   "always_keep_tensor_constants": True,
                   "aot_inductor.precompile_headers": header}
        t, c = time.perf_counter(), os.times()
        torch._inductor.aoti_compile_and_package(
            ep, package_path=f"{tempfile.mkdtemp(dir=base)}/p.pt2", inductor_configs=configs)
        c2 = os.times()
        cpu = sum(c2[:4]) - sum(c[:4])
        if label is not None:
            lines.append(f"{label:<28} wall {time.perf_counter() - t:5.1f} s  CPU {cpu:5.1f} s")
            print(lines[-1], flush=True)

    build(None, False, f"{base}/a")
    build("no header", False, f"{base}/a")
    build(None, True, f"{base}/b")
    build("header already built", True, f"{base}/b")
    build("no header, again", False, f"{base}/a")
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
