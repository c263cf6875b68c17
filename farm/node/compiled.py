"""Run a module on the farm's artifact, or on JIT with the reason when there is none.

One call makes a module run on the farm's artifact for its inputs::

    import farm.node

    fn = farm.node.compiled(model, model="llama-1b", ref="prod",
                              example_inputs=["bfloat16[8,512]"])
    out = fn(x)          # the artifact, or JIT torch.compile if the farm had none

A node that loads weights anyway can start the farm's part first and let the
two overlap (the load path, see ``prefetch_compiled``)::

    handle = farm.node.prefetch_compiled(model="llama-1b", ref="prod",
                                           example_inputs=["bfloat16[8,512]"],
                                           device="cuda", grad_mode="inference")
    model = build_model().cuda(); model.load_state_dict(torch.load(...))
    fn = handle.bind(model)

Trust (what is checked before anything is loaded) is ``farm.node.trust``'s.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import sys
import threading
import time
import types
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from farm.core.inputs import TensorSpec
from farm.core.specs import GradMode, SpecError
from farm.core.target import Target, TargetError
from farm.core.text import first_line
from farm.node.arguments import as_grad_mode, as_input_specs, as_target, module_tensors
from farm.node.client import FarmClient
from farm.node.errors import (
    FarmError,
    FarmUnavailable,
    IntegrityError,
    NotFoundError,
    format_rejections,
)

log = logging.getLogger(__name__)

_GUARD_FAILURE = "GuardManager check failed"


# torch._inductor alone). Names that a torch version lacks are skipped.
_WARM_MODULES = (
    "torch._dynamo",
    "torch._inductor.compile_fx",
    "torch._inductor.codecache",
    "torch._functorch.aot_autograd",
    "torch._dynamo.aot_compile",
    "torch._inductor.codegen.memory_planning",
    "torch._inductor.hooks",
    "torch.utils.cpp_extension",
    # Every module Inductor writes imports it (extern_kernels), and with it
    # lowering and decompositions: 0.5 s of a CPU load, else run in bind().
    "torch._inductor.select_algorithm",
)


# Formats whose loading imports _WARM_MODULES. An AOTI package needs none of
# them (its kernels are in a shared library); importing them anyway would take
# the GIL from the node's own start for seconds (measured on the H200: the
# model build beside them went from 2.0 to 3.4 s).
_FORMATS_NEEDING_WARM_IMPORTS = frozenset({"aot_compile"})


def warm_imports() -> float:
    """Import what loading an artifact needs; returns the seconds it took."""
    import importlib

    t0 = time.perf_counter()
    for name in _WARM_MODULES:
        try:
            importlib.import_module(name)
        except Exception as exc:  # a module this torch does not have
            log.debug("warm import of %s skipped: %s", name, exc)
    return time.perf_counter() - t0


@dataclass(frozen=True)
class Prefetched:
    """A verified artifact in the local cache, ready to load."""

    model: str
    ref: str | None
    version: str | None
    inputs: tuple[TensorSpec, ...]
    grad_mode: GradMode
    target: Target
    artifact: dict[str, Any]
    path: Path
    timings: dict[str, float]
    # The farm could not be reached: the resolve answer came from this node's cache.
    offline: bool = False
    # What verified (farm.node.verify.Verified).
    verified: Any = None

    @property
    def format(self) -> str:
        return str(self.artifact["format"])

    @property
    def digest(self) -> str:
        return str(self.artifact["digest"])


class CompiledHandle:
    """The farm's side of loading a model, running in the background.

    ``result()`` waits for the resolve, download and verification and returns
    a ``Prefetched`` (or raises the ``FarmError`` that stopped it);
    ``bind(module)`` loads the artifact for ``module`` and returns the callable,
    falling back to JIT ``torch.compile`` if anything failed.
    """

    def __init__(self, *, model: str, ref: str | None, inputs: tuple[TensorSpec, ...],
                 grad_mode: GradMode, target: Target | str | None, device: str | None,
                 client: FarmClient | None, overlap: bool, warm: bool,
                 formats: Sequence[str] | None = None) -> None:
        self.model = model
        self.ref = ref
        self.inputs = inputs
        self.grad_mode = grad_mode
        self._target_arg = target
        self._device = device
        self._client = client
        self._formats = tuple(formats) if formats is not None else None
        self._warm_wanted = warm and overlap
        self._future: concurrent.futures.Future[Prefetched] = concurrent.futures.Future()
        self._import_thread: threading.Thread | None = None
        self.timings: dict[str, float] = {}
        self.target: Target | None = None
        if overlap:
            threading.Thread(target=self._run, name="farm-prefetch", daemon=True).start()
        else:
            self._run()

    @property
    def client(self) -> FarmClient:
        if self._client is None:
            self._client = default_client()
        return self._client

    def _warm(self) -> None:
        self.timings["warm_imports_s"] = warm_imports()

    def _run(self) -> None:
        if not self._future.set_running_or_notify_cancel():
            return
        try:
            self._future.set_result(self._prefetch())
        except BaseException as exc:
            self._future.set_exception(exc)

    def _start_warm_imports(self) -> None:
        if self._import_thread is None:
            # Beside the download and verification, which wait on the network
            # and hashlib (both release the GIL).
            self._import_thread = threading.Thread(target=self._warm, name="farm-warm-imports",
                                                   daemon=True)
            self._import_thread.start()

    def _prefetch(self) -> Prefetched:
        if self._warm_wanted and self.grad_mode is GradMode.TRAINING and (
                self._formats is None or set(self._formats) & _FORMATS_NEEDING_WARM_IMPORTS):
            # A training artifact is an aot_compile one (AOTI packages are
            # inference only): its imports can start before the farm answers,
            # and they are the longest part of its load.
            self._start_warm_imports()
        t0 = time.perf_counter()
        try:
            target = as_target(self._target_arg, self._device)
        except TargetError as exc:
            raise FarmError(f"cannot describe this node as a target: {exc}") from None
        self.target = target
        t1 = time.perf_counter()
        # offline: with the farm unreachable, the answer this node kept from
        # an earlier resolve (``farm prefetch``), checked as a fresh one is.
        resolved = self.client.resolve(self.model, self.ref, self.inputs, self.grad_mode, target,
                                       formats=self._formats, offline=True)
        t2 = time.perf_counter()
        fmt = resolved["artifact"].get("format")
        if self._warm_wanted and fmt in _FORMATS_NEEDING_WARM_IMPORTS:
            self._start_warm_imports()
        path, verified = self.client.fetch_verified(resolved)
        t3 = time.perf_counter()
        self.timings.update(target_s=t1 - t0, resolve_s=t2 - t1, fetch_verify_s=t3 - t2)
        return Prefetched(model=self.model, ref=self.ref, version=resolved.get("version"),
                          inputs=self.inputs, grad_mode=self.grad_mode, target=target,
                          artifact=dict(resolved["artifact"]), path=path, timings=self.timings,
                          verified=verified, offline=bool(resolved.get("offline")))

    def done(self) -> bool:
        return self._future.done()

    def result(self, timeout: float | None = None) -> Prefetched:
        return self._future.result(timeout)

    def bind(self, module_or_fn: Any, *, fallback: bool = True,
             timeout: float | None = None, cuda_graphs: bool = False) -> Callable[..., Any]:
        """The callable that runs ``module_or_fn`` on the farm's artifact.

        With ``fallback`` (the default) any failure (no artifact, a download,
        signature or load error) logs why and returns JIT
        ``torch.compile(module_or_fn, fullgraph=True)`` instead; without it,
        the error is raised (a miss with every candidate's rejection reason).

        An inference artifact runs the module as it was built: in ``eval()``
        (a module still in training mode is switched, with a log line) and
        under ``torch.no_grad()``, so a caller in torch's default grad mode
        gets the artifact rather than a guard failure.

        ``cuda_graphs``: replay each call on a CUDA node from CUDA graphs
        of its shapes (``farm.node.cuda_graphs``), recorded at the shape's
        first call: one launch a call instead of the host's work per kernel
        and per block (a training artifact's call: its forward, then its
        backward). ``.cuda_graphs`` of the result says
        how many it holds and why any call ran without one.
        """
        try:
            pre = self.result(timeout)
        except Exception as exc:
            # Any failure of the farm's side (a miss, the network, a bad
            # answer, a full disk) is a reason to run JIT, never to crash.
            if not fallback:
                if isinstance(exc, NotFoundError) and exc.rejections:
                    raise NotFoundError(
                        f"{exc}; each candidate and why:\n{format_rejections(exc.rejections)}",
                        status=exc.status, detail=exc.detail, rejections=exc.rejections,
                    ) from exc
                raise
            self._explain(exc)
            return FarmCompiled(None, module_or_fn, prefetched=None, reason=first_line(exc))
        if self._import_thread is not None:
            # Loading would import the same modules: wait for ours rather
            # than contend with it on import locks.
            self._import_thread.join()
        mismatch = class_mismatch(pre.artifact, module_or_fn,
                                  signed=pre.verified.build if pre.verified is not None else None)
        if mismatch is not None:
            # Loading it would run another class's program on this object (or
            # fail its type guard on every call): JIT, and say why.
            if not fallback:
                raise FarmError(mismatch)
            log.warning("torch-farm: %s; using JIT torch.compile instead", mismatch)
            self._report("fallback", pre, code="class_mismatch", reason=mismatch)
            return FarmCompiled(None, module_or_fn, prefetched=pre, reason=mismatch)
        if pre.grad_mode is GradMode.INFERENCE and getattr(module_or_fn, "training", False):
            # Dynamo guards on the training flag, and the farm built (and
            # verified) the inference artifact in eval mode.
            log.info("torch-farm: %s is in training mode; switching it to eval() for its "
                     "inference artifact (pass grad_mode='training' for a training one)",
                     type(module_or_fn).__name__)
            module_or_fn.eval()
        t0 = time.perf_counter()
        from farm.node.weight_check import MANIFEST_KEY, WeightsMismatch

        try:
            from farm.node.loader import load_artifact

            fn = load_artifact(pre.path, pre.format, module=module_or_fn,
                               attestation=pre.verified, trust_unverified=pre.verified is None,
                               disable_guard_check=bool((pre.artifact.get("options") or {})
                                                        .get("disable_guard_check")),
                               weights_manifest=(pre.artifact.get("meta") or {}).get(MANIFEST_KEY))
        except Exception as exc:
            if not fallback:
                raise
            what = f"artifact {pre.digest[:12]} ({pre.format})"
            # The farm's own check of the weights (a fake-weight build has no
            # guards on them) refuses before anything is loaded.
            refused = isinstance(exc, WeightsMismatch)
            reason = (f"{what} refused: {first_line(exc)}" if refused
                      else f"loading {what} failed: {first_line(exc)}")
            log.warning("torch-farm: %s; using JIT torch.compile instead", reason)
            self._report("fallback", pre, code="weights_mismatch" if refused else "load_failed",
                         reason=reason)
            return FarmCompiled(None, module_or_fn, prefetched=pre, reason=reason)
        self.timings["load_s"] = time.perf_counter() - t0
        self._report("load", pre, seconds=self.timings["load_s"],
                     code="offline" if pre.offline else None)
        log.info("torch-farm: %s@%s runs artifact %s (%s) for %s%s", self.model,
                 pre.version, pre.digest[:12], pre.format, pre.target,
                 " (offline: from this node's cache)" if pre.offline else "")
        # Served: the reason names what runs, so a log line tells which artifact.
        offline = ", offline: from this node's cache" if pre.offline else ""
        served = (f"farm artifact {pre.digest[:12]} ({pre.format}) of {self.model}@{pre.version} "
                  f"for {pre.target}{offline}")
        graphs = _with_cuda_graphs(fn, module_or_fn, pre) if cuda_graphs else None
        return FarmCompiled(graphs or fn, module_or_fn, prefetched=pre, reason=served,
                            on_guard_failure=functools.partial(self._guard_failed, pre),
                            cuda_graphs=graphs)

    def _report(self, kind: str, pre: Prefetched | None, *, inputs: Any = None,
                code: str | None = None, reason: str | None = None,
                seconds: float | None = None, version: str | None = None) -> None:
        """Queue a node report (farm.node.reports): never waits, never raises."""
        target = pre.target if pre is not None else self.target
        if target is None:
            return  # nothing to say which target the node is
        self.client.report(kind, model=self.model, ref=self.ref,
                           inputs=inputs if inputs is not None else self.inputs,
                           grad_mode=self.grad_mode, target=target,
                           version=pre.version if pre is not None else version,
                           format=pre.format if pre is not None else None,
                           digest=pre.digest if pre is not None else None,
                           code=code, reason=reason, seconds=seconds)

    def _guard_failed(self, pre: Prefetched, reason: str, args: tuple[Any, ...]) -> None:
        # The call's own inputs, when they are tensors: the shape the fleet
        # needs and no artifact has (what build on miss builds).
        try:
            inputs: Any = as_input_specs(list(args))
        except Exception:
            inputs = None
        self._report("guard_failure", pre, inputs=inputs, code="guard", reason=reason)

    def _explain(self, exc: BaseException) -> None:
        what = f"{self.model}@{self.ref or 'latest'} for {', '.join(map(str, self.inputs))} " \
               f"({self.grad_mode.value})"
        if isinstance(exc, NotFoundError):
            detail = exc.detail if isinstance(exc.detail, dict) else {}
            codes = sorted({str(r.get("code")) for r in exc.rejections if isinstance(r, dict)})
            self._report("miss", None, version=detail.get("version"),
                         code=",".join(codes)[:32] if codes else (
                             "no_artifact" if detail.get("version") else "unknown_ref"),
                         reason=first_line(exc))
            reasons = format_rejections(exc.rejections)
            log.warning("torch-farm: no artifact for %s: %s; using JIT torch.compile%s",
                        what, exc, f"\n{reasons}" if reasons else "")
            return
        log.warning("torch-farm: not using the farm for %s: %s; using JIT torch.compile",
                    what, first_line(exc))
        if isinstance(exc, FarmError) and not isinstance(exc, FarmUnavailable):
            code = "integrity" if isinstance(exc, IntegrityError) else "fetch_failed"
            self._report("fallback", None, code=code, reason=first_line(exc))


def _with_cuda_graphs(fn: Callable[..., Any], module_or_fn: Any, pre: Prefetched) -> Any:
    """``fn`` replayed from CUDA graphs, or None (logged: why not)."""
    if pre.target.device == "cuda":
        from farm.node.cuda_graphs import GraphedCalls

        return GraphedCalls(fn, module_or_fn, training=pre.grad_mode is not GradMode.INFERENCE)
    why = f"the artifact is for {pre.target.device}"
    log.warning("torch-farm: cuda_graphs=True ignored: %s; calls run on the artifact as they are",
                why)
    return None


def class_mismatch(artifact: dict[str, Any], module_or_fn: Any, *,
                   signed: Mapping[str, Any] | None = None) -> str | None:
    """Why ``artifact`` is not for ``module_or_fn``'s class (None: it is, or
    the artifact predates the record). The farm records the ``module.qualname``
    of what the factory built; a node's own copy of the code must build the
    same class, or the artifact's program is some other model's.

    ``signed``: the verified build statement's predicate. With it, only its
    signed ``model_class`` counts (the artifact row's meta is the farm's
    unsigned word); without (a node that trusts unsigned artifacts), the meta."""
    from farm.core.modelref import model_class_name

    expected = (signed.get("model_class") if signed is not None
                else (artifact.get("meta") or {}).get("model_class"))
    if not expected:
        return None
    mine = model_class_name(module_or_fn)
    if mine == expected:
        return None
    return (f"artifact {str(artifact.get('digest', ''))[:12]} was built from {expected}, and "
            f"this node's model is {mine}: import the model the way it was built (the same "
            "module and class names as the code shipped with the job)")


class FarmCompiled:
    """What ``compiled`` returns: calls the artifact, or JIT when there is none.

    ``source`` is ``"farm"`` or ``"jit"``; ``reason`` names the artifact that
    runs (``farm artifact 5a307ab4c1d2 (aoti) of M@V for TARGET``) or says why
    JIT was used.
    A call the artifact's guards reject (another grad mode, shape or dtype
    than it was built for) runs on JIT as well, rather than failing: guards
    are checked before any kernel runs, so nothing ran twice.
    ``cuda_graphs``: the ``GraphedCalls`` that replays its calls (``bind``'s
    ``cuda_graphs=True`` on a CUDA node), else None.
    """

    def __init__(self, fn: Callable[..., Any] | None, original: Any, *,
                 prefetched: Prefetched | None, reason: str | None,
                 on_guard_failure: Callable[[str, tuple[Any, ...]], None] | None = None,
                 cuda_graphs: Any = None) -> None:
        self._fn = fn
        self._original = original
        self._jit: Callable[..., Any] | None = None
        self._jit_lock = threading.Lock()
        self.prefetched = prefetched
        self.reason = reason
        self.cuda_graphs = cuda_graphs
        self._inference = prefetched is not None and prefetched.grad_mode is GradMode.INFERENCE
        self._warned_guard = False
        self._on_guard_failure = on_guard_failure
        # Distinct call signatures reported as guard failures (a few: the
        # farm needs to know a shape is asked for, not how often per node).
        self._guard_reported: set[tuple[Any, ...]] = set()
        if fn is not None:
            functools.update_wrapper(self, fn, updated=())

    @property
    def source(self) -> str:
        return "farm" if self._fn is not None else "jit"

    @property
    def artifact(self) -> dict[str, Any] | None:
        return self.prefetched.artifact if self.prefetched else None

    def jit(self) -> Callable[..., Any]:
        with self._jit_lock:
            if self._jit is None:
                import torch

                self._jit = torch.compile(self._original, fullgraph=True)
            return self._jit

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._fn is None:
            return self.jit()(*args, **kwargs)
        try:
            if self._inference:
                import torch

                # Guards pin grad mode: the artifact was built without grad.
                with torch.no_grad():
                    return self._fn(*args, **kwargs)
            return self._fn(*args, **kwargs)
        except RuntimeError as exc:
            if not str(exc).startswith(_GUARD_FAILURE):
                raise
            if not self._warned_guard:
                self._warned_guard = True
                log.warning("torch-farm: this call does not fit the artifact's guards (%s); "
                            "such calls run on JIT torch.compile", _guard_reason(exc))
            self._report_guard(exc, args)
            return self.jit()(*args, **kwargs)

    def _report_guard(self, exc: BaseException, args: tuple[Any, ...]) -> None:
        if self._on_guard_failure is None or len(self._guard_reported) >= 16:
            return
        sig = tuple((str(getattr(a, "dtype", type(a).__name__)), tuple(getattr(a, "shape", ())))
                    for a in args)
        if sig in self._guard_reported:
            return
        self._guard_reported.add(sig)
        self._on_guard_failure(_guard_reason(exc), args)

    def __repr__(self) -> str:
        if self.prefetched is not None and self._fn is not None:
            return f"<FarmCompiled farm artifact {self.prefetched.digest[:12]}>"
        return f"<FarmCompiled jit ({self.reason})>"


def _guard_reason(exc: BaseException) -> str:
    text = str(exc)
    start = text.find("verbose_code_parts=")
    if start >= 0:
        end = text.find("]", start)
        return text[start + len("verbose_code_parts="):end + 1]
    return first_line(exc)


_default_client: FarmClient | None = None
_default_lock = threading.Lock()


def default_client() -> FarmClient:
    """One client per process, configured from the environment. (Its module
    is imported with this one, on the caller's thread: imported by the
    background thread instead, beside the model build, the first result came
    0.04 s later on CPU; docs/fleet-path.md.)"""
    global _default_client
    with _default_lock:
        if _default_client is None:
            _default_client = FarmClient()
        return _default_client


def _module_device(module_or_fn: Any, example_inputs: Any) -> str | None:
    for t in module_tensors(module_or_fn):
        return str(t.device.type)
    for x in example_inputs or ():
        if hasattr(x, "device") and hasattr(x, "shape"):
            return str(x.device.type)
    return None


def prefetch_compiled(
    *,
    model: str,
    ref: str | None = None,
    example_inputs: Any,
    grad_mode: GradMode | str | bool | None = GradMode.INFERENCE,
    target: Target | str | None = "auto",
    device: str | None = None,
    client: FarmClient | None = None,
    overlap: bool = True,
    warm_imports: bool = True,
    formats: Sequence[str] | None = None,
) -> CompiledHandle:
    """Start resolving, downloading and verifying the artifact (and importing
    what loading it needs) in the background; ``.bind(module)`` later.

    ``device`` (``"cpu"``, ``"cuda"``) picks the target with ``target="auto"``;
    None means CUDA when present. ``grad_mode``: ``"inference"`` (the default,
    what ``farm submit`` builds without ``--train``), ``"training"`` (backward
    compiled ahead), or None for the grad mode in force now. ``formats`` limits the artifact
    formats this node takes (default: any, the resolver's preference).
    """
    specs = as_input_specs(example_inputs)
    mode = as_grad_mode(grad_mode)
    if device is not None and ":" in device:
        device = device.split(":", 1)[0]
    return CompiledHandle(model=model, ref=ref, inputs=specs, grad_mode=mode, target=target,
                          device=device, client=client, overlap=overlap, warm=warm_imports,
                          formats=formats)


def compiled(
    module_or_fn: Any,
    *,
    model: str,
    ref: str | None = None,
    example_inputs: Any = None,
    grad_mode: GradMode | str | bool | None = GradMode.INFERENCE,
    target: Target | str | None = "auto",
    client: FarmClient | None = None,
    fallback: bool = True,
    overlap: bool = True,
    formats: Sequence[str] | None = None,
    cuda_graphs: bool = False,
) -> Callable[..., Any]:
    """Run ``module_or_fn`` on the farm's artifact for its inputs.

    Detects this node's target (of the module's device), resolves
    (``model``, ``ref``, inputs, grad mode, target), downloads into the local
    cache, verifies digest and signature, loads, and returns the callable.
    With ``fallback`` any failure logs why (the resolver's rejection reasons
    on a miss) and returns JIT ``torch.compile(module_or_fn, fullgraph=True)``.

    ``example_inputs``: spec strings, ``TensorSpec``s or example tensors; if
    None, the first call's positional arguments are used (and the farm is
    asked then). With ``overlap`` the imports that loading needs run beside
    the resolve and download.

    Grad mode: ``"inference"`` by default, whatever ``torch.is_grad_enabled()``
    says, because that is what the farm builds unless a job asks for
    training: the module is put in ``eval()`` and every call runs under
    ``torch.no_grad()``. ``grad_mode="training"`` asks for the training
    artifact (``farm submit --train``); None takes torch's grad mode now
    (or, without ``example_inputs``, at the first call).

    ``cuda_graphs``: on a CUDA node, replay each call from CUDA graphs
    recorded at its shape's first call (``CompiledHandle.bind``).

    Offline: when the farm cannot be reached, the resolve answer this node
    kept from an earlier resolve (``farm prefetch``) is used, with the same
    signature and digest checks, and the bytes come from the node's cache.
    """
    device = _module_device(module_or_fn, example_inputs)
    if example_inputs is None:
        return _OnFirstCall(module_or_fn, model=model, ref=ref, grad_mode=grad_mode,
                            target=target, client=client, fallback=fallback, formats=formats,
                            cuda_graphs=cuda_graphs)
    try:
        handle = prefetch_compiled(model=model, ref=ref, example_inputs=example_inputs,
                                   grad_mode=grad_mode, target=target, device=device,
                                   client=client, overlap=overlap, formats=formats)
    except (SpecError, TargetError) as exc:
        if not fallback:
            raise
        log.warning("torch-farm: cannot ask the farm (%s); using JIT torch.compile", exc)
        return FarmCompiled(None, module_or_fn, prefetched=None, reason=str(exc))
    return handle.bind(module_or_fn, fallback=fallback, cuda_graphs=cuda_graphs)


class _OnFirstCall:
    """``compiled`` without example inputs: ask the farm at the first call."""

    def __init__(self, module_or_fn: Any, **kw: Any) -> None:
        self._original = module_or_fn
        self._kw = kw
        self._impl: Callable[..., Any] | None = None
        self._lock = threading.Lock()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._impl is None:
            with self._lock:
                if self._impl is None:
                    kw = dict(self._kw)
                    if kw["grad_mode"] is None:
                        kw["grad_mode"] = as_grad_mode(None)  # the mode of this call
                    self._impl = compiled(self._original, example_inputs=list(args),
                                          overlap=False, **kw)
        return self._impl(*args, **kwargs)


class _CallableModule(types.ModuleType):
    """This module, callable as ``compiled``: a program that imported
    ``farm.node.compiled`` before ``from farm.node import compiled`` gets this
    module there (the import system names the package attribute after the
    submodule), and the README's snippet must work all the same."""

    def __call__(self, module_or_fn: Any, **kw: Any) -> Callable[..., Any]:
        return compiled(module_or_fn, **kw)


sys.modules[__name__].__class__ = _CallableModule
