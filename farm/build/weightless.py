"""The model a compile works on, built without its weights: on the meta
device and ``to_empty()``-ed onto the build device, or with fake weights
where they do not fit (``options.weights``, ``farm.build.fake_weights``).

Split out of farm.build.compile; the bodies are as they were.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from farm.build.compile_common import CompileError, ModelDoesNotFit
from farm.build.fake_weights import (
    WEIGHTS_AUTO,
    WEIGHTS_EMPTY,
    WEIGHTS_FAKE,
    WeightsPlan,
    build_fake,
    fake_unsupported,
)
from farm.core.aliases import to_empty_keeping_aliases, zero_unloaded
from farm.core.modelref import apply_grad_mode, build_module
from farm.core.parallel import build_mesh, parallelize
from farm.core.specs import JobSpec

log = logging.getLogger(__name__)


def build_for_compile(spec: JobSpec, device: torch.device) -> tuple[Any, WeightsPlan]:
    """The model to compile and how its weights were made (``options.weights``):
    ``empty`` (``build_weightless``), ``fake`` (``farm.build.fake_weights``), or
    ``auto``: empty where the weights fit, fake for a CUDA build where they do not."""
    wanted = spec.options.weights
    if wanted == WEIGHTS_FAKE:
        why = fake_unsupported(spec)
        if why is not None:
            raise CompileError(f"options.weights fake: {why}")
        model, mode = build_fake(spec, device)
        return model, WeightsPlan(WEIGHTS_FAKE, "asked for (options.weights fake)", mode)
    try:
        return build_weightless(spec, device), WeightsPlan(WEIGHTS_EMPTY, (
            "asked for (options.weights empty)" if wanted == WEIGHTS_EMPTY
            else "they fit the build device"))
    except ModelDoesNotFit as exc:
        if wanted != WEIGHTS_AUTO:
            raise
        why = fake_unsupported(spec)
        if why is not None:
            raise ModelDoesNotFit(f"{exc}; a fake-weight build cannot help: {why}") from None
        log.info("weights do not fit %s: building with fake weights (%s)", device, exc)
        model, mode = build_fake(spec, device)
        return model, WeightsPlan(WEIGHTS_FAKE, f"they do not fit the build device: {exc}", mode,
                                  does_not_fit=str(exc))


def usable_gpu_memory(device: torch.device) -> tuple[int, int]:
    """(free, total) bytes this process may still allocate on ``device``:
    the driver's free memory, lowered to what
    ``torch.cuda.set_per_process_memory_fraction`` leaves this process."""
    free, total = torch.cuda.mem_get_info(device)
    get_fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    if get_fraction is not None:
        # An index: torch's getter refuses a device without one ("cuda").
        index = device.index if device.index is not None else torch.cuda.current_device()
        fraction = float(get_fraction(index))
        if fraction < 1.0:
            allowed = int(fraction * total) - torch.cuda.memory_reserved(index)
            free = max(0, min(free, allowed))
    return free, total


def build_weightless(spec: JobSpec, device: torch.device) -> Any:
    """The model on ``device`` with uninitialised storage (meta, then
    ``to_empty``): compiling needs shapes, dtypes and Parameter types, not values."""
    model = build_module(spec.model, device="meta")
    if isinstance(model, nn.Module):
        if device.type == "cuda":
            free, total = usable_gpu_memory(device)
            check_fits(tensor_bytes(model), free_bytes=free, total_bytes=total, device=str(device))
        # Tied weights stay tied (to_empty alone unties them, and the node's
        # module has them tied), and what no checkpoint loads is zeroed: a
        # garbage index buffer (BERT's position_ids) made the CPU warm-up
        # call abort the build child in Inductor's bounds check.
        to_empty_keeping_aliases(model, device)
        zero_unloaded(model)
        apply_grad_mode(model, spec.grad_mode)
        if spec.options.parallel is not None:
            model = parallelize(model, spec.options.parallel, build_mesh())
    return model


# Room left for activations, the CUDA context and Inductor's autotuning buffers.
FIT_HEADROOM = 0.8


def tensor_bytes(module: nn.Module) -> int:
    """Bytes of every parameter and buffer, read off the meta-device model."""
    return sum(t.numel() * t.element_size()
               for t in (*module.parameters(), *module.buffers()))


def check_fits(weight_bytes: int, *, free_bytes: int, total_bytes: int, device: str) -> None:
    """Fail early and clearly, before ``to_empty`` reserves the weights' memory.

    ``to_empty`` gives a weight-free compile real Parameters (guards check
    their type), and so still takes the weights' memory on the build GPU. A
    model that cannot fit fails here, with the numbers, instead of as a CUDA
    out-of-memory error halfway through a compile.
    """
    if weight_bytes > FIT_HEADROOM * free_bytes:
        gib = 1024**3
        raise ModelDoesNotFit(
            f"the model's weights take {weight_bytes / gib:.1f} GiB, and {device} has "
            f"{free_bytes / gib:.1f} of {total_bytes / gib:.1f} GiB free; a build needs the "
            f"weights to fit in {FIT_HEADROOM:.0%} of free memory. Build it on a larger GPU, "
            "or shard it (not supported yet); a CUDA build with options.weights auto or "
            "fake compiles with fake weights instead (farm.build.fake_weights)"
        )
