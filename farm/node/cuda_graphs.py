"""A node's calls replayed as CUDA graphs: one launch a call (two for a
training call: its forward, then its backward).

A small model's GPU call is launch-bound: on the H100 a 16-layer Llama at
1x64 tokens keeps the GPU busy 0.55 ms of a 4-6 ms call
(``bench/per_block_steady.py --launches``); the rest is the host's Python,
guard checks and one launch per kernel. A per-block artifact pays torch's
per-call machinery once per block on top. A CUDA graph records a whole call's
kernels once and replays them with one launch, so neither the host's work
nor the number of blocks counts on later calls.

``GraphedCalls(fn, module)`` keeps one graph per call key and replays it.
What a replay assumes, and how each assumption is kept:

- The same program for the same inputs. The key is every tensor argument's
  shape, stride, dtype and device, and every other argument's value. A key's
  first call runs the artifact as usual (``WARM_UP_CALLS`` times, its guards
  checked, so a call the artifact refuses is refused as it would be without
  graphs), then records it.
- The same torch state: the state Dynamo's guards check globally (grad mode,
  autocast, default dtype, deterministic algorithms; torch's own
  ``GlobalStateGuard``) is compared before each replay; a call under another
  state runs as usual. Calls with grad are replayed only for a training
  artifact (``training=True``), see below.
- The same weights in the same memory: the parameters' and buffers'
  addresses are compared before each replay, and a parameter, buffer or
  submodule assigned anywhere (torch's module registration hooks) makes the
  next call look again. Weights changed in place (``load_state_dict``) are
  read by the replay; weights moved, cast or replaced are recorded anew.
- Nothing read on the host inside the call. A forward that reads a tensor's
  value (``.item()``, a data-dependent shape, a print of a tensor) cannot be
  recorded: that key runs as usual, and ``reasons`` says why.
- Results the caller may keep: a replay rewrites the graph's own output
  memory, so each call returns copies of it.

Not seen by a replay: a change to the module other than its weights that its
forward reads (a flag, a Python attribute); call ``reset()`` after one.

A training call (grad enabled, ``training=True``) is recorded as two graphs
in one memory pool, as torch's ``make_graphed_callables`` does: the forward,
and the backward from its outputs to the inputs that require grad and the
module's trainable parameters. A replayed call returns outputs whose
backward replays the second graph. That graph reads the activations the
forward graph left in the pool, so two rules keep every gradient the one
the call would have had without graphs:

- A call whose key's last replay still waits for its backward (two forwards
  before one backward: a loss summed over two calls) runs as it is.
- A backward that comes after a later replay of its key overwrote its
  activations (a graph kept with ``retain_graph`` and run again later)
  raises rather than return another call's gradients.

Gradients are handed to autograd as copies, so ``.grad`` accumulated over
several steps adds each step's own. The module's ``training`` flag is part
of a training call's key. Under ``torch.autocast`` its weight cache must be
off (``cache_enabled=False``), as for torch's own graphed callables.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map_only, tree_unflatten

from farm.core.text import first_line
from farm.node.arguments import module_tensors

log = logging.getLogger(__name__)

# A key's first calls before it is recorded (torch's make_graphed_callables
# warms up 3 times): lazy initialisation (cuBLAS handles, Triton's kernel
# loads) must happen outside the capture.
WARM_UP_CALLS = 3
# Graphs kept per callable: each holds its inputs, outputs and memory pool.
MAX_GRAPHS = 8
# Keys remembered as not recordable (so their calls skip straight to the
# artifact), beyond which new ones are not remembered.
_MAX_REFUSED = 64

# Bumped by torch's module registration hooks (a parameter, buffer or
# submodule assigned anywhere): each GraphedCalls then looks at its
# module's tensors again before its next replay.
_generation = [0]
_hooks_lock = threading.Lock()
_hooks_installed = False


class NotRecordable(ValueError):
    """A call (or its result) that a CUDA graph cannot replay; the message
    says why."""


def _install_registration_hooks() -> None:
    global _hooks_installed
    with _hooks_lock:
        if _hooks_installed:
            return
        from torch.nn.modules import module as nn_module

        def bump(*_: Any) -> None:
            _generation[0] += 1

        for name in ("register_module_parameter_registration_hook",
                     "register_module_buffer_registration_hook",
                     "register_module_module_registration_hook"):
            getattr(nn_module, name)(bump)
        _hooks_installed = True


def call_key(args: tuple[Any, ...], kwargs: dict[str, Any],
             tensors: list[Any]) -> Hashable:
    """The key of a call to ``fn(*args, **kwargs)``; appends its tensors to
    ``tensors`` in order. Raises NotRecordable for an argument a replay
    cannot stand for."""
    return (_key(args, tensors), _key(kwargs, tensors))


def _key(x: Any, tensors: list[Any]) -> Hashable:
    if isinstance(x, torch.Tensor):
        if type(x) is not torch.Tensor and type(x) is not torch.nn.Parameter:
            raise NotRecordable(f"an argument is a {type(x).__name__}, a tensor subclass")
        if x.device.type != "cuda":
            raise NotRecordable(f"an argument is on {x.device}, not a CUDA device")
        tensors.append(x)
        return ("tensor", tuple(x.shape), x.stride(), x.dtype, x.device, x.requires_grad)
    if isinstance(x, (tuple, list)):
        return (type(x).__name__, tuple(_key(v, tensors) for v in x))
    if isinstance(x, dict):
        return ("dict", tuple((k, _key(v, tensors)) for k, v in x.items()))
    if x is None or isinstance(x, (bool, int, float, str, torch.dtype, torch.device)):
        return (type(x).__name__, x)
    raise NotRecordable(f"an argument is a {type(x).__name__}: only tensors, numbers, strings "
                        "and lists, tuples and dicts of them are keyed")


def _rebuild(x: Any, tensors: Any) -> Any:
    """``x`` with its tensors taken, in order, from the iterator ``tensors``."""
    if isinstance(x, torch.Tensor):
        return next(tensors)
    if isinstance(x, (tuple, list)):
        return type(x)(_rebuild(v, tensors) for v in x)
    if isinstance(x, dict):
        return {k: _rebuild(v, tensors) for k, v in x.items()}
    return x


def _static_copy(x: Any) -> Any:
    """A tensor of ``x``'s shape and strides in memory of its own."""
    out = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device)
    try:
        with torch.no_grad():   # a leaf of its own, not a step of the caller's graph
            out.copy_(x)
    except RuntimeError as exc:  # overlapping strides (an expanded tensor)
        raise NotRecordable(f"an argument's strides overlap in memory ({exc})") from None
    return out


def _check_output(out: Any) -> None:
    """NotRecordable if a recorded call's result holds anything a copy of it
    could not be made of."""
    leaves, _ = tree_flatten(out)
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            if type(leaf) is not torch.Tensor:
                raise NotRecordable(f"the result holds a {type(leaf).__name__}")
        elif not (leaf is None or isinstance(leaf, (bool, int, float, str))):
            raise NotRecordable(f"the result holds a {type(leaf).__name__}, which is not "
                                "copied out of the graph's memory")


@dataclass
class _Graph:
    graph: Any
    inputs: list[Any]       # where each replay's argument tensors are copied to
    output: Any             # the recorded result (its tensors rewritten by each replay)
    state: Any              # torch's GlobalStateGuard at the recording
    weights: list[Any]      # the module's tensors at the recording
    pointers: list[tuple[int, bool]]   # and their addresses and requires_grad
    generation: int
    # Recorded after each replay's copies out; waiting on it before it was
    # ever recorded waits for nothing.
    done: Any = field(default_factory=lambda: torch.cuda.Event())


@dataclass
class _StepGraph(_Graph):
    """A training call's two graphs (see the module's docstring)."""

    backward: Any = None    # None: no output requires grad
    spec: Any = None        # the result's structure
    constants: tuple[Any, ...] = ()     # its leaves: _TENSOR where ``output``'s go, else values
    params: tuple[Any, ...] = ()        # trainable parameters, in the backward's inputs
    needs_grad: tuple[bool, ...] = ()   # per output tensor: does the backward take its grad
    grad_outputs: tuple[Any, ...] = ()  # where each replay's output grads are copied to
    grad_inputs: tuple[Any, ...] = ()   # per input tensor, then per parameter: grad or None
    replays: int = 0        # forwards replayed, so a backward knows whether it is the last's
    awaiting: Any = None    # a weak reference to the last replay's token until its backward


_TENSOR = object()   # in _StepGraph.constants: an output tensor's place


class _Token:
    """Alive while a replayed training call's autograd graph is."""


def _trainable(module: Any) -> tuple[Any, ...]:
    params = getattr(module, "parameters", None)
    return tuple(p for p in params() if p.requires_grad) if callable(params) else ()


class _Step(torch.autograd.Function):
    """A replayed training call: the forward graph, and as its backward the
    backward graph. Inputs: the owner, the graph, a token, then the call's
    tensors and the trainable parameters (so autograd hands their grads on)."""

    @staticmethod
    def forward(ctx: Any, owner: GraphedCalls, entry: _StepGraph, token: _Token,
                *tensors: Any) -> Any:
        outs = _run_graph(entry, tensors[:len(entry.inputs)])
        entry.replays += 1
        entry.awaiting = weakref.ref(token)
        ctx.owner, ctx.entry, ctx.token, ctx.replay = owner, entry, token, entry.replays
        ctx.mark_non_differentiable(*(o for o, g in zip(outs, entry.needs_grad, strict=True)
                                      if not g))
        return outs

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, *grads: Any) -> Any:
        entry: _StepGraph = ctx.entry
        with ctx.owner._lock:
            if ctx.replay != entry.replays:
                raise RuntimeError(
                    "torch-farm: this backward belongs to a call replayed from a CUDA graph "
                    "that was replayed again since, which overwrote the activations it "
                    "needs: run each call's backward before the next call of its shape, or "
                    "bind the artifact without cuda_graphs=True")
            entry.awaiting = None
            if entry.backward is not None:
                for static, g, needed in zip(entry.grad_outputs, grads, entry.needs_grad,
                                             strict=True):
                    if needed and static.data_ptr() != g.data_ptr():
                        static.copy_(g)
                entry.backward.replay()
            # Copies: autograd may keep a gradient as ``.grad`` itself, and the
            # next replay rewrites the graph's own.
            out = tuple(None if g is None else g.clone() for g in entry.grad_inputs)
        return (None, None, None, *out)


class GraphedCalls:
    """``fn`` (an artifact's callable over ``module``) with each no-grad call
    replayed from a CUDA graph of its key (see the module's docstring).

    ``training``: calls with grad are replayed too, forward and backward
    (a training artifact's).

    ``captured``: how many graphs it holds; ``reasons``: why a call was not
    replayed (by kind of call), for the node's log and its user."""

    def __init__(self, fn: Callable[..., Any], module: Any, *,
                 max_graphs: int = MAX_GRAPHS, training: bool = False) -> None:
        _install_registration_hooks()
        self.fn = fn
        self.module = module
        self.training = training
        self.max_graphs = max_graphs
        self._graphs: dict[Hashable, _Graph] = {}
        self._refused: set[Hashable] = set()
        self.reasons: dict[str, str] = {}
        self._lock = threading.Lock()

    @property
    def captured(self) -> int:
        return len(self._graphs)

    def reset(self) -> None:
        """Forget every graph (after changing what the forward reads other
        than its weights)."""
        with self._lock:
            self._graphs.clear()
            self._refused.clear()

    def _refuse(self, what: str, reason: str) -> None:
        if what not in self.reasons:
            log.warning("torch-farm: %s runs without a CUDA graph: %s", what, reason)
            self.reasons[what] = reason

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        grad = torch.is_grad_enabled()
        if grad and not self.training:
            self._refuse("a call with grad enabled",
                         "only calls without grad (inference) are replayed for an inference "
                         "artifact")
            return self.fn(*args, **kwargs)
        tensors: list[Any] = []
        try:
            key = call_key(args, kwargs, tensors)
        except NotRecordable as exc:
            self._refuse("a call", str(exc))
            return self.fn(*args, **kwargs)
        if not tensors:
            self._refuse("a call without tensors", "nothing of it is on a CUDA device")
            return self.fn(*args, **kwargs)
        if grad:
            if torch.is_autocast_enabled() and torch.is_autocast_cache_enabled():
                self._refuse("a training call under autocast",
                             "autocast's weight cache is on: pass cache_enabled=False to "
                             "torch.autocast")
                return self.fn(*args, **kwargs)
            key = ("grad", getattr(self.module, "training", None), key)
        with self._lock:
            # The graph's input and output memory is shared by its calls: one
            # replay (or recording) at a time. A call run as it is needs no lock.
            entry = self._graphs.get(key)
            if key in self._refused:
                pass
            elif entry is not None and not entry.state.check():
                # Another grad, autocast or dtype state than recorded (for
                # this call only, as a rule): the artifact's guards decide.
                pass
            elif entry is not None and self._same_weights(entry):
                if not isinstance(entry, _StepGraph):
                    return _run_graph(entry, tensors)
                if entry.awaiting is None or entry.awaiting() is None:
                    return self._replay_step(entry, tensors)
                self._refuse("a training call before the backward of the last one of its "
                             "shape", "its replay would overwrite the activations that "
                             "backward reads")
            elif entry is None and len(self._graphs) >= self.max_graphs:
                self._refuse("a call of a new shape",
                             f"{self.max_graphs} graphs are kept already")
            elif not grad:
                return self._record(key, args, kwargs, tensors)
            elif (step := self._record_step(key, args, kwargs, tensors)) is not None:
                return self._replay_step(step, tensors)
        return self.fn(*args, **kwargs)

    def _same_weights(self, entry: _Graph) -> bool:
        """Whether the module's tensors are those ``entry`` recorded, in the
        same memory (else it is recorded anew)."""
        if entry.generation != _generation[0]:
            if [id(t) for t in module_tensors(self.module)] != [id(t) for t in entry.weights]:
                return False
            entry.generation = _generation[0]
        return _pointers(entry.weights) == entry.pointers

    def _warmed_up(self, key: Hashable, what: str,
                   call: Callable[[], Any]) -> tuple[Any, tuple[Any, list[Any]] | None]:
        """``call`` warmed up (``_warm_up``): the last warm-up's result, and
        what a recording keeps (torch's global state, the module's tensors),
        or None there when the call waits for the GPU on the host (its
        reason kept)."""
        from torch._C._dynamo.guards import GlobalStateGuard

        result, synchronizes = _warm_up(call)
        if synchronizes:
            self._remember_refusal(key, what,
                                   f"it waits for the GPU on the host ({synchronizes})")
            return result, None
        return result, (GlobalStateGuard(), list(module_tensors(self.module)))

    def _recording_failed(self, key: Hashable, what: str, exc: Exception,
                          *graphs: Any) -> None:
        """After a capture that failed: its graphs freed, torch's random
        generator out of capture, the key's earlier graph dropped (its
        weights were left behind), and the reason kept."""
        for graph in graphs:
            _forget(graph)
        _end_broken_capture()
        self._graphs.pop(key, None)
        self._remember_refusal(key, what, f"recording it failed ({type(exc).__name__}: "
                                          f"{first_line(exc)})")

    def _record(self, key: Hashable, args: tuple[Any, ...], kwargs: dict[str, Any],
                tensors: list[Any]) -> Any:
        device = tensors[0].device
        try:
            inputs = [_static_copy(x) for x in tensors]
        except NotRecordable as exc:
            self._remember_refusal(key, "a call", str(exc))
            return self.fn(*args, **kwargs)
        s_args, s_kwargs = _rebuild((args, kwargs), iter(inputs))
        with torch.cuda.device(device):
            # Errors here are the artifact's own (a guard's refusal included):
            # the caller sees them as without graphs.
            result, kept = self._warmed_up(key, "a call of this shape",
                                           lambda: self.fn(*s_args, **s_kwargs))
            if kept is None:
                return result
            state, weights = kept
            graph = torch.cuda.CUDAGraph()
            try:
                # thread_local: other threads of the node (its downloads, the
                # caller's own) are not stopped by this capture.
                with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                    output = self.fn(*s_args, **s_kwargs)
                _check_output(output)
            except Exception as exc:  # any failure to record is a reason to run as it is
                self._recording_failed(key, "a call of this shape", exc, graph)
                # The warm-up's result is this call's (its inputs' copy).
                return result
        self._graphs[key] = _Graph(graph=graph, inputs=inputs, output=output, state=state,
                                   weights=weights, pointers=_pointers(weights),
                                   generation=_generation[0])
        return _run_graph(self._graphs[key], tensors)

    # --- training calls ------------------------------------------------------------------

    def _replay_step(self, entry: _StepGraph, tensors: list[Any]) -> Any:
        outs = iter(_Step.apply(self, entry, _Token(), *tensors, *entry.params))
        return tree_unflatten([next(outs) if c is _TENSOR else c for c in entry.constants],
                              entry.spec)

    def _record_step(self, key: Hashable, args: tuple[Any, ...], kwargs: dict[str, Any],
                     tensors: list[Any]) -> _StepGraph | None:
        """Record a training call's forward and backward graphs (None: it
        cannot be, and the reason is kept). The caller runs the call itself."""
        try:
            inputs = [_static_copy(x).requires_grad_(x.requires_grad) for x in tensors]
        except NotRecordable as exc:
            self._remember_refusal(key, "a training call", str(exc))
            return None
        s_args, s_kwargs = _rebuild((args, kwargs), iter(inputs))
        params = _trainable(self.module)
        wrt = [x for x in inputs if x.requires_grad] + list(params)

        def forward_and_backward() -> None:
            # As a replayed pair runs: a forward, then a backward of every
            # output that requires grad.
            leaves, _ = tree_flatten(self.fn(*s_args, **s_kwargs))
            outs = [o for o in leaves if isinstance(o, torch.Tensor) and o.requires_grad]
            if outs and wrt:
                torch.autograd.grad(outs, wrt, [torch.ones_like(o) for o in outs],
                                    allow_unused=True)

        device = tensors[0].device
        with torch.cuda.device(device):
            _, kept = self._warmed_up(key, "a training call of this shape",
                                      forward_and_backward)
            if kept is None:
                return None
            state, weights = kept
            pool = torch.cuda.graph_pool_handle()
            forward, backward = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(forward, pool=pool, capture_error_mode="thread_local"):
                    result = self.fn(*s_args, **s_kwargs)
                _check_output(result)
                leaves, spec = tree_flatten(result)
                output = tuple(o for o in leaves if isinstance(o, torch.Tensor))
                # The result's other values (numbers, strings) are the key's.
                constants = tuple(_TENSOR if isinstance(o, torch.Tensor) else o for o in leaves)
                needs_grad = tuple(o.requires_grad for o in output)
                grad_outputs = tuple(torch.empty_like(o) if g else None
                                     for o, g in zip(output, needs_grad, strict=True))
                grads: tuple[Any, ...] = (None,) * len(wrt)
                if any(needs_grad) and wrt:
                    # The backward's own memory in the forward's pool, after it:
                    # replays run in this order.
                    with torch.cuda.graph(backward, pool=pool, capture_error_mode="thread_local"):
                        grads = torch.autograd.grad(
                            [o for o, g in zip(output, needs_grad, strict=True) if g], wrt,
                            [g for g in grad_outputs if g is not None], allow_unused=True)
                else:
                    _forget(backward)
                    backward = None
            except Exception as exc:  # any failure to record is a reason to run as it is
                self._recording_failed(key, "a training call of this shape", exc,
                                       *(g for g in (forward, backward) if g is not None))
                return None
        by_input = iter(grads)
        grad_inputs = tuple(next(by_input) if x.requires_grad else None for x in inputs) + \
            tuple(next(by_input) for _ in params)
        entry = _StepGraph(graph=forward, inputs=inputs, output=output, state=state,
                           weights=weights, pointers=_pointers(weights),
                           generation=_generation[0], backward=backward, spec=spec,
                           constants=constants,
                           params=params, needs_grad=needs_grad, grad_outputs=grad_outputs,
                           grad_inputs=grad_inputs)
        self._graphs[key] = entry
        return entry

    def _remember_refusal(self, key: Hashable, what: str, reason: str) -> None:
        self._refuse(what, reason)
        if len(self._refused) < _MAX_REFUSED:
            self._refused.add(key)


def _run_graph(entry: _Graph, tensors: Any) -> Any:
    """``entry``'s graph replayed on the call's ``tensors``: copied into its
    inputs, replayed, and copies of its outputs returned."""
    stream = torch.cuda.current_stream(tensors[0].device)
    # The last replay's results were copied out on its stream.
    stream.wait_event(entry.done)
    for static, x in zip(entry.inputs, tensors, strict=True):
        static.copy_(x)
    entry.graph.replay()
    out = tree_map_only(torch.Tensor, torch.Tensor.clone, entry.output)
    entry.done.record(stream)
    return out


def _warm_up(call: Callable[[], Any]) -> tuple[Any, str | None]:
    """``call`` run ``WARM_UP_CALLS`` times on a side stream, as before a
    capture (lazy initialisation outside it), the last under torch's sync
    debug mode: the result of the one before, and why the call cannot be
    recorded (``_synchronizes``), or None."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(WARM_UP_CALLS - 1):
            result = call()
        synchronizes = _synchronizes(call)
    torch.cuda.current_stream().wait_stream(side)
    return result, synchronizes


def _pointers(weights: list[Any]) -> list[tuple[int, bool]]:
    return [(t.data_ptr(), t.requires_grad) for t in weights]


def _synchronizes(call: Callable[[], Any]) -> str | None:
    """Why ``call`` cannot be recorded because it waits for the GPU on the
    host (``.item()``, a data-dependent shape, a copy to the CPU), or None.

    Found before recording, with torch's sync debug mode: a capture that
    fails half-way leaves torch's CUDA random generator in capture, and
    every later random op of the process fails ("Offset increment outside
    graph capture"; ``_end_broken_capture`` mends what it can). The mode is
    the process's: for this one call, another thread's wait raises too."""
    before = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        call()
    except RuntimeError as exc:
        if "synchroniz" not in str(exc):
            raise
        return first_line(exc)
    finally:
        torch.cuda.set_sync_debug_mode(before)
    return None


def _end_broken_capture() -> None:
    """Take torch's CUDA random generator out of a capture that failed.

    torch 2.11's ``CUDAGraph::capture_end`` ends the generators' capture
    only after the stream's capture ended well, so a failure before that
    leaves the generator capturing (seen on an H100: every later
    ``normal_`` on the GPU raised); an empty capture begins and ends it
    again. (Later torch keeps that state per capture, and ``reset`` of the
    failed graph removes it.)"""
    import warnings

    try:
        empty = torch.cuda.CUDAGraph()
        with warnings.catch_warnings():   # "The CUDA Graph is empty": it is meant to be
            warnings.simplefilter("ignore")
            with torch.cuda.graph(empty, capture_error_mode="thread_local"):
                pass
        _forget(empty)
    except RuntimeError as exc:
        log.warning("torch-farm: after a failed CUDA graph capture, its cleanup failed "
                    "too (%s): random ops on this GPU may fail", first_line(exc))


def _forget(graph: Any) -> None:
    try:
        graph.reset()
    except RuntimeError as exc:  # a capture that never began has nothing to free
        log.debug("resetting a failed CUDA graph: %s", exc)
