"""Fleet feedback over HTTP: node reports, misses, coverage, policies, upgrade plans."""

from __future__ import annotations

import functools
import re
from datetime import datetime
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Path, Query
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from farm.core.inputs import format_inputs, parse_inputs
from farm.core.specs import CompileOptions, JobSpec, SpecError
from farm.core.target import Target, TargetError, TargetSelector
from registry import service
from registry.service import coverage, projects
from registry.service import miss_builds as mb
from registry.service import reports as report_service

from .deps import Reader, State, Submitter
from .schemas import INPUT_PATTERN, NAME_PATTERN, PROTECTED, TARGET_PATTERN, err

router = APIRouter(tags=["fleet"], responses=PROTECTED)

ModelName = Annotated[str, Path(max_length=128, json_schema_extra={"pattern": NAME_PATTERN})]
# At most ten years: a larger window is all of them, and a datetime cannot
# reach back further than year 1 (schemathesis sent 3.6e307 and got a 500).
MAX_SINCE_S = 10 * 365 * 86400.0
SinceS = Annotated[float | None, Query(gt=0, le=MAX_SINCE_S,
                                       description="only reports of the last N seconds")]


class ReportIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: Literal["miss", "guard_failure", "fallback", "load"]
    model: str = Field(max_length=128, json_schema_extra={"pattern": NAME_PATTERN})
    ref: str | None = Field(default=None, max_length=64)
    version: str | None = Field(default=None, max_length=64)
    inputs: list[Annotated[str, Field(max_length=256,
                                      json_schema_extra={"pattern": INPUT_PATTERN})]] = Field(
        min_length=1, max_length=64)
    grad_mode: Literal["inference", "training"] = "inference"
    target: str = Field(max_length=512, json_schema_extra={"pattern": TARGET_PATTERN})
    format: str | None = Field(default=None, max_length=32)
    digest: str | None = Field(default=None, max_length=64)
    code: str | None = Field(default=None, max_length=32,
                             description="why, as a code: the resolver's rejection codes, "
                                         "load_failed, class_mismatch, guard, ...")
    reason: str | None = Field(default=None, max_length=2000)
    seconds: float | None = Field(default=None, ge=0)
    at: datetime | None = Field(default=None, description="when, by the node's clock")


class ReportBatchIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    node: str | None = Field(default=None, max_length=256, description="the node's id")
    reports: list[ReportIn] = Field(min_length=1, max_length=1000)


_NAME_RE = re.compile(NAME_PATTERN)


def _row(r: ReportIn, node: str | None) -> dict[str, Any]:
    # Parsed so that what is stored is canonical and a bad spec or target is
    # a 422 naming it, not a row every later reader must skip. Checked here,
    # not at the INSERT: the rows of many requests are written together, and
    # one the database refuses (a NUL byte) would take the others with it.
    if not _NAME_RE.match(r.model):
        raise SpecError(f"bad model name {r.model!r} in a report: letters, digits, '.', '_' "
                        "and '-', at most 128")
    for field_name in ("ref", "version", "format", "digest", "code"):
        value = getattr(r, field_name)
        if value is not None and not value.isprintable():
            raise SpecError(f"report field {field_name!r} holds a control character")
    if r.reason is not None and "\x00" in r.reason:
        raise SpecError("report field 'reason' holds a NUL byte")
    if node is not None and not node.isprintable():
        raise SpecError("the batch's 'node' holds a control character")
    inputs = _canonical_inputs(tuple(r.inputs))
    _check_target(r.target)
    return {"reported_at": r.at, "kind": r.kind, "model": r.model, "ref": r.ref,
            "version": r.version, "inputs": inputs, "grad_mode": r.grad_mode,
            "target": r.target, "format": r.format, "digest": r.digest, "code": r.code,
            "reason": r.reason, "node": node, "seconds": r.seconds}


# A fleet reports the same few targets and shapes over and over: parsed once.
@functools.lru_cache(maxsize=4096)
def _canonical_inputs(inputs: tuple[str, ...]) -> str:
    return format_inputs(parse_inputs(list(inputs)))


@functools.lru_cache(maxsize=4096)
def _check_target(text: str) -> None:
    Target.parse(text)


@router.post("/v1/reports", status_code=202,
             responses={413: err("body over MAX_BODY_BYTES"),
                        422: err("a malformed report: the message says which and why")})
async def post_reports(body: ReportBatchIn, state: State, _: Reader) -> dict[str, Any]:
    """A node's batch of reports: misses, guard failures, JIT fallbacks and
    loads. Counted at once (``farm_node_reports``), stored within a second."""
    rows = [_row(r, body.node) for r in body.reports]
    taken = state.reports.put(rows)
    return {"accepted": taken, "dropped": len(rows) - taken}


@router.get("/v1/misses")
def get_misses(state: State, _: Reader,
               model: Annotated[str | None, Query(max_length=128)] = None,
               since_s: SinceS = None,
               limit: Annotated[int, Query(ge=1, le=1000)] = 100) -> dict[str, Any]:
    """What nodes did not get (misses, guard failures, fallbacks), grouped and
    counted, most frequent first (``farm misses``)."""
    state.reports.flush(2.0)
    return {"model": model,
            "misses": report_service.miss_summary(state.db, model=model, since_s=since_s,
                                                  limit=limit),
            "recent": report_service.list_reports(state.db, model=model, since_s=since_s,
                                                  limit=min(limit, 20))}


@router.get("/v1/models/{name}/reports", responses={404: err("no such model")})
def get_report_counts(name: ModelName, state: State, _: Reader,
                      since_s: SinceS = None) -> dict[str, Any]:
    """Reports of one model by kind (for ``farm status MODEL``)."""
    state.reports.flush(2.0)
    return {"model": name, "counts": report_service.report_counts(state.db, name,
                                                                  since_s=since_s),
            "misses": report_service.miss_summary(state.db, model=name, since_s=since_s,
                                                  limit=10)}


@router.get("/v1/models/{name}/coverage", responses={404: err("no such model or version")})
def get_coverage(name: ModelName, state: State, _: Reader,
                 version: Annotated[str | None, Query(max_length=64)] = None,
                 since_s: SinceS = None) -> dict[str, Any]:
    """What each version's artifacts serve (targets, shapes with dynamic
    ranges, grad modes, options) and what nodes asked for that none serves."""
    state.reports.flush(2.0)
    return coverage.version_coverage(state.db, name, version, since_s=since_s)


class PolicyIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    build_on_miss: bool | None = None
    min_interval_s: float | None = Field(default=None, ge=1, le=86400,
                                         description="seconds between two builds on miss")


@router.get("/v1/models/{name}/policy")
def get_policy(name: ModelName, state: State, _: Reader) -> dict[str, Any]:
    """The model's fleet policy (build on miss, off by default) and its recent miss builds."""
    return mb.get_policy(state.db, name)


@router.put("/v1/models/{name}/policy",
            responses={403: err("the token is no maintainer of the model's project"),
                       404: err("no such model")})
def put_policy(name: ModelName, body: PolicyIn, state: State,
               who: Submitter) -> dict[str, Any]:
    """Set the model's policy (``farm policy set MODEL --build-on-miss``): a
    maintainer of the model's project (build on miss starts its builds)."""
    projects.require_on_model(state.db, who, name, "maintainer")
    out = mb.set_policy(state.db, name, build_on_miss=body.build_on_miss,
                        min_interval_s=body.min_interval_s, actor=who.name,
                        default_interval_s=state.settings.farm_miss_build_interval_s)
    state.miss_builder.forget_policies()
    return out


def _selector(text: str) -> TargetSelector | Target:
    try:
        return Target.parse(text)
    except TargetError:
        return TargetSelector.parse(text)


class PlanIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    target: str = Field(max_length=512, description="a full target or a selector")
    since_s: float | None = Field(default=None, gt=0, le=MAX_SINCE_S)


def _plan(state: Any, target: str, since_s: float | None) -> list[coverage.PlannedBuild]:
    state.reports.flush(2.0)
    live = service.live_targets(state.db, max_age_s=state.heartbeat_max_age_s)
    return coverage.plan_for_target(state.db, _selector(target), live=live, since_s=since_s)


@router.get("/v1/plan", responses={422: err("not a target or selector")})
def get_plan(state: State, _: Reader,
             target: Annotated[str, Query(max_length=512)],
             since_s: SinceS = None) -> dict[str, Any]:
    """The builds needed so that every model and alias the fleet uses is
    served on ``target`` (``farm plan --target``)."""
    return {"target": target, "builds": [b.to_json() for b in _plan(state, target, since_s)]}


@router.post("/v1/plan", status_code=201, responses={422: err("not a target or selector")})
async def submit_plan(body: PlanIn, state: State, who: Submitter) -> dict[str, Any]:
    """Submit the plan's builds: one job per (model, version, inputs, grad
    mode, options), through the same path as ``POST /v1/jobs``."""
    from .jobs import accept_job

    def run() -> dict[str, Any]:
        plan = _plan(state, body.target, body.since_s)
        jobs: list[dict[str, Any]] = []
        grouped: dict[tuple[str, str, str, str, str], list[coverage.PlannedBuild]] = {}
        for b in plan:
            k = (b.model, b.version, format_inputs(b.inputs), b.grad_mode.value,
                 b.options.canonical())
            grouped.setdefault(k, []).append(b)
        for builds in grouped.values():
            first = builds[0]
            base: JobSpec | None = coverage.base_spec(state.db, first.model, first.version)
            if base is None:
                jobs.append({**first.to_json(), "error": "no job of this version to build from"})
                continue
            spec = JobSpec(name=base.name, version=base.version, model=base.model,
                           inputs=first.inputs, grad_mode=first.grad_mode,
                           options=first.options or CompileOptions(),
                           targets=tuple(b.target for b in builds),
                           code_digest=base.code_digest)
            try:
                job_id, enqueued, warning = accept_job(state, spec, submitted_by=who.name, who=who)
            except Exception as exc:
                jobs.append({**first.to_json(), "error": f"{type(exc).__name__}: {exc}"})
                continue
            jobs.append({**first.to_json(), "targets": list(spec.targets), "job_id": job_id,
                         "enqueued": enqueued, "warning": warning})
        return {"target": body.target, "builds": [b.to_json() for b in plan], "jobs": jobs}

    return await run_in_threadpool(run)
