"""The fleet path's steps one after another (overlap=False), in a fresh process.

    FARM_URL=... CLIENT_CACHE_DIR=... TORCHINDUCTOR_CACHE_DIR=... \
        python bench/fleet_steps.py MODEL inference|training

(docs/fleet-path.md)
"""

# Imports are timed where they happen.
# ruff: noqa: E402, E501

import os
import sys
import time

t0 = time.perf_counter()
import torch

t1 = time.perf_counter()
from farm.node.client import FarmClient

t2 = time.perf_counter()
from farm.node.compiled import prefetch_compiled

t3 = time.perf_counter()
train = sys.argv[2] == "training"
h = prefetch_compiled(
    model=sys.argv[1],
    ref="1",
    example_inputs=["float32[4,64,128]"],
    grad_mode=sys.argv[2],
    device="cpu",
    client=FarmClient(os.environ["FARM_URL"]),
    overlap=False,
)
pre = h.result()
t4 = time.perf_counter()
from farm.core.modelref import build_module
from farm.core.specs import ModelRef

m = build_module(ModelRef(entrypoint="farm.zoo.basic:small_transformer"), device="cpu", seed=0)
if not train:
    m.eval()
t5 = time.perf_counter()
fn = h.bind(m)
t6 = time.perf_counter()
x = torch.randn(4, 64, 128)
with torch.enable_grad() if train else torch.no_grad():
    y = fn(x)
    if train:
        y.sum().backward()
t7 = time.perf_counter()
print(
    f"import torch {t1 - t0:.3f}  import client {t2 - t1:.3f}  import compiled {t3 - t2:.3f}  "
    f"prefetch {t4 - t3:.3f} {dict((k, round(v, 3)) for k, v in h.timings.items())}  build {t5 - t4:.3f}  "
    f"bind/load {t6 - t5:.3f}  first call {t7 - t6:.3f}  source={getattr(fn, 'source', None)} {getattr(fn, 'reason', None)}"
)
