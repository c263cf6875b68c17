"""Import a job's model entrypoint and build the model without its weights.

Every stage builds the same way so that what was traced is what gets compiled:

- ``build_module(ref, device="meta")``: the factory runs under the meta device, so
  a 70B model costs no memory and no init time (trace stage).
- ``build_module(ref, device="cuda")`` (or ``materialize(module, device)``): meta,
  then ``to_empty()`` and a seeded random init (compile workers and verifiers).
  A module built under FakeTensorMode failed its guards ("expected tensor, found
  Parameter") and once segfaulted at load; meta + ``to_empty()`` gives real
  Parameters, which is what the fleet node calls the artifact with.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from farm.core.aliases import to_empty_keeping_aliases
from farm.core.inputs import TensorSpec
from farm.core.specs import GradMode, ModelRef

log = logging.getLogger(__name__)

DEFAULT_SEED = 0
# Parameters that no reset_parameters() covers get N(0, 0.02), the usual transformer
# init: small enough that deep stacks of random layers stay finite in bf16.
FALLBACK_STD = 0.02


class ModelError(Exception):
    """The user's model could not be imported or built. ``traceback_text`` holds the
    original traceback so a build record can show where the user's code failed."""

    def __init__(self, message: str, *, traceback_text: str = "") -> None:
        super().__init__(message)
        self.traceback_text = traceback_text

    def __str__(self) -> str:
        base = super().__str__()
        return f"{base}\n\n{self.traceback_text}" if self.traceback_text else base

    def __reduce__(self) -> Any:
        # Keyword-only fields survive pickling (a process pool, a task result).
        return (_rebuild, (type(self), self.args[0] if self.args else "", dict(self.__dict__)))


def _rebuild(cls: type[ModelError], message: str, state: dict[str, Any]) -> ModelError:
    err = cls.__new__(cls)
    Exception.__init__(err, message)
    err.__dict__.update(state)
    return err


class ModelImportError(ModelError):
    def __init__(
        self, message: str, *, module: str, attribute: str, traceback_text: str = ""
    ) -> None:
        super().__init__(message, traceback_text=traceback_text)
        self.module = module
        self.attribute = attribute


class ModelBuildError(ModelError):
    """The factory raised, or returned something that is not a module."""


def load_callable(entrypoint: str) -> Callable[..., Any]:
    """``'pkg.mod:attr.sub'`` -> the callable it names."""
    module_name, sep, attr_path = entrypoint.partition(":")

    def refused(message: str, traceback_text: str = "") -> ModelImportError:
        return ModelImportError(message, module=module_name, attribute=attr_path,
                                traceback_text=traceback_text)

    if not sep or not module_name or not attr_path:
        raise refused(f"bad entrypoint {entrypoint!r}: expected 'package.module:callable'")
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as exc:  # the user's module body can raise anything
        raise refused(f"cannot import module {module_name!r} of entrypoint {entrypoint!r}: "
                      f"{type(exc).__name__}: {exc}", traceback.format_exc()) from exc
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError as exc:
            raise refused(f"module {module_name!r} has no attribute {attr_path!r} "
                          f"(entrypoint {entrypoint!r})", traceback.format_exc()) from exc
    if not callable(obj):
        raise refused(f"{entrypoint!r} is a {type(obj).__name__}, not a callable")
    return obj


def check_kwargs(fn: Callable[..., Any], model: ModelRef) -> None:
    """Fail before the factory runs when its signature cannot take the job's
    kwargs: a typo'd kwarg then fails the trace in seconds, saying what the
    factory takes, instead of whatever the factory does with ``**kwargs``."""
    import inspect

    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin or C callable: let the call decide
        return
    try:
        sig.bind(**dict(model.kwargs))
    except TypeError as exc:
        raise ModelBuildError(
            f"model factory {model.entrypoint!r} cannot take kwargs "
            f"{dict(model.kwargs)!r}: {exc}; its signature is {fn.__name__}{sig}"
        ) from None


def model_class_name(obj: Any) -> str:
    """``module.qualname`` of what a factory built (its class) or of a free
    function: what an artifact records it was built from, and what a node
    compares with its own object before loading."""
    from farm.core.training import LossStep

    if isinstance(obj, LossStep):
        # A training step is for its model's class (and the fingerprint names
        # its loss and optimizer): a node's wrapper of another model mismatches.
        return f"{model_class_name(obj.model)}+loss"
    target = obj if callable(obj) and not isinstance(obj, nn.Module) else type(obj)
    module = getattr(target, "__module__", None) or "?"
    qual = getattr(target, "__qualname__", None) or getattr(target, "__name__", "?")
    return f"{module}.{qual}"


def build_module(
    model: ModelRef, *, device: str | torch.device = "meta", seed: int = DEFAULT_SEED
) -> nn.Module | Callable[..., Any]:
    """Build the model weight-free on meta; for any other device, materialise it
    there with seeded random values. A ``kind='function'`` ref is returned as is."""
    fn = load_callable(model.entrypoint)
    if model.kind == "function":
        return fn
    check_kwargs(fn, model)
    built = _as_program(model, _run_factory(fn, model, torch.device("meta")))
    if torch.device(device).type != "meta":
        materialize(built, device, seed=seed)
    return built


def _as_program(model: ModelRef, built: nn.Module) -> nn.Module:
    """What the job compiles from the factory's module: the module itself,
    or for a ``training_step`` its loss step (``farm.core.training.LossStep``)."""
    if model.train is None:
        return built
    from farm.core.training import loss_step

    return loss_step(built, model.train)


def build_real(
    model: ModelRef, *, device: str | torch.device, seed: int = DEFAULT_SEED
) -> nn.Module | Callable[..., Any]:
    """Build the model for real on ``device``: the factory runs there, under a
    seeded RNG, so every parameter gets the factory's own init and every
    buffer what ``__init__`` computes (a Llama's RoPE ``inv_freq``), where
    ``materialize`` can only zero the buffers no ``reset_parameters`` covers.
    What a verifier should check an artifact against. A ``kind='function'``
    ref is returned as is."""
    fn = load_callable(model.entrypoint)
    if model.kind == "function":
        return fn
    check_kwargs(fn, model)
    device = torch.device(device)
    accel = device.type not in ("cpu", "meta")
    with torch.random.fork_rng(
        devices=[device.index or 0] if accel else [],
        device_type=device.type if accel else "cpu",
    ):
        torch.manual_seed(seed)
        return _as_program(model, _run_factory(fn, model, device))


def _run_factory(fn: Callable[..., Any], model: ModelRef, device: torch.device) -> nn.Module:
    """The factory's module, built with ``device`` as the default device; what
    it raises, or a non-module it returns, is a ModelBuildError naming it."""
    try:
        with device:
            built = fn(**dict(model.kwargs))
    except Exception as exc:
        raise ModelBuildError(
            f"model factory {model.entrypoint!r} raised {type(exc).__name__}: {exc}",
            traceback_text=traceback.format_exc(),
        ) from exc
    if not isinstance(built, nn.Module):
        raise ModelBuildError(
            f"model factory {model.entrypoint!r} returned {type(built).__name__}, "
            "expected a torch.nn.Module (use kind='function' for a free function)"
        )
    return built


def external_objects(model: ModelRef, fn: Any) -> dict[str, Any]:
    """The objects a function job declares as ``external_data``: its module's
    globals of those names (what a build saves references to, and what a
    verifier, like a node, supplies at load)."""
    if not model.external_data:
        return {}
    found = getattr(fn, "__globals__", None) or {}
    missing = [n for n in model.external_data if n not in found]
    if missing:
        raise ModelBuildError(
            f"external_data {missing} are not globals of {model.entrypoint.partition(':')[0]!r}"
            f" (it has {sorted(k for k in found if not k.startswith('_'))[:20]}); name the "
            "module-level objects the function uses")
    return {n: found[n] for n in model.external_data}


def external_device(objects: dict[str, Any]) -> torch.device | None:
    """The device of the external objects' tensors (a captured module's
    weights): a trace must fake its inputs there, not on meta."""
    for obj in objects.values():
        if isinstance(obj, nn.Module):
            for t in (*obj.parameters(), *obj.buffers()):
                return t.device
        elif isinstance(obj, torch.Tensor):
            return obj.device
    return None


def embedding_size(module: Any) -> tuple[str, int] | None:
    """(name, num_embeddings) of the module's first ``nn.Embedding``: the range
    of token ids an integer input without a declared range is drawn from."""
    if not isinstance(module, nn.Module):
        return None
    for name, sub in module.named_modules():
        if isinstance(sub, nn.Embedding):
            return name, int(sub.num_embeddings)
    return None


def check_value_ranges(specs: Sequence[TensorSpec], embed: tuple[str, int] | None) -> None:
    """A declared value range the model's embedding cannot index fails here
    (at trace, in seconds), with words, instead of as an index error inside
    eager at verification, minutes later."""
    # With several inputs an integer one need not be token ids (positions,
    # lengths): only a lone input, or one named input_ids (the transformers
    # convention), is known to index the embedding.
    if embed is None:
        return
    tokens = [s for s in specs if s.path[-1:] == ("input_ids",)]
    for s in tokens or (specs if len(specs) == 1 else ()):
        if s.values is not None and (s.values[1] >= embed[1] or s.values[0] < 0):
            raise ModelBuildError(
                f"input {s} declares values {s.values[0]}..{s.values[1]}, but the model's "
                f"nn.Embedding {embed[0]!r} has {embed[1]} entries (ids 0..{embed[1] - 1}); "
                f"the range is inclusive: declare {{0..{embed[1] - 1}}}")


def materialize(
    module: nn.Module, device: str | torch.device, *, seed: int = DEFAULT_SEED
) -> nn.Module:
    """Give a meta-built module real, deterministic storage on ``device``.

    ``to_empty()`` keeps Parameters as Parameters (compiled guards check the type)
    but leaves memory uninitialised, so every tensor is then written: modules with
    ``reset_parameters()`` (Linear, Embedding, norms) init themselves, everything
    else gets N(0, 0.02) for float parameters and zeros for buffers. The same seed
    gives the same values in every process, so a verifier can rebuild the model a
    compile worker used.
    """
    device = torch.device(device)
    # Tied weights stay one tensor, as in the module a node loads.
    to_empty_keeping_aliases(module, device)
    # Fork only the RNG of the device we write to: forking every GPU is slow and
    # the caller's RNG stream is left as it was.
    accel = device.type not in ("cpu", "meta")
    rng_devices = [device.index or 0] if accel else []
    covered: set[int] = set()
    with torch.random.fork_rng(
        devices=rng_devices, device_type=device.type if accel else "cpu"
    ), torch.no_grad():
        torch.manual_seed(seed)
        for sub in module.modules():
            reset = getattr(sub, "reset_parameters", None)
            if not callable(reset):
                continue
            try:
                reset()
            except Exception:  # a custom reset_parameters with required args, say
                log.debug("reset_parameters of %s failed; using fallback init",
                          type(sub).__name__, exc_info=True)
                continue
            covered.update(id(t) for t in sub.parameters(recurse=False))
            covered.update(id(t) for t in sub.buffers(recurse=False))
        for p in module.parameters():
            if id(p) in covered:
                continue
            if p.is_floating_point() or p.is_complex():
                p.normal_(0.0, FALLBACK_STD)
            else:
                p.zero_()
        for b in module.buffers():
            if id(b) not in covered:
                # Garbage (possibly NaN) would make eager-vs-compiled checks meaningless.
                b.zero_()
    return module


def apply_grad_mode(module: nn.Module, grad_mode: GradMode) -> None:
    """train()/eval() to match the artifact's grad mode: dynamo guards on the
    ``training`` flag, so trace, compile and the fleet must all agree."""
    module.train(grad_mode is GradMode.TRAINING)


def grad_context(grad_mode: GradMode) -> contextlib.AbstractContextManager[Any]:
    """The autograd state an artifact is compiled and called under (guards pin it)."""
    return torch.enable_grad() if grad_mode is GradMode.TRAINING else torch.no_grad()


def example_inputs(
    specs: Sequence[TensorSpec],
    *,
    device: str | torch.device = "meta",
    seed: int = DEFAULT_SEED,
    mark_dynamic: bool = True,
    int_high: int | None = None,
) -> list[torch.Tensor]:
    """One tensor per spec at its example shape, with dynamic dims marked.

    Integer inputs are drawn from the spec's declared value range
    (``int64[1,16]{0..50256}``), else from ``0..int_high-1`` when the caller
    gives ``int_high`` (a model's embedding size), else zeros (a valid index
    for any embedding table); float inputs are seeded normal values; on meta
    nothing is written at all.
    """
    device = torch.device(device)
    out: list[torch.Tensor] = []
    gen = None if device.type == "meta" else torch.Generator(device=device).manual_seed(seed)
    for spec in specs:
        dtype = getattr(torch, spec.dtype)
        if gen is None:
            t = torch.empty(spec.shape, dtype=dtype, device=device)
        elif dtype.is_floating_point:
            t = torch.randn(spec.shape, dtype=dtype, device=device, generator=gen)
        elif dtype == torch.bool:
            t = torch.randint(0, 2, spec.shape, device=device, generator=gen).bool()
        elif spec.values is not None:
            t = torch.randint(spec.values[0], spec.values[1] + 1, spec.shape, dtype=dtype,
                              device=device, generator=gen)
        elif int_high is not None and int_high > 0:
            t = torch.randint(0, int_high, spec.shape, dtype=dtype, device=device,
                              generator=gen)
        else:
            t = torch.zeros(spec.shape, dtype=dtype, device=device)
        if mark_dynamic:
            mark_dynamic_dims(t, spec)
        out.append(t)
    return out


def mark_dynamic_dims(t: torch.Tensor, spec: TensorSpec) -> None:
    """``mark_dynamic`` with the spec's range: one artifact for every size in it,
    and a compile error (not a silent specialisation) if the model pins the size."""
    import torch._dynamo  # deferred: importing dynamo costs about a second

    for i in spec.dynamic_dims:
        dim = spec.dims[i]
        torch._dynamo.mark_dynamic(t, i, min=dim.lo, max=dim.hi)


def iter_named_tensors(module: nn.Module) -> Iterator[tuple[str, str, torch.Tensor]]:
    """(kind, name, tensor) for every parameter and buffer, shared ones once."""
    for name, p in module.named_parameters():
        yield "param", name, p
    for name, b in module.named_buffers():
        yield "buffer", name, b
