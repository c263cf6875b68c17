"""Coverage: what each version's artifacts serve, what the fleet asked for
that none serves, and the builds a target needs (upgrade plans).

The pure functions (``summarize``, ``target_serves``, ``uncovered``,
``plan_builds``) take artifact records and requests and use the resolver's own
rules, so "covered" here means what a resolve would answer. The functions
that read the database (``version_coverage``, ``plan_for_target``) gather
their inputs and call them; the CLI, the HTTP API and the dashboard use those.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import select

from farm.core.inputs import TensorSpec, format_inputs, inputs_cover, parse_input_list
from farm.core.specs import CompileOptions, GradMode, JobSpec, SpecError
from farm.core.target import Target, TargetError, TargetSelector
from registry import models as m
from registry import resolver
from registry.db import Database
from registry.entities import ArtifactRecord
from registry.service.common import NotFound
from registry.service.reports import miss_summary, requested
from registry.service.views import list_models, version_candidates

# --- pure ---------------------------------------------------------------------


def is_dynamic(specs: Sequence[TensorSpec]) -> bool:
    return any(d.lo != d.hi for s in specs for d in s.dims)


def summarize(records: Sequence[ArtifactRecord]) -> list[dict[str, Any]]:
    """One entry per (target, inputs, grad mode, options) the records serve,
    with its formats and digests; dynamic ranges are kept as written
    (``float32[1..64,128]``) and flagged."""
    groups: dict[tuple[str, str, str, str], dict[str, Any]] = {}
    for r in records:
        key = (str(r.target), format_inputs(r.inputs), r.grad_mode.value, r.options.canonical())
        g = groups.setdefault(key, {
            "target": key[0], "inputs": key[1], "grad_mode": key[2],
            "options": r.options.to_json(), "dynamic": is_dynamic(r.inputs),
            "formats": [], "digests": [], "verified": True})
        g["formats"].append(r.format)
        g["digests"].append(r.digest)
        g["verified"] = g["verified"] and r.verified
    return [groups[k] for k in sorted(groups)]


def _probe(target: Target) -> ArtifactRecord:
    """A record that differs from nothing but its target: what the resolver
    says of it is what it says of the target."""
    return ArtifactRecord(id=0, digest="0" * 64, size=0, format="aot_compile", fingerprint="",
                          build_key="", inputs=(), grad_mode=GradMode.INFERENCE,
                          options=CompileOptions(), target=target)


def target_serves(built: Target, node: Target) -> bool:
    """Whether an artifact built on ``built`` loads on ``node`` (the resolver's
    target rules: device, python, torch, CUDA, Triton, GPU, ISA, threads)."""
    request = resolver.Request(target=node, inputs=(), grad_mode=GradMode.INFERENCE)
    return resolver.check(_probe(built), request) is None


@dataclass(frozen=True)
class VersionUse:
    """A model version called with these input specs in this grad mode: what a
    need, a planned build and a build on miss (``miss_builds``) are about."""

    model: str
    version: str
    inputs: tuple[TensorSpec, ...]
    grad_mode: GradMode

    def use_key(self) -> tuple[str, str, str, str]:
        return (self.model, self.version, format_inputs(self.inputs), self.grad_mode.value)


@dataclass(frozen=True)
class Need(VersionUse):
    """What a node asked for: (inputs, grad mode) of a model version on a target."""

    target: Target | None = None  # None: any target the plan names
    options: CompileOptions | None = None
    count: int = 1
    source: str = "reports"

    def key(self) -> tuple[str, str, str, str, str]:
        return (*self.use_key(), self.options.canonical() if self.options else "")


def uncovered(records: Sequence[ArtifactRecord], needs: Iterable[Need]) -> list[dict[str, Any]]:
    """The needs no record serves (as a resolve would answer them), each with
    the rejection codes of the candidates, most asked for first."""
    out = []
    for n in needs:
        if n.target is None:
            continue
        res = resolver.resolve(records, target=n.target, inputs=n.inputs,
                               grad_mode=n.grad_mode, options=n.options)
        if res.best is not None:
            continue
        out.append({"model": n.model, "version": n.version, "inputs": format_inputs(n.inputs),
                    "grad_mode": n.grad_mode.value, "target": str(n.target),
                    "count": n.count, "dynamic": is_dynamic(n.inputs),
                    "codes": sorted({r.code for r in res.rejected}) or ["no_artifact"],
                    "hint": resolver.dynamic_hint(res, inputs=n.inputs)})
    return sorted(out, key=lambda u: (-u["count"], u["target"], u["inputs"]))


@dataclass(frozen=True)
class PlannedBuild(VersionUse):
    """One build an upgrade plan asks for."""

    options: CompileOptions
    target: str  # a full target, or the selector as given when none is live
    why: tuple[str, ...] = field(default=())

    def to_json(self) -> dict[str, Any]:
        return {"model": self.model, "version": self.version,
                "inputs": [str(s) for s in self.inputs], "grad_mode": self.grad_mode.value,
                "options": self.options.to_json(), "target": self.target,
                "why": list(self.why)}


def _record_serves_selector(r: ArtifactRecord, selector: TargetSelector | Target) -> bool:
    if isinstance(selector, Target):
        return target_serves(r.target, selector)
    return selector.matches(r.target)


def plan_builds(selector: TargetSelector | Target, needs: Iterable[Need],
                records: Mapping[tuple[str, str], Sequence[ArtifactRecord]], *,
                live: Sequence[Target] = ()) -> list[PlannedBuild]:
    """The builds that make every need servable on ``selector``.

    A full target is planned as it is. A partial selector (``cpu/torch=2.14``)
    is planned on every live target it matches, or as written when none is
    live (its build waits until such a worker starts). A need is already met
    when one of its version's records serves the target (the resolver's
    rules) for its inputs, grad mode and options; needs with the same
    (model, version, inputs, grad mode, options) are planned once, with every
    reason they were asked for.
    """
    if isinstance(selector, Target):
        targets: list[Target | str] = [selector]
    else:
        hits = [t for t in live if selector.matches(t)]
        targets = list(hits) if hits else [str(selector)]
    merged: dict[tuple[str, str, str, str, str], tuple[Need, list[str]]] = {}
    for n in needs:
        k = n.key()
        why = f"{n.source} ({n.count})" if n.source == "reports" else n.source
        if k in merged:
            merged[k][1].append(why)
        else:
            merged[k] = (n, [why])
    plan: list[PlannedBuild] = []
    for _, (n, whys) in sorted(merged.items()):
        options = n.options or CompileOptions()
        recs = records.get((n.model, n.version), ())
        for t in targets:
            sel: TargetSelector | Target = t if isinstance(t, Target) else selector
            served = any(_record_serves_selector(r, sel) and r.grad_mode is n.grad_mode
                         and r.options == options and r.verified
                         and inputs_cover(r.inputs, n.inputs) for r in recs)
            if not served:
                plan.append(PlannedBuild(model=n.model, version=n.version, inputs=n.inputs,
                                         grad_mode=n.grad_mode, options=options,
                                         target=str(t), why=tuple(sorted(set(whys)))))
    return plan


# --- over the database -------------------------------------------------------------


def _needs_from_reports(rows: Iterable[dict[str, Any]], *, aliases: dict[tuple[str, str], str],
                        with_target: bool) -> list[Need]:
    """Reports grouped by ``requested`` as needs. A report that named an
    alias stands for the version the alias points at now (a node asking for
    ``prod`` wants what ``prod`` is)."""
    needs = []
    for row in rows:
        version = aliases.get((row["model"], row["ref"] or "")) or row["version"]
        if not version:
            continue  # the ref resolved to nothing: nothing to build
        try:
            inputs = parse_input_list(row["inputs"])
            target = Target.parse(row["target"]) if with_target else None
            mode = GradMode(row["grad_mode"])
        except (SpecError, TargetError, ValueError):
            continue  # a malformed report says nothing about coverage
        needs.append(Need(model=row["model"], version=version, inputs=inputs, grad_mode=mode,
                          target=target, count=row["count"]))
    return needs


def alias_map(db: Database) -> dict[tuple[str, str], str]:
    """(model, alias) -> the version it points at now."""
    with db.session() as s:
        rows = s.execute(select(m.Model.name, m.Alias.name, m.ModelVersion.version)
                         .join(m.Alias, m.Alias.model_id == m.Model.id)
                         .join(m.ModelVersion, m.ModelVersion.id == m.Alias.version_id)).all()
    return {(model, alias): version for model, alias, version in rows}


def version_coverage(db: Database, model: str, version: str | None = None, *,
                     since_s: float | None = None) -> dict[str, Any]:
    """``farm coverage MODEL[@VERSION]``: per version, what its artifacts
    serve (targets, shapes with dynamic ranges, grad modes, options) and what
    nodes asked for that none of them serves."""
    known = next((x for x in list_models(db) if x["name"] == model), None)
    if known is None:
        raise NotFound(f"no model {model!r}")
    versions = [v["version"] for v in known["versions"]]
    if version is not None:
        if version not in versions:
            raise NotFound(f"no version {version!r} of model {model!r}; versions: "
                           f"{', '.join(versions) or 'none'}")
        versions = [version]
    aliases = alias_map(db)
    needs = _needs_from_reports(requested(db, model=model, since_s=since_s),
                                aliases=aliases, with_target=True)
    # Covered is not served: what nodes reported not getting, per version
    # (an alias standing for its version now, as for the needs).
    not_served: dict[str, int] = {}
    for row in miss_summary(db, model=model, since_s=since_s, limit=100_000):
        if v := aliases.get((model, row["ref"] or "")) or row["version"]:
            not_served[v] = not_served.get(v, 0) + row["count"]
    out = []
    for v in versions:
        _, records = version_candidates(db, model, v)
        out.append({
            "version": v,
            "aliases": sorted(a for (mm, a), vv in aliases.items() if mm == model and vv == v),
            "covers": summarize(records),
            "targets": sorted({str(r.target) for r in records}),
            "grad_modes": sorted({r.grad_mode.value for r in records}),
            "uncovered": uncovered(records, [n for n in needs if n.version == v]),
            "not_served": not_served.get(v, 0),
        })
    return {"model": model, "versions": out}


def base_spec(db: Database, model: str, version: str) -> JobSpec | None:
    """The newest job spec of ``model@version`` (its program, code pack and
    options), which a build for another shape or target starts from."""
    with db.session() as s:
        job = s.scalar(select(m.Job).join(m.ModelVersion, m.ModelVersion.id == m.Job.version_id)
                       .join(m.Model, m.Model.id == m.ModelVersion.model_id)
                       .where(m.Model.name == model, m.ModelVersion.version == version)
                       .order_by((m.Job.state == "succeeded").desc(), m.Job.created_at.desc())
                       .limit(1))
        return None if job is None else JobSpec.from_json(job.spec)


def fleet_needs(db: Database, *, since_s: float | None = None) -> list[Need]:
    """Every (model, version, inputs, grad mode, options) the fleet uses:
    what nodes reported asking for (an alias standing for its version now),
    and each alias's version with every shape it was built for."""
    aliases = alias_map(db)
    needs = _needs_from_reports(requested(db, since_s=since_s), aliases=aliases,
                                with_target=False)
    for (model, alias), version in sorted(aliases.items()):
        try:
            _, records = version_candidates(db, model, version)
        except NotFound:
            continue
        seen = set()
        for r in records:
            k = (format_inputs(r.inputs), r.grad_mode, r.options.canonical())
            if k in seen:
                continue
            seen.add(k)
            needs.append(Need(model=model, version=version, inputs=r.inputs,
                              grad_mode=r.grad_mode, options=r.options,
                              source=f"alias {alias}"))
    return needs


def plan_for_target(db: Database, selector: TargetSelector | Target, *,
                    live: Sequence[Target] = (),
                    since_s: float | None = None) -> list[PlannedBuild]:
    """``farm plan --target SELECTOR``: the builds every model and alias the
    fleet uses needs on that target."""
    needs = fleet_needs(db, since_s=since_s)
    records: dict[tuple[str, str], Sequence[ArtifactRecord]] = {}
    for n in needs:
        if (n.model, n.version) not in records:
            try:
                records[(n.model, n.version)] = version_candidates(db, n.model, n.version)[1]
            except NotFound:
                records[(n.model, n.version)] = ()
    # Needs from reports carry no options: the version's own (its base job's).
    filled = []
    for n in needs:
        if n.options is None:
            spec = base_spec(db, n.model, n.version)
            if spec is None:
                continue  # a version with no job: nothing to build it from
            n = Need(model=n.model, version=n.version, inputs=n.inputs, grad_mode=n.grad_mode,
                     options=spec.options, count=n.count, source=n.source)
        filled.append(n)
    return plan_builds(selector, filled, records, live=live)
