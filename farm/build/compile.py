"""Compile one job for this machine's device: the work of a compile worker's child.

``compile_artifacts(spec, device, out_dir)`` writes up to two artifacts:

``aot_compile`` (every target)
    ``torch.compile(call_module, fullgraph=True).aot_compile(((module, *inputs), {}))``
    then ``save_compiled_function``. The model is built on the meta device and
    ``to_empty()``-ed onto the target device: real Parameters (guards check the
    type) in uninitialised memory, so weights are never loaded or initialised.
    A CUDA build whose weights do not fit the build GPU (or any build with
    ``options.weights: fake``) does the ``to_empty()`` inside FakeTensorMode
    instead: no memory for the weights at all, weight guards dropped, and a
    weights manifest the verifier and nodes check (``farm.build.fake_weights``).
    Example inputs come from the input specs, with dynamic dims marked
    (``mark_dynamic`` with the spec's range). Compiled and saved under the
    grad mode the artifact is for (guards pin it): inference under
    ``no_grad`` with ``module.eval()``, training with grad enabled and
    ``module.train()``, where the backward graph is compiled ahead too.

``aoti`` (inference only, where ``farm.build.aoti_check`` finds that packages built
on this host load here)
    ``torch.export`` + ``aoti_compile_and_package``: compiled kernels in a
    shared library. A CPU ``aot_compile`` artifact holds C++ source that the
    node recompiles with g++ at load (as slow as JIT, and impossible without a
    compiler); the AOTI package loads without one, and on CUDA without the
    dynamo and Inductor imports an ``aot_compile`` artifact costs a node
    (4.4 s on the H200). Built weight-free
    (``package_constants_in_so=False``) and with every parameter and buffer
    kept as a named constant (``always_keep_tensor_constants``: otherwise
    inductor inlines scalars and tensors of up to a few elements into the
    generated code, baking the compile host's uninitialised values in), so the
    node's own module supplies all weights at load. Reproducible: compiled in
    a fresh Inductor cache at a path fixed by the build's inputs, for a
    portable ``-march`` of the target ISA instead of ``-march=native``.

Guard filter (``CompileOptions.guard_filter``): ``drop-unserializable`` drops
exactly the guards torch cannot serialize (ID_MATCH and the guards derived from
it: closures of decorated ``forward`` methods, module and function identity)
and keeps tensor, shape, global-state and attribute guards; ``keep-all``
keeps every guard, so a model with an unserializable guard fails to save.

Beside it: ``farm.build.weightless`` builds the model without weights,
``farm.build.aoti_compile`` writes the AOTI package, ``farm.build.compile_common``
holds the errors and the mode options both use.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from farm.build import kernel_names, stage_times
from farm.build.aoti_compile import compile_aoti
from farm.build.aoti_support import cxx_identity
from farm.build.compile_common import AOTIUnsupported, CompileError, ModelDoesNotFit, mode_options
from farm.build.cpu_kernels import record_loaded_kernels
from farm.build.crash_site import native_phase
from farm.build.fake_weights import (
    WEIGHTS_FAKE,
    WeightFreeGuards,
    WeightsPlan,
    describe_failure,
    fake_inputs,
    manifest_of,
)
from farm.build.graph_identity import aot_cache_outcome, stable_graph_id
from farm.build.guards import GuardPolicy, global_state
from farm.build.weightless import build_for_compile
from farm.core import precompiled_headers
from farm.core.cpu_isa import detect_cpu_isa
from farm.core.digests import sha256_file
from farm.core.inputs import call_args
from farm.core.modelref import (
    example_inputs,
    external_objects,
    grad_context,
)
from farm.core.parallel import build_mesh, fake_group, replicate
from farm.core.specs import GradMode, JobSpec
from farm.core.text import first_line
from farm.core.torch_compat import enable_aot_compile
from farm.node.bundle import write_bundle
from farm.node.loader import FORMAT_AOT_COMPILE, FORMAT_AOTI, call_module
from farm.node.weight_check import MANIFEST_KEY

log = logging.getLogger(__name__)

ARTIFACT_FILES = {FORMAT_AOT_COMPILE: "aot_compile.bin", FORMAT_AOTI: "aoti.pt2"}




@dataclass(frozen=True)
class CompiledArtifact:
    path: Path
    format: str
    meta: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"path": str(self.path), "format": self.format, "meta": self.meta}


# compile_artifacts' default: ask farm.build.aoti_check in this process.
CHECK_AOTI = "check"


def aoti_not_applicable(spec: JobSpec) -> str | None:
    """Why ``spec`` asks for something an AOTI package cannot be (None: it can)."""
    if spec.grad_mode is not GradMode.INFERENCE:
        return "AOTI packages are inference-only"
    if spec.model.external_data:
        # The captured module's weights would be constants of the package
        # that no node module supplies by name.
        return ("AOTI packages of a function with external_data are not built: its captured "
                f"objects ({', '.join(spec.model.external_data)}) would be constants the "
                "node cannot supply")
    if spec.options.parallel is not None:
        # torch.export of DTensor modules is not what the guide's section 7.1
        # covers; the tensor-parallel artifact is an aot_compile one.
        return ("AOTI packages of tensor-parallel (options.parallel) models are not built: "
                "the artifact is the aot_compile one, built once for every rank")
    if spec.options.backend != "inductor":
        # torch.export + AOTInductor is Inductor code generation; an eager or
        # aot_eager build has no generated code to package.
        return (f"AOTI packages are Inductor builds; backend {spec.options.backend!r} "
                "generates no code to package (use backend inductor for one)")
    if spec.options.per_block:
        # A package is one program of the whole model: every changed layer
        # compiles all of it again (on CPU most of a build: its wrapper alone
        # is an 8 s g++ run; bench/build_cost.py --aoti), which is what a
        # per-block build is there to avoid.
        return ("no AOTI package for a per_block job: a package is one program of the whole "
                "model, compiled in full on every change, which per_block avoids; submit "
                "without --per-block for one")
    return None


def aoti_unavailable_reason(spec: JobSpec, device: str) -> str | None:
    """Why a default build of ``spec`` for ``device`` gets no AOTI package
    (None: it gets one). AOTI is inference-only and Inductor-only, and it is only
    built where packages built on this host load here (``farm.build.aoti_check``:
    on the H200 image they crash at load; a version gate was wrong, since the
    same torch builds loadable packages elsewhere)."""
    why = aoti_not_applicable(spec)
    if why is not None:
        return why
    from farm.build.aoti_check import aoti_loads_here

    try:
        ok, why = aoti_loads_here(device)
    except Exception as exc:  # the check's own trouble must not fail the build
        ok, why = False, f"the check failed: {type(exc).__name__}: {exc}"
    if not ok:
        return f"AOTI packages built on this host do not load here ({why}; farm.build.aoti_check)"
    return None


def compile_artifacts(
    spec: JobSpec,
    target_device: str,
    out_dir: Path,
    *,
    formats: Sequence[str] | None = None,
    aoti_unavailable: str | None = CHECK_AOTI,
    cxx: str | None = None,
) -> list[CompiledArtifact]:
    """Compile ``spec`` for ``target_device`` (this machine's) into ``out_dir``.

    With ``formats`` None: aot_compile, and an AOTI package too unless
    ``aoti_unavailable_reason`` says why not (on CPU it loads with no C++
    compiler on the node, on CUDA without importing dynamo and Inductor); one that
    cannot be built is left out (the reason goes into the aot_compile
    artifact's meta under ``aoti_skipped``); an explicitly requested one
    raises. ``aoti_unavailable`` is ``aoti_unavailable_reason``'s answer when
    the caller has it (None: AOTI can be built); by default it is asked here.
    ``cxx`` is the C++ compiler the caller's check chose (a worker's payload
    names it to its build child); None: chosen here, from this machine's cache.
    """
    # This machine's precompiled headers, where the worker gave their store
    # (farm.build.pch); a second call changes nothing.
    precompiled_headers.install_from_env()
    if spec.options.parallel is not None and build_mesh() is None:
        # One process playing rank 0 of the layout (farm.core.parallel).
        with fake_group(spec.options.parallel, torch.device(target_device).type):
            return compile_artifacts(spec, target_device, out_dir, formats=formats,
                                     aoti_unavailable=aoti_unavailable, cxx=cxx)
    explicit = formats is not None
    skipped: dict[str, str] = {}
    failed: dict[str, str] = {}  # a format that was to be built and could not be
    if formats is not None:
        wanted = tuple(formats)
    else:
        no_aoti = (aoti_unavailable_reason(spec, target_device)
                   if aoti_unavailable == CHECK_AOTI else aoti_unavailable)
        wanted = (FORMAT_AOT_COMPILE,) if no_aoti else (FORMAT_AOT_COMPILE, FORMAT_AOTI)
        if no_aoti:
            # Recorded even where it is by design (training, another backend):
            # the build summary says why there is no AOTI package rather than
            # leaving it out silently.
            skipped[FORMAT_AOTI] = no_aoti
    unknown = [f for f in wanted if f not in ARTIFACT_FILES]
    if unknown:
        raise CompileError(f"unknown formats {unknown}; known: {', '.join(ARTIFACT_FILES)}")
    if FORMAT_AOTI in wanted and spec.grad_mode is GradMode.TRAINING:
        raise CompileError("an AOTI package is inference-only: it has no backward")
    if FORMAT_AOTI in wanted:
        _use_chosen_compiler(target_device, cxx)
    if FORMAT_AOTI in wanted and spec.options.backend != "inductor":
        raise CompileError(str(aoti_not_applicable(spec)))
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    enable_aot_compile()
    # Every Triton kernel a static launcher (farm.build.kernel_names says why).
    kernel_names.install()
    device = torch.device(target_device)
    with stage_times.stage(stage_times.MODEL):
        model, weights = build_for_compile(spec, device)
    if weights.mode == WEIGHTS_FAKE and FORMAT_AOTI in wanted:
        why = ("no AOTI package from a fake-weight build: torch.export of FakeTensor weights "
               "is not tried yet; the aot_compile artifact is the build")
        if explicit:
            raise CompileError(why)
        wanted = tuple(f for f in wanted if f != FORMAT_AOTI)
        skipped[FORMAT_AOTI] = why
    # The kernel libraries (and Inductor's ISA probes) a CPU build loads from
    # its own cache, to ship in the aot_compile artifact (farm.build.cpu_kernels).
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    record_under = (Path(cache_dir()) if device.type == "cpu" and weights.mode != WEIGHTS_FAKE
                    else None)
    with record_loaded_kernels(record_under) as kernels:
        common = {
            "device": target_device,
            "torch": torch.__version__,
            "grad_mode": spec.grad_mode.value,
            "mode": spec.options.mode,
            "backend": spec.options.backend,
            "inputs": [str(s) for s in spec.inputs],
            "threads": torch.get_num_threads(),
            "global_state": global_state(spec.grad_mode),
            # How the weights were made (farm.build.fake_weights), and the
            # manifest the node checks its module against before the first call.
            "weights": weights.to_json(),
        }
        manifest = manifest_of(spec, model)
        if manifest is not None:
            common[MANIFEST_KEY] = manifest
        if spec.model.train is not None:
            from farm.core.training import OPTIMIZER_STEP

            # What the node needs to run the step (its loss, targets, optimizer),
            # and that the optimizer step is not in the artifact, and why.
            common["train"] = spec.model.train.to_json()
            common["optimizer_step"] = OPTIMIZER_STEP
        if spec.options.parallel is not None:
            # What a node's rank process needs: its group's layout, and that the
            # graph computes mesh coordinates at run time (any rank loads it).
            common["parallel"] = {**spec.options.parallel.to_json(), "compile_on_one_rank": True,
                                  "built_as": "rank 0 of a fake process group"}
        with stage_times.stage(stage_times.TOOLCHAIN):
            if device.type == "cpu":
                common["cpu_isa"] = detect_cpu_isa()
            common["cxx"] = cxx_identity()
        out: list[CompiledArtifact] = []
        first_failure: Exception | None = None
        for fmt in wanted:
            path = out_dir / ARTIFACT_FILES[fmt]
            t0 = time.perf_counter()
            try:
                if fmt == FORMAT_AOT_COMPILE:
                    meta = compile_aot(spec, model, device, path, weights=weights, kernels=kernels)
                else:
                    with stage_times.aoti_package():
                        meta = compile_aoti(spec, model, device, path)
            except AOTIUnsupported as exc:
                if explicit:
                    raise
                log.warning("no AOTI package for %s: %s", spec.name, exc)
                skipped[fmt] = str(exc)
                failed[fmt] = str(exc)
                continue
            except Exception as exc:
                if first_failure is not None:
                    raise first_failure from exc  # aot_compile's error stays the build's
                # The farm's own refusals (CompileError: the job asks for
                # something that cannot be) are the build's, whatever AOTI does.
                if (explicit or fmt != FORMAT_AOT_COMPILE or FORMAT_AOTI not in wanted
                        or isinstance(exc, (CompileError, ModelDoesNotFit))):
                    raise
                # One format torch cannot build must not cost the other:
                # wav2vec2's aot_compile fails (Dynamo cannot pickle its
                # weight_norm parametrization into the guards) where its AOTI
                # package (torch.export) builds and matches eager.
                log.warning("aot_compile of %s failed, building the AOTI package still: %s",
                            spec.name, exc, exc_info=True)
                first_failure = first_failure or exc
                failed[fmt] = f"{type(exc).__name__}: {first_line(exc)}"
                continue
            meta = {
                **common,
                **meta,
                "format": fmt,
                "compile_s": round(time.perf_counter() - t0, 3),
                "size": path.stat().st_size,
                "sha256": sha256_file(path),
            }
            out.append(CompiledArtifact(path=path, format=fmt, meta=meta))
    if not out and first_failure is not None:
        raise first_failure
    if skipped or failed:
        for art in out:
            art.meta["aoti_skipped"] = skipped.get(FORMAT_AOTI)
            # What was to be built and failed ({format: {"stage", "reason"}};
            # the worker adds the verifier's, stage "verify"), apart from what
            # is not built by design or because this host cannot (skipped).
            art.meta["formats_failed"] = {
                fmt: {"stage": "compile", "reason": why} for fmt, why in failed.items()}
            art.meta["formats_skipped"] = {
                fmt: why for fmt, why in skipped.items() if fmt not in failed}
    return out


def _use_chosen_compiler(device: str, cxx: str | None = None) -> None:
    """``cxx``, else the compiler this machine's check chose
    (``farm.build.toolchain``, cached), when nothing in this process set one
    yet: a package names its compiler in its bytes, so an explicitly requested
    AOTI build must run the same one as a default build for the same bytes."""
    from farm.build.toolchain import compiler_for, current_compiler, use_compiler

    if cxx is not None:
        # The worker's answer. A sandboxed child sees neither the worker's
        # cache file nor its home: asking again here ran the whole check (a
        # tiny AOTI build with its precompiled header, and a load in another
        # process) inside every build, a minute of each CPU build on 2 cores.
        use_compiler(cxx)
    elif current_compiler() is None:
        try:
            compiler_for(device)
        except Exception as exc:  # the check's own trouble: Inductor's default, linkage-checked
            log.warning("no compiler choice for %s: %s", device, exc)


def compile_job(payload: dict[str, Any]) -> dict[str, Any]:
    """Sandbox entry point: ``{"spec", "device", "out_dir", "formats"?,
    "aoti_unavailable"?, "cxx"?}`` -> artifacts. ``aoti_unavailable`` and
    ``cxx`` are the host's answers (``farm.build.aoti_check``), given by the
    caller as a compile worker gives them; without them the child asks itself,
    a tiny AOTI build and load that a sandbox cannot cache."""
    spec = JobSpec.from_json(payload["spec"])
    arts = compile_artifacts(
        spec, payload["device"], Path(payload["out_dir"]), formats=payload.get("formats"),
        aoti_unavailable=payload.get("aoti_unavailable", CHECK_AOTI), cxx=payload.get("cxx"),
    )
    return {"artifacts": [a.to_json() for a in arts]}


def _entry(spec: JobSpec, model: Any, inputs: list[torch.Tensor]
           ) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
    """What gets traced, and its example arguments: positional and keyword
    (``input_ids=``, a dict under a keyword), as the input specs place them."""
    args, kwargs = call_args(spec.inputs, inputs)
    if isinstance(model, nn.Module):
        return call_module, (model, *args), kwargs
    return model, args, kwargs


def _module_globals_as_imports(compiled_fn: Any) -> list[str]:
    """Make the artifact import the Python modules Dynamo's bytecode loads
    from globals it installed by object id (``___module_collections_<id>_c0``
    to rebuild a ``transformers`` ``ModelOutput``, an OrderedDict): torch
    saves none of them, and loading then fails ("Missing required external
    references"). Recorded as the import sources torch already saves."""
    import types

    artifacts = getattr(compiled_fn, "_artifacts", None)
    env = getattr(artifacts, "runtime_env", None)
    scope = getattr(compiled_fn, "_extra_globals", None) or {}
    if env is None or not hasattr(env, "import_sources"):
        return []
    added = []
    for ref in sorted(getattr(env, "external_refs", ()) or ()):
        value = scope.get(ref)
        if (ref.startswith("___module_") and isinstance(value, types.ModuleType)
                and ref not in env.import_sources and ref not in env.used_globals):
            env.import_sources[ref] = value.__name__
            added.append(value.__name__)
    return added


# --- aot_compile ------------------------------------------------------------------------


def compile_aot(spec: JobSpec, model: Any, device: torch.device, path: Path, *,
                weights: WeightsPlan | None = None,
                kernels: list[Path] | None = None) -> dict[str, Any]:
    """``kernels``: the list a ``record_loaded_kernels`` around this build
    fills (CPU); what it holds once a warm-up call has run ships in the
    artifact."""
    fake = weights is not None and weights.mode == WEIGHTS_FAKE
    if fake:
        assert weights is not None
        inputs = fake_inputs(spec.inputs, device, weights.fake_mode)
    else:
        inputs = example_inputs(spec.inputs, device=device, mark_dynamic=True)
    if spec.options.parallel is not None:
        inputs = replicate(inputs, build_mesh())
    fn, args, kwargs = _entry(spec, model, inputs)
    drop: list[str] = []
    if spec.options.regional and isinstance(model, nn.Module):
        from farm.build.regions import region_guard_prefixes

        drop = region_guard_prefixes(model)
    policy = (WeightFreeGuards if fake else GuardPolicy)(spec.options.guard_filter,
                                                         drop_prefixes=drop)
    options = {**mode_options(spec.options.mode), "guard_filter_fn": policy}
    compiled = torch.compile(fn, fullgraph=True, backend=spec.options.backend, options=options)
    aot = getattr(compiled, "aot_compile", None)
    if aot is None:
        raise CompileError(f"torch {torch.__version__} has no aot_compile on compiled functions")
    t0 = time.perf_counter()
    # What ships beside torch's bytes (farm.node.bundle) comes from this
    # process's Inductor cache. It must be the build's own and set before the
    # process starts (the compile worker does: farm.build.steps.compile_env):
    # Inductor's kernel-compile subprocesses start with torch and keep the
    # cache dir they were born with, so changing it here would lose their
    # results. CUDA: the autotuning results of a warm-up (a fake-weight build
    # cannot run its kernels: nothing to tune). CPU: the kernel libraries a
    # warm-up call loads (aot_compile compiles them in worker processes and
    # loads them only when the graph first runs), so that nodes need not
    # compile them again.
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    cache_root = Path(cache_dir())
    tune = device.type == "cuda" and not fake
    per_block: dict[str, Any] = {}
    if spec.options.per_block and fake:
        # A per-block build runs each block's compiled function to feed the
        # next block, which FakeTensor weights cannot do.
        raise CompileError("per_block needs weights it can run (this build's are FakeTensors: "
                           "the model does not fit the build device, or the job asked for "
                           "weights fake); build it without per_block, or with weights empty")
    with grad_context(spec.grad_mode), _regional(spec, model) as regions:
        try:
            with (native_phase("tracing and lowering the model (torch aot_compile)"),
                  stage_times.torch_phases(), stable_graph_id(), aot_cache_outcome() as cache):
                if spec.options.per_block:
                    compiled_fn, per_block = _compile_per_block(
                        spec, model, args, kwargs, options, device, cache_root)
                else:
                    compiled_fn = aot((args, kwargs))
        except Exception as exc:
            if not fake:
                raise
            assert weights is not None
            # Where torch cannot trace or lower FakeTensor weights: the fit
            # check's numbers (when that is why it was fake) and torch's reason.
            cls = ModelDoesNotFit if weights.does_not_fit else CompileError
            raise cls(describe_failure(weights, exc)) from exc
        trace_compile_s = time.perf_counter() - t0
        imported = _module_globals_as_imports(compiled_fn)
        external = external_objects(spec.model, model)
        with stage_times.stage(stage_times.SAVE):
            if per_block:
                path.write_bytes(per_block.pop("payload"))
            elif external:
                # Saved as references by name; the node passes its own at load.
                compiled_fn.save_compiled_function(str(path), external_data=external)
            else:
                compiled_fn.save_compiled_function(str(path))
        configs: list[Path] = []
        if tune:
            t1 = time.perf_counter()
            with (native_phase("running the compiled kernels once (warm-up, autotuning)"),
                  stage_times.stage(stage_times.WARM_UP)):
                warm_up(compiled_fn, args, spec.grad_mode, kwargs=kwargs)
            configs = list(cache_root.rglob("*.best_config"))
            log.info("tuned %d kernels on the target in %.1f s", len(configs),
                     time.perf_counter() - t1)
        elif kernels is not None:
            try:
                with (native_phase("running the compiled kernels once (CPU warm-up)"),
                      stage_times.stage(stage_times.WARM_UP)):
                    warm_up(compiled_fn, args, spec.grad_mode, kwargs=kwargs)
            except Exception as exc:  # the artifact stands; nodes compile the kernels
                log.warning("CPU warm-up failed, no kernels shipped: %s", exc)
                kernels = None
    if per_block:
        # The build's model goes on to other formats (an AOTI package traces
        # it again): its blocks get their own forward back.
        compiled_fn.unpatch()
    bundle_meta: dict[str, Any] = {}
    if kernels:
        from torch._inductor import config as inductor_config
        from torch._inductor.cpp_builder import get_cpp_compiler

        bundle_meta["cpp_compiler"] = get_cpp_compiler()
        bundle_meta["precompiled_headers"] = bool(inductor_config.cpp_cache_precompile_headers)
    cubins: list[Path] = []
    roots: dict[str, Path] = {}
    if device.type == "cuda":
        # Every compiled Triton binary of the build, each config's: torch's
        # own bundle drops the static launcher of any kernel one of whose
        # configs' binaries a fresh node lacks, and the node compiles it again
        # (farm.node.bundle).
        from torch._inductor.runtime.cache_dir_utils import triton_cache_dir

        index = device.index or 0
        roots["triton/"] = Path(triton_cache_dir(index))
        cubins = list(roots["triton/"].rglob("*.cubin"))
        bundle_meta["triton_device"] = index
    with stage_times.stage(stage_times.SAVE):
        shipped = write_bundle(path, cache_root, {"autotune/": configs,
                                                  "kernels/": kernels or [],
                                                  "triton/": cubins},
                               meta=bundle_meta, roots=roots)
    return {
        # Kernels whose autotuning result ships inside the artifact.
        "autotune_configs": shipped["autotune/"],
        # Compiled Triton binaries inside it (a node starts them, no recompile).
        **({"triton_binaries": shipped["triton/"]} if device.type == "cuda" else {}),
        # Compiled CPU kernel libraries inside it (a node loads them, no g++).
        **({"cpu_kernels": shipped["kernels/"]} if device.type == "cpu" else {}),
        **({"autotune": "not run on the builder: a fake-weight build has no weights to run "
            "its kernels with (kernels with several configs tune at a node's first call)"}
           if fake and device.type == "cuda" else {}),
        "entry": (
            f"{call_module.__module__}:{call_module.__qualname__}"
            if isinstance(model, nn.Module)
            else spec.model.entrypoint
        ),
        # How the loaded function is called: the module first, then the inputs.
        "calling_convention": "module" if isinstance(model, nn.Module) else "function",
        "trace_and_lower_s": round(trace_compile_s, 3),
        # Whether torch's AOTAutograd cache answered the compile (farm.build.graph_identity).
        "aot_autograd_cache": cache.get("outcome", "unknown"),
        "guards": policy.summary,
        # regional: the block classes compiled once each as nested compile
        # regions, with their instance counts.
        **({"regional": {"blocks": regions}} if spec.options.regional else {}),
        # per_block: how many blocks, how many functions serve them, and how
        # many of those this build compiled or found in the compile cache.
        **({"per_block": per_block} if per_block else {}),
        # Modules the artifact imports at load in place of Dynamo's by-id globals.
        **({"module_imports": imported} if imported else {}),
        # Names the node must pass as external_data at load (empty: none).
        "external_data": list(spec.model.external_data),
        # CPU artifacts hold C++ source: loading compiles it on the node.
        "load_needs_cxx_compiler": device.type == "cpu",
    }


@contextlib.contextmanager
def _regional(spec: JobSpec, model: Any) -> Iterator[dict[str, int]]:
    """Regional compilation for a ``regional: true`` job (farm.build.regions);
    nothing otherwise."""
    if not spec.options.regional:
        yield {}
        return
    if not isinstance(model, nn.Module):
        raise CompileError("regional compilation is for a model's repeated blocks; a free "
                           "function has none (build it without regional)")
    from farm.build.regions import RegionsUnavailable, compile_regions

    try:
        with compile_regions(model) as blocks:
            yield blocks
    except RegionsUnavailable as exc:
        raise CompileError(str(exc)) from None


def _compile_per_block(spec: JobSpec, model: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                       options: dict[str, Any], device: torch.device, cache_root: Path
                       ) -> tuple[Any, dict[str, Any]]:
    """A ``per_block`` build (farm.build.blocks): each layer-list block an
    ``aot_compile`` function of its own, from this build, an earlier block
    of it, or the compile cache. Returns the function that runs the model
    (its blocks patched) and the meta, with the payload to save."""
    import io

    from farm.build.blocks import (
        CACHE_SUBDIR,
        BlocksUnavailable,
        call_block,
        compile_blocks,
        precompile_in_parallel,
    )
    from farm.node.blocks import BlockwiseModel, pack

    if not isinstance(model, nn.Module):
        raise CompileError("per-block compilation is for an nn.Module's blocks; a free "
                           "function has none (build it without per_block)")
    if spec.model.external_data:
        raise CompileError("per_block does not take external_data yet: build it without "
                           "per_block")
    if any(getattr(s, "dynamic_dims", ()) for s in spec.inputs):
        raise CompileError("per_block compiles each block for the inputs' exact shapes; this "
                           "job has dynamic dimensions: build it without per_block")

    def compile_one(block: nn.Module, b_args: tuple[Any, ...], b_kwargs: dict[str, Any]) -> Any:
        compiled = torch.compile(call_block, fullgraph=True, backend=spec.options.backend,
                                 options=options)
        fn = compiled.aot_compile(((block, *b_args), b_kwargs))
        _module_globals_as_imports(fn)
        return fn

    def load_one(data: bytes) -> Any:
        return torch.compiler.load_compiled_function(io.BytesIO(data))

    context = {"torch": torch.__version__, "device": device.type,
               "grad_mode": spec.grad_mode.value, "options": spec.options.canonical(),
               "compile_options": repr(sorted((k, repr(v)) for k, v in options.items()
                                              if k != "guard_filter_fn"))}
    def run() -> Any:
        return model(*args[1:], **kwargs)

    fresh: set[str] = set()
    if device.type == "cpu":
        # Where a fork is safe (no CUDA context): distinct blocks compiled
        # side by side, one process per compile thread this build has.
        with stage_times.stage(stage_times.BLOCKS_IN_PARALLEL):
            fresh = precompile_in_parallel(
                model, run, compile_one, context=context, cache=cache_root / CACHE_SUBDIR,
                workers=int(torch._inductor.config.compile_threads))
    try:
        made = compile_blocks(model, run, compile_one, load_one,
                              context=context, cache=cache_root / CACHE_SUBDIR, fresh=fresh)
    except BlocksUnavailable as exc:
        raise CompileError(str(exc)) from None
    log.info("per-block: %s", made.summary())
    runner = BlockwiseModel(model, {n: made.functions[i] for n, i in made.assignment.items()})
    meta: dict[str, Any] = {**made.summary(), "payload": pack(made.saved, made.assignment)}
    return runner, meta


def warm_up(compiled_fn: Callable[..., Any], args: Sequence[Any], grad_mode: GradMode, *,
            kwargs: dict[str, Any] | None = None) -> None:
    """Run the compiled function once on the target device (and its backward
    for training), so every kernel that tunes at its first launch does so here,
    on the build worker, instead of on each fleet node."""
    out = compiled_fn(*args, **(kwargs or {}))
    if grad_mode is GradMode.TRAINING:
        leaves = [
            t
            for t in torch.utils._pytree.tree_leaves(out)
            if isinstance(t, torch.Tensor) and t.requires_grad
        ]
        if leaves:
            torch.autograd.backward([t.float().sum() for t in leaves])
    if torch.cuda.is_available():
        torch.cuda.synchronize()


__all__ = [
    "ARTIFACT_FILES",
    "CHECK_AOTI",
    "AOTIUnsupported",
    "CompileError",
    "CompiledArtifact",
    "GuardPolicy",
    "aoti_unavailable_reason",
    "compile_artifacts",
    "compile_job",
]
