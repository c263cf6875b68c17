"""The job view's advice (farm.core.hints): the per-block hint is given
where per-block could be used, and only there."""

from __future__ import annotations

from typing import Any

from farm.core.hints import per_block_hint


def spec(inputs: list[str], **options: Any) -> dict[str, Any]:
    return {"inputs": inputs, "options": options}


def test_the_per_block_hint_is_given_where_per_block_could_be_used() -> None:
    hint = per_block_hint(16, spec(["int64[1,64]"]))
    assert hint is not None and hint.startswith("16 calls of repeated blocks: --per-block")
    # The trade: the AOTI package, and a cost on every block call.
    assert "no AOTI package" in hint and "each block call adds" in hint
    # Both: the per-block artifact first, the full graph after (registry.resolver).
    assert "submit the version both ways" in hint
    assert per_block_hint(16, spec(["int64[1,64]"], regional=True)) is not None
    assert per_block_hint(16, spec(["int64[1,64]{0..31999}"])) is not None  # a value range


def test_no_hint_where_per_block_is_used_or_cannot_be() -> None:
    assert per_block_hint(16, spec(["int64[1,64]"], per_block=True)) is None
    assert per_block_hint(0, spec(["int64[1,64]"])) is None
    assert per_block_hint(1, spec(["int64[1,64]"])) is None
    assert per_block_hint(16, spec(["int64[1,2..64]"])) is None  # dynamic dimensions
    assert per_block_hint(16, {}) is not None  # a spec with nothing to refuse it
