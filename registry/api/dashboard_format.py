"""What the dashboard's templates show, computed from the service layer's read
views: pure functions over plain dicts and records, no database, no HTTP.

Attestations are decoded for display only. The dashboard vouches for nothing:
a node verifies every signature against the farm's trust list before it
loads (``farm.node.verify``); a page that says "signed by key X" says only
what the stored envelope claims.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Any

from farm.core import attest, text
from registry.entities import ArtifactRecord


def decode_envelope(envelope: Any) -> dict[str, Any]:
    """A DSSE envelope (dict or JSON text) as ``{payload_type, keyids, statement,
    predicate_type, subject, predicate, error}`` for a template; a malformed
    one gives its ``error`` instead of raising (a page must still render)."""
    out: dict[str, Any] = {"payload_type": None, "keyids": [], "statement": None,
                           "predicate_type": None, "subject": None, "predicate": None,
                           "error": None}
    if envelope is None:
        out["error"] = "none stored"
        return out
    try:
        ptype, payload, sigs = attest.parse_envelope(envelope)
        out["payload_type"] = ptype
        out["keyids"] = [kid for kid, _ in sigs]
        body = attest.payload_json(payload)
    except attest.AttestationError as exc:
        out["error"] = str(exc)
        return out
    out["statement"] = body
    out["predicate_type"] = body.get("predicateType")
    subject = body.get("subject")
    if isinstance(subject, list) and subject and isinstance(subject[0], dict):
        digest = subject[0].get("digest")
        out["subject"] = {"name": subject[0].get("name"),
                          "sha256": digest.get("sha256") if isinstance(digest, dict) else None}
    predicate = body.get("predicate")
    out["predicate"] = predicate if isinstance(predicate, dict) else None
    return out


def flatten(value: Any, prefix: str = "") -> list[tuple[str, str]]:
    """Nested JSON as ``(dotted.key, text)`` rows, for a two-column table."""
    if isinstance(value, Mapping):
        rows: list[tuple[str, str]] = []
        if not value and prefix:
            return [(prefix, "{}")]
        for k in value:
            rows += flatten(value[k], f"{prefix}.{k}" if prefix else str(k))
        return rows
    if isinstance(value, list):
        if all(not isinstance(v, (Mapping, list)) for v in value):
            return [(prefix, ", ".join(_scalar(v) for v in value) or "[]")]
        rows = []
        for i, v in enumerate(value):
            rows += flatten(v, f"{prefix}[{i}]")
        return rows
    return [(prefix, _scalar(value))]


def _scalar(v: Any) -> str:
    if v is None:
        return "—"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, str):
        return v
    return json.dumps(v)


def artifact_row(record: ArtifactRecord) -> dict[str, Any]:
    """An artifact's JSON (as the API returns it) with its build attestation decoded."""
    out = record.to_json()
    build = decode_envelope(record.attestation)
    out["attestation"] = build
    predicate: dict[str, Any] = build["predicate"] or {}
    builder = predicate.get("builder")
    builder = builder if isinstance(builder, dict) else {}
    out["builder_id"] = builder.get("id")
    out["builder_keyid"] = builder.get("keyid") or (build["keyids"][0] if build["keyids"]
                                                    else None)
    out["built_at"] = predicate.get("built_at")
    # The statement must be about these bytes: a mismatch is shown, not hidden.
    subject = build["subject"] or {}
    out["subject_matches"] = subject.get("sha256") == record.digest if subject else None
    return out


def by_target(records: Iterable[ArtifactRecord]) -> list[tuple[str, list[dict[str, Any]]]]:
    """Artifacts grouped by their target string, targets and artifacts in a stable order."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in sorted(records, key=lambda r: (str(r.target), r.format, r.id)):
        groups.setdefault(str(r.target), []).append(artifact_row(r))
    return sorted(groups.items())


def duration(start: str | None, end: str | None) -> str:
    """``12.3 s`` between two ISO times, or empty when either is missing."""
    if not start or not end:
        return ""
    try:
        s = (datetime.fromisoformat(end) - datetime.fromisoformat(start)).total_seconds()
    except ValueError:
        return ""
    return f"{s:.1f} s" if s < 120 else f"{s / 60:.1f} min"


def short_time(iso: str | None) -> str:
    """``2026-12-01 17:22:41`` from an ISO timestamp (UTC as stored)."""
    if not iso:
        return ""
    try:
        return datetime.fromisoformat(iso).strftime("%Y-%m-%d %H:%M:%S")
    except ValueError:
        return iso


def error_value(x: float | None) -> str:
    """A verification error as people read it: three significant digits
    (``2.98e-07``, ``0.0938``), not every digit a float has."""
    if x is None:
        return ""
    return f"{float(x):.3g}"


def human_bytes(n: int | None) -> str:
    return text.human_bytes(n, missing="")


def json_text(value: Any) -> str:
    """Indented JSON for a <pre> block (escaped by the template like any text)."""
    return json.dumps(value, indent=2, sort_keys=True, default=str)
