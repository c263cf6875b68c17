"""Differences between the torch releases the farm supports (2.11 on the GPU
hosts, 2.13 here), in one place for the builder and the fleet node."""

from __future__ import annotations

from typing import Any


def enable_aot_compile() -> None:
    """torch before 2.12 only attaches ``.aot_compile`` to compiled functions,
    and loads what it saved, when ``torch._dynamo.config.enable_aot_compile``
    is set; later releases have no such flag. Also makes 2.11 save the
    builtins its bytecode loads (below)."""
    import torch._dynamo.config as dynamo_config

    if hasattr(dynamo_config, "enable_aot_compile"):
        dynamo_config.enable_aot_compile = True
    _save_builtins_the_bytecode_loads()


def _save_builtins_the_bytecode_loads() -> None:
    """torch 2.11's ``aot_compile`` checks that every global its bytecode
    loads is one it saves (a graph input's global, a module import), and a
    builtin is neither: a 2-layer transformers Llama's full graph, whose
    bytecode calls ``type``, failed its build on an H100 with "Missing
    required external references: ['type']". torch 2.13 saves the builtins
    the bytecode names beside the other globals; this does the same on
    releases that do not, as the saved function is made (its bytes then
    carry them) and as it is loaded (an artifact saved without them).
    Nothing changes where torch saved them already."""
    import builtins

    try:
        from torch._dynamo.convert_frame import GraphRuntimeEnv
    except ImportError:  # a torch without aot_compile's runtime env
        return
    orig = GraphRuntimeEnv.forward_callable
    if getattr(orig, "_farm_saves_builtins", False):
        return

    def forward_callable(self: Any, *args: Any, **kwargs: Any) -> Any:
        used = getattr(self, "used_globals", None)
        imports = getattr(self, "import_sources", None) or {}
        if isinstance(used, dict):
            for ref in getattr(self, "external_refs", None) or ():
                if ref not in used and ref not in imports and hasattr(builtins, ref):
                    used[ref] = getattr(builtins, ref)
        return orig(self, *args, **kwargs)

    forward_callable._farm_saves_builtins = True  # type: ignore[attr-defined]
    GraphRuntimeEnv.forward_callable = forward_callable
