"""The AOTInductor package of an inference job: ``torch.export``, then
``aoti_compile_and_package``, weight-free and for a portable ``-march``
(``farm.build.compile``'s docstring says why each choice).

Split out of farm.build.compile; the body is as it was.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from farm.build import aoti_cache, stage_times
from farm.build.aoti_support import (
    _FunctionModule,
    cxx_identity,
    portable_march,
    reproducible_cache_dir,
)
from farm.build.compile_common import AOTIUnsupported, mode_options
from farm.build.crash_site import native_phase
from farm.build.toolchain import inductor_compiler
from farm.core import precompiled_headers
from farm.core.cpu_isa import detect_cpu_isa
from farm.core.elf import package_linkage
from farm.core.inputs import call_args
from farm.core.modelref import example_inputs
from farm.core.specs import GradMode, JobSpec, canonical_json
from farm.node.loader import AOTI_META_KEY, _describe


def compile_aoti(spec: JobSpec, model: Any, device: torch.device, path: Path, *,
                 headers: bool | None = None) -> dict[str, Any]:
    """``spec``'s AOTI package at ``path``. ``headers``: compile the wrapper
    with a precompiled header (None: where this machine's store holds AOTI's
    headers; True: the store's fill, which builds them)."""
    if spec.grad_mode is not GradMode.INFERENCE:
        raise AOTIUnsupported("AOTI packages are inference-only")
    module = model if isinstance(model, nn.Module) else _FunctionModule(model)
    inputs = example_inputs(spec.inputs, device=device, mark_dynamic=False)
    args, kwargs = call_args(spec.inputs, inputs)
    dynamic = tuple(
        {i: torch.export.Dim.DYNAMIC(min=d.lo, max=d.hi) for i, d in enumerate(s.dims) if d.dynamic}
        or None
        for s in spec.inputs
    )
    dynamic_shapes: Any = None
    if any(d is not None for d in dynamic):
        if any(s.name for s in spec.inputs):
            # By parameter name (the dict form), in the call's own structure.
            import inspect

            dyn_args, dyn_kwargs = call_args(spec.inputs, dynamic)
            dynamic_shapes = dict(
                inspect.signature(module.forward).bind(*dyn_args, **dyn_kwargs).arguments)
        else:
            # A free function's wrapper takes *args: its one argument is that tuple.
            dynamic_shapes = dynamic if isinstance(model, nn.Module) else (dynamic,)
    t0 = time.perf_counter()
    with torch.no_grad():
        try:
            ep = torch.export.export(
                module, args, kwargs or None, dynamic_shapes=dynamic_shapes, strict=False
            )
        except Exception as exc:
            raise AOTIUnsupported(f"torch.export failed: {type(exc).__name__}: {exc}") from exc
    export_s = time.perf_counter() - t0
    stage_times.add(stage_times.AOTI_EXPORT, export_s)
    import torch.utils._pytree as pytree

    if (any(s.name for s in spec.inputs)
            and ep.call_spec.in_spec != pytree.tree_structure((args, kwargs))):
        # The node's loader feeds the package the tensors in the specs'
        # (canonical) order: the package must take them in that order.
        raise AOTIUnsupported(f"torch.export took the inputs as {ep.call_spec.in_spec}, not in "
                              "the input specs' order")
    lifted = list(getattr(ep.graph_signature, "lifted_tensor_constants", []) or [])
    if lifted:
        # They would become unnamed constants (_tensor_constant0) that the
        # node's module cannot supply, and without weights in the package
        # nothing else can: a call would read uninitialised memory.
        raise AOTIUnsupported(
            "the model uses tensors that are neither parameters nor buffers "
            f"({', '.join(lifted[:5])}: a tensor attribute or a tensor literal in forward); "
            "register them with register_buffer to get an AOTI package"
        )

    # Constants the node's module must supply, with what each must be.
    # Every name (a tied weight's too): torch.export may keep either.
    named = dict(module.named_parameters(remove_duplicate=False))
    named.update(module.named_buffers(remove_duplicate=False))
    constants = {
        name: _describe(named[name]) for name in [*ep.state_dict, *ep.constants] if name in named
    }
    isa = detect_cpu_isa() if device.type == "cpu" else ""
    march = portable_march(isa) if device.type == "cpu" else None
    farm_meta = {
        "format_version": 1,
        "inputs": [str(s) for s in spec.inputs],
        "grad_mode": spec.grad_mode.value,
        "calling_convention": "module" if isinstance(model, nn.Module) else "function",
        "input_checks": [
            {
                "dtype": s.dtype,
                "device": device.type,
                "dims": [[d.lo, d.hi] for d in s.dims],
                # Keyword and dict inputs only: where the loader takes it from.
                **({"name": s.name} if s.name else {}),
            }
            for s in spec.inputs
        ],
        "constants": constants,
        "cpu_isa": isa,
        "march": march or "native",
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }
    configs: dict[str, Any] = {
        "aot_inductor.package_constants_in_so": False,
        "always_keep_tensor_constants": True,
        "freezing": False,
        "aot_inductor.metadata": {AOTI_META_KEY: canonical_json(farm_meta)},
    }
    inductor_config = torch._inductor.config
    header_store = (precompiled_headers.aoti_store(inductor_compiler()) if device.type == "cpu"
                    else None)
    if hasattr(inductor_config.aot_inductor, "precompile_headers"):
        # The wrapper's header (its g++ run is most of a CPU package:
        # bench/aoti_header.py, 8.5 s against 5.9 s) comes from this
        # machine's read-only store, which the worker fills
        # (farm.build.pch); never built here: a fresh cache per build would
        # build it every time (53 s against 24-30 s for a small MLP). Whether
        # it is used changes the package's bytes (its compile command), so
        # the package's key holds it.
        configs["aot_inductor.precompile_headers"] = (
            header_store is not None if headers is None else headers)
    if march and hasattr(inductor_config.cpp, "march"):
        configs["cpp.march"] = march
    configs.update(mode_options(spec.options.mode))
    gemm_backends = None
    if device.type == "cpu" and configs.get("max_autotune"):
        # max-autotune's CPP GEMM template prepacks each weight it picks into
        # a blocked layout at compile time: a new constant ("constant4")
        # computed from this host's uninitialised weight, which a weight-free
        # package cannot carry and no node module can supply (its loader
        # failed: "module lacks constant4"). ATen GEMMs take the node's own
        # weights; the mode's other options (epilogue fusion...) stay.
        gemm_backends = "ATEN"
        configs["max_autotune_gemm_backends"] = gemm_backends

    t0 = time.perf_counter()
    # The same exported program compiled with the same configs and toolchain
    # is the same package (farm.build.aoti_cache): an earlier build's, from
    # the build's compile cache, or compiled here and kept there.
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    kept = Path(cache_dir()) / aoti_cache.CACHE_SUBDIR
    key = aoti_cache.package_key(ep, configs, device, cxx_identity(), header_store=header_store)
    cached = aoti_cache.cached_package(kept, key)
    if cached is not None:
        shutil.copyfile(cached, path)
    else:
        with reproducible_cache_dir(key[:32]), native_phase(
                "compiling the AOTInductor package (torch aoti_compile_and_package)"), \
                stage_times.aoti_phases():
            torch._inductor.aoti_compile_and_package(
                ep, package_path=str(path), inductor_configs=configs
            )
        aoti_cache.keep_package(kept, key, path)
    lower_s = time.perf_counter() - t0
    linkage = package_linkage(path)
    if not linkage["links_shared_libstdcxx"]:
        # A static libstdc++ beside the process's shared one crashed the
        # loader on the H200 (farm.build.toolchain): never ship one.
        raise AOTIUnsupported(
            f"the package's library links no shared libstdc++.so.6 (compiled with "
            f"{cxx_identity()}): a static copy crashes at load; farm.build.toolchain "
            "chooses a compiler that links it shared"
        )
    return {
        "libstdcxx_needs": linkage["libstdcxx_needs"],
        "export_s": round(export_s, 3),
        "lower_s": round(lower_s, 3),
        # Where the package came from: compiled by this build, or an earlier
        # build's of the same program (farm.build.aoti_cache).
        "package_cache": {"key": key, "hit": cached is not None},
        # The wrapper compiled with the store's precompiled header.
        "precompiled_header": bool(configs.get("aot_inductor.precompile_headers")),
        "constants": len(constants),
        "march": march or "native",
        "weights_in_package": False,
        "load_needs_cxx_compiler": False,
        # torch.export traces the whole graph: nested compile regions are a
        # torch.compile feature, so a regional job's package is not regional.
        **({"regional": "not applied: an AOTI package is compiled from torch.export's "
            "whole graph"} if spec.options.regional else {}),
        **({"per_block": "not applied: an AOTI package is one program of the whole model"}
           if spec.options.per_block else {}),
        # Set only where the farm narrows max-autotune's GEMM choices (CPU).
        **({"gemm_backends": gemm_backends} if gemm_backends else {}),
        "calling_convention": farm_meta["calling_convention"],
    }
