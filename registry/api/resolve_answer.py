"""A resolve answer's bytes, of a size that does not grow with the model.

The best artifact in full (its record, the bounded meta keys, where to
download it and its attestation), the other loadable ones by digest and the
reason they rank behind it. The build statement (which carries the weights
manifest and the verification report, both growing with the model's
parameter count) is not in the answer: it is named by its sha256 and served,
immutable, by ``GET /v1/attestations/<digest>``, which a node fetches once
and keeps. The version and alias statements are small (a model name, a
version, a program's entrypoint and arguments) and travel inline, as stored.

Each artifact's JSON is serialized once, the first time it is answered, and
kept in the read model beside the record (``VersionView.answers``): only
what depends on the request (which alias statement, the download URL's
host, the reasons) is written per answer.
"""

from __future__ import annotations

import json
from typing import Any

from registry import resolver
from registry.entities import ArtifactRecord
from registry.service.read_model_load import ModelView, VersionView

ATTESTATIONS_PATH = "/v1/attestations/"


def _dumps(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


def statement_path(digest: str) -> str:
    return f"{ATTESTATIONS_PATH}{digest}"


def artifact_json(version: VersionView, record: ArtifactRecord) -> bytes:
    """The record's answer JSON, an object without its closing brace (the
    per-request fields follow), made once per artifact."""
    cached = version.answers.get(record.id)
    if cached is None:
        out = record.to_json()
        out["version"] = version.version
        out["meta"] = record.meta  # only read_model_load.ANSWER_META_KEYS
        cached = version.answers[record.id] = _dumps(out)[:-1]
    return cached


def attestation_json(
    view: ModelView, version: VersionView, record: ArtifactRecord, ref: str | None
) -> bytes:
    """What a node verifies: the build statement by digest, the name statements inline."""
    digest = version.statements.get(record.id)
    alias = view.alias_statement(version, ref)
    build = (
        b"null"
        if digest is None
        else b'{"digest":"'
        + digest.encode()
        + b'","url":"'
        + statement_path(digest).encode()
        + b'"}'
    )
    return (
        b'{"build_statement":'
        + build
        + b',"version":'
        + (version.version_statement or "null").encode()
        + b',"alias":'
        + (alias or "null").encode()
        + b"}"
    )


def hit_body(
    *,
    view: ModelView,
    version: VersionView,
    ref: str | None,
    result: resolver.Resolution,
    why: list[str],
    base_url: str,
) -> bytes:
    best = result.best
    assert best is not None
    alternatives = [
        {
            "digest": r.digest,
            "format": r.format,
            "target": str(r.target),
            "inputs": [str(s) for s in r.inputs],
            "reason": "ranks behind: the chosen one's "
            + resolver.behind_reason(best, r, accepted=len(result.accepted)),
        }
        for r in result.accepted[1:]
    ]
    url = f"{base_url}v1/artifacts/{best.digest}/blob"
    return b"".join(
        (
            b'{"model":',
            _dumps(view.name),
            b',"version":',
            _dumps(version.version),
            b',"ref":',
            _dumps(ref),
            b',"artifact":',
            artifact_json(version, best),
            b',"download_url":',
            _dumps(url),
            b',"attestation":',
            attestation_json(view, version, best, ref),
            b"}",
            b',"alternatives":',
            _dumps(alternatives),
            b',"why":',
            _dumps(why),
            b"}",
        )
    )
