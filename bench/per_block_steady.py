"""Per-call time of a per-block artifact against a full-graph one, and what
its guard checks cost (CPU): the farm's plain-torch Llama, 16 layers.

Builds ``farm.zoo.llama:llama`` both ways in this process (aot_compile,
inference), loads each with a fresh model, and times the median of
``--calls`` calls after 5 warm-up calls: the full graph, per-block, per-block
loaded with ``disable_guard_check`` (what the 16 blocks' guard checks cost),
and eager.

    .venv/bin/python bench/per_block_steady.py [--calls 100] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
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
    ap.add_argument("--calls", type=int, default=100)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    def spec(per_block: bool) -> JobSpec:
        return JobSpec(name="steady", version="1",
                       model=ModelRef("farm.zoo.llama:llama", kwargs=KWARGS),
                       inputs=parse_inputs(["int64[1,64]{0..1023}"]),
                       grad_mode=GradMode.INFERENCE, options=CompileOptions(per_block=per_block))

    def model(s: JobSpec) -> Any:
        m = build_real(s.model, device="cpu", seed=0)
        apply_grad_mode(m, s.grad_mode)
        return m

    def median_ms(f: Any, x: torch.Tensor) -> float:
        with torch.no_grad():
            return round(median_s(lambda: f(x), calls=args.calls, warm_up=5) * 1e3, 3)

    got: dict[str, float] = {}
    for per_block in (False, True):
        s = spec(per_block)
        (art,) = compile_artifacts(s, "cpu", Path(tempfile.mkdtemp()), formats=["aot_compile"])
        (x,) = example_inputs(s.inputs, device="cpu", mark_dynamic=False)
        name = "per-block" if per_block else "full graph"
        fn = load_artifact(art.path, "aot_compile", module=model(s), trust_unverified=True)
        got[name] = median_ms(fn, x)
        if per_block:
            off = load_artifact(art.path, "aot_compile", module=model(s),
                                trust_unverified=True, disable_guard_check=True)
            got["per-block, guard checks off"] = median_ms(off, x)
        got[f"eager (beside {name})"] = median_ms(model(s), x)
    line = (f"per_block_steady: farm.zoo.llama 16 layers dim 128, int64[1,64], CPU, torch "
            f"{torch.__version__}, {torch.get_num_threads()} threads, median of {args.calls} "
            f"calls, ms: {json.dumps(got)}")
    print(line)
    if args.out:
        args.out.write_text(line + "\n")


if __name__ == "__main__":
    main()
