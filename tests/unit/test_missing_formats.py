"""Which formats a resubmitted job builds again (registry.service.formats)."""

from __future__ import annotations

from typing import Any

from registry import models as m
from registry.service.formats import missing_formats


def art(fmt: str, **meta: Any) -> m.Artifact:
    return m.Artifact(format=fmt, meta=meta)


def test_a_deleted_format_is_missing() -> None:
    assert missing_formats([art("aot_compile")]) == ["aoti"]
    assert missing_formats([art("aoti")]) == ["aot_compile"]


def test_a_complete_build_misses_nothing() -> None:
    assert missing_formats([art("aot_compile"), art("aoti")]) == []


def test_a_format_the_build_skipped_or_failed_is_not_missing() -> None:
    # Building again would give the same answer: no rebuild on every submit.
    skipped = art("aot_compile", formats_skipped={"aoti": "training: no backward"})
    assert missing_formats([skipped]) == []
    failed = art("aot_compile", formats_failed={"aoti": {"stage": "verify", "reason": "x"}})
    assert missing_formats([failed]) == []
