"""A/B of the fleet path's client import on CPU: one fresh process per call.

    FARM_URL=... CLIENT_CACHE_DIR=... python bench/fleet_ab.py E|A|B MODEL

E: eager; A: farm.node.client imported on the main thread before prefetch_compiled;
B: left to farm.node.compiled (which now imports it itself: B measured the background
import only before that was reverted). Prints seconds from process start to the first result.
(docs/fleet-path.md; bench/results/coldstart-cpu-20261204-fleet-ab.txt)
"""

# Imports are timed where they happen.
# ruff: noqa: E402

import sys
import time

import psutil

started = psutil.Process().create_time()
import torch

mode = sys.argv[1]
if mode == "A":
    import farm.node.client  # noqa: F401  (A: the main-thread import)
h = None
if mode in ("A", "B"):
    from farm.node.compiled import prefetch_compiled

    h = prefetch_compiled(
        model=sys.argv[2],
        ref="1",
        example_inputs=["float32[4,64,128]"],
        grad_mode="inference",
        device="cpu",
    )
from farm.core.modelref import build_module
from farm.core.specs import ModelRef

m = build_module(
    ModelRef(entrypoint="farm.zoo.basic:small_transformer"), device="cpu", seed=0
).eval()
fn = h.bind(m) if h else m
with torch.no_grad():
    fn(torch.randn(4, 64, 128))
print(
    f"{mode} {time.time() - started:.3f} {getattr(fn, 'source', 'eager')} {h.timings if h else ''}"
)
