"""What both compilers share: their errors, and ``torch.compile``'s mode
spelled out as Inductor options. ``farm.build.compile`` writes the
``aot_compile`` artifact, ``farm.build.aoti_compile`` the AOTInductor package.

Split out of farm.build.compile; the bodies are as they were.
"""

from __future__ import annotations

from typing import Any


class CompileError(RuntimeError):
    """The job cannot be compiled as asked; the message says why."""


class ModelDoesNotFit(CompileError):
    """The model's weights alone exceed what the build GPU has free."""


class AOTIUnsupported(CompileError):
    """This job cannot be an AOTI package (an aot_compile artifact still can)."""


def mode_options(mode: str) -> dict[str, Any]:
    """``torch.compile`` takes a mode or options, never both, and the guard
    filter travels in options: spell the mode out as its options."""
    if mode == "default":
        return {}
    from torch._inductor import list_mode_options

    from farm.core.settings import get_settings

    options = dict(list_mode_options(mode))
    if options.get("coordinate_descent_tuning") and not get_settings().farm_coordesc:
        # Coordinate-descent tuning runs at a kernel's first launch and, on the
        # H200 with torch 2.11, was redone on every node at the first call
        # after loading (42 benchmarks, 7 s): the artifact would not be
        # finished. GEMM template selection, max-autotune's main gain, happens
        # at compile time and stays. FARM_COORDESC=1 restores torch's mode.
        options["coordinate_descent_tuning"] = False
    return options
