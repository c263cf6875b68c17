"""Job specs: what a user asks the farm to build (the program, its options,
grad mode, training and parallel layouts) and the build key that names it.

Every spec is a frozen value with a canonical string or JSON form that parses
back to the same value, so it can be hashed into build keys, stored in SQL and
typed on a command line. The tensors a job is built for are input specs
(``farm.core.inputs``).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from farm.core.inputs import (
    SpecError as SpecError,  # raised by both; re-exported for callers of specs
)
from farm.core.inputs import TensorSpec, canonical_inputs, format_inputs, parse_inputs

_ENTRYPOINT_RE = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")
_DIGEST_RE = re.compile(r"^[0-9a-f]{64}$")
# The project every model belonged to before projects (registry.models.DEFAULT_PROJECT).
DEFAULT_PROJECT = "default"
_PROJECT_RE = re.compile(r"^[a-z][a-z0-9._-]{0,63}$")
_IDENT_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class GradMode(str, Enum):
    """What the artifact is compiled for; guards pin it (grad_mode, inference_mode)."""

    INFERENCE = "inference"  # called under torch.no_grad()
    TRAINING = "training"  # grad enabled, the artifact supports backward

    def __str__(self) -> str:
        return self.value


COMPILE_MODES = ("default", "max-autotune", "max-autotune-no-cudagraphs")
# Every backend torch.compile(...).aot_compile can save and load (the guide's
# "inductor", "eager", "aot_eager"): eager and aot_eager generate no code, for
# debugging a build; only inductor has modes, and only it gives AOTI packages.
BACKENDS = ("inductor", "eager", "aot_eager")
GUARD_FILTERS = ("drop-unserializable", "keep-all")
OPTION_NAMES = ("mode", "backend", "guard_filter", "disable_guard_check", "regional", "per_block",
                "parallel", "weights")
# How a build makes the model's weights (farm.build.fake_weights): "empty"
# (to_empty on the target: real Parameters, uninitialised memory), "fake"
# (FakeTensors: no memory at all), "auto" (empty where they fit, fake for a
# CUDA build whose weights do not fit the build GPU).
WEIGHT_MODES = ("auto", "empty", "fake")
# Tensor-parallel styles a plan may name (torch.distributed.tensor.parallel).
PARALLEL_STYLES = ("colwise", "rowwise")
_MODULE_PATH_RE = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_0-9]\w*)*$")


@dataclass(frozen=True)
class MeshLayout:
    """What a node states about its process group: the world size and the
    device mesh (shape, dimension names). An artifact built for another one
    is refused (``registry.resolver`` rule ``layout``)."""

    world_size: int
    mesh_shape: tuple[int, ...]
    mesh_dim_names: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.world_size, bool) or not isinstance(self.world_size, int) \
                or self.world_size < 1:
            raise SpecError(f"world_size must be a positive int, got {self.world_size!r}")
        if (not isinstance(self.mesh_shape, tuple) or not self.mesh_shape
                or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1
                           for n in self.mesh_shape)):
            raise SpecError(f"mesh_shape must be a non-empty list of positive ints, "
                            f"got {self.mesh_shape!r}")
        size = 1
        for n in self.mesh_shape:
            size *= n
        if size != self.world_size:
            raise SpecError(f"mesh {list(self.mesh_shape)} holds {size} ranks, world_size is "
                            f"{self.world_size}: the mesh must cover every rank")
        if self.mesh_dim_names and (
                len(self.mesh_dim_names) != len(self.mesh_shape)
                or not all(isinstance(n, str) and _IDENT_RE.match(n) for n in self.mesh_dim_names)
                or len(set(self.mesh_dim_names)) != len(self.mesh_dim_names)):
            raise SpecError(f"mesh_dim_names must be one distinct identifier per mesh dim "
                            f"({len(self.mesh_shape)}), got {list(self.mesh_dim_names)!r}")

    def __str__(self) -> str:
        dims = ",".join(f"{n}:{s}" if n else str(s) for n, s in
                        zip(self.mesh_dim_names or ("",) * len(self.mesh_shape),
                            self.mesh_shape, strict=True))
        return f"world {self.world_size}, mesh [{dims}]"

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {"world_size": self.world_size,
                                "mesh_shape": list(self.mesh_shape)}
        if self.mesh_dim_names:
            data["mesh_dim_names"] = list(self.mesh_dim_names)
        return data

    @classmethod
    def from_json(cls, data: Any) -> MeshLayout:
        if not isinstance(data, Mapping):
            raise SpecError(f"a layout is an object like {{\"world_size\": 2, \"mesh_shape\": "
                            f"[2]}}, got {data!r}")
        unknown = set(data) - {"world_size", "mesh_shape", "mesh_dim_names"}
        if unknown:
            raise SpecError(f"unknown layout fields: {', '.join(sorted(unknown))}; known: "
                            "world_size, mesh_shape, mesh_dim_names")
        shape = data.get("mesh_shape", [data.get("world_size")])
        names = data.get("mesh_dim_names") or ()
        if not isinstance(shape, list | tuple) or not isinstance(names, list | tuple):
            raise SpecError("mesh_shape and mesh_dim_names are lists")
        return cls(world_size=data.get("world_size"), mesh_shape=tuple(shape),  # type: ignore[arg-type]
                   mesh_dim_names=tuple(names))


@dataclass(frozen=True)
class ParallelLayout:
    """A tensor-parallel build: the model is parallelized over a
    1-D device mesh with ``plan`` (module path -> ``colwise``/``rowwise``,
    ``parallelize_module``), its inputs are replicated DTensors, and it is
    compiled once under a fake process group with
    ``torch.distributed.config.compile_on_one_rank`` so one artifact serves
    every rank of ``mesh``."""

    mesh: MeshLayout
    plan: tuple[tuple[str, str], ...]

    def __post_init__(self) -> None:
        if len(self.mesh.mesh_shape) != 1:
            # parallelize_module takes a 1-D mesh (or a named sub-mesh of one);
            # a plan naming which dim each module uses is not designed yet.
            raise SpecError(f"a parallel plan needs a 1-D mesh, got {list(self.mesh.mesh_shape)}")
        if not isinstance(self.plan, tuple) or not self.plan:
            raise SpecError("parallel.plan names at least one module: "
                            "{\"linear1\": \"colwise\", \"linear2\": \"rowwise\"}")
        for path, style in self.plan:
            if not isinstance(path, str) or not _MODULE_PATH_RE.match(path):
                raise SpecError(f"bad module path {path!r} in parallel.plan: a dotted "
                                "submodule path such as layers.0.mlp.up")
            if style not in PARALLEL_STYLES:
                raise SpecError(f"unknown parallel style {style!r} for {path}; known: "
                                f"{', '.join(PARALLEL_STYLES)}")
        if [p for p, _ in self.plan] != sorted({p for p, _ in self.plan}):
            raise SpecError("parallel.plan must name each module once, sorted "
                            "(ParallelLayout.from_json sorts)")

    def to_json(self) -> dict[str, Any]:
        return {**self.mesh.to_json(), "plan": dict(self.plan)}

    @classmethod
    def from_json(cls, data: Any) -> ParallelLayout:
        if not isinstance(data, Mapping) or not isinstance(data.get("plan"), Mapping):
            raise SpecError("parallel must be an object with world_size, mesh_shape, "
                            "mesh_dim_names and plan ({module path: colwise|rowwise})")
        mesh = MeshLayout.from_json({k: v for k, v in data.items() if k != "plan"})
        return cls(mesh=mesh, plan=tuple(sorted(dict(data["plan"]).items())))


@dataclass(frozen=True)
class CompileOptions:
    mode: str = "default"
    backend: str = "inductor"
    # Which guards to keep when saving: real-world modules carry guards on
    # closures (ID_MATCH) that cannot be serialized; "drop-unserializable"
    # drops only those, never tensor or global-state guards.
    guard_filter: str = "drop-unserializable"
    # The loaded function skips its guard check on every call
    # (``AOTCompiledFunction.disable_guard_check()``): a call on other shapes,
    # dtypes or devices than the artifact's is then not refused but wrong.
    # Recorded, so a node gets it only when it asks for it (or for any options).
    disable_guard_check: bool = False
    # Regional compilation: each repeated block class (a transformer layer)
    # is a torch.compiler.nested_compile_region, compiled once and stamped
    # for every layer, in the same one aot_compile artifact.
    regional: bool = False
    # Per-block compilation (farm.build.blocks): each block of the model's
    # layer list is an aot_compile function of its own, reused across the
    # layers and across builds; the rest of the model runs eagerly.
    per_block: bool = False
    # A tensor-parallel build (ParallelLayout); None: a single-process model.
    parallel: ParallelLayout | None = None
    # WEIGHT_MODES: how the build makes the weights; "auto" unless a job asks.
    weights: str = "auto"

    def __post_init__(self) -> None:
        if self.weights not in WEIGHT_MODES:
            raise SpecError(f"unknown weights {self.weights!r}; known: {', '.join(WEIGHT_MODES)} "
                            "(fake: build without memory for the weights)")
        if self.parallel is not None and not isinstance(self.parallel, ParallelLayout):
            raise SpecError(f"parallel must be a ParallelLayout, got {self.parallel!r}")
        if self.mode not in COMPILE_MODES:
            raise SpecError(f"unknown mode {self.mode!r}; known: {', '.join(COMPILE_MODES)}")
        if self.backend not in BACKENDS:
            raise SpecError(f"unknown backend {self.backend!r}; known: {', '.join(BACKENDS)}")
        if self.backend != "inductor" and self.mode != "default":
            raise SpecError(
                f"mode {self.mode!r} is an inductor mode; backend {self.backend!r} has none "
                "(leave mode at default, or use backend inductor)"
            )
        if self.guard_filter not in GUARD_FILTERS:
            raise SpecError(
                f"unknown guard filter {self.guard_filter!r}; known: {', '.join(GUARD_FILTERS)}"
            )
        for name in ("disable_guard_check", "regional", "per_block"):
            if not isinstance(getattr(self, name), bool):
                raise SpecError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.regional and self.per_block:
            raise SpecError("regional and per_block are two ways to compile a model's blocks; "
                            "ask for one of them")

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "mode": self.mode, "backend": self.backend, "guard_filter": self.guard_filter}
        if self.disable_guard_check:
            # Only when set: options stored before it existed keep their exact
            # canonical text, so their build keys and rows still match.
            data["disable_guard_check"] = True
        if self.regional:
            # Only when set, as above.
            data["regional"] = True
        if self.per_block:
            # Only when set, as above.
            data["per_block"] = True
        if self.parallel is not None:
            # Only when set, as above: the layout is in the build key.
            data["parallel"] = self.parallel.to_json()
        if self.weights != "auto":
            # Only when set, as above: a fake-weight artifact's guards differ.
            data["weights"] = self.weights
        return data

    def canonical(self) -> str:
        return canonical_json(self.to_json())

    @classmethod
    def from_json(cls, data: Mapping[str, Any] | None) -> CompileOptions:
        data = dict(data or {})
        unknown = set(data) - set(OPTION_NAMES)
        if unknown:
            raise SpecError(f"unknown compile options: {', '.join(sorted(unknown))}; "
                            f"known: {', '.join(OPTION_NAMES)}")
        flags = {name: _flag(name, data.pop(name, False))
                 for name in ("regional", "per_block", "disable_guard_check")}
        raw_parallel = data.pop("parallel", None)
        parallel = None if raw_parallel is None else ParallelLayout.from_json(raw_parallel)
        text = {k: str(v) for k, v in data.items()}
        return cls(**text, regional=flags["regional"], per_block=flags["per_block"],
                   disable_guard_check=flags["disable_guard_check"], parallel=parallel)


def _flag(name: str, value: Any) -> bool:
    """A true/false option, as JSON or as the CLI's ``--option name=true`` text."""
    if isinstance(value, str) and value.lower() in ("true", "false"):
        value = value.lower() == "true"
    if not isinstance(value, bool):
        raise SpecError(f"{name} must be true or false, got {value!r}")
    return value


def unasked_options(options: CompileOptions, device: str) -> list[str]:
    """The options of an artifact built with ``options`` for ``device`` that
    change what a call means, not only how fast it is: such an artifact is
    served only to a request that names its options, never to one that names
    none (which gets default semantics or nothing). Empty: any request may
    have it.

    - ``disable_guard_check``: a call on other shapes, dtypes or devices than
      the artifact's is not refused but wrong;
    - ``mode=max-autotune`` on CUDA: CUDA graphs, whose outputs the next
      call overwrites (a caller that keeps an output sees it change).

    The other options (backend, guard filter, regional, per-block, fake weights, the
    no-cudagraphs mode) compute the same function; they are only preferred
    after the default (registry.resolver)."""
    out = []
    if options.disable_guard_check:
        out.append("disable_guard_check")
    if options.mode == "max-autotune" and device.startswith("cuda"):
        out.append("mode=max-autotune (CUDA graphs: the next call overwrites its outputs)")
    return out


_OPTIMIZER_RE = re.compile(r"^[A-Z][A-Za-z0-9_]*$")


@dataclass(frozen=True)
class TrainSpec:
    """A training step (model kind ``training_step``): the artifact is
    ``loss(model(*inputs), *targets)`` with its backward (AOTAutograd); the
    last ``targets`` job inputs are the loss's targets. ``optimizer`` names a
    ``torch.optim`` class, built with ``optimizer_kwargs`` on the node and in
    verification, which checks the loss, every gradient and the optimizer's
    state after two steps against eager. The step itself runs uncompiled
    (``farm.core.training.OPTIMIZER_STEP``)."""

    loss: str
    targets: int = 1
    optimizer: str = "SGD"
    optimizer_kwargs: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.loss, str) or not _ENTRYPOINT_RE.match(self.loss):
            raise SpecError(f"bad train.loss {self.loss!r}: expected 'package.module:function', "
                            "e.g. torch.nn.functional:mse_loss")
        if isinstance(self.targets, bool) or not isinstance(self.targets, int) \
                or self.targets < 0:
            raise SpecError(f"train.targets must be a count of trailing inputs (0 or more), "
                            f"got {self.targets!r}")
        if not isinstance(self.optimizer, str) or not _OPTIMIZER_RE.match(self.optimizer):
            raise SpecError(f"bad train.optimizer {self.optimizer!r}: a torch.optim class name, "
                            "e.g. SGD, AdamW")
        if not isinstance(self.optimizer_kwargs, Mapping):
            raise SpecError(f"train.optimizer_kwargs must be an object, "
                            f"got {self.optimizer_kwargs!r}")
        try:
            canonical_json(dict(self.optimizer_kwargs))
        except (TypeError, ValueError) as exc:
            raise SpecError(f"train.optimizer_kwargs must be JSON: {exc}") from None

    def __hash__(self) -> int:
        return hash(self.canonical())

    def to_json(self) -> dict[str, Any]:
        return {"loss": self.loss, "targets": self.targets, "optimizer": self.optimizer,
                "optimizer_kwargs": dict(self.optimizer_kwargs)}

    def canonical(self) -> str:
        return canonical_json(self.to_json())

    @classmethod
    def from_json(cls, data: Any) -> TrainSpec:
        if not isinstance(data, Mapping):
            raise SpecError(f"train must be an object with loss, targets, optimizer and "
                            f"optimizer_kwargs, got {data!r}")
        unknown = set(data) - {"loss", "targets", "optimizer", "optimizer_kwargs"}
        if unknown:
            raise SpecError(f"unknown train fields: {', '.join(sorted(unknown))}; known: loss, "
                            "targets, optimizer, optimizer_kwargs")
        if "loss" not in data:
            raise SpecError("train needs a loss, e.g. torch.nn.functional:mse_loss")
        return cls(loss=data["loss"], targets=data.get("targets", 1),
                   optimizer=data.get("optimizer", "SGD"),
                   optimizer_kwargs=dict(data.get("optimizer_kwargs") or {}))


MODEL_KINDS = ("factory", "function", "training_step")


@dataclass(frozen=True)
class ModelRef:
    """An importable callable: a factory returning an nn.Module (with JSON kwargs),
    or, with ``kind='function'``, a free function compiled as it is."""

    entrypoint: str
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    kind: str = "factory"
    # A free function's captured objects that torch cannot serialize (an
    # nn.Module with its weights): names of globals of the function's module.
    # Saved as references (``save_compiled_function(external_data=...)``); the
    # node supplies its own objects under the same names at load.
    external_data: tuple[str, ...] = ()
    # kind 'training_step': the factory's module trained with this loss and
    # optimizer (TrainSpec); None for every other kind.
    train: TrainSpec | None = None

    def __post_init__(self) -> None:
        if (self.kind == "training_step") != (self.train is not None):
            raise SpecError("model kind 'training_step' needs a train section (loss, targets, "
                            "optimizer, optimizer_kwargs), and only that kind takes one")
        if not isinstance(self.external_data, tuple) or not all(
                isinstance(n, str) and _IDENT_RE.match(n) for n in self.external_data):
            raise SpecError(f"external_data must be names of the function's globals (Python "
                            f"identifiers), got {self.external_data!r}")
        if len(set(self.external_data)) != len(self.external_data):
            raise SpecError(f"external_data names a global twice: {list(self.external_data)}")
        if self.external_data and self.kind != "function":
            raise SpecError("external_data is for a free function's captured objects "
                            "(kind 'function'); a factory's module holds its own weights")
        if not _ENTRYPOINT_RE.match(self.entrypoint):
            raise SpecError(
                f"bad entrypoint {self.entrypoint!r}: expected 'package.module:callable'"
            )
        if self.kind not in MODEL_KINDS:
            raise SpecError(f"unknown model kind {self.kind!r}; known: {', '.join(MODEL_KINDS)}")
        if self.kind == "function" and self.kwargs:
            raise SpecError("a free function takes no factory kwargs")
        try:
            canonical_json(dict(self.kwargs))
        except (TypeError, ValueError) as exc:
            raise SpecError(f"factory kwargs must be JSON: {exc}") from None

    def __hash__(self) -> int:
        return hash((self.entrypoint, canonical_json(dict(self.kwargs)), self.kind,
                     self.external_data, self.train))

    @property
    def identity(self) -> str:
        """What the fingerprint names the program by: the entrypoint, and for
        a training step its loss and optimizer too (two jobs training one
        model differently must not share an artifact and its verification)."""
        if self.train is None:
            return self.entrypoint
        return f"{self.entrypoint}|train:{self.train.canonical()}"

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "entrypoint": self.entrypoint, "kwargs": dict(self.kwargs), "kind": self.kind}
        if self.external_data:
            # Only when declared: specs stored before it keep their exact JSON.
            data["external_data"] = list(self.external_data)
        if self.train is not None:
            data["train"] = self.train.to_json()
        return data


@dataclass(frozen=True)
class JobSpec:
    """Everything needed to build one model for a set of targets."""

    name: str
    version: str
    model: ModelRef
    inputs: tuple[TensorSpec, ...]
    grad_mode: GradMode = GradMode.INFERENCE
    options: CompileOptions = field(default_factory=CompileOptions)
    targets: tuple[str, ...] = ()  # target selectors; empty means every live target
    # sha256 hex of the code pack the model's code travels in
    # (farm.core.codepack); None: the entrypoint is installed on the workers.
    code_digest: str | None = None
    # The project the model belongs to, set by the API from the model's row
    # (a submitter's request only asks): part of the build key and of the
    # compile cache's namespace, so no build of one project serves another's.
    # None: the ``default`` project, whose keys are what they were before
    # projects existed.
    project: str | None = None

    def __post_init__(self) -> None:
        if self.project == DEFAULT_PROJECT:
            object.__setattr__(self, "project", None)
        if self.project is not None and not _PROJECT_RE.match(self.project):
            raise SpecError(f"bad project {self.project!r}: a lower-case letter, then "
                            "lower-case letters, digits, '.', '_' or '-' (at most 64)")
        if not re.match(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$", self.name):
            raise SpecError(
                f"bad model name {self.name!r}: letters, digits, '.', '_' and '-', at most 128"
            )
        if not re.match(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,63}$", self.version):
            raise SpecError(f"bad version {self.version!r}: letters, digits, '.', '_', '+', '-'")
        # One call, one text (and one build key): keyword and dict inputs in
        # their canonical order, whatever order they were given in.
        object.__setattr__(self, "inputs", canonical_inputs(tuple(self.inputs)))
        if not self.inputs:
            raise SpecError("a job needs at least one input spec")
        train = self.model.train
        if train is not None:
            if self.grad_mode is not GradMode.TRAINING:
                raise SpecError("a training_step job is compiled for training: set "
                                "grad_mode 'training'")
            if train.targets >= len(self.inputs):
                raise SpecError(f"train.targets is {train.targets}, and the job has "
                                f"{len(self.inputs)} inputs: the model needs at least one "
                                "input before the loss's targets")
        if self.code_digest is not None and not _DIGEST_RE.match(self.code_digest):
            raise SpecError(f"bad code_digest {self.code_digest!r}: expected the sha256 of the "
                            "code pack, 64 lowercase hex characters")

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "name": self.name,
            "version": self.version,
            "model": self.model.to_json(),
            "inputs": [str(s) for s in self.inputs],
            "grad_mode": self.grad_mode.value,
            "options": self.options.to_json(),
            "targets": list(self.targets),
        }
        if self.code_digest is not None:
            # Left out when there is none, so specs stored before code packs
            # existed keep their exact JSON.
            data["code_digest"] = self.code_digest
        if self.project is not None:
            data["project"] = self.project
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> JobSpec:
        try:
            model = data["model"]
            grad = data.get("grad_mode", GradMode.INFERENCE.value)
            try:
                grad_mode = GradMode(grad)
            except ValueError:
                raise SpecError(f"unknown grad_mode {grad!r}; known: inference, training") from None
            return cls(
                name=str(data["name"]),
                version=str(data["version"]),
                model=ModelRef(
                    entrypoint=str(model["entrypoint"]),
                    kwargs=dict(model.get("kwargs") or {}),
                    kind=str(model.get("kind", "factory")),
                    external_data=_names(model.get("external_data")),
                    train=None if model.get("train") is None
                    else TrainSpec.from_json(model["train"]),
                ),
                inputs=parse_inputs(data["inputs"]),
                grad_mode=grad_mode,
                options=CompileOptions.from_json(data.get("options")),
                targets=tuple(str(t) for t in data.get("targets") or ()),
                code_digest=None if data.get("code_digest") is None
                else str(data["code_digest"]),
                project=None if data.get("project") is None else str(data["project"]),
            )
        except KeyError as exc:
            raise SpecError(f"job spec is missing {exc.args[0]!r}") from None
        except (TypeError, AttributeError) as exc:
            raise SpecError(f"malformed job spec: {exc}") from None


def _names(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise SpecError(f"external_data must be a list of names, e.g. [\"model\"], got {value!r}")
    return tuple(str(v) for v in value)


def canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)


def sha256_text(*parts: str) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode())
        h.update(b"\0")
    return h.hexdigest()


def build_key(
    *,
    fingerprint: str,
    inputs: Sequence[TensorSpec],
    grad_mode: GradMode,
    options: CompileOptions,
    target: str,
    project: str | None = None,
) -> str:
    """Identity of one build: artifacts are deduplicated on it.

    ``aot_compile`` output is not byte-reproducible, so builds are keyed by
    what went in, never by the bytes that came out. The project is part of
    it (all but ``default``, whose keys predate projects): the bytes depend
    on the project's compile cache, so one project's artifact is never
    reused as another's.
    """
    parts = [fingerprint, format_inputs(inputs), grad_mode.value, options.canonical(), target]
    if project is not None and project != DEFAULT_PROJECT:
        parts.append(f"project={project}")
    return sha256_text(*parts)
