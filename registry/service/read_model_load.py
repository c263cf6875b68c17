"""What the API's read model holds of a model, read from SQL in a few bulk queries.

A ``ModelView`` is one model as the resolve path needs it: its versions with
their candidates already parsed (targets, input specs, options: shared
between rows that store the same text), bucketed by what a node states
exactly (grad mode, device, Python, torch) so a request only checks the few
that can match; its aliases; and the name statements as stored (raw JSON
text, put into answers as they are). No artifact's ``meta`` beyond the
bounded keys a node reads (``ANSWER_META_KEYS``) and no build statement is
held: a statement is named by its sha256 and served by digest.

``load_models(db, names)`` reads given models (a change notification names
them); ``load_all(db)`` every model, in batches, when an API process starts.
Both are pure reads; ``registry.api.read_model`` keeps the result current.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import select

from farm.core.inputs import TensorSpec, parse_input_list
from farm.core.specs import CompileOptions, GradMode, SpecError
from farm.core.target import Target, TargetError
from registry import models as m
from registry.convert import TARGET_COLUMNS, BadRow
from registry.db import Database
from registry.entities import ArtifactRecord
from registry.service.trust import ALIAS, VERSION

log = logging.getLogger(__name__)

# The keys of an artifact's meta that a resolve answer carries: what the
# resolver's messages and a node read, each bounded in size. The weights
# manifest and the verification report grow with the model: they are in the
# build statement, fetched by digest.
ANSWER_META_KEYS = (
    "formats_failed",
    "formats_skipped",
    "model_class",
    "train",
    "grad_mode",
    "external_data",
    "calling_convention",
    "weights",  # fake or real weights, and why
    "parallel",
    "optimizer_step",
)
BATCH_MODELS = 500

Bucket = tuple[GradMode, str, str, str, str | None]


def bucket_of(grad_mode: GradMode, target: Target) -> Bucket:
    """The fields a candidate must equal exactly to be loadable (resolver rules
    3-5, 10 and 12), its CPU vector ISA included."""
    return (grad_mode, target.device, target.python_version, target.torch_version, target.cpu_isa)


def request_buckets(grad_mode: GradMode, target: Target) -> tuple[Bucket, ...]:
    """The buckets whose candidates a node with ``target`` may load: a cpu
    artifact's ISA must equal the node's; another device's artifact may also
    record none (it holds no CPU kernels)."""
    own = bucket_of(grad_mode, target)
    if target.device == "cpu" or target.cpu_isa is None:
        return (own,)
    return (own, (*own[:4], None))


@dataclass(slots=True)
class VersionView:
    id: int
    version: str
    created_at: datetime | None
    records: list[ArtifactRecord] = field(default_factory=list)
    # artifact id -> sha256 of its build statement (None: not attested)
    statements: dict[int, str | None] = field(default_factory=dict)
    buckets: dict[Bucket, list[ArtifactRecord]] = field(default_factory=dict)
    # the version's name statement, as stored (JSON text), or None
    version_statement: str | None = None
    # artifact id -> its answer JSON (filled by the first answer that needs it)
    answers: dict[int, bytes] = field(default_factory=dict)

    def add(self, record: ArtifactRecord, statement: str | None) -> None:
        self.records.append(record)
        self.statements[record.id] = statement
        self.buckets.setdefault(bucket_of(record.grad_mode, record.target), []).append(record)


@dataclass(slots=True)
class ModelView:
    id: int
    name: str
    project: str
    versions: dict[str, VersionView] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)  # alias -> version
    alias_statements: dict[str, str] = field(default_factory=dict)  # alias -> JSON text
    # ref -> why it names nothing (the database's wording), kept until the
    # model changes: a fleet asking for a missing ref costs one query
    unknown_refs: dict[str | None, str] = field(default_factory=dict)

    def newest(self) -> VersionView | None:
        """What a ref-less resolve gets when there is no ``latest`` alias."""
        best: VersionView | None = None
        for v in self.versions.values():
            if best is None or _newer(v, best):
                best = v
        return best

    def version_for(self, ref: str | None) -> VersionView | None:
        """``registry.service.views._version_row``'s rules, on this view; None:
        not found (the caller asks the database for the message)."""
        if ref is None:
            latest = self.aliases.get("latest")
            if latest is not None and latest in self.versions:
                return self.versions[latest]
            return self.newest()
        v = self.versions.get(ref)
        if v is not None:
            return v
        target = self.aliases.get(ref)
        return self.versions.get(target) if target is not None else None

    def alias_statement(self, version: VersionView, ref: str | None) -> str | None:
        """The alias statement a resolve of ``ref`` serves (``bindings_in``'s rule)."""
        alias = ref if ref is not None and ref != version.version else (None if ref else "latest")
        return None if alias is None else self.alias_statements.get(alias)


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _newer(a: VersionView, b: VersionView) -> bool:
    ka = (a.created_at is not None, a.created_at or datetime.min, a.id)
    kb = (b.created_at is not None, b.created_at or datetime.min, b.id)
    return ka > kb


class _Interned:
    """Parsed values shared between rows that store the same text: a farm's
    100,000 rows hold a few dozen targets, shapes and option sets."""

    def __init__(self) -> None:
        self.targets: dict[str, Target] = {}
        self.inputs: dict[str, tuple[TensorSpec, ...]] = {}
        self.options: dict[str, CompileOptions] = {}
        self.strings: dict[str, str] = {}

    def target(self, text: str) -> Target:
        t = self.targets.get(text)
        if t is None:
            t = self.targets[text] = Target.parse(text)
        return t

    def input_list(self, text: str) -> tuple[TensorSpec, ...]:
        v = self.inputs.get(text)
        if v is None:
            v = self.inputs[text] = tuple(parse_input_list(text))
        return v

    def option(self, text: str) -> CompileOptions:
        v = self.options.get(text)
        if v is None:
            v = self.options[text] = CompileOptions.from_json(json.loads(text))
        return v

    def string(self, text: str) -> str:
        return self.strings.setdefault(text, text)


_A = m.Artifact
_ARTIFACT_COLUMNS = (
    m.VersionArtifact.version_id,
    _A.id,
    _A.digest,
    _A.size,
    _A.format,
    _A.fingerprint,
    _A.build_key,
    _A.inputs,
    _A.grad_mode,
    _A.options,
    _A.target,
    _A.verified,
    _A.first_call_compiles,
    _A.max_abs_err,
    _A.first_call_s,
    _A.load_s,
    _A.cxx,
    _A.libstdcxx_needs,
    _A.created_at,
    _A.attestation_sha256,
    *(getattr(_A, c) for c in TARGET_COLUMNS),
    *(_A.meta[k] for k in ANSWER_META_KEYS),
)
_N_FIXED = 20
_STATEMENT = _N_FIXED - 1  # attestation_sha256, the last fixed column


def _record(row: Sequence[Any], interned: _Interned) -> ArtifactRecord:
    (
        _,
        art_id,
        digest,
        size,
        fmt,
        fingerprint,
        build_key,
        inputs,
        grad_mode,
        options,
        target,
        verified,
        first_call_compiles,
        max_abs_err,
        first_call_s,
        load_s,
        cxx,
        libstdcxx_needs,
        created_at,
        _statement,
    ) = row[:_N_FIXED]
    columns = row[_N_FIXED : _N_FIXED + len(TARGET_COLUMNS)]
    meta_values = row[_N_FIXED + len(TARGET_COLUMNS) :]
    try:
        t = interned.target(target)
        record = ArtifactRecord(
            id=art_id,
            digest=digest,
            size=size,
            format=interned.string(fmt),
            fingerprint=interned.string(fingerprint),
            build_key=build_key,
            inputs=interned.input_list(inputs),
            grad_mode=GradMode(grad_mode),
            options=interned.option(options),
            target=t,
            verified=bool(verified),
            first_call_compiles=bool(first_call_compiles),
            max_abs_err=max_abs_err,
            first_call_s=first_call_s,
            load_s=load_s,
            cxx=cxx,
            libstdcxx_needs=tuple(str(v) for v in libstdcxx_needs or ()),
            created_at=created_at,
            meta={
                k: v for k, v in zip(ANSWER_META_KEYS, meta_values, strict=True) if v is not None
            },
        )
    except (SpecError, TargetError, ValueError, TypeError) as exc:
        raise BadRow(f"artifact {art_id} does not parse: {exc}") from exc
    # As registry.convert.artifact_to_record: never serve a row whose target
    # columns disagree with its target string.
    mismatched = [n for n, v in zip(TARGET_COLUMNS, columns, strict=True) if v != getattr(t, n)]
    if mismatched:
        raise BadRow(
            f"artifact {art_id}: column(s) {', '.join(mismatched)} disagree with "
            f"its target {target!r}"
        )
    return record


def load_models(
    db: Database, names: Iterable[str], *, interned: _Interned | None = None
) -> dict[str, ModelView]:
    """The named models that exist, in one transaction (absent names: absent)."""
    wanted = sorted(set(names))
    if not wanted:
        return {}
    interned = interned or _Interned()
    with db.session() as s:
        rows = s.execute(
            select(m.Model.id, m.Model.name, m.Model.project).where(m.Model.name.in_(wanted))
        ).all()
        return _fill(s, {r.id: ModelView(r.id, r.name, r.project) for r in rows}, interned)


def load_all(db: Database, *, batch: int = BATCH_MODELS) -> Iterator[dict[str, ModelView]]:
    """Every model, ``batch`` models per transaction (a start-up's full read)."""
    interned = _Interned()
    with db.session() as s:
        everything = s.execute(
            select(m.Model.id, m.Model.name, m.Model.project).order_by(m.Model.id)
        ).all()
    for i in range(0, len(everything), batch):
        chunk = everything[i : i + batch]
        with db.session() as s:
            yield _fill(s, {r.id: ModelView(r.id, r.name, r.project) for r in chunk}, interned)


def _fill(s: Any, by_id: dict[int, ModelView], interned: _Interned) -> dict[str, ModelView]:
    if not by_id:
        return {}
    ids = list(by_id)
    versions: dict[int, tuple[ModelView, VersionView]] = {}
    for vid, model_id, version, created_at in s.execute(
        select(
            m.ModelVersion.id,
            m.ModelVersion.model_id,
            m.ModelVersion.version,
            m.ModelVersion.created_at,
        ).where(m.ModelVersion.model_id.in_(ids))
    ):
        model = by_id[model_id]
        view = VersionView(vid, version, created_at)
        model.versions[version] = view
        versions[vid] = (model, view)
    for model_id, alias, version_id in s.execute(
        select(m.Alias.model_id, m.Alias.name, m.Alias.version_id).where(m.Alias.model_id.in_(ids))
    ):
        target = versions.get(version_id)
        if target is not None:
            by_id[model_id].aliases[alias] = target[1].version
    by_name = {v.name: v for v in by_id.values()}
    for model_name, kind, ref, envelope in s.execute(
        select(
            m.NameBinding.model, m.NameBinding.kind, m.NameBinding.ref, m.NameBinding.envelope
        ).where(m.NameBinding.model.in_(list(by_name)))
    ):
        model = by_name[model_name]
        if not _is_json(envelope):
            # Put into answers as it is stored: a row that is not JSON would
            # break every answer of the model, so it is left out (and the
            # node refuses the artifact for want of the statement).
            log.warning("name statement %s %s@%s is not JSON; not served", kind, model_name, ref)
            continue
        if kind == VERSION and ref in model.versions:
            model.versions[ref].version_statement = envelope
        elif kind == ALIAS:
            model.alias_statements[ref] = envelope
    if versions:
        for row in s.execute(
            select(*_ARTIFACT_COLUMNS)
            .join(_A, _A.id == m.VersionArtifact.artifact_id)
            .where(
                m.VersionArtifact.version_id.in_(
                    select(m.ModelVersion.id).where(m.ModelVersion.model_id.in_(ids))
                )
            )
        ):
            versions[row[0]][1].add(_record(row, interned), row[_STATEMENT])
    return by_name
