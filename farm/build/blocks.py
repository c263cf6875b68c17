"""Per-block compilation: each block of a model's layer list compiled on its
own, and blocks compiled by earlier builds reused without tracing them again.

A ``per_block: true`` build (``farm.build.compile.compile_aot``) runs the
model once, each block (a composite child of an ``nn.ModuleList``/
``nn.Sequential``: a transformer layer) served at its first call, in the
order the forward calls them, by:

1. its **keys**: hashes of what the block's program depends on that can
   be read without tracing it. The *shape key*: the toolchain and compile
   options, its module tree (classes, parameter and buffer shapes and
   dtypes), the source files of its classes, and what it is called with
   (shapes, dtypes, strides, constants). The *exact key* adds the blocks'
   plain attributes (an activation's name, but also a layer's own index,
   which most forwards never read);
2. a function compiled earlier in this build, or found in the build's
   compile cache (``<inductor cache>/farm-blocks/<key>``, which the worker
   fills from and harvests into the project's shared cache,
   ``farm.build.compile_cache``), under the exact key first and then the
   shape key, serves the block if its **guards** accept the block and its
   inputs: Dynamo's own check of "the same program", which reads every
   attribute the forward used;
3. otherwise the block is compiled (``aot_compile`` of
   ``farm.node.blocks.call_block``) and its function stored under both
   keys.

So a build's compile time follows the blocks that differ from every block
compiled before it, not the number of layers: a model whose 16 layers are
one class compiles one block; a new version with one layer changed
compiles that layer. What the key leaves out (a helper in another file,
global state) the guards check, and every artifact is still verified
against eager in a fresh process (``farm.build.verify``).

The key is a lookup, not a proof: a stored function from a sandboxed
child is as trusted as the Inductor cache entries beside it (the
project's own builds wrote them).

Compiled one after another, 16 distinct blocks cost 1.5-1.8 times a full
graph's build on CPU (docs/benchmarks.md): each block waits for its one or
two kernels' compiler runs before the next is traced, so the compile
threads sit idle, and each pays torch's per-graph work.
``precompile_in_parallel`` runs first where a fork is safe (a CPU target's
build: no CUDA context, one thread): the model runs once as it is, and the
distinct blocks that no stored function serves are compiled side by side
in forked processes, which store them as above. The pass that follows
finds them there, each checked by its guards as any stored function is; a
block the processes did not compile (one that failed, or inputs the eager
run shaped otherwise) is compiled by that pass.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import os
import tempfile
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from farm.build.regions import layer_blocks
from farm.node.blocks import call_block

log = logging.getLogger(__name__)

CACHE_SUBDIR = "farm-blocks"
# A stored function larger than this is not read back (the shared cache
# refuses entries above 64 MiB anyway).
_MAX_STORED = 64 * 1024**2


class BlocksUnavailable(RuntimeError):
    """A per-block build that cannot be one; the message says why."""


@dataclass
class BlockBuild:
    """What ``compile_blocks`` made: the functions (loaded, and their saved
    bytes), which serves each block, and where each came from."""

    functions: list[Any] = field(default_factory=list)
    saved: list[bytes] = field(default_factory=list)
    assignment: dict[str, int] = field(default_factory=dict)
    compiled: int = 0
    from_cache: int = 0
    # Blocks served by a function this build compiled or loaded for another block.
    shared: int = 0
    # Keyed candidates whose guards refused the block (then compiled anew).
    refused: int = 0
    # Each served block's exact key, in the order the forward called them.
    keys: list[str] = field(default_factory=list)
    # Of ``compiled``: those compiled side by side before this pass
    # (precompile_in_parallel), which it found stored.
    in_parallel: int = 0

    def summary(self) -> dict[str, int]:
        return {"blocks": len(self.assignment), "functions": len(self.functions),
                "compiled": self.compiled, "from_cache": self.from_cache,
                "shared": self.shared, "guard_refusals": self.refused,
                "compiled_in_parallel": self.in_parallel}


def compile_blocks(model: nn.Module, run: Callable[[], Any],
                   compile_one: Callable[[nn.Module, tuple[Any, ...], dict[str, Any]], Any],
                   load_one: Callable[[bytes], Any], *, context: Mapping[str, Any],
                   cache: Path | None, fresh: Collection[str] = ()) -> BlockBuild:
    """Run the model (``run()``) with each layer-list block served by a
    function compiled or reused at the block's first call, in the order the
    forward calls them; each block's output is its function's, so the next
    block sees what it will see on a node, and no block's inputs are kept
    past its call. A block called again (weights shared across steps) is
    served by its function if its guards accept the new inputs.

    ``compile_one(block, args, kwargs)`` returns an ``aot_compile`` function
    of ``call_block``; ``load_one(bytes)`` loads a stored one. ``cache``: the
    directory of stored functions (None: none); ``fresh``: the keys this
    build's ``precompile_in_parallel`` stored (their blocks count as
    compiled)."""
    blocks = layer_blocks(model)
    if len(blocks) < 2:
        raise BlocksUnavailable(
            "per-block compilation needs a model whose forward runs a list of blocks (an "
            "nn.ModuleList or nn.Sequential of modules with children of their own, at least "
            "2); this model has none: build it without per_block")
    out = BlockBuild()
    by_key: dict[str, list[int]] = {}
    sources: dict[str, str] = {}

    def serve(name: str, block: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        # The block as the node has it while it is traced and its guards
        # checked: Dynamo would otherwise read (and try to save) this wrapper.
        patched = vars(block).pop("forward")
        try:
            return _serve(name, block, args, kwargs)
        finally:
            block.forward = patched

    def _serve(name: str, block: nn.Module, args: tuple[Any, ...],
               kwargs: dict[str, Any]) -> Any:
        seen = (_detached(args), _detached(kwargs))
        if name in out.assignment:
            fn = out.functions[out.assignment[name]]
            if not _accepts(fn, block, *seen):
                raise BlocksUnavailable(
                    f"block {name!r} ran again in one forward with inputs its first call's "
                    "function does not take (other shapes or constants); per-block "
                    "compilation compiles one program per block: build it without per_block")
            return fn(block, *args, **kwargs)
        index = _function_for(out, by_key, sources, block, *seen, compile_one=compile_one,
                              load_one=load_one, context=context, cache=cache, fresh=fresh)
        out.assignment[name] = index
        return out.functions[index](block, *args, **kwargs)

    def forward_of(name: str, block: nn.Module) -> Callable[..., Any]:
        def forward(*args: Any, **kwargs: Any) -> Any:
            return serve(name, block, args, kwargs)
        return forward

    _run_patched(blocks, forward_of, run)
    missing = [n for n, _ in blocks if n not in out.assignment]
    if missing:
        raise BlocksUnavailable(
            f"block {missing[0]!r} of the model's layer list never ran in its forward: "
            "per-block compilation serves the blocks the forward calls; build it without "
            "per_block")
    return out


def precompile_in_parallel(model: nn.Module, run: Callable[[], Any],
                           compile_one: Callable[[nn.Module, tuple[Any, ...], dict[str, Any]], Any],
                           *, context: Mapping[str, Any], cache: Path | None,
                           workers: int) -> set[str]:
    """Compile the model's distinct blocks that ``cache`` has no function
    for, in up to ``workers`` forked processes at once, each storing its
    functions under the blocks' keys (see the module's docstring). Returns
    the keys the processes stored (for ``compile_blocks``'s ``fresh``); none
    where it does not apply (one block to compile, one worker, or a fork
    that is not safe: logged). Blocks are told apart by their shape keys: of
    layers that differ only in an attribute, one is compiled here, and the
    pass after compiles the others if the guards refuse its function."""
    import threading

    if workers < 2 or cache is None:
        return set()
    why = ("the build has started CUDA" if torch.cuda.is_initialized() else
           f"the build runs {threading.active_count()} threads" if threading.active_count() > 1
           else None)
    if why:
        log.info("per-block: blocks compiled one after another (%s: no fork)", why)
        return set()
    todo = _distinct_uncached(model, run, context, cache)
    if len(todo) < 2:
        return set()
    n = min(workers, len(todo))
    pids = []
    for w in range(n):
        try:
            pid = os.fork()
        except OSError as exc:   # the build's process limit: the pass after compiles the rest
            log.info("per-block: %d of %d processes started (%s)", w, n, exc)
            break
        if pid == 0:   # pragma: no cover - a forked child; its stores are what is checked
            _compile_and_store(todo[w::n], compile_one, cache)
        pids.append(pid)
    failed = sum(1 for pid in pids if os.waitpid(pid, 0)[1] != 0)
    stored = {key for *_, keys in todo for key in keys if (cache / key).is_file()}
    log.info("per-block: %d distinct blocks compiled in %d processes side by side%s",
             len(todo), len(pids), f" ({failed} failed; the build compiles what they did not "
             "store)" if failed else "")
    return stored


def _distinct_uncached(model: nn.Module, run: Callable[[], Any], context: Mapping[str, Any],
                       cache: Path) -> list[tuple[nn.Module, tuple[Any, ...], dict[str, Any],
                                                  list[str]]]:
    """The model run once with its blocks as they are: each block's first
    inputs, and of those with a shape key no other block has and no stored
    function under either key, (block, args, kwargs, keys) in call order."""
    seen: dict[str, tuple[nn.Module, tuple[Any, ...], dict[str, Any]]] = {}

    def watched(name: str, block: nn.Module) -> Callable[..., Any]:
        forward = block.forward

        def call(*args: Any, **kwargs: Any) -> Any:
            if name not in seen:
                seen[name] = (block, _detached(args), _detached(kwargs))
            return forward(*args, **kwargs)
        return call

    _run_patched(layer_blocks(model), watched, run)
    sources: dict[str, str] = {}
    todo: dict[str, tuple[nn.Module, tuple[Any, ...], dict[str, Any], list[str]]] = {}
    for block, args, kwargs in seen.values():
        keys = [block_key(block, args, kwargs, context, sources=sources, attributes=a)
                for a in (True, False)]
        if keys[1] not in todo and not any((cache / key).is_file() for key in keys):
            todo[keys[1]] = (block, args, kwargs, keys)
    return list(todo.values())


def _compile_and_store(todo: list[tuple[nn.Module, tuple[Any, ...], dict[str, Any], list[str]]],
                       compile_one: Callable[[nn.Module, tuple[Any, ...], dict[str, Any]], Any],
                       cache: Path) -> None:  # pragma: no cover - runs in a forked child
    """A forked process's work: compile and store each of ``todo``, its
    kernels one at a time (the processes are the parallelism; an Inductor
    pool of its own would start a Python per thread), then exit."""
    code = 1
    try:
        # torch's intra-op threads stay as the build set them: Inductor
        # compiles CPU kernels for that count, and functions compiled under
        # torch.set_num_threads(1) were not taken by the pass after (tried).
        with torch._inductor.config.patch(compile_threads=1):
            for block, args, kwargs, keys in todo:
                data = _saved_bytes(compile_one(block, args, kwargs))
                for key in keys:
                    store_bytes(cache / key, data)
        code = 0
    except BaseException as exc:   # the pass after compiles what is missing
        log.warning("per-block: a block compiled beside the others failed (%s); the build "
                    "compiles it again", exc)
    finally:
        os._exit(code)


def _run_patched(blocks: list[tuple[str, nn.Module]],
                 forward_of: Callable[[str, nn.Module], Callable[..., Any]],
                 run: Callable[[], Any]) -> None:
    """``run()`` with each block's ``forward`` set on the instance (as the
    node does: farm.node.blocks.BlockwiseModel) to ``forward_of(name,
    block)``, and taken off again after."""
    for name, block in blocks:
        block.forward = forward_of(name, block)
    try:
        run()
    finally:
        for _, block in blocks:
            vars(block).pop("forward", None)


def _detached(value: Any) -> Any:
    # The inputs as the block saw them, without the autograd graph of the
    # run that produced them (a training build's inputs still require grad).
    def one(t: Any) -> Any:
        if isinstance(t, torch.Tensor):
            return t.detach().requires_grad_(t.requires_grad)
        return t

    return torch.utils._pytree.tree_map(one, value)


def block_key(block: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any],
              context: Mapping[str, Any], *, sources: dict[str, str] | None = None,
              attributes: bool = True) -> str:
    """The lookup key of ``block`` called with ``args``/``kwargs`` under
    ``context`` (toolchain, options, grad mode): the exact key, or without
    ``attributes`` the shape key. ``sources`` caches file digests across
    blocks."""
    sources = {} if sources is None else sources
    leaves, spec = torch.utils._pytree.tree_flatten((args, dict(kwargs)))
    material = {
        "context": {k: str(v) for k, v in sorted(context.items())},
        "modules": [_describe_module(name, m, sources, attributes=attributes)
                    for name, m in block.named_modules()],
        "inputs": [_describe(v) for v in leaves],
        "input_structure": str(spec),
    }
    kind = "exact" if attributes else "shape"
    return f"{kind[0]}{hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()}"


_MODULE_INTERNALS = frozenset({"training"})


def _describe_module(name: str, m: nn.Module, sources: dict[str, str], *,
                     attributes: bool) -> dict[str, Any]:
    cls = type(m)
    return {
        "name": name,
        "class": f"{cls.__module__}.{cls.__qualname__}",
        "training": m.training,
        "sources": [_source_digest(c, sources) for c in cls.__mro__
                    if c not in (nn.Module, object)],
        "tensors": [[n, _describe(t)] for n, t in (*m.named_parameters(recurse=False),
                                                   *m.named_buffers(recurse=False))],
        "attributes": {k: _describe(v) for k, v in sorted(vars(m).items())
                       if not k.startswith("_") and k not in _MODULE_INTERNALS}
        if attributes else {},
    }


def _source_digest(cls: type, sources: dict[str, str]) -> str:
    # torch's own classes change only with torch, whose version is in the
    # context; a user's class by its whole file (a helper beside it counts).
    module = cls.__module__
    if module == "torch" or module.startswith("torch."):
        return module
    try:
        path = inspect.getsourcefile(cls) or ""
    except TypeError:
        path = ""
    if not path:
        return f"{module}.{cls.__qualname__}:no-source"
    if path not in sources:
        try:
            sources[path] = hashlib.sha256(Path(path).read_bytes()).hexdigest()
        except OSError:
            sources[path] = "unreadable"
    return f"{module}:{sources[path]}"


def _describe(v: Any) -> Any:
    """A JSON-able description of a value, as far as it decides a program."""
    if isinstance(v, torch.Tensor):
        return {"tensor": [list(v.shape), list(v.stride()), str(v.dtype), v.device.type,
                           v.requires_grad, isinstance(v, nn.Parameter)]}
    if v is None or isinstance(v, (bool, int, float, str)):
        return [type(v).__name__, repr(v)]
    if isinstance(v, (torch.dtype, torch.device, torch.Size)):
        return [type(v).__name__, str(v)]
    if isinstance(v, (list, tuple)):
        return [type(v).__name__, [_describe(x) for x in v]]
    if isinstance(v, dict):
        return ["dict", [[str(k), _describe(x)] for k, x in v.items()]]
    code = getattr(v, "__code__", None)
    if code is not None:
        return ["function", getattr(v, "__qualname__", ""),
                hashlib.sha256(code.co_code + repr(code.co_consts).encode()).hexdigest()]
    # Anything else by its type; the guards check what Dynamo read of it.
    cls = type(v)
    return ["object", f"{cls.__module__}.{cls.__qualname__}"]


def _function_for(out: BlockBuild, by_key: dict[str, list[int]], sources: dict[str, str],
                  block: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], *,
                  compile_one: Callable[[nn.Module, tuple[Any, ...], dict[str, Any]], Any],
                  load_one: Callable[[bytes], Any], context: Mapping[str, Any],
                  cache: Path | None, fresh: Collection[str] = ()) -> int:
    """The index in ``out`` of the function that serves ``block`` on these
    inputs: one of this build's, a stored one, or a new one."""
    keys = [block_key(block, args, kwargs, context, sources=sources, attributes=a)
            for a in (True, False)]
    index = _first_accepting(out, _candidates(by_key, keys), block, args, kwargs)
    if index is not None:
        out.shared += 1
    else:
        for key in keys:
            index = _from_cache(out, cache, key, load_one, block, args, kwargs,
                                fresh=key in fresh)
            if index is not None:
                break
    if index is None:
        fn = compile_one(block, args, kwargs)
        data = _saved_bytes(fn)
        index = _add(out, fn, data)
        out.compiled += 1
        if cache is not None:
            for key in keys:
                store_bytes(cache / key, data)
    for key in keys:
        if index not in by_key.setdefault(key, []):
            by_key[key].append(index)
    out.keys.append(keys[0])
    return index


def _candidates(by_key: Mapping[str, list[int]], keys: list[str]) -> list[int]:
    seen: list[int] = []
    for key in keys:
        seen += [i for i in by_key.get(key, ()) if i not in seen]
    return seen


def _first_accepting(out: BlockBuild, candidates: list[int], block: nn.Module,
                     args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
    for i in candidates:
        if _accepts(out.functions[i], block, args, kwargs):
            return i
        out.refused += 1
    return None


def _from_cache(out: BlockBuild, cache: Path | None, key: str, load_one: Callable[[bytes], Any],
                block: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], *,
                fresh: bool = False) -> int | None:
    """The index of the function stored under ``key`` once it serves
    ``block`` (loaded, or one this build has already), else None.
    ``fresh``: stored by this build's processes a moment ago
    (precompile_in_parallel), so counted as compiled."""
    if cache is None:
        return None
    path = cache / key
    try:
        if not path.is_file() or path.stat().st_size > _MAX_STORED:
            return None
        data = path.read_bytes()
        if data in out.saved:  # loaded already, for another block
            known = out.saved.index(data)
            # (A refusal here is not counted again: the function was most
            # likely offered already, under the key it was stored with.)
            if not _accepts(out.functions[known], block, args, kwargs):
                return None
            out.shared += 1
            return known
        fn = load_one(data)
    except Exception as exc:  # a stale or foreign entry: compile instead
        log.info("stored block function %s not usable (%s); compiling", key[:12], exc)
        return None
    if not _accepts(fn, block, args, kwargs):
        out.refused += 1
        return None
    if fresh:
        out.compiled += 1
        out.in_parallel += 1
    else:
        out.from_cache += 1
    return _add(out, fn, data)


def _accepts(fn: Any, block: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    if not hasattr(fn, "guard_check"):
        log.warning("torch %s's aot_compile functions have no guard_check: each block is "
                    "compiled on its own, none reused", torch.__version__)
        return False
    try:
        return bool(fn.guard_check(block, *args, **kwargs))
    except Exception as exc:
        log.info("guard check of a block function failed to run: %s", exc)
        return False


def _add(out: BlockBuild, fn: Any, data: bytes) -> int:
    out.functions.append(fn)
    out.saved.append(data)
    return len(out.functions) - 1


def _saved_bytes(fn: Any) -> bytes:
    with tempfile.TemporaryDirectory(prefix="farm-block-") as tmp:
        path = Path(tmp) / "fn"
        fn.save_compiled_function(str(path))
        return path.read_bytes()


def store_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically: a build beside this one (or the
    worker's harvest) never reads half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".", suffix=".tmp")
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
    os.replace(tmp, path)


__all__ = ["CACHE_SUBDIR", "BlockBuild", "BlocksUnavailable", "block_key", "call_block",
           "compile_blocks", "precompile_in_parallel", "store_bytes"]
