"""The trace stage: build a model without weights, capture its full graph, fail fast
on graph breaks, and record what it is (fingerprint, size, FLOPs).

How the graph is captured, and why:

- ``torch.compile(fullgraph=True)`` with a capturing backend, i.e. Dynamo, the very
  front end the compile stage's ``aot_compile`` runs. What breaks here breaks
  there and vice versa, and its errors carry the reason and the user's
  ``file:line`` (``exc.real_stack``) on torch 2.11 and 2.13 alike. Non-strict
  ``torch.export`` would run the model as Python and never see a Dynamo graph
  break; strict export adds an aten lowering the fingerprint does not need.
- Nothing is ever executed. Without dynamic dims the backend stops Dynamo as
  soon as it has the graph (guard building is a tenth of a 70B trace and cannot
  fail on a static spec). With dynamic dims Dynamo runs to the end, guards
  included, because a dim the model specialises only fails there
  (``ConstraintViolationError``), which the compile worker would otherwise hit
  minutes later; the backend then returns a function that raises instead of
  running.
- The model is built on the meta device (no memory, no init work) and called with
  meta inputs; Dynamo fakes them itself. Building under FakeTensorMode instead
  would run every init op through fake dispatch for nothing.
- Repeated blocks (the same composite module class several times in a
  ModuleList or Sequential: transformer layers) are traced as nested compile
  regions (``torch.compiler.nested_compile_region``): Dynamo traces the block
  once and stamps it out for every later call whose guards match: a reuse check
  per layer instead of a retrace (a 70B Llama captures about 3x faster). The whole graph is still
  captured and fingerprinted (each call is a node taking that layer's
  parameters). Any failure in that mode is retried without regions, so a graph
  break is always reported by plain Dynamo, exactly as the compile stage sees it.
- FLOPs come from the captured graph with ``FlopCounterMode``: each computing
  node runs once on fresh static fake tensors of its recorded shapes (dynamic
  dims at their example size), and a region's FLOPs are counted once and
  multiplied by its calls.

``trace()`` resets Dynamo's in-process caches when it is done (otherwise a second
trace of the same class would hit the first one's cache and capture nothing): run
it in a process that serves no compiled code, as the trace task's child does.
"""

from __future__ import annotations

import logging
import os
import re
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.fx
from torch import nn

from farm.build.graph_analysis import _analyse
from farm.build.regions import repeated_blocks
from farm.core import fingerprint as fp
from farm.core.inputs import call_args
from farm.core.modelref import (
    apply_grad_mode,
    build_module,
    check_value_ranges,
    embedding_size,
    example_inputs,
    external_device,
    external_objects,
    grad_context,
    iter_named_tensors,
    model_class_name,
)
from farm.core.parallel import build_mesh, fake_group, parallelize, replicate
from farm.core.specs import JobSpec

log = logging.getLogger(__name__)

TOP_OPS = 25

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep


class CaptureError(Exception):
    """The model built, but its full graph could not be captured.

    ``reason`` is torch's one-paragraph explanation, ``location`` the innermost
    user frame as ``file:line``, ``detail`` torch's whole message."""

    kind = "capture failed"

    def __init__(self, reason: str, *, location: str | None = None, detail: str = "") -> None:
        self.reason = reason
        self.location = location
        self.detail = detail
        where = f" at {location}" if location else ""
        super().__init__(f"{self.kind}{where}: {reason}")

    def __reduce__(self) -> Any:
        # Keyword-only fields survive pickling (a process pool, a task result).
        return (_rebuild_capture_error, (type(self), self.reason, self.location, self.detail))


def _rebuild_capture_error(
    cls: type[CaptureError], reason: str, location: str | None, detail: str
) -> CaptureError:
    return cls(reason, location=location, detail=detail)


class GraphBreakError(CaptureError):
    """Dynamo cannot put the whole forward into one graph (unsupported Python,
    data-dependent control flow, an explicit graph_break()...)."""

    kind = "graph break"


class DynamicDimError(CaptureError):
    """A dim the spec marks dynamic is specialised (or narrowed) by the model."""

    kind = "dynamic dim violated"


@dataclass(frozen=True)
class TraceReport:
    fingerprint: str
    graph_hash: str
    param_count: int
    param_bytes: int
    buffer_count: int
    buffer_bytes: int
    flops: int  # forward FLOPs at the example shapes (a multiply-add counts 2)
    graph_nodes: int  # computing nodes of the whole graph, regions expanded per call
    ops: dict[str, int]  # the most frequent targets, regions expanded
    trace_s: float  # build + capture + analysis, import of torch excluded
    capture: str  # "dynamo" or "dynamo+regions"
    regions: int  # region calls in the captured graph (0 without regions)
    example_shapes: list[list[int]]
    model_class: str = ""  # module.qualname of what the factory built (or the function)
    returns: str = ""  # the result's type structure (farm.core.fingerprint.return_structure)
    torch_version: str = field(default_factory=lambda: torch.__version__)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TraceReport:
        return cls(**data)


# --------------------------------------------------------------------------- #
# entry point
# --------------------------------------------------------------------------- #


def trace(spec: JobSpec, *, regions: bool = True) -> TraceReport:
    """Build ``spec.model`` weight-free and capture its full graph.

    Raises ``ModelImportError``/``ModelBuildError`` (from farm.core.modelref) when the
    model cannot be built, ``GraphBreakError`` or ``DynamicDimError`` when its graph
    cannot be captured whole, and ``CaptureError`` for anything else Dynamo
    rejects (e.g. the model fails on inputs of the given shapes).
    """
    import torch._dynamo  # deferred: importing Dynamo costs about a second

    if spec.options.parallel is not None and build_mesh() is None:
        # As the compile stage builds it: rank 0 of a fake group (farm.core.parallel).
        with fake_group(spec.options.parallel, "cpu"):
            return trace(spec, regions=regions)
    start = time.perf_counter()
    model = build_module(spec.model, device="meta")
    if spec.options.parallel is not None:
        model = parallelize(model, spec.options.parallel, build_mesh())
    # A function's captured module (external_data) has real weights: Dynamo
    # fakes the inputs on their device, as meta inputs would mismatch them.
    ext_device = external_device(external_objects(spec.model, model))
    inputs = example_inputs(spec.inputs, device=ext_device or "meta")
    if spec.options.parallel is not None:
        inputs = replicate(inputs, build_mesh())
    tensors: list[tuple[str, str, torch.Tensor]] = []
    if isinstance(model, nn.Module):
        apply_grad_mode(model, spec.grad_mode)
        tensors = list(iter_named_tensors(model))
        check_value_ranges(spec.inputs, embedding_size(model))

    try:
        gm, capture = _capture_with_fallback(model, inputs, spec, regions=regions)
        analysis = _analyse(gm)
        ghash = fp.graph_hash(gm)
    except CaptureError as exc:
        if spec.model.kind == "function" and "at least two devices, meta and" in exc.reason:
            # The function uses an object with real tensors (a module-level
            # nn.Module) that the job did not declare.
            raise type(exc)(
                f"{exc.reason} (the function captures tensors of its own, e.g. a module-level "
                "nn.Module: declare it with external_data, e.g. --external-data NAME, and "
                "the node supplies it at load)", location=exc.location, detail=exc.detail,
            ) from exc
        raise
    finally:
        torch.compiler.reset()
    returns = _return_structure(model, inputs, spec)

    params = [t for kind, _, t in tensors if kind == "param"]
    buffers = [t for kind, _, t in tensors if kind == "buffer"]
    return TraceReport(
        fingerprint=fp.fingerprint(
            graph=ghash,
            tensors=fp.tensor_lines(tensors),
            inputs=spec.inputs,
            grad_mode=spec.grad_mode,
            options=spec.options,
            entrypoint=spec.model.identity,
            code_digest=spec.code_digest,
            model_class=model_class_name(model),
            returns=returns,
            external_data=spec.model.external_data,
        ),
        graph_hash=ghash,
        param_count=sum(p.numel() for p in params),
        param_bytes=sum(p.numel() * p.element_size() for p in params),
        buffer_count=sum(b.numel() for b in buffers),
        buffer_bytes=sum(b.numel() * b.element_size() for b in buffers),
        flops=analysis.flops,
        graph_nodes=analysis.nodes,
        ops=dict(analysis.ops.most_common(TOP_OPS)),
        trace_s=round(time.perf_counter() - start, 3),
        capture=capture,
        regions=analysis.region_calls,
        example_shapes=[list(s.shape) for s in spec.inputs],
        model_class=model_class_name(model),
        returns=returns,
    )


def _return_structure(
    model: nn.Module | Callable[..., Any], inputs: list[torch.Tensor], spec: JobSpec
) -> str:
    """What the program returns, by type (``fingerprint.return_structure``).

    Dynamo's graph has only the output tensors, so the program is run once,
    eagerly on the meta inputs (shapes only: no memory, no arithmetic; a
    70B-shaped model runs in well under a second). A program that cannot run
    on meta eagerly gets a structure naming why: its key then still covers
    the graph and the code, not the return type.
    """
    try:
        args, kwargs = call_args(spec.inputs, inputs)
        with grad_context(spec.grad_mode):
            out = model(*args, **kwargs)
        return fp.return_structure(out)
    except Exception as exc:
        log.info("could not run %s on meta to see what it returns: %s: %s",
                 spec.model.entrypoint, type(exc).__name__, exc)
        return f"unknown ({type(exc).__name__})"


# --------------------------------------------------------------------------- #
# capture
# --------------------------------------------------------------------------- #


class _Captured(Exception):
    """Raised by the compiled function instead of running it."""


def _capture_with_fallback(
    model: nn.Module | Callable[..., Any],
    inputs: list[torch.Tensor],
    spec: JobSpec,
    *,
    regions: bool,
) -> tuple[torch.fx.GraphModule, str]:
    if regions and isinstance(model, nn.Module):
        swapped = _install_regions(model)
        if swapped:
            try:
                return _capture(model, inputs, spec), "dynamo+regions"
            except Exception as exc:
                # Regions are an optimisation only; plain Dynamo gives the verdict
                # (and the error text) the compile stage will see.
                log.info("capture with compile regions failed (%s); retrying without",
                         type(exc).__name__)
                torch.compiler.reset()
            finally:
                _remove_regions(swapped)
    return _capture(model, inputs, spec), "dynamo"


def _capture(
    model: nn.Module | Callable[..., Any], inputs: list[torch.Tensor], spec: JobSpec
) -> torch.fx.GraphModule:
    # Guards are only worth building when a dim is marked dynamic: that is where a
    # specialised dim surfaces (ConstraintViolationError). Otherwise stop Dynamo in
    # the backend and skip guard building, a tenth of a 70B trace.
    need_guards = any(s.dynamic_dims for s in spec.inputs)
    for attempt in (1, 2):
        graphs: list[torch.fx.GraphModule] = []
        backend = _capturing_backend(graphs, need_guards=need_guards)
        compiled = torch.compile(model, fullgraph=True, backend=backend)
        args, kwargs = call_args(spec.inputs, inputs)
        try:
            with grad_context(spec.grad_mode):
                compiled(*args, **kwargs)
        except Exception as exc:
            if not _is_captured(exc):
                raise _to_capture_error(exc) from exc
        if graphs:
            return graphs[-1]
        # A cache entry from an earlier compile of the same code answered the call
        # (or the recompile limit sent it to eager): start clean and try again.
        log.debug("dynamo did not call the backend (attempt %d); resetting", attempt)
        torch.compiler.reset()
    raise CaptureError("Dynamo never called the capturing backend", location=None)


def _capturing_backend(
    graphs: list[torch.fx.GraphModule], *, need_guards: bool
) -> Callable[..., Any]:
    def backend(gm: torch.fx.GraphModule, example: list[Any]) -> Callable[..., Any]:
        graphs.append(gm)
        if not need_guards:
            raise _Captured

        def refuse(*args: Any) -> Any:
            raise _Captured

        return refuse

    return backend


def _is_captured(exc: BaseException | None) -> bool:
    # Dynamo wraps a backend's exception in BackendCompilerFailed.
    seen = 0
    while exc is not None and seen < 8:
        inner = getattr(exc, "inner_exception", None)
        if isinstance(exc, _Captured) or isinstance(inner, _Captured):
            return True
        exc = exc.__cause__
        seen += 1
    return False


def _to_capture_error(exc: Exception) -> Exception:
    import torch._dynamo.exc as dexc
    from torch.fx.experimental.symbolic_shapes import ConstraintViolationError

    detail = str(exc)
    location = _user_location(exc)
    if isinstance(exc, ConstraintViolationError) or isinstance(
        exc.__cause__, ConstraintViolationError
    ):
        # torch lists one "- You marked ... but your code specialized it" per dim.
        bullets = [ln.strip()[2:] for ln in detail.splitlines() if ln.strip().startswith("- ")]
        reason = "; ".join(bullets) or _reason(detail)
        return DynamicDimError(reason, location=location, detail=detail)
    if isinstance(exc, dexc.Unsupported) or (
        # Control flow on a captured scalar (``if x.item() > 0``) is a UserError:
        # a graph break under another name.
        isinstance(exc, dexc.UserError) and "data-dependent" in detail
    ):
        return GraphBreakError(_reason(detail), location=location, detail=detail)
    if isinstance(exc, dexc.TorchDynamoException):
        return CaptureError(_reason(detail), location=location, detail=detail)
    # An exception the user's forward raised while being traced.
    return CaptureError(
        f"{type(exc).__name__}: {_reason(detail)}",
        location=location,
        detail=traceback.format_exc(),
    )


def _reason(message: str) -> str:
    """torch's headline plus its Explanation line, when it gives one."""
    lines = [ln.strip() for ln in message.strip().splitlines()]
    head = next((ln for ln in lines if ln), "unknown error")
    explanation = next(
        (ln.removeprefix("Explanation:").strip() for ln in lines if ln.startswith("Explanation:")),
        "",
    )
    return f"{head}: {explanation}" if explanation else head


def _user_location(exc: BaseException) -> str | None:
    """The innermost frame of user code (not torch's) where Dynamo gave up."""
    frames: list[tuple[str, int | None]] = []
    for e in (exc, exc.__cause__):
        stack = getattr(e, "real_stack", None)
        if stack:
            frames = [(f.filename, f.lineno) for f in stack]
            break
    if not frames:
        frames = [
            (m.group(1), int(m.group(2)))
            for m in re.finditer(r'File "([^"]+)", line (\d+)', str(exc))
        ]
    if not frames:
        return None
    user = [f for f in frames if not f[0].startswith(_TORCH_DIR)]
    filename, lineno = (user or frames)[-1]
    return f"{filename}:{lineno}"


# --------------------------------------------------------------------------- #
# compile regions for repeated blocks
# --------------------------------------------------------------------------- #

_region_classes: dict[type, type] = {}


def _install_regions(model: nn.Module) -> list[tuple[nn.Module, type]]:
    """Swap each repeated block's class for a subclass whose forward is a nested
    compile region; returns (module, original class) to undo it.

    Per-instance, not by patching the user's class: a class-level patch would leak
    into every other user of the class in this process. (Binding a region to an
    instance's ``forward`` attribute instead made Dynamo 2.13 reuse layer 0's
    parameters for every layer, so the subclass it is.)
    """
    region = getattr(torch.compiler, "nested_compile_region", None)
    if region is None:  # older torch: no regions, plain capture
        return []
    swapped: list[tuple[nn.Module, type]] = []
    for _name, child in repeated_blocks(model):
        cls = type(child)
        sub = _region_classes.get(cls)
        if sub is None:
            metaclass: Any = type(cls)  # nn.Module subclasses may bring their own
            sub = metaclass(
                cls.__name__,
                (cls,),
                {
                    "forward": region(cls.forward),
                    "__module__": cls.__module__,
                    "__qualname__": cls.__qualname__,
                },
            )
            _region_classes[cls] = sub
        child.__class__ = sub
        swapped.append((child, cls))
    return swapped


def _remove_regions(swapped: list[tuple[nn.Module, type]]) -> None:
    for module, cls in swapped:
        module.__class__ = cls

