"""ORM rows to plain entities and back.

Rows store specs in their canonical text forms (``farm.core.specs.format_inputs``,
``CompileOptions.canonical``, ``str(Target)``); these functions are the only
place that turns them back into values, so a row that does not parse fails
here, loudly, and never reaches the resolver.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from farm.core.elf import LIBSTDCXX_VERSION_RE, libstdcxx_versions
from farm.core.inputs import TensorSpec, format_inputs, parse_input_list
from farm.core.specs import CompileOptions, GradMode, SpecError, build_key
from farm.core.target import Target, TargetError
from registry import models
from registry.entities import FORMATS, ArtifactRecord

# Artifact columns that mirror the target's fields, by Target attribute name.
TARGET_COLUMNS = (
    "device",
    "gpu_name",
    "capability",
    "torch_version",
    "triton_version",
    "python_version",
    "cuda_version",
    "cpu_isa",
    "threads",
)


class BadRow(ValueError):
    """A stored row whose values do not parse or contradict each other."""


def artifact_to_record(row: models.Artifact) -> ArtifactRecord:
    """The plain value of an artifact row; call it before the session closes."""
    try:
        target = Target.parse(row.target)
        record = ArtifactRecord(
            id=row.id,
            digest=row.digest,
            size=row.size,
            format=row.format,
            fingerprint=row.fingerprint,
            build_key=row.build_key,
            inputs=parse_input_list(row.inputs),
            grad_mode=GradMode(row.grad_mode),
            options=CompileOptions.from_json(json.loads(row.options)),
            target=target,
            verified=bool(row.verified),
            first_call_compiles=bool(row.first_call_compiles),
            max_abs_err=row.max_abs_err,
            first_call_s=row.first_call_s,
            load_s=row.load_s,
            cxx=row.cxx,
            libstdcxx_needs=tuple(str(v) for v in row.libstdcxx_needs or ()),
            attestation=row.attestation,
            created_at=row.created_at,
            meta=dict(row.meta or {}),
        )
    except (SpecError, TargetError, ValueError, TypeError) as exc:
        raise BadRow(f"artifact {row.id} does not parse: {exc}") from exc
    # The resolver reads the target string while operators query the columns;
    # a row where they disagree would be served for the wrong machine.
    mismatched = [name for name in TARGET_COLUMNS if getattr(row, name) != getattr(target, name)]
    if mismatched:
        raise BadRow(
            f"artifact {row.id}: column(s) {', '.join(mismatched)} disagree with "
            f"its target {row.target!r}"
        )
    return record


def _text_or_none(value: Any, limit: int) -> str | None:
    return value[:limit] if isinstance(value, str) and value else None


def _versions(value: Any) -> list[str]:
    """libstdc++ symbol versions as a compile worker records them; anything
    else is refused rather than stored (the resolver trusts this column)."""
    if value is None:
        return []
    if not isinstance(value, (list, tuple)) or not all(
        isinstance(v, str) and LIBSTDCXX_VERSION_RE.match(v) for v in value
    ):
        raise ValueError(f"libstdcxx_needs must be a list of GLIBCXX_/CXXABI_ versions: {value!r}")
    return list(libstdcxx_versions(value))


def artifact_row(
    *,
    digest: str,
    size: int,
    format: str,
    fingerprint: str,
    inputs: Sequence[TensorSpec],
    grad_mode: GradMode,
    options: CompileOptions,
    target: Target,
    **extra: Any,
) -> models.Artifact:
    """A new artifact row with its build key and target columns derived, not typed.

    ``extra`` sets the remaining columns (``verified``, ``max_abs_err``,
    ``attestation``, ``meta``, ...). The compiler columns (``cxx``,
    ``libstdcxx_needs``) come from the compile worker's ``meta`` unless given.
    """
    meta = extra.get("meta") or {}
    extra.setdefault("cxx", _text_or_none(meta.get("cxx"), 256))
    extra.setdefault("libstdcxx_needs", _versions(meta.get("libstdcxx_needs")))
    if format not in FORMATS:
        raise ValueError(f"unknown artifact format {format!r}; known: {', '.join(FORMATS)}")
    target_text = str(target)
    row = models.Artifact(
        digest=digest,
        size=size,
        format=format,
        build_key=build_key(
            fingerprint=fingerprint,
            inputs=inputs,
            grad_mode=grad_mode,
            options=options,
            target=target_text,
        ),
        fingerprint=fingerprint,
        inputs=format_inputs(inputs),
        grad_mode=grad_mode.value,
        options=options.canonical(),
        target=target_text,
        **{name: getattr(target, name) for name in TARGET_COLUMNS},
        **extra,
    )
    return row
