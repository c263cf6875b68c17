"""Differences between the torch releases the farm supports (2.11 on the GPU
hosts, 2.13 here), in one place for the builder and the fleet node."""

from __future__ import annotations


def enable_aot_compile() -> None:
    """torch before 2.12 only attaches ``.aot_compile`` to compiled functions,
    and loads what it saved, when ``torch._dynamo.config.enable_aot_compile``
    is set; later releases have no such flag."""
    import torch._dynamo.config as dynamo_config

    if hasattr(dynamo_config, "enable_aot_compile"):
        dynamo_config.enable_aot_compile = True
