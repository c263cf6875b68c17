"""Repeated blocks as nested compile regions (``torch.compiler.nested_compile_region``).

A model whose layers are instances of one block class (transformer layers in
a ModuleList) has its block traced and compiled once and stamped out for
every later call whose guards match (the 004 guide's hierarchical
compilation), instead of each layer being traced and compiled again.

Two uses, two ways of marking the block:

- the trace stage (``farm.build.trace``) swaps each block instance's class for
  a subclass whose forward is a region, so no other user of the class in the
  process sees it;
- a ``regional: true`` compile (``compile_regions``) decorates the block
  class's own ``forward`` for the duration of the compile, because Dynamo
  pickles the guards on the module's class by name when it saves the
  artifact, and a subclass of the same name cannot be pickled ("not the same
  object as farm.zoo.llama.Block"). The compile child builds one model, so
  nothing else in its process sees the patch, and it is undone afterwards.
  The artifact holds the region's graph and compiled code once
  (``invoke_subgraph``) and does not need the decorator at load.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator

import torch
from torch import nn

# A block class must repeat this often before it becomes a compile region: below
# that, the region machinery costs more than tracing the copies.
MIN_REGION_REPEATS = 2


def repeated_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every block to make a region: a composite child of a
    ModuleList or Sequential whose class repeats, outermost only."""
    candidates = _list_children(model)
    counts = Counter(type(child) for _, child in candidates)
    return _outermost([(n, c) for n, c in candidates if counts[type(c)] >= MIN_REGION_REPEATS])


def layer_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every composite child of a ModuleList or Sequential,
    repeated or not, outermost only: the blocks a per-block build compiles
    each on its own (farm.build.blocks)."""
    return _outermost(_list_children(model))


def _list_children(model: nn.Module) -> list[tuple[str, nn.Module]]:
    out: list[tuple[str, nn.Module]] = []
    for name, container in model.named_modules():
        if not isinstance(container, (nn.ModuleList, nn.Sequential)):
            continue
        for child_name, child in container.named_children():
            if _regionable(child):
                out.append((f"{name}.{child_name}" if name else child_name, child))
    return out


def _outermost(candidates: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    chosen: list[tuple[str, nn.Module]] = []
    for name, child in candidates:
        # A block nested in a chosen block stays plain: regions inside regions
        # buy nothing once the outer one is reused.
        if not any(name.startswith(c + ".") for c, _ in chosen):
            chosen.append((name, child))
    return chosen


def _regionable(m: nn.Module) -> bool:
    # Composite blocks only (a bare Linear gains nothing), with a forward of their
    # own and no hooks (a hook outside the region would change what is traced).
    return (
        next(m.children(), None) is not None
        and type(m).forward is not nn.Module.forward
        and not (m._forward_hooks or m._forward_pre_hooks)
    )


@contextlib.contextmanager
def compile_regions(model: nn.Module) -> Iterator[dict[str, int]]:
    """Decorate each repeated block class's ``forward`` as a nested compile
    region while the block is compiled; yields {class: instances}. Raises
    RegionsUnavailable when this torch has no regions or the model no
    repeated block (a regional build that would silently be a full one)."""
    region = getattr(torch.compiler, "nested_compile_region", None)
    if region is None:
        raise RegionsUnavailable(f"torch {torch.__version__} has no "
                                 "torch.compiler.nested_compile_region")
    blocks = repeated_blocks(model)
    if not blocks:
        raise RegionsUnavailable(
            "regional compilation needs a block class repeated in an nn.ModuleList or "
            f"nn.Sequential (at least {MIN_REGION_REPEATS} instances, with children of their "
            "own); this model has none: build it without regional")
    counts = Counter(type(m) for _, m in blocks)
    patched: list[tuple[type, object]] = []
    try:
        for cls in counts:
            original = cls.__dict__.get("forward")
            patched.append((cls, original))
            cls.forward = region(cls.forward)
        yield {f"{c.__module__}.{c.__qualname__}": n for c, n in counts.items()}
    finally:
        for cls, original in reversed(patched):
            if original is None:
                del cls.forward
            else:
                cls.forward = original


def region_guard_prefixes(model: nn.Module, *, root: str = "module") -> list[str]:
    """Dynamo's source names of the region blocks' ``forward`` closures, as the
    compiled function (``call_module(module, ...)``) sees them: guards under
    them pin the region decorator the node does not have (``GuardPolicy``'s
    ``drop_prefixes``)."""
    out = []
    for name, _ in repeated_blocks(model):
        path = "".join(f"._modules[{part!r}]" for part in name.split("."))
        out.append(f"dict(type({root}{path}).__dict__)['forward'].__closure__")
    return out


class RegionsUnavailable(RuntimeError):
    """A regional build that cannot be regional; the message says why."""
