"""A fresh node process for tests/integration/test_fake_weights.py: load a
fake-weight artifact with a real module, compare with eager, then try a module
of the wrong shape, which the farm's weight check must refuse before loading.

argv: ARTIFACT META_JSON HIDDEN WRONG_HIDDEN; prints one JSON line.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from farm.node.loader import load_artifact
from farm.node.weight_check import MANIFEST_KEY, WeightsMismatch
from farm.zoo.basic import mlp


def main() -> None:
    path, meta_path, hidden, wrong = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    meta = json.loads(Path(meta_path).read_text())
    manifest = meta[MANIFEST_KEY]
    torch.manual_seed(7)
    module = mlp(d_in=32, hidden=hidden, d_out=32).eval()
    fn = load_artifact(path, "aot_compile", module=module, trust_unverified=True,
                       weights_manifest=manifest)
    errs = []
    with torch.no_grad():
        for batch in (2, 5):
            x = torch.randn(batch, 32)
            errs.append(float((fn(x) - module(x)).abs().max()))
    refused = None
    try:
        load_artifact(path, "aot_compile", module=mlp(d_in=32, hidden=wrong, d_out=32).eval(),
                      trust_unverified=True, weights_manifest=manifest)
    except WeightsMismatch as exc:
        refused = str(exc)
    print(json.dumps({"errs": errs, "refused": refused}))


if __name__ == "__main__":
    main()
