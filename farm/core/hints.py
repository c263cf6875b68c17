"""What a job's trace says the user could do better, as a line of advice
(the job view carries it; ``farm status`` and the dashboard show it)."""

from __future__ import annotations

from typing import Any

from farm.core.inputs import parse_inputs


def per_block_hint(repeated_blocks: int, spec: dict[str, Any]) -> str | None:
    """Where the trace found repeated blocks (transformer layers) and the job
    (``spec``, its JSON) was not built per block and could be (static
    shapes), what ``--per-block`` would give. The farm does not choose it:
    per-block drops the AOTI package and costs a little per call
    (docs/benchmarks.md), which is the user's trade."""
    if repeated_blocks < 2 or (spec.get("options") or {}).get("per_block"):
        return None
    if any(t.dynamic_dims for t in parse_inputs(spec.get("inputs") or [])):
        return None  # dynamic dimensions: per-block compiles exact shapes
    return (f"{repeated_blocks} calls of repeated blocks: --per-block compiles each distinct "
            "block once, and a new version recompiles only the blocks it changes (aot_compile "
            "only, no AOTI package; each block call costs a little, so a small model runs "
            "faster as one graph)")


__all__ = ["per_block_hint"]
