"""Triton kernel names short enough for torch's static launcher.

Inductor names a fused Triton kernel after every op fused into it
(``triton_poi_fused__scaled_dot_product_efficient_attention__to_copy_..._where_2``,
over 200 characters for a transformers Llama's attention-mask kernels).
Triton names the kernel's files in its cache after the first 150 characters
of that name, and Inductor looks for the binary under the whole name, does
not find it ("Bypassing StaticallyLaunchedCudaKernel due to Cubin path not
found"), and keeps no static launcher for the kernel: torch's bundle inside
an ``aot_compile`` artifact then holds no launcher for it, and a node runs
Triton's compiler front end for it at load (a cache load at best, 0.04 to
0.56 s each on an H100; in a per-block artifact three real compiles, its
Triton keys there differing from the builder's). So the farm's builds cut
the descriptive part of such names to stay under Triton's 150; the
kernel's number keeps each name unique, and a profile still shows what it
fuses first. Measured with ``bench/per_block_verify.py --device cuda --full
--explain`` (docs/benchmarks.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# "triton_" + a 3-letter category + "_" + this + "_" + the kernel's number.
MAX_FUSED = 120


def short(name: str) -> str:
    """``name`` (Inductor's ``fused_...`` part), cut to ``MAX_FUSED``."""
    return name if len(name) <= MAX_FUSED else name[:MAX_FUSED].rstrip("_")


def install() -> bool:
    """Make this process's Inductor name its Triton kernels ``short``ly.
    False where this torch names them elsewhere (nothing changed)."""
    try:
        from torch._inductor.codegen import triton as triton_codegen
    except Exception:  # no Triton codegen in this torch
        return False
    orig: Callable[..., str] | None = getattr(triton_codegen, "get_fused_kernel_name", None)
    if orig is None:
        return False
    if getattr(orig, "_farm_short", False):
        return True

    def get_fused_kernel_name(*args: Any, **kwargs: Any) -> str:
        return short(orig(*args, **kwargs))

    get_fused_kernel_name._farm_short = True  # type: ignore[attr-defined]
    triton_codegen.get_fused_kernel_name = get_fused_kernel_name
    return True


__all__ = ["MAX_FUSED", "install", "short"]
