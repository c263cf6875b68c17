"""Which formats a build key's artifacts lack: what a resubmitted job rebuilds."""

from __future__ import annotations

from collections.abc import Sequence

from registry import models as m
from registry.entities import FORMATS


def missing_formats(arts: Sequence[m.Artifact]) -> list[str]:
    """The formats a build made that none of ``arts`` (its artifact rows) is
    any more: one was deleted (`farm delete artifact`). A format its compile
    recorded as failed or skipped (AOTI for training, a host without it) is
    not missing: building again would give the same answer."""
    present = {a.format for a in arts}
    settled: set[str] = set()
    for a in arts:
        meta = a.meta or {}
        settled |= set(meta.get("formats_failed") or {}) | set(meta.get("formats_skipped") or {})
    return [f for f in FORMATS if f not in present and f not in settled]
