"""Resolve: which artifact a node should load, and misses the fleet reports.

This is the hot path of a rollout (thousands of nodes asking at once), so it
is an ``async`` endpoint that normally never leaves the event loop: the token
comes from a short-lived cache, the model's candidates from the process's
read model (``read_model``: replicated from the database, kept current by
its change notifications), and the resolver is a pure function over the few
candidates in the node's bucket. Only a model not yet held or a miss record
goes to the database, in the thread pool.

Nothing is signed here. Each artifact carries the build statement its
compile worker signed (named in the answer by its sha256, fetched from
``/v1/attestations/<digest>``), the version the name statement the API
signed when the submission was accepted, an alias the one signed when it
was set; the node verifies all of them against its pinned root key and
compares them with its own request (``farm.node.verify``). The answer's
size does not depend on the model's (``resolve_answer``).
"""

from __future__ import annotations

import json
import logging
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from farm.core.elf import LIBSTDCXX_VERSION_RE
from farm.core.inputs import TensorSpec, format_inputs, inputs_cover, parse_inputs
from farm.core.specs import CompileOptions, GradMode, MeshLayout, SpecError
from farm.core.target import Target
from registry import resolver, service
from registry.entities import FORMATS
from registry.service import projects, resolve_reads
from registry.service.read_model_load import ModelView, VersionView, request_buckets

from . import resolve_answer
from .deps import Reader, State
from .read_model import Missing
from .schemas import (
    INPUT_PATTERN,
    NAME_PATTERN,
    PROTECTED,
    TARGET_PATTERN,
    ResolveMissOut,
    err,
)
from .state import AppState

log = logging.getLogger(__name__)

router = APIRouter(tags=["resolve"], responses=PROTECTED)


def parse_grad_mode(text: str) -> GradMode:
    try:
        return GradMode(text)
    except ValueError:
        raise SpecError(f"unknown grad_mode {text!r}; known: inference, training") from None


def _json_param(name: str, text: str, example: str) -> Any:
    """A query parameter that holds JSON; the error names it and shows ``example``."""
    try:
        return json.loads(text)
    except ValueError as exc:
        raise SpecError(f"{name} must be a JSON object, e.g. {example}: {exc}") from None


_OPTIONS_EXAMPLE = '{"mode": "default"}'


def parse_options(text: str | None) -> CompileOptions | None:
    if text is None:
        return None
    data = _json_param("options", text, _OPTIONS_EXAMPLE)
    if not isinstance(data, dict):
        raise SpecError(f"options must be a JSON object, e.g. {_OPTIONS_EXAMPLE}")
    return CompileOptions.from_json(data)


def parse_layout(text: str | None) -> MeshLayout | None:
    """The node's world size and mesh, as JSON (``MeshLayout.to_json``)."""
    if text is None:
        return None
    return MeshLayout.from_json(
        _json_param("layout", text, '{"world_size": 2, "mesh_shape": [2]}'))


def parse_formats(formats: list[str] | None) -> list[str] | None:
    if not formats:
        return None
    unknown = [f for f in formats if f not in FORMATS]
    if unknown:
        raise SpecError(f"unknown format(s) {', '.join(map(repr, unknown))}; "
                        f"known: {', '.join(FORMATS)}")
    return formats


def parse_libstdcxx(text: str | None) -> frozenset[str] | None:
    if text is None:
        return None
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if not LIBSTDCXX_VERSION_RE.match(n)]
    if bad:
        raise SpecError(f"libstdcxx: not GLIBCXX_/CXXABI_ versions: {', '.join(bad[:5])}")
    return frozenset(names)


# The bounds of a resolve's parameters, one source for the route's Query
# declarations and for the plain-ASGI path (registry.api.resolve_fast), which
# answers only what the route would accept.
MAX_LENGTH = {"model": 128, "target": 512, "ref": 64, "grad_mode": 16, "options": 512,
              "layout": 256, "libstdcxx": 4096}
MAX_INPUTS, MAX_FORMATS, MAX_RANK = 64, 8, 1 << 20


@router.get(
    "/v1/resolve",
    responses={
        200: {"description": "the best artifact for the node, and the other loadable ones"},
        404: err("unknown model or ref, or no artifact the node can load; `rejections` "
                 "says why each candidate was refused", ResolveMissOut),
        422: err("malformed input spec, target, grad mode, format or options"),
    },
)
async def resolve(
    request: Request,
    state: State,
    who: Reader,
    model: Annotated[str, Query(max_length=MAX_LENGTH["model"], description="model name",
                                json_schema_extra={"pattern": NAME_PATTERN})],
    target: Annotated[str, Query(max_length=MAX_LENGTH["target"],
                                 description="the node's full target string",
                                 json_schema_extra={"pattern": TARGET_PATTERN})],
    inputs: Annotated[list[str], Query(alias="input", min_length=1, max_length=MAX_INPUTS,
                                       description="input specs, e.g. float32[8,64]",
                                       json_schema_extra={"items": {"type": "string",
                                                                    "pattern": INPUT_PATTERN}})],
    ref: Annotated[str | None, Query(max_length=MAX_LENGTH["ref"],
                                     description="version or alias; default: 'latest' "
                                                 "alias, else the newest version")] = None,
    grad_mode: Annotated[str, Query(max_length=MAX_LENGTH["grad_mode"])] = "inference",
    formats: Annotated[list[str] | None, Query(alias="format", max_length=MAX_FORMATS,
                                               description="formats the node can load")] = None,
    options: Annotated[str | None, Query(max_length=MAX_LENGTH["options"],
                                         description="compile options as JSON")] = None,
    layout: Annotated[str | None, Query(
        max_length=MAX_LENGTH["layout"],
        description="the node's process group as JSON: world_size, mesh_shape, "
                    "mesh_dim_names; omitted: one process")] = None,
    rank: Annotated[int | None, Query(ge=0, le=MAX_RANK,
                                      description="the node's rank in layout")] = None,
    libstdcxx: Annotated[str | None, Query(
        max_length=MAX_LENGTH["libstdcxx"],
        description="the GLIBCXX_/CXXABI_ symbol versions the node's libstdc++ provides, "
                    "comma-separated; an AOTI package needing one it lacks is refused")] = None,
) -> Response:
    specs = parse_inputs(inputs)
    node = Target.parse(target)
    mode = parse_grad_mode(grad_mode)
    opts = parse_options(options)
    wanted = parse_formats(formats)
    provides = parse_libstdcxx(libstdcxx)
    node_layout = parse_layout(layout)

    metrics = request.app.state.metrics
    view = await model_view(state, model)
    if who.projects is not None and not who.allows("admin"):
        # A token confined to its projects (one with project roles): the
        # model's project decides. Farm-wide readers (fleet nodes) skip this.
        projects.require_read(who, view.project if isinstance(view, ModelView) else None)
    version = view.version_for(ref) if isinstance(view, ModelView) else None
    if version is None:
        # A name that does not exist is the caller's mistake, not a gap in
        # what the farm builds: answered, counted, not recorded.
        metrics.resolves.labels("miss").inc()
        detail = (view.message if isinstance(view, Missing)
                  else await run_in_threadpool(_unknown_ref, state, view, ref))
        return JSONResponse({"detail": detail, "rejections": []}, status_code=404)
    assert isinstance(view, ModelView)
    answer = answer_resolve(view, version, ref=ref, node=node, specs=specs, mode=mode,
                            opts=opts, wanted=wanted, provides=provides,
                            node_layout=node_layout, rank=rank, base_url=str(request.base_url))
    if isinstance(answer, bytes):
        metrics.resolves.labels("hit").inc()
        return Response(answer, media_type="application/json")
    metrics.resolves.labels("miss").inc()
    await _record_miss(state, model, version.version, specs, mode, node, answer["rejections"])
    return JSONResponse(answer, status_code=404)


async def model_view(state: AppState, model: str) -> ModelView | Missing:
    """The model from the read model (read from SQL, in a worker thread, when not held)."""
    view = state.read_model.peek(model)
    if view is None:
        view = await run_in_threadpool(state.read_model.get, model)
    return view


def _unknown_ref(state: AppState, view: ModelView, ref: str | None) -> str:
    """The message for a ref the model lacks, as the database path words it
    (kept on the view, which a change to the model replaces)."""
    known = view.unknown_refs.get(ref)
    if known is not None:
        return known
    try:
        resolve_reads.candidates_and_bindings(state.db, view.name, ref)
    except service.NotFound as exc:
        if len(view.unknown_refs) >= 1000:  # refs come from clients
            view.unknown_refs.clear()
        view.unknown_refs[ref] = str(exc)
        return str(exc)
    return f"{view.name}@{ref} was just created; ask again"


def answer_resolve(view: ModelView, version: VersionView, *, ref: str | None, node: Target,
                   specs: tuple[TensorSpec, ...], mode: GradMode, opts: CompileOptions | None,
                   wanted: list[str] | None, provides: frozenset[str] | None,
                   node_layout: MeshLayout | None, rank: int | None,
                   base_url: str) -> bytes | dict[str, Any]:
    """A hit's body (bytes) or a miss's JSON. Only the candidates in the
    node's bucket are checked; on a miss, all of them, for their reasons."""
    kw: dict[str, Any] = {"target": node, "inputs": specs, "grad_mode": mode, "options": opts,
                          "formats": wanted, "libstdcxx": provides, "layout": node_layout,
                          "rank": rank}
    # The few candidates that can load: the node's buckets, those whose input
    # specs cover the request (checked here without writing a reason each).
    maybe = [r for b in request_buckets(mode, node) for r in version.buckets.get(b, ())
             if inputs_cover(r.inputs, specs)]
    result = resolver.resolve(maybe, **kw)
    if result.best is not None:
        why = resolver.why_chosen(result, target=node, inputs=specs,
                                  rejected=len(version.records) - len(result.accepted))
        return resolve_answer.hit_body(view=view, version=version, ref=ref, result=result,
                                       why=why, base_url=base_url)
    result = resolver.resolve(version.records, **kw)
    rejections = [
        {"digest": r.artifact.digest, "format": r.artifact.format,
         "target": str(r.artifact.target), "code": r.code, "reason": r.reason}
        for r in result.rejected
    ]
    what = f"{view.name}@{version.version}"
    codes = ", ".join(sorted({r["code"] for r in rejections}))
    if rejections:
        detail = (f"no artifact of {what} fits this node: {len(rejections)} "
                  f"candidate(s) rejected ({codes})")
    else:
        detail = f"{what} has no artifacts yet (not built, or its builds are still running)"
    hint = resolver.dynamic_hint(result, inputs=specs)
    if hint:
        detail = f"{detail}; {hint}"
    return {"detail": detail, "model": view.name, "version": version.version,
            "rejections": rejections, "hint": hint}


async def _record_miss(state: AppState, model: str, version: str | None,
                       specs: tuple[TensorSpec, ...], mode: GradMode, node: Target,
                       reasons: list[Any]) -> None:
    # One row per distinct miss per few seconds per replica: a whole fleet
    # missing at once must not become thousands of inserts.
    key = (model, version, format_inputs(specs), mode.value, str(node))
    hit, _ = state.recent_misses.peek(key)
    if hit:
        return
    state.recent_misses.put(key, True)
    try:
        await run_in_threadpool(service.record_miss, state.db, model=model, version=version,
                                inputs=specs, grad_mode=mode, target=node, reasons=reasons)
    except Exception as exc:  # the answer matters more than the record
        log.warning("could not record a resolve miss: %s", exc)


class MissIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(max_length=128, json_schema_extra={"pattern": NAME_PATTERN})
    ref: str | None = Field(default=None, max_length=64, description="version or alias asked for")
    inputs: list[Annotated[str, Field(max_length=256,
                                      json_schema_extra={"pattern": INPUT_PATTERN})]] = Field(
        min_length=1, max_length=64)
    grad_mode: str = Field(default="inference", max_length=16)
    target: str = Field(max_length=512, json_schema_extra={"pattern": TARGET_PATTERN})
    reasons: list[Any] = Field(default_factory=list, max_length=256,
                               description="why nothing was used (rejections, a load error)")


@router.post("/v1/misses", status_code=202, tags=["resolve"],
             responses={413: err("body over MAX_BODY_BYTES")})
def report_miss(body: MissIn, state: State, _: Reader) -> dict[str, Any]:
    """A node reports that it could not use the farm's artifact (and fell back to JIT)."""
    specs = parse_inputs(body.inputs)
    node = Target.parse(body.target)
    mode = parse_grad_mode(body.grad_mode)
    service.record_miss(state.db, model=body.model, version=body.ref, inputs=specs,
                        grad_mode=mode, target=node, reasons=body.reasons)
    return {"recorded": True}
