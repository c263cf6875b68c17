"""Load a farm artifact on a fleet node and get a callable that takes the inputs.

Two formats (``farm.build.compile`` writes both for CPU targets):

``aot_compile``
    ``torch.compile(...).aot_compile`` bytes, loaded with
    ``torch.compiler.load_compiled_function``. For an ``nn.Module`` the farm
    compiles ``call_module(module, *inputs)`` below, so the loaded function
    takes the module as its first argument; ``load_artifact`` binds the node's
    module, and the node's own weights are what runs. Guards (grad mode,
    shapes, dtypes, parameter ``requires_grad``, module attributes) are checked
    on every call; a failure raises ``RuntimeError("GuardManager check failed ...")``.
    On CPU the artifact holds C++ source that loading recompiles with the
    node's C++ compiler; on CUDA it holds compiled kernels.

``aoti``
    An AOTInductor package (``.pt2``) with the compiled kernels in a shared
    library and no weights: the node's module supplies them through
    ``load_constants(..., user_managed=True)``, so nothing is copied and the
    module's later in-place updates (``load_state_dict``) are seen. Loads with
    no C++ compiler. It is inference only, and it has no dynamo guards, so the
    wrapper here checks what they would have: grad mode off, the inputs'
    count, dtype, device and shape ranges, and the CPU ISA of the node.
"""

from __future__ import annotations

import json
import logging
import operator
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from farm.core.cpu_isa import aten_capability
from farm.core.torch_compat import enable_aot_compile
from farm.node import blocks, bundle
from farm.node.arguments import module_tensors

log = logging.getLogger(__name__)

FORMAT_AOT_COMPILE = "aot_compile"
FORMAT_AOTI = "aoti"
FORMATS = (FORMAT_AOT_COMPILE, FORMAT_AOTI)

# The message prefix torch uses when an aot_compile artifact's guards reject a
# call; the AOTI wrapper raises the same so callers handle both alike.
GUARD_FAILURE = "GuardManager check failed"
# Key of the farm's JSON metadata inside an AOTI package (aot_inductor.metadata).
AOTI_META_KEY = "torch_farm"


class ArtifactLoadError(RuntimeError):
    """The artifact cannot run here (format, ISA, missing or mismatched weights)."""


def call_module(module: Any, *inputs: Any, **kwargs: Any) -> Any:
    """The function the farm compiles for an ``nn.Module``.

    Keyword inputs (``input_ids=...``, a dict under a keyword) pass through
    as keywords. Tracing ``module(*inputs)`` through a plain top-level function (instead of
    ``module.forward``) gives one calling convention on every torch version
    (torch 2.11's ``torch.compile(module).forward`` has no ``.aot_compile``,
    2.13's traces ``_wrapped_call_impl``), keeps forward hooks in the graph as
    eager runs them, and leaves no closure in the artifact: a decorated
    ``forward``'s closure cannot be pickled.
    """
    return module(*inputs, **kwargs)


def load_artifact(
    path: str | Path,
    format: str,
    *,
    module: Any = None,
    device_index: int = -1,
    attestation: Any = None,
    trust_unverified: bool = False,
    root_key: Any = None,
    disable_guard_check: bool = False,
    external_data: Mapping[str, Any] | None = None,
    weights_manifest: Sequence[Mapping[str, Any]] | None = None,
) -> Callable[..., Any]:
    """Check ``path`` is attested, then load it and return a callable that
    takes only the model inputs.

    ``module`` is the node's model (an ``nn.Module`` with its real weights) or,
    for an artifact of a free function, that function (or None).

    Loading unpickles or dlopens the file, which runs its code, so before any
    of that: with ``attestation`` (a ``farm.node.verify.Verified`` the caller
    got from ``FarmClient.fetch_verified``) the file must hold exactly the
    attested bytes; otherwise the attestation bundle beside the file
    (``FILE.attestation.json``, written by ``farm fetch -o FILE``) is verified
    against the root key (``root_key``, else ``FARM_ROOT_KEY``) and this
    node's own target. A file with neither loads only with
    ``trust_unverified=True``: for bytes you built yourself.

    ``disable_guard_check`` (an artifact built with that option, which its
    record carries): the loaded ``aot_compile`` function skips its guard
    check on every call (torch's ``disable_guard_check()``); an AOTI package
    has no Dynamo guards, so it is ignored there.

    ``external_data``: the node's own objects for an artifact of a function
    that captures unserializable ones (an ``nn.Module``), by the names its
    job declared (the artifact's ``meta["external_data"]``).

    ``weights_manifest`` (the artifact's ``meta["weights_manifest"]``): the
    module's parameters and buffers must match it (name, shape, dtype,
    device, requires_grad), checked before anything is loaded; a fake-weight
    build has no guards on the weights, so this is what checks them
    (``farm.node.weight_check.WeightsMismatch`` names the first difference).
    """
    from farm.node import verify
    from farm.node.weight_check import MANIFEST_KEY, check_weights

    signed: Any = None
    if attestation is not None:
        if not isinstance(attestation, verify.Verified):
            raise ArtifactLoadError("attestation must be the Verified that fetch_verified returned")
        verify.check_file(path, attestation)
        if attestation.format != format:
            raise verify.AttestationRefused(
                f"asked to load it as {format}, it was attested as {attestation.format}",
                field="format")
        signed = attestation
    elif trust_unverified:
        log.warning("loading %s without checking an attestation (trust_unverified=True)", path)
    else:
        verified = verify_local_file(path, root_key=root_key, formats=(format,))
        signed = verified
        log.info("%s: attested build %s of %s@%s (builder key %s)", path,
                 verified.build_key[:12], verified.model, verified.version,
                 verified.builder_keyid[:16])
    if signed is not None and (signed.build or {}).get(MANIFEST_KEY) is not None:
        # The builder signed the manifest with the build statement: that one,
        # not what the farm's answer (unsigned meta) says.
        weights_manifest = signed.build[MANIFEST_KEY]
    check_weights(module, weights_manifest)
    if format == FORMAT_AOT_COMPILE:
        return _load_aot_compile(Path(path), module, disable_guard_check=disable_guard_check,
                                 external_data=external_data)
    if format == FORMAT_AOTI:
        return _load_aoti(Path(path), module, device_index=device_index)
    raise ArtifactLoadError(f"unknown artifact format {format!r}; known: {', '.join(FORMATS)}")


def verify_local_file(path: str | Path, *, root_key: Any = None,
                      formats: Sequence[str] | None = None, target: Any = None) -> Any:
    """``farm.node.verify.verify_file`` with this node's settings: the root key
    (argument, ``FARM_ROOT_KEY``, or the key pinned for the bundle's farm URL),
    its trust store and its own target."""
    from farm.core.settings import get_settings
    from farm.core.target import Target, detect_local_target
    from farm.node import verify

    settings = get_settings()
    store = verify.TrustStore(settings.resolved_cache_dir() / "trust")
    source = root_key if root_key is not None else (settings.farm_root_key or None)
    if source is None:
        import hashlib

        farm_url = str(verify.read_bundle(path).get("farm_url") or "").rstrip("/")
        pin = (settings.resolved_cache_dir() / "trusted-keys" /
               f"{hashlib.sha256(farm_url.encode()).hexdigest()[:16]}.root.pem")
        if not pin.exists():
            raise verify.AttestationRefused(
                f"no root key to check it with: set FARM_ROOT_KEY to the root public key of "
                f"the farm it came from ({farm_url or 'unknown'}; an embedded farm's is "
                f"FARM_HOME/root-key.pem.pub); for a farm on this machine, any farm command "
                f"against it pins its key in {pin}", field="root_key")
        source = pin
    if target is None:
        bundle_req = verify.read_bundle(path).get("request") or {}
        device = Target.parse(str(bundle_req.get("target"))).device \
            if bundle_req.get("target") else None
        target = detect_local_target(device, check_compiler=False)
    elif isinstance(target, str):
        target = Target.parse(target)
    return verify.verify_file(path, root_key=source, node_target=target, store=store,
                              formats=formats)


# --- aot_compile ---------------------------------------------------------------------


class BoundArtifact:
    """An ``aot_compile`` function with the node's module bound as first argument."""

    def __init__(self, fn: Callable[..., Any], module: Any) -> None:
        self.fn = fn
        self.module = module

    def __call__(self, *inputs: Any, **kwargs: Any) -> Any:
        return self.fn(self.module, *inputs, **kwargs)


def _load_aot_compile(path: Path, module: Any, *, disable_guard_check: bool = False,
                      external_data: Mapping[str, Any] | None = None) -> Callable[..., Any]:
    import io

    import torch

    enable_aot_compile()
    f_globals = None
    if callable(module) and not isinstance(module, torch.nn.Module):
        # A free function's artifact guards on its module's globals.
        f_globals = getattr(module, "__globals__", None)
    if bundle.is_bundle(path):
        # Autotuning results and compiled CPU kernels go into this process's
        # Inductor cache first (farm.node.bundle says why).
        try:
            payload, sections, meta = bundle.read_bundle(path)
            for section, files in sections.items():
                bundle.install_into_cache(section, files, root=bundle.section_root(section, meta))
        except bundle.BundleError as exc:
            raise ArtifactLoadError(str(exc)) from exc
        if sections["kernels/"]:
            # A CPU artifact with its kernel libraries: they hit only under the
            # builder's compiler name and header setting, and Inductor
            # test-compiles every candidate ISA unless this machine's checked
            # pick is known.
            from farm.core.cpu_isa import skip_redundant_isa_checks

            bundle.adopt_build_compiler(meta)
            bundle.adopt_header_precompile(meta)
            skip_redundant_isa_checks()
        fh: Any = io.BytesIO(payload)
    else:
        fh = open(path, "rb")  # noqa: SIM115
    kw: dict[str, Any] = {}
    if f_globals is not None:
        kw["f_globals"] = f_globals
    if external_data:
        kw["external_data"] = dict(external_data)
    with fh:
        data = fh.read()

    def load_one(buf: io.BytesIO) -> Any:
        try:
            return torch.compiler.load_compiled_function(buf, **kw)
        except RuntimeError as exc:
            if "TracingContext.get() must be called within an ongoing trace" not in str(exc):
                raise
            # torch 2.13: the saved guards of a nested compile region (a regional
            # transformers build) hold an ImportSource, whose unpickling installs
            # an ID_MATCH guard into the current trace, and at load there is none.
            # The guard checks the loaded function runs are rebuilt from the saved
            # guard state itself; the one installed here goes into a throwaway
            # context.
            from torch._guards import TracingContext, tracing

            buf.seek(0)
            with tracing(TracingContext(None)):
                return torch.compiler.load_compiled_function(buf, **kw)

    fn: Any
    if blocks.is_blocks(data):
        if not isinstance(module, torch.nn.Module):
            raise ArtifactLoadError("a per-block artifact runs an nn.Module's blocks: pass the "
                                    "model as module=")
        try:
            fn = blocks.load(data, module, load_one)
        except blocks.BlocksFormatError as exc:
            raise ArtifactLoadError(str(exc)) from exc
    else:
        fn = load_one(io.BytesIO(data))
    if disable_guard_check:
        off = getattr(fn, "disable_guard_check", None)
        if off is None:
            raise ArtifactLoadError(f"the artifact was built with disable_guard_check, and "
                                    f"torch {torch.__version__}'s loaded function has no "
                                    "disable_guard_check()")
        off()
    if isinstance(module, torch.nn.Module):
        return BoundArtifact(fn, module)
    return fn


# --- AOTInductor -----------------------------------------------------------------------


class AOTIRunner:
    """``torch._C._aoti.AOTIModelPackageLoader`` with torch's call convention.

    The same as torch's ``AOTICompiledModel`` for positional tensor inputs,
    without importing ``torch.export.pt2_archive`` (which imports dynamo and
    export: 1.5 s of a cold node's start, for a 15-line wrapper).
    """

    def __init__(self, path: str | Path, *, device_index: int = -1) -> None:
        import torch
        import torch.utils._pytree as pytree

        self.loader = torch._C._aoti.AOTIModelPackageLoader(
            str(path), "model", False, 1, device_index
        )
        self._out_spec = pytree.treespec_loads(self.loader.get_call_spec()[1])
        self._unflatten = pytree.tree_unflatten

    def __call__(self, *args: Any) -> Any:
        """The package's flat inputs, in its call spec's order."""
        return self._unflatten(self.loader.boxed_run(list(args)), self._out_spec)

    def get_metadata(self) -> dict[str, str]:
        return dict(self.loader.get_metadata())

    def get_constant_fqns(self) -> list[str]:
        return list(self.loader.get_constant_fqns())

    def load_constants(
        self, constants: dict[str, Any], *, check_full_update: bool, user_managed: bool
    ) -> None:
        # (map, use_inactive, check_full_update, user_managed)
        self.loader.load_constants(constants, False, check_full_update, user_managed)


def read_aoti_metadata(path: str | Path) -> dict[str, str]:
    """The package's metadata (torch's ``AOTI_*`` keys and the farm's JSON),
    without loading the shared library where this torch can."""
    import torch

    loader_cls = torch._C._aoti.AOTIModelPackageLoader
    read = getattr(loader_cls, "load_metadata_from_package", None)
    if read is not None:
        return dict(read(str(path), "model"))
    return AOTIRunner(path).get_metadata()


def farm_metadata(meta: dict[str, str]) -> dict[str, Any]:
    raw = meta.get(AOTI_META_KEY)
    return dict(json.loads(raw)) if raw else {}


def _resolve(module: Any, fqn: str) -> Any:
    return operator.attrgetter(fqn)(module)


class AOTIFunction:
    """An AOTInductor runner bound to the node's module weights.

    The runner keeps raw pointers to the module's tensors (``user_managed``);
    if the module's tensors are replaced (``module.to(...)``, assigning a new
    Parameter) the pointers are reloaded before the next call.
    """

    def __init__(self, runner: Any, module: Any, fqns: Sequence[str], meta: dict[str, Any]) -> None:
        self.runner = runner
        self.module = module
        self.fqns = list(fqns)
        self.meta = meta
        self._inputs: list[dict[str, Any]] = list(meta.get("input_checks") or [])
        # Keyword and dict inputs (farm.core.specs names): a call's tensors are
        # taken from their places, in the order the package was exported with.
        self._specs = None
        if any(c.get("name") for c in self._inputs):
            from farm.core.inputs import parse_inputs

            self._specs = parse_inputs(meta.get("inputs") or [])
        self._ptrs: list[int] = []
        self._constants: dict[str, Any] = {}
        self._load_constants()

    def _current(self) -> dict[str, Any]:
        return {name: _resolve(self.module, name) for name in self.fqns}

    def _load_constants(self) -> None:
        if not self.fqns:
            return
        constants = self._current()
        self.runner.load_constants(constants, check_full_update=True, user_managed=True)
        # Holding the tensors keeps the runner's raw pointers valid.
        self._constants = constants
        self._ptrs = [t.data_ptr() for t in constants.values()]

    def _moved(self) -> bool:
        if not self.fqns:
            return False
        return [t.data_ptr() for t in self._current().values()] != self._ptrs

    def check(self, inputs: Sequence[Any]) -> str | None:
        """Why this call is outside what the package was built for, or None."""
        import torch

        if torch.is_grad_enabled() and not torch.is_inference_mode_enabled():
            return "GLOBAL_STATE changed: grad_mode (an AOTI package is inference-only)"
        if not self._inputs:
            return None
        if len(inputs) != len(self._inputs):
            return f"expected {len(self._inputs)} inputs, got {len(inputs)}"
        for i, (x, want) in enumerate(zip(inputs, self._inputs, strict=True)):
            if not isinstance(x, torch.Tensor):
                return f"input {i}: expected a tensor, got {type(x).__name__}"
            if str(x.dtype).removeprefix("torch.") != want["dtype"]:
                return f"input {i}: dtype {x.dtype} is not {want['dtype']}"
            if x.device.type != want["device"]:
                return f"input {i}: device {x.device} is not {want['device']}"
            if x.dim() != len(want["dims"]):
                return f"input {i}: {x.dim()} dims, expected {len(want['dims'])}"
            for d, (size, (lo, hi)) in enumerate(zip(x.shape, want["dims"], strict=True)):
                if size < lo or (hi is not None and size > hi):
                    rng = str(lo) if lo == hi else f"{lo}..{'' if hi is None else hi}"
                    return f"input {i} dim {d}: size {size} outside {rng}"
            if not x.is_contiguous():
                return f"input {i}: not contiguous"
        return None

    def flat_inputs(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> list[Any]:
        """The call's tensors in the package's order; a call that does not
        fit the specs' names is a guard failure, as Dynamo's would be."""
        if self._specs is None:
            if kwargs:
                raise RuntimeError(f"{GUARD_FAILURE}, reason: the package takes positional "
                                   f"inputs only, got keywords {sorted(kwargs)}")
            return list(args)
        from farm.core.inputs import call_leaves
        from farm.core.specs import SpecError

        try:
            return call_leaves(self._specs, args, kwargs)
        except SpecError as exc:
            raise RuntimeError(f"{GUARD_FAILURE}, reason: {exc}") from None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        inputs = self.flat_inputs(args, kwargs)
        reason = self.check(inputs)
        if reason is not None:
            raise RuntimeError(f"{GUARD_FAILURE}, reason: {reason}")
        if self._moved():
            self._load_constants()
        return self.runner(*inputs)


def _load_aoti(path: Path, module: Any, *, device_index: int) -> Callable[..., Any]:
    import torch

    meta_all = read_aoti_metadata(path)
    meta = farm_metadata(meta_all)
    if meta_all.get("AOTI_DEVICE_KEY", "cpu") == "cpu":
        # torch only warns about an ISA mismatch, and only when a C++ compiler
        # is present to detect it; the wrong ISA gives wrong numbers or SIGILL.
        built = meta_all.get("AOTI_CPU_ISA", "").split()
        # ATen's level ("AVX2", "AVX512"): AOTI names the ISA as ATen does.
        here = aten_capability().upper()
        if built and built[0] != here.split()[0]:
            raise ArtifactLoadError(
                f"AOTI package was built for CPU ISA {built[0]}, this node runs {here}"
            )
    if device_index < 0:
        device_index = _cuda_index(module)
    # torch's load_package first tries a loader that probes the ISA by
    # compiling test programs, and without a compiler logs a warning and falls
    # back to the plain loader: go straight to it.
    runner = AOTIRunner(path, device_index=device_index)
    fqns = runner.get_constant_fqns()
    if fqns and module is None:
        raise ArtifactLoadError(
            "this AOTI package has no weights: pass the node's module to load_artifact"
        )
    missing = []
    mismatched = []
    expected: dict[str, str] = dict(meta.get("constants") or {})
    for name in fqns:
        try:
            t = _resolve(module, name)
        except AttributeError:
            missing.append(name)
            continue
        if not isinstance(t, torch.Tensor):
            mismatched.append(f"{name} is a {type(t).__name__}")
            continue
        want = expected.get(name)
        have = _describe(t)
        if want is not None and want != have:
            mismatched.append(f"{name}: package wants {want}, module has {have}")
    if missing or mismatched:
        parts = []
        if missing:
            parts.append(f"module lacks {', '.join(missing[:10])}")
        if mismatched:
            parts.append("; ".join(mismatched[:10]))
        raise ArtifactLoadError("module does not fit the AOTI package: " + "; ".join(parts))
    return AOTIFunction(runner, module, fqns, meta)


def _cuda_index(module: Any) -> int:
    """The GPU the module's weights are on (-1: none, or not a module): a CUDA
    package runs its kernels on the device it is loaded for."""
    for t in module_tensors(module):
        return int(t.device.index or 0) if t.device.type == "cuda" else -1
    return -1


def _describe(t: Any) -> str:
    """``dtype[shape]@device``: what the package expects of one constant."""
    return f"{str(t.dtype).removeprefix('torch.')}[{','.join(map(str, t.shape))}]@{t.device.type}"
