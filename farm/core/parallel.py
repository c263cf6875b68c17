"""Tensor-parallel models: the same layout on the build worker,
in verification and on every node rank.

A job's ``options.parallel`` (``farm.core.specs.ParallelLayout``) names a
world size, a 1-D device mesh and a plan (module path -> ``colwise`` /
``rowwise``). The farm builds under a *fake* process group (one process
playing rank 0: collectives are recorded, never run) with
``torch.distributed.config.compile_on_one_rank``, so the compiled graph
computes mesh coordinates at run time instead of baking rank 0's in; a node
loads the one artifact on each rank of a real process group of that layout.

Inputs are replicated DTensors (``Replicate()`` on every rank), as in the
aot_compile guide's section 7.1.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from farm.core.specs import MeshLayout, ParallelLayout, SpecError

# The mesh of the fake group this process builds under (``fake_group``), so
# the build's stages find it without threading it through every call.
_BUILD_MESH: Any = None


def build_mesh() -> Any:
    """The mesh ``fake_group`` set up in this process; None outside one."""
    return _BUILD_MESH


class LayoutError(RuntimeError):
    """The process group this process runs does not match the artifact's layout."""


def _styles() -> dict[str, Any]:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}


def make_mesh(layout: MeshLayout, device_type: str) -> Any:
    """The device mesh of ``layout`` over the initialised default process group."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, layout.mesh_shape,
                            mesh_dim_names=layout.mesh_dim_names or None)


def running_layout(layout: MeshLayout) -> None:
    """Raise LayoutError unless the default process group has ``layout``'s world size."""
    import torch.distributed as dist

    if not dist.is_initialized():
        raise LayoutError(f"the artifact is tensor-parallel ({layout}): initialise the "
                          "process group (torch.distributed.init_process_group) first")
    if dist.get_world_size() != layout.world_size:
        raise LayoutError(f"the artifact is built for {layout}; this process group has "
                          f"world size {dist.get_world_size()}")


def parallelize(model: nn.Module, layout: ParallelLayout, mesh: Any) -> nn.Module:
    """``parallelize_module`` with the job's plan. Each rank takes its shard of
    its own full weights (``src_data_rank=None``: no scatter from rank 0), so
    a fake process group shards real weights as a real one does."""
    from torch.distributed.tensor.parallel import parallelize_module

    styles = _styles()
    for path, _ in layout.plan:
        try:
            model.get_submodule(path)
        except AttributeError:
            raise SpecError(f"parallel.plan names {path!r}, which {type(model).__name__} "
                            "does not have (a dotted submodule path, as named_modules() "
                            "lists them)") from None
    plan = {path: styles[style]() for path, style in layout.plan}
    return parallelize_module(model, mesh, plan, src_data_rank=None)


def replicate(tensors: Sequence[Any], mesh: Any) -> list[Any]:
    """Each tensor as a DTensor replicated over ``mesh`` (the guide's inputs)."""
    from torch.distributed.tensor import DTensor, Replicate

    return [DTensor.from_local(t, mesh, [Replicate()], run_check=False)
            if isinstance(t, torch.Tensor) else t for t in tensors]


def local(value: Any) -> Any:
    """A DTensor's local shard (a RowwiseParallel output is already a local
    tensor: ``use_local_output``); any other value as it is."""
    from torch.distributed.tensor import DTensor

    return value.to_local() if isinstance(value, DTensor) else value


@contextmanager
def fake_group(layout: ParallelLayout | None, device_type: str) -> Iterator[Any]:
    """Run the body as rank 0 of ``layout`` under a fake process group, with
    ``compile_on_one_rank``; yields the mesh (None, and nothing changes,
    without a layout). A farm worker has one process and no peers: the fake
    group records collectives in the graph without running them."""
    if layout is None:
        yield None
        return
    import torch.distributed as dist
    import torch.distributed.config as dist_config

    # Importing it registers the "fake" backend.
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise LayoutError("a process group is already initialised in this build process; "
                          "a parallel build runs in a process of its own")
    dist.init_process_group("fake", store=FakeStore(), rank=0,
                            world_size=layout.mesh.world_size)
    global _BUILD_MESH
    try:
        with dist_config.patch(compile_on_one_rank=True):
            _BUILD_MESH = make_mesh(layout.mesh, device_type)
            yield _BUILD_MESH
    finally:
        _BUILD_MESH = None
        dist.destroy_process_group()


def bind_mesh(mesh: Any) -> int:
    """Give a loaded Inductor artifact built under ``compile_on_one_rank`` this
    process's mesh; returns how many references it set.

    torch 2.13 keeps the mesh such a graph asks for its process group
    (``_dtensor.mesh_get_process_group(_opaque_obj0, 0)``) as a module-level
    global of the generated code, which a saved artifact reloads as
    ``_opaque_obj0 = None`` (the mesh sits in ``torchbind_constants``, which
    loading never re-attaches): the first call then fails with
    "'NoneType' object has no attribute 'get_group'". A tensor-parallel node
    has one mesh, so every such unset reference is it. Also registers
    ``device_mesh::_runtime_compute_coordinate_on_dim``, which a
    rank-dependent graph calls and nothing else on the node imports.
    """
    import torch.distributed._ops.device_mesh  # noqa: F401  (registers the op)
    from torch._inductor.codecache import PyCodeCache

    bound = 0
    for module in list(PyCodeCache.modules):
        for name, value in list(vars(module).items()):
            if name.startswith("_opaque_obj") and value is None:
                setattr(module, name, mesh)
                bound += 1
    return bound
