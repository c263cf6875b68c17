"""Jobs: submit one, read its state."""

from __future__ import annotations

import dataclasses
import importlib.machinery
import importlib.util
import logging
import sys
from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Path, Response
from pydantic import BaseModel, ConfigDict, Field

from farm.core.specs import DEFAULT_PROJECT, JobSpec, SpecError
from registry import service
from registry.auth import Principal
from registry.db import Conflict
from registry.service import projects

from . import names
from .deps import Reader, State, Submitter
from .schemas import (
    INPUT_PATTERN,
    NAME_PATTERN,
    PROTECTED,
    VERSION_PATTERN,
    err,
)
from .state import AppState

log = logging.getLogger(__name__)

router = APIRouter(prefix="/v1/jobs", tags=["jobs"], responses=PROTECTED)


class ModelRefIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    entrypoint: str = Field(max_length=512, examples=["farm.zoo.mlp:make"],
                            description="'package.module:callable'")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="JSON kwargs of the factory")
    kind: str = Field(default="factory", description="'factory' (returns an nn.Module), "
                                                     "'function' (compiled as it is) or "
                                                     "'training_step' (the factory's module "
                                                     "with its loss; needs train)")
    train: dict[str, Any] | None = Field(
        default=None, examples=[{"loss": "torch.nn.functional:mse_loss", "targets": 1,
                                 "optimizer": "AdamW", "optimizer_kwargs": {"lr": 1e-3}}],
        description="kind 'training_step': the loss function ('module:function', called "
                    "as loss(model(*inputs), *targets)), how many trailing inputs are its "
                    "targets, a torch.optim class and its kwargs")
    external_data: list[Annotated[str, Field(max_length=128)]] = Field(
        default_factory=list, max_length=32,
        description="a function's captured objects torch cannot serialize (an nn.Module): "
                    "names of its module's globals, which the node supplies at load")


class JobSpecIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(max_length=128, json_schema_extra={"pattern": NAME_PATTERN})
    version: str = Field(max_length=64, json_schema_extra={"pattern": VERSION_PATTERN})
    model: ModelRefIn
    inputs: list[Annotated[str, Field(max_length=256,
                                      json_schema_extra={"pattern": INPUT_PATTERN})]] = Field(
        max_length=64, examples=[["float32[8,64]"]],
        description="input specs, e.g. float32[8,64] or float32[2..64,128]")
    grad_mode: str = Field(default="inference", description="'inference' or 'training'")
    options: dict[str, str | bool | dict[str, Any]] = Field(
        default_factory=dict,
        description="compile options: mode, backend (inductor, eager, aot_eager), "
                    "guard_filter, disable_guard_check (true/false), regional (true/false: "
                    "repeated blocks compiled once as nested compile regions), "
                    "per_block (true/false: each layer-list block compiled on its own, "
                    "reused across layers and builds), "
                    "weights (auto, empty, "
                    "fake: a build without memory for the weights), parallel (a "
                    "tensor-parallel layout: world_size, mesh_shape, mesh_dim_names, "
                    "plan {module path: colwise|rowwise})")
    targets: list[Annotated[str, Field(max_length=512)]] = Field(
        default_factory=list, max_length=64,
        description="full targets or selectors (e.g. 'cpu'); empty: every live target")
    project: str | None = Field(
        default=None, max_length=64, pattern="^[a-z][a-z0-9._-]{0,63}$",
        description="the project a new model is made in (default: 'default'); a model's "
                    "versions stay in its project, and the token must be a maintainer there")
    code_digest: str | None = Field(
        default=None, min_length=64, max_length=64, pattern="^[0-9a-f]{64}$",
        description="sha256 of the code pack uploaded with PUT /v1/code/{digest} "
                    "(farm submit packs and uploads the model's code); omitted: the "
                    "entrypoint is installed on the farm's workers")
    rebuild: bool = Field(
        default=False,
        description="compile even where this program's artifacts exist for a target, and "
                    "replace them (false: artifacts are reused, and only a format deleted "
                    "from them is built again)")


class BuildOut(BaseModel):
    id: str
    target: str
    state: str


class SubmitOut(BaseModel):
    id: str
    state: str
    model: str
    version: str
    builds: list[BuildOut]
    enqueued: bool = Field(description="false when the broker could not be reached: the job "
                                       "is recorded and is sent again by the sweep")
    warning: str | None = None


def _in_project(state: AppState, spec: JobSpec, who: Principal | None) -> JobSpec:
    """The spec with the project its model belongs to (a new model: the one
    asked for, else ``default``), once ``who`` is a maintainer there."""
    asked = spec.project or DEFAULT_PROJECT
    owner = projects.project_of(state.db, spec.name)
    project = owner or asked
    if who is not None:
        projects.require(state.db, who, project, "maintainer")
    if owner is not None and owner != asked and spec.project is not None:
        raise service.Clash(f"model {spec.name!r} belongs to project {owner!r}, not {asked!r}: "
                            "a model name is one project's; pick another name for your model")
    return dataclasses.replace(spec, project=project)


def module_missing(entrypoint: str) -> str | None:
    """Why the entrypoint's module cannot be found, or None when it can.

    Walks the dotted name with finders only: ``importlib.util.find_spec`` on
    ``a.b`` would import (run) package ``a``, and model code never runs in
    the API process.
    """
    module = entrypoint.partition(":")[0]
    parts = module.split(".")
    try:
        spec = importlib.util.find_spec(parts[0])
    except (ImportError, ValueError) as exc:
        return f"{parts[0]!r} cannot be found ({exc})"
    if spec is None:
        return f"no module named {parts[0]!r}"
    for i in range(1, len(parts)):
        name = ".".join(parts[: i + 1])
        loaded = sys.modules.get(name)
        if loaded is not None and loaded.__spec__ is not None:
            spec = loaded.__spec__
            continue
        assert spec is not None
        locations = spec.submodule_search_locations
        if locations is None:
            return f"{'.'.join(parts[:i])!r} is a module, not a package, so {name!r} does not exist"
        spec = importlib.machinery.PathFinder.find_spec(name, list(locations))
        if spec is None:
            return f"no module named {name!r}"
    return None


def accept_job(state: AppState, spec: JobSpec, *, submitted_by: str | None,
               who: Principal | None = None,
               rebuild: bool = False) -> tuple[str, bool, str | None]:
    """Take a job the way ``POST /v1/jobs`` does (project role, code check,
    targets, version binding, commit, then enqueue): ``(job id, enqueued,
    warning)``. Build on miss and ``farm plan --submit`` submit through here
    too, so their jobs are checked, signed and deduplicated (by build key)
    like any other. ``who``: the token asking (None: the farm itself, build
    on miss, which a project's policy allowed). ``rebuild``: compile even
    where artifacts exist (``POST /v1/jobs``'s ``rebuild``)."""
    spec = _in_project(state, spec, who)
    # The API never imports the model's code. Shipped code is checked by the
    # trace stage, in seconds (module, callable, kwargs); code said to be
    # installed must at least be found here, where the farm runs.
    if spec.code_digest is not None:
        try:
            present = state.store.exists(spec.code_digest)
        except Exception as exc:
            # The blob store is down: take the job anyway (submission needs
            # only the database); the worker fetches the pack, retrying
            # while the store is unreachable, and fails the job if it is absent.
            log.warning("cannot check code pack %s (%s: %s); job accepted",
                        spec.code_digest[:12], type(exc).__name__, exc)
            present = True
        if not present:
            raise SpecError(f"code pack {spec.code_digest} is not on the farm: upload it first "
                            "(PUT /v1/code/{digest}; farm submit and FarmClient.submit do)")
    else:
        missing = module_missing(spec.model.entrypoint)
        if missing:
            raise SpecError(
                f"entrypoint {spec.model.entrypoint!r} does not import: {missing}; the farm "
                "builds only code it is given or has installed: ship the code with the job "
                "(farm submit --source PATH, or run farm submit where the module is)")
    live = service.live_targets(state.db, max_age_s=state.heartbeat_max_age_s)
    targets = service.choose_targets(spec.targets, live)
    try:
        names.check_version(state, spec)
        try:
            job_id = service.submit_job(state.db, spec, targets=targets, submitted_by=submitted_by,
                                        project=spec.project, rebuild=rebuild)
        except Conflict:
            # Two first submissions of one model raced to create its row; the
            # loser's retry finds it.
            job_id = service.submit_job(state.db, spec, targets=targets, submitted_by=submitted_by,
                                        project=spec.project, rebuild=rebuild)
    except service.InvalidRequest as exc:
        # The version exists with another program: a conflict, not a bad request.
        raise HTTPException(409, str(exc)) from None
    # Signed now, from the request this token made: what nodes will accept as
    # this version (docs/security.md).
    names.bind_version(state, spec, submitted_by=submitted_by)
    # Only after the commit: a worker must never get an id the database lacks.
    enqueued, warning = True, None
    try:
        state.enqueue(job_id)
    except Exception as exc:
        # The job is committed and stays "queued"; the sweep sends it again
        # once the broker is back. Failing the request would make the client
        # submit a duplicate.
        log.error("job %s recorded but not enqueued: %s", job_id, exc)
        enqueued = False
        warning = (f"job recorded but the broker is unreachable ({type(exc).__name__}: "
                   f"{str(exc).strip()[:200]}); it stays queued and is sent again when the "
                   "broker is back")
    return job_id, enqueued, warning


@router.post("", status_code=201, response_model=SubmitOut,
             responses={422: err("malformed spec, an entrypoint that does not import, or no "
                                 "target to build for"),
                        403: err("the token is no maintainer of the model's project"),
                        409: err("the version exists with another program (entrypoint, "
                                 "kwargs or code) and has builds that did not fail; or it is "
                                 "named like an alias; or the model is another project's"),
                        413: err("body over MAX_BODY_BYTES")})
def submit_job(body: JobSpecIn, state: State, who: Submitter, response: Response) -> SubmitOut:
    spec = JobSpec.from_json(body.model_dump(exclude_none=True, exclude={"rebuild"}))
    job_id, enqueued, warning = accept_job(state, spec, submitted_by=who.name, who=who,
                                           rebuild=body.rebuild)
    view = service.job_view(state.db, job_id)
    response.headers["Location"] = f"/v1/jobs/{job_id}"
    return SubmitOut(
        id=job_id, state=view["state"], model=view["model"], version=view["version"],
        builds=[BuildOut(id=b["id"], target=b["target"], state=b["state"])
                for b in view["builds"]],
        enqueued=enqueued, warning=warning,
    )


@router.get("/{job_id}", responses={404: err("no such job")})
def get_job(job_id: Annotated[str, Path(max_length=64)], state: State,
            _: Reader) -> dict[str, Any]:
    """The job, with each target's build state, timings, log, error and artifacts."""
    return service.job_view(state.db, job_id)
