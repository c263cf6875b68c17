"""A per-block artifact: each block of a model's layer list compiled on its own.

A ``per_block: true`` build (``farm.build.blocks``) compiles every block of
the model's ``nn.ModuleList``/``nn.Sequential`` (a transformer layer) as an
``aot_compile`` function of its own, ``call_block(block, *inputs)``, and
keeps one function for all blocks that compile to the same program. The
rest of the model (embeddings, the final norm, the loop over the layers)
runs eagerly on the node, and each block's call goes to its compiled
function, which checks its guards on every call as a whole-model
artifact does.

The payload (inside the bundle, where torch's bytes would be):

    FARMBLK1\\n <header JSON>\\n <function 0 bytes> <function 1 bytes> ...

``header``: ``{"sizes": [bytes of each function], "blocks": {"layers.0": 0,
...}}``: which function serves which block, by the block's dotted name in
the model. The node checks the whole payload's digest before this runs
(``farm.node.verify``); the parser still refuses a header that does not
add up.
"""

from __future__ import annotations

import inspect
import io
import json
import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any

MAGIC = b"FARMBLK1\n"
# A header larger than this is not one the builder wrote.
_MAX_HEADER = 1 << 20


class BlocksFormatError(ValueError):
    """The payload is not a per-block artifact the farm wrote."""


def call_block(block: Any, *inputs: Any, **kwargs: Any) -> Any:
    """The function the farm compiles for each block: the block class's own
    ``forward``, looked up on the class. On the node each block's ``forward``
    is replaced (on the instance) by its compiled function; tracing the
    class's method instead of ``block(...)`` keeps that replacement out of
    the guards. Blocks carry no hooks (``farm.build.blocks`` picks only
    those), so ``__call__`` would add nothing."""
    return type(block).forward(block, *inputs, **kwargs)


def is_blocks(data: bytes) -> bool:
    return data.startswith(MAGIC)


def pack(functions: Sequence[bytes], blocks: Mapping[str, int]) -> bytes:
    """The payload of ``functions`` (torch's saved bytes of each) serving
    ``blocks`` (dotted name -> index into ``functions``)."""
    if any(not 0 <= i < len(functions) for i in blocks.values()):
        raise ValueError("a block names a function that is not in the payload")
    header = json.dumps({"sizes": [len(f) for f in functions], "blocks": dict(blocks)},
                        sort_keys=True).encode()
    return MAGIC + header + b"\n" + b"".join(functions)


def unpack(data: bytes) -> tuple[list[bytes], dict[str, int]]:
    """(each function's bytes, block name -> function index)."""
    if not is_blocks(data):
        raise BlocksFormatError("not a per-block artifact")
    end = data.find(b"\n", len(MAGIC), len(MAGIC) + _MAX_HEADER)
    if end < 0:
        raise BlocksFormatError("per-block artifact: header missing or too large")
    try:
        header = json.loads(data[len(MAGIC):end])
        sizes = [int(s) for s in header["sizes"]]
        blocks = {str(k): int(v) for k, v in dict(header["blocks"]).items()}
    except (ValueError, KeyError, TypeError) as exc:
        raise BlocksFormatError(f"per-block artifact: bad header ({exc})") from None
    body = data[end + 1:]
    if any(s < 0 for s in sizes) or sum(sizes) != len(body):
        raise BlocksFormatError("per-block artifact: the sizes do not add up to the payload")
    if not blocks or any(not 0 <= i < len(sizes) for i in blocks.values()):
        raise BlocksFormatError("per-block artifact: a block names no function in it")
    out, at = [], 0
    for s in sizes:
        out.append(body[at:at + s])
        at += s
    return out, blocks


class BlockwiseModel:
    """The node's module with each block's ``forward`` answered by its
    compiled function; calling it runs the module as eager code does."""

    def __init__(self, module: Any, functions: Mapping[str, Any]) -> None:
        self.module = module
        self.functions = dict(functions)
        for name, fn in self.functions.items():
            block = operator.attrgetter(name)(module)
            # An instance attribute: other instances of the class, and the
            # class itself, are untouched.
            block.forward = _bound(fn, block)

    def __call__(self, module: Any, *inputs: Any, **kwargs: Any) -> Any:
        if module is not self.module:
            raise ValueError("a per-block artifact runs the module it was loaded with")
        return module(*inputs, **kwargs)

    def unpatch(self) -> None:
        """Give each block its class's ``forward`` back (the builder, before
        it traces the same model again for another format)."""
        for name in self.functions:
            vars(operator.attrgetter(name)(self.module)).pop("forward", None)

    def disable_guard_check(self) -> None:
        for fn in {id(f): f for f in self.functions.values()}.values():
            fn.disable_guard_check()


def through_torchs_call(fn: Callable[..., Any], block: Any) -> Callable[..., Any]:
    """``block``'s forward through ``fn``'s own call: where ``direct_call``
    does not apply (and what the bench times it against)."""
    def forward(*inputs: Any, **kwargs: Any) -> Any:
        return fn(block, *inputs, **kwargs)

    return forward


def _bound(fn: Any, block: Any) -> Callable[..., Any]:
    direct = direct_call(fn)
    if direct is None:
        return through_torchs_call(fn, block)
    check, run = direct

    def checked_forward(*inputs: Any, **kwargs: Any) -> Any:
        # What torch's call checks, with the locals built here: a refusal
        # goes through torch's own call, which raises with the guard's reason.
        if fn._guard_check_enabled and not check(
                {"block": block, "inputs": inputs, "kwargs": kwargs}):
            return fn(block, *inputs, **kwargs)
        return run(block, *inputs, **kwargs)

    return checked_forward


def direct_call(fn: Any) -> tuple[Callable[[dict[str, Any]], bool], Callable[..., Any]] | None:
    """(guard check, compiled call) of a loaded ``call_block`` function, to
    call without torch's ``AOTCompiledFunction.__call__``; None where ``fn``
    is not one this torch built as expected (then it is called as it is).

    That call binds each call's arguments to the function's signature with
    ``inspect`` to build the guards' locals: about 5 us a call on CPU, paid
    by every block of every call (bench/per_block_steady.py: a launch-bound
    GPU call spends its time on the host, not the GPU). ``call_block``'s
    locals are always ``block``, ``inputs`` and ``kwargs``, so they are built
    here directly, and the guards still check every call. What else torch's
    call does (nothing more in 2.13's source; 2.11's profile shows the same
    calls) this skips too: a torch that adds to it needs this read again
    (``tests/unit/test_blocks.py`` checks the path is taken and that the
    guards still refuse)."""
    try:
        from torch._dynamo.aot_compile import AOTCompiledFunction
    except ImportError:
        return None
    # Exactly torch's class: a subclass may do more in its call.
    if type(fn) is not AOTCompiledFunction:
        return None
    artifacts = getattr(fn, "_artifacts", None)
    run = getattr(fn, "fn", None)
    manager = getattr(artifacts, "guard_manager", None)
    signature = getattr(artifacts, "signature", None)
    env = getattr(artifacts, "runtime_env", None)
    if (manager is None or not callable(run) or signature is None or env is None
            or getattr(env, "closure", None) or not hasattr(fn, "_guard_check_enabled")):
        return None
    try:
        kinds = [(p.name, p.kind) for p in signature.parameters.values()]
    except AttributeError:
        return None
    if kinds != [("block", inspect.Parameter.POSITIONAL_OR_KEYWORD),
                 ("inputs", inspect.Parameter.VAR_POSITIONAL),
                 ("kwargs", inspect.Parameter.VAR_KEYWORD)]:
        return None
    return manager.check, run


def load(data: bytes, module: Any,
         load_function: Callable[[io.BytesIO], Any]) -> BlockwiseModel:
    """A BlockwiseModel over ``module`` from a per-block payload;
    ``load_function`` loads one function's bytes (torch's
    ``load_compiled_function``, with the loader's arguments)."""
    functions, blocks = unpack(data)
    loaded = [load_function(io.BytesIO(f)) for f in functions]
    missing = [n for n in blocks if not _has(module, n)]
    if missing:
        raise BlocksFormatError(f"the module has no block {missing[0]!r}: it is not the model "
                                "this artifact was built for")
    return BlockwiseModel(module, {name: loaded[i] for name, i in blocks.items()})


def _has(module: Any, name: str) -> bool:
    try:
        operator.attrgetter(name)(module)
    except AttributeError:
        return False
    return True
