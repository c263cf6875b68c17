"""What a job's trace says the user could do better, as a line of advice
(the job view carries it; ``farm status`` and the dashboard show it)."""

from __future__ import annotations

from typing import Any

from farm.core.inputs import parse_inputs


def per_block_hint(repeated_blocks: int, spec: dict[str, Any]) -> str | None:
    """Where the trace found repeated blocks (transformer layers) and the job
    (``spec``, its JSON) was not built per block and could be (static
    shapes), what ``--per-block`` would give. The farm does not choose it:
    per-block drops the AOTI package and costs about 0.1 ms per block call
    (docs/benchmarks.md: +15% on CPU, +40% on an H100 for a small
    Llama), which is the user's trade."""
    if repeated_blocks < 2 or (spec.get("options") or {}).get("per_block"):
        return None
    if any(t.dynamic_dims for t in parse_inputs(spec.get("inputs") or [])):
        return None  # dynamic dimensions: per-block compiles exact shapes
    return (f"{repeated_blocks} calls of repeated blocks: --per-block compiles each distinct "
            "block once, and a new version recompiles only the blocks it changes (aot_compile "
            "only, no AOTI package; each block call adds about 0.1 ms, so a call of a few ms, "
            "a small model or a GPU call of few tokens, runs faster as one graph); or submit "
            "the version both ways: nodes get the per-block artifact first, the full graph "
            "once it is built")


__all__ = ["per_block_hint"]
