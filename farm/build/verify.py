"""Check an artifact the way a fleet node will use it, in a fresh process.

``verify_artifact(spec, path, format, device=...)`` starts a sandboxed child
with an empty Inductor (and Triton) cache, and for a CPU AOTI package no C++
compiler on PATH either: a cold node. The child

1. builds the real model: the factory runs on the device under a seeded RNG
   (``farm.core.modelref.build_real``), so buffers are what the model really
   computes (a Llama's RoPE ``inv_freq``), in the grad mode the artifact is
   for;
2. runs eager on realistic inputs (integers drawn from the spec's declared
   range, else below the model's embedding size; see ``input_values``) at
   the example shapes (and, for each dynamic dim, one more size in its
   range) and, for training, a backward with seeded cotangents;
3. loads the artifact with that module's weights and runs the same calls;
4. compares outputs by value, leaf by leaf (and every parameter's gradient)
   within the output dtype's tolerance: ``|compiled - eager| <= atol + rtol *
   max|eager|``, and their structure by type (containers, pytree specs, and a
   program's own result types with their attributes), never by identity;
   ``outputs`` holds each leaf's error and tolerance;
5. watches for compilation during the load and the first call (C++ builds,
   Triton kernel compiles, autotuning benchmarks, Inductor cache misses, new
   compiled files in the cache dir): an artifact whose first call still
   compiles is not finished (DESIGN.md: a max-autotune artifact spent 8.1 s
   compiling on its first call).
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from farm.build import zygote
from farm.build.child_env import compilers_on_path, without_compilers
from farm.build.compare import GRAD_FACTOR, Tolerance, Worst, compare_tree, non_finite
from farm.build.compile_watch import CompileWatch, autotuned_in, compiled_in
from farm.build.isolation import Isolation
from farm.build.sandbox import run_isolated
from farm.build.steps import toolchain_env
from farm.core.cpu_isa import isa_check_env
from farm.core.inputs import Dim, TensorSpec, call_args
from farm.core.specs import GradMode, JobSpec

SEED = 1234  # weights and inputs of a verification run; any fixed value will do
STEADY_CALLS = 10
STEADY_MAX_S = 5.0

@dataclass
class VerifyReport:
    ok: bool
    max_abs_err: float | None = None
    tol: float | None = None
    load_s: float | None = None
    first_call_s: float | None = None
    # True when the first call (with its backward, for training) compiled or
    # autotuned anything: work an ahead-of-time artifact should not leave to
    # the node. ``first_call_events`` says which.
    first_call_compiled: bool = False
    steady_call_s: float | None = None
    error: str | None = None
    # Beyond the brief's fields: where the time and the compiling went.
    format: str | None = None
    device: str | None = None
    load_compiled: bool = False  # a CPU aot_compile artifact compiles its C++ here
    first_call_autotuned: bool = False
    load_events: dict[str, int] = field(default_factory=dict)
    first_call_events: dict[str, int] = field(default_factory=dict)
    grad_max_abs_err: float | None = None
    grad_tol: float | None = None
    sizes_checked: list[list[list[int]]] = field(default_factory=list)
    # Per compared leaf: {"output": path, "dtype", "shape", "max_abs_err",
    # "tol", "ok"}, worst call of each; gradients are under "grad NAME".
    outputs: list[dict[str, Any]] = field(default_factory=list)
    # How each input's values were drawn (integer inputs: the range and where
    # it came from), and how the model was built ("real" or why not).
    input_values: list[str] = field(default_factory=list)
    model_init: str | None = None
    eager_steady_call_s: float | None = None
    process_to_first_result_s: float | None = None
    import_s: float | None = None
    cold_node: dict[str, Any] = field(default_factory=dict)
    # A training_step job: the optimizer loop compared with eager
    # (farm.build.verify_train); its leaves are in ``outputs`` as "stepK ...".
    train: dict[str, Any] = field(default_factory=dict)

    @property
    def compiles_on_node(self) -> bool:
        return self.load_compiled or self.first_call_compiled

    def summary(self) -> str:
        if not self.ok:
            return f"FAILED: {self.error}"
        parts = [
            f"ok, max err {_fmt(self.max_abs_err)} <= {_fmt(self.tol)}",
        ]
        leaves = [o for o in self.outputs if not str(o.get("output", "")).startswith("grad ")]
        if 1 < len(leaves) <= 4:
            parts.append("per output " + ", ".join(
                f"{o['output']} {_fmt(o['max_abs_err'])} <= {_fmt(o['tol'])}" for o in leaves))
        if self.grad_max_abs_err is not None:
            parts.append(f"grad err {_fmt(self.grad_max_abs_err)} <= {_fmt(self.grad_tol)}")
        parts.append(f"load {_fmt(self.load_s)} s")
        if self.load_compiled:
            parts.append("(load compiled)")
        parts.append(f"first call {_fmt(self.first_call_s)} s")
        if self.first_call_compiled:
            what = ", ".join(f"{k}={v}" for k, v in sorted(self.first_call_events.items()))
            parts.append(f"(FIRST CALL COMPILED: {what})")
        if self.steady_call_s is not None:
            parts.append(f"steady {self.steady_call_s * 1e3:.3f} ms")
        return ", ".join(parts)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "compiles_on_node": self.compiles_on_node}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> VerifyReport:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


class MalformedReport(ValueError):
    """The verifier child's report is not one ``verify_step`` writes."""


# Each field of a VerifyReport (and to_json's compiles_on_node), with the JSON
# types it may have. A report with another field, or a field of another type,
# was not written by verify_step: the child's code (the submitter's) wrote it.
_NUM = (int, float)
_NONE = (type(None),)
REPORT_FIELDS: dict[str, tuple[type, ...]] = {
    "ok": (bool,), "max_abs_err": _NUM + _NONE, "tol": _NUM + _NONE,
    "load_s": _NUM + _NONE, "first_call_s": _NUM + _NONE, "first_call_compiled": (bool,),
    "steady_call_s": _NUM + _NONE, "error": (str, *_NONE), "format": (str,), "device": (str,),
    "load_compiled": (bool,), "first_call_autotuned": (bool,), "load_events": (dict,),
    "first_call_events": (dict,), "grad_max_abs_err": _NUM + _NONE, "grad_tol": _NUM + _NONE,
    "sizes_checked": (list,), "outputs": (list,), "input_values": (list,),
    "model_init": (str, *_NONE), "eager_steady_call_s": _NUM + _NONE,
    "process_to_first_result_s": _NUM + _NONE, "import_s": _NUM + _NONE, "cold_node": (dict,),
    "train": (dict,), "compiles_on_node": (bool,),
}


def checked_report(value: Any, *, spec: JobSpec, format: str, device: str) -> VerifyReport:
    """The verifier child's report, believed only as far as the worker can
    check it: the child runs the submitter's code, which can write any JSON
    (``{"ok": true}`` alone, say). A report of another shape, of another
    format or device than asked, of other input sizes than the worker would
    check, or whose pass its own numbers contradict, is a failed verification
    saying so. What it cannot catch: a hostile submitter's code that fakes a
    consistent report (docs/security.md, "Children are hostile")."""
    try:
        _check_report(value, spec=spec, format=format, device=device)
    except MalformedReport as exc:
        return VerifyReport(ok=False, format=format, device=device,
                            error=f"the verifier's report is not one the farm's verifier "
                                  f"writes: {exc} (the model's code wrote or changed it)")
    return VerifyReport.from_json(value)


def _check_report(value: Any, *, spec: JobSpec, format: str, device: str) -> None:
    if not isinstance(value, dict):
        raise MalformedReport(f"a {type(value).__name__}, not an object")
    missing = sorted(set(REPORT_FIELDS) - set(value))
    extra = sorted(set(value) - set(REPORT_FIELDS))
    if missing or extra:
        raise MalformedReport(", ".join(
            ([f"missing {', '.join(missing)}"] if missing else [])
            + ([f"unknown {', '.join(extra)}"] if extra else [])))
    for name, types in REPORT_FIELDS.items():
        v = value[name]
        # bool is an int in Python: a number field must not be a bool.
        if not isinstance(v, types) or (isinstance(v, bool) and bool not in types):
            raise MalformedReport(f"{name} is {type(v).__name__} {v!r}")
    if value["format"] != format or value["device"] != device:
        raise MalformedReport(f"it is for {value['format']} on {value['device']}, the worker "
                              f"asked for {format} on {device}")
    if value["compiles_on_node"] != (value["load_compiled"] or value["first_call_compiled"]):
        raise MalformedReport("compiles_on_node contradicts load_compiled and "
                              "first_call_compiled")
    if not value["ok"]:
        if not value["error"]:
            raise MalformedReport("a failed verification without an error")
        return
    if value["error"] is not None:
        raise MalformedReport(f"a pass with an error: {value['error'][:200]}")
    want = check_sizes(spec.inputs)
    if value["sizes_checked"] != want:
        raise MalformedReport(f"it checked sizes {value['sizes_checked']!r}, the worker's "
                              f"verification checks {want!r}")
    for err, tol, what in (("max_abs_err", "tol", "outputs"),
                           ("grad_max_abs_err", "grad_tol", "gradients")):
        e, t = value[err], value[tol]
        if e is not None and (t is None or not e <= t):
            raise MalformedReport(f"a pass whose {what}' error {e!r} is not within {t!r}")
    for leaf in value["outputs"]:
        if not isinstance(leaf, dict):
            raise MalformedReport(f"an output entry is {type(leaf).__name__}")
        e, t = leaf.get("max_abs_err"), leaf.get("tol")
        if leaf.get("ok") is not True or not isinstance(e, _NUM) or not isinstance(t, _NUM) \
                or not e <= t:
            raise MalformedReport(f"a pass whose output {leaf.get('output')!r} failed "
                                  f"({e!r} > {t!r})")
    for name in ("load_s", "first_call_s"):
        if value[name] is None or value[name] < 0:
            raise MalformedReport(f"a pass without a time for {name}")


def _fmt(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.3g}"


def verifier_env(cache: str, *, cold_node: bool) -> dict[str, str]:
    """What the verifier's child gets on top of its environment: an empty
    cache of its own (nothing the build or the shared cache left), and
    Inductor's ISA test compiles skipped where they are redundant. With a
    compiler, the compile child's toolchain environment too, so the two fork
    from one zygote (``farm.build.steps.toolchain_env``)."""
    return {"TORCHINDUCTOR_CACHE_DIR": cache, "TRITON_CACHE_DIR": str(Path(cache) / "triton"),
            **(isa_check_env() if cold_node else toolchain_env())}


def verify_artifact(
    spec: JobSpec,
    artifact_path: str | Path,
    format: str,
    *,
    device: str,
    tolerance: Tolerance | float | None = None,
    timeout_s: float = 900,
    memory_mb: float = 16384,
    cold_node: bool | None = None,
    import_paths: Sequence[str | Path] = (),
    isolation: Isolation | None = None,
    weights_manifest: Sequence[Mapping[str, Any]] | None = None,
    zygote_start: dict[str, float] | None = None,
) -> VerifyReport:
    """Verify in a fresh sandboxed process; never raises for the artifact's faults.

    ``zygote_start``: filled with ``SandboxResult.zygote_start`` when the
    verification child waited for its zygote's start (the worker's own
    measure, not the child's report), so the build's timings can tell it
    from the verification itself.

    ``weights_manifest`` (the artifact's ``meta["weights_manifest"]``): the
    child checks its real module against it before loading, as a node does
    (a fake-weight build has no guards on its weights). The child, not the
    builder, holds the real weights.

    ``cold_node`` (default: for CPU AOTI packages) hides every C++ compiler
    from the child, proving the artifact loads where there is none.
    ``import_paths`` (the code pack) go on the child's path; with
    ``isolation`` the child sees the artifact read-only and writes only its
    own Inductor cache (not the build directory the artifact came from).
    """
    if cold_node is None:
        cold_node = format == "aoti" and device == "cpu"
    cache = tempfile.mkdtemp(prefix="farm-verify-cache-",
                             dir=zygote.work_dir() if isolation is not None else None)
    try:
        env = without_compilers() if cold_node else dict(os.environ)
        extra = verifier_env(cache, cold_node=cold_node)
        payload = {
            "spec": spec.to_json(),
            "path": str(artifact_path),
            "format": format,
            "device": device,
            "tolerance": asdict(tolerance) if isinstance(tolerance, Tolerance) else tolerance,
            "cold_node": cold_node,
            "cache_dir": cache,
            "weights_manifest": list(weights_manifest) if weights_manifest is not None else None,
        }
        iso = None if isolation is None else Isolation(
            readonly=(str(artifact_path),), writable=(cache,), uid=isolation.uid)
        res = run_isolated(
            "farm.build.verify:verify_step", payload, timeout_s=timeout_s, memory_mb=memory_mb,
            env=env, env_extra=extra, import_paths=import_paths, isolation=iso,
        )
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    if zygote_start is not None:
        zygote_start.update(res.zygote_start)
    if res.ok:
        return checked_report(res.value, spec=spec, format=format, device=device)
    detail = res.describe()
    if res.traceback:
        detail += "\n" + res.traceback
    elif res.stderr_tail:
        detail += "\n" + res.stderr_tail[-2000:]
    return VerifyReport(ok=False, error=f"verifier {detail}", format=format, device=device)


# --- the child -------------------------------------------------------------------------


def concrete(specs: Sequence[TensorSpec], sizes: Sequence[Sequence[int]]) -> list[TensorSpec]:
    return [
        TensorSpec(s.dtype, tuple(Dim(n, n) for n in shape), s.values, s.name)
        for s, shape in zip(specs, sizes, strict=True)
    ]


_INT = frozenset({"int64", "int32", "int16", "int8", "uint8"})


def describe_input_values(specs: Sequence[TensorSpec],
                          embed: tuple[str, int] | None) -> list[str]:
    """How each input's values are drawn, for the report."""
    out = []
    for s in specs:
        if s.dtype not in _INT:
            out.append(f"{s}: {'0 or 1' if s.dtype == 'bool' else 'seeded normal'}")
        elif s.values is not None:
            out.append(f"{s}: uniform in {s.values[0]}..{s.values[1]} (declared)")
        elif embed is not None:
            out.append(f"{s}: uniform in 0..{embed[1] - 1} (nn.Embedding "
                       f"{embed[0] or '(root)'}: {embed[1]} entries)")
        else:
            out.append(f"{s}: zeros (no range declared and no nn.Embedding; "
                       "declare one: {LO..HI})")
    return out


def check_sizes(specs: Sequence[TensorSpec]) -> list[list[list[int]]]:
    """The example shapes, plus one more shape per dynamic dim's range (a size
    other than the example proves the artifact did not specialise)."""
    first = [list(s.shape) for s in specs]
    out = [first]
    other = [list(s.shape) for s in specs]
    changed = False
    for s, shape in zip(specs, other, strict=True):
        for i, d in enumerate(s.dims):
            if d.dynamic:
                hi = d.hi if d.hi is not None else d.lo + 3
                shape[i] = min(hi, d.lo + 3)
                changed = True
    if changed:
        out.append(other)
    return out


def verify_step(payload: dict[str, Any]) -> dict[str, Any]:
    """Sandbox entry point (see the module docstring); returns a VerifyReport dict."""
    import psutil

    started = psutil.Process().create_time()
    t_import = time.perf_counter()
    import torch
    import torch.utils._pytree as pytree

    from farm.core import precompiled_headers

    # Before anything loads: a kernel the artifact lacks compiles with this
    # machine's header or none, never building torch's own (farm.build.pch).
    precompiled_headers.install_from_env()

    from farm.core.modelref import (
        ModelError,
        apply_grad_mode,
        build_module,
        build_real,
        check_value_ranges,
        embedding_size,
        example_inputs,
        external_objects,
        grad_context,
    )
    from farm.node.loader import load_artifact

    import_s = time.perf_counter() - t_import
    spec = JobSpec.from_json(payload["spec"])
    from farm.core.parallel import build_mesh, fake_group, local, parallelize, replicate

    layout = spec.options.parallel
    if layout is not None and build_mesh() is None:
        # As it was built: rank 0 of a fake group. Its collectives do nothing,
        # in eager and in the artifact alike, so the two still compare like
        # for like; the real collectives run in tests/integration/test_tensor_parallel.py.
        with fake_group(layout, torch.device(payload["device"]).type):
            return verify_step(payload)
    fmt = payload["format"]
    device = payload["device"]
    tol_override = payload.get("tolerance")
    if isinstance(tol_override, dict):
        tol_override = Tolerance(**tol_override)
    report = VerifyReport(ok=False, format=fmt, device=device, import_s=round(import_s, 3))
    if payload.get("cold_node"):
        report.cold_node = {
            "compilers_on_path": compilers_on_path(dict(os.environ)),
            "cache_dir_empty": not any(Path(payload["cache_dir"]).iterdir()),
        }
    training = spec.grad_mode is GradMode.TRAINING
    try:
        try:
            model = build_real(spec.model, device=device, seed=SEED)
            report.model_init = "real"
            bad = non_finite(model)
            if bad:
                # torch.empty left uninitialised by a factory that inits
                # elsewhere: garbage would make the comparison meaningless.
                raise ModelError(f"its real build left non-finite values in {bad}")
        except ModelError as exc:
            # A factory that only works under meta (it sizes itself off the
            # device, say): the weight-free build, seeded; buffers no
            # reset_parameters covers are then zero, and the report says so.
            model = build_module(spec.model, device=device, seed=SEED)
            report.model_init = (f"meta+reset_parameters, uncovered buffers zero (the factory "
                                 f"failed on {device}: {str(exc).splitlines()[0]})")
        is_module = isinstance(model, torch.nn.Module)
        if is_module:
            apply_grad_mode(model, spec.grad_mode)
        # Eager runs on its own copy: the artifact's calls must not share grads.
        import copy

        eager_model = copy.deepcopy(model) if is_module else model
        if layout is not None and is_module:
            model = parallelize(model, layout, build_mesh())
            eager_model = parallelize(eager_model, layout, build_mesh())
        sizes = check_sizes(spec.inputs)
        report.sizes_checked = sizes
        embed = embedding_size(model)
        report.input_values = describe_input_values(spec.inputs, embed)
        check_value_ranges(spec.inputs, embed)
        calls = [
            example_inputs(concrete(spec.inputs, s), device=device, seed=SEED + i,
                           mark_dynamic=False, int_high=embed[1] if embed else None)
            for i, s in enumerate(sizes)
        ]
        if layout is not None:
            calls = [replicate(c, build_mesh()) for c in calls]

        def run(fn: Callable[..., Any], params: Any, inputs: list[Any], seed: int) -> Any:
            args, kwargs = call_args(spec.inputs, inputs)
            with grad_context(spec.grad_mode):
                out = fn(*args, **kwargs)
                if training:
                    flat = [t for t in pytree.tree_leaves(out)
                            if isinstance(t, torch.Tensor) and t.requires_grad]
                    g = torch.Generator(device=device).manual_seed(seed)
                    cots = [torch.randn(t.shape, dtype=t.dtype, device=t.device, generator=g)
                            for t in flat]
                    if flat:
                        torch.autograd.backward(flat, cots)
            _sync(device)
            out = pytree.tree_map(local, out)
            grads = {}
            if training and params is not None:
                for name, p in params.named_parameters():
                    grads[name] = None if p.grad is None else local(p.grad).detach().clone()
                    p.grad = None
            return out, grads

        eager_fn = eager_model
        ref = [run(eager_fn, eager_model if is_module else None, c, SEED + 100 + i)
               for i, c in enumerate(calls)]

        watch = CompileWatch(payload.get("cache_dir"))
        watch.install()
        try:
            t0 = time.perf_counter()
            with watch.phase() as load_events:
                # The worker's own fresh build, not yet attested: attesting it is
                # what passing this check leads to.
                fn = load_artifact(payload["path"], fmt, module=model, trust_unverified=True,
                                   disable_guard_check=spec.options.disable_guard_check,
                                   external_data=external_objects(spec.model, model),
                                   weights_manifest=payload.get("weights_manifest"))
                if layout is not None:
                    from farm.core.parallel import bind_mesh

                    bind_mesh(build_mesh())  # what a node's FarmClient.load(mesh=) does
            report.load_s = round(time.perf_counter() - t0, 4)
            t0 = time.perf_counter()
            with watch.phase() as first_events:
                got0 = run(fn, model if is_module else None, calls[0], SEED + 100)
            report.first_call_s = round(time.perf_counter() - t0, 4)
            report.process_to_first_result_s = round(time.time() - started, 3)
            got = [got0]
            for i, c in enumerate(calls[1:], start=1):
                with watch.phase() as later:
                    got.append(run(fn, model if is_module else None, c, SEED + 100 + i))
                # A later size that compiles means the artifact specialised on
                # the example: count it against the first call.
                for k, v in later.items():
                    first_events[k] = first_events.get(k, 0) + v
        finally:
            watch.uninstall()
        report.load_events = load_events
        report.first_call_events = first_events
        report.load_compiled = compiled_in(load_events)
        report.first_call_autotuned = autotuned_in(first_events)
        report.first_call_compiled = compiled_in(first_events) or report.first_call_autotuned

        worst = Worst()
        grad_worst = Worst()
        for (out_ref, g_ref), (out_got, g_got) in zip(ref, got, strict=True):
            compare_tree(out_got, out_ref, worst, tol_override)
            for name, gr in g_ref.items():
                gg = g_got.get(name)
                if gr is None and gg is None:
                    continue
                if gr is None or gg is None:
                    raise AssertionError(f"gradient of {name}: eager {gr is not None}, "
                                         f"artifact {gg is not None}")
                grad_worst.add(gg, gr, tol_override, factor=GRAD_FACTOR, what=f"grad {name}")
        report.max_abs_err, report.tol = worst.err, worst.tol
        report.outputs = worst.finish() + grad_worst.finish()
        if training:
            report.grad_max_abs_err, report.grad_tol = grad_worst.err, grad_worst.tol
        failures = worst.failures + grad_worst.failures
        report.steady_call_s = _steady(lambda: run(fn, model if is_module else None,
                                                    calls[0], SEED + 100), device)
        report.eager_steady_call_s = _steady(lambda: run(eager_fn, eager_model if is_module
                                                         else None, calls[0], SEED + 100), device)
        if spec.model.train is not None:
            from farm.build.verify_train import check_train_steps

            step_worst = Worst()
            report.train = check_train_steps(
                spec.model.train, eager=eager_model, compiled_module=model, fn=fn,
                inputs=calls[0], grad_factor=GRAD_FACTOR,
                compare=lambda got, ref, what, factor: step_worst.add(
                    got, ref, tol_override, factor=factor, what=what))
            report.outputs += step_worst.finish()
            failures += step_worst.failures
        if failures:
            report.error = "; ".join(failures[:5])
        else:
            report.ok = True
    except Exception as exc:
        import traceback

        report.ok = False
        report.error = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
    return report.to_json()


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def _steady(call: Callable[[], Any], device: str) -> float:
    """Median seconds per call, after one warm-up call."""
    call()
    times = []
    deadline = time.perf_counter() + STEADY_MAX_S
    for _ in range(STEADY_CALLS):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
        if time.perf_counter() > deadline:
            break
    return round(statistics.median(times), 6)
