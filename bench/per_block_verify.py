"""A per-block artifact built and verified as a worker does, with the
verification's compile events: does a fresh node compile anything?

Builds ``tests.models.structured:hf_llama`` (transformers, 2 layers) with
``per_block: true`` in this process, in both formats, and verifies each in a
fresh process with an empty cache (``farm.build.verify.verify_artifact``),
printing the per-block meta and the verification's load and first-call
events (``load_compiled``: the node compiled something while loading).

    .venv/bin/python bench/per_block_verify.py [--device cuda] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from farm.build.compile import compile_artifacts  # noqa: E402
from farm.build.verify import verify_artifact  # noqa: E402
from farm.core.specs import JobSpec  # noqa: E402

FIELDS = ("max_abs_err", "first_call_s", "first_call_compiled", "load_compiled", "error",
          "load_events", "first_call_events")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    spec = JobSpec.from_json({
        "name": "per-block-verify", "version": "1",
        "model": {"entrypoint": "tests.models.structured:hf_llama", "kwargs": {"layers": 2}},
        "inputs": ["input_ids=int64[1,16]", "attention_mask=int64[1,16]{0..1}"],
        "options": {"per_block": True}})
    lines = []
    arts = compile_artifacts(spec, args.device, Path(tempfile.mkdtemp()),
                             formats=["aot_compile", "aoti"])
    for art in arts:
        lines.append(f"ART {art.format} {json.dumps(art.meta.get('per_block'))}")
        rep = verify_artifact(spec, str(art.path), art.format, device=args.device,
                              timeout_s=300, memory_mb=20000)
        got = {k: v for k, v in rep.to_json().items() if k in FIELDS}
        lines.append(f"REPORT {art.format} ok={rep.ok} {json.dumps(got)}")
        print(lines[-2], lines[-1], sep="\n", flush=True)
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
