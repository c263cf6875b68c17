"""farm.build.trace, farm.core.fingerprint, farm.core.modelref and the zoo models they run on.

Everything here is weight-free and CPU-only; the slowest part is the two
subprocesses that check the fingerprint across interpreters."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import tests.models.broken as broken
from farm.build.trace import CaptureError, DynamicDimError, GraphBreakError, TraceReport, trace
from farm.core.inputs import parse_inputs
from farm.core.modelref import (
    ModelBuildError,
    ModelImportError,
    build_module,
    load_callable,
    materialize,
)
from farm.core.specs import CompileOptions, GradMode, JobSpec, ModelRef
from farm.zoo.llama import PRESETS, llama, param_count

ROOT = Path(__file__).resolve().parents[2]


def job(
    entrypoint: str,
    inputs: list[str],
    *,
    kind: str = "factory",
    grad_mode: GradMode = GradMode.INFERENCE,
    options: CompileOptions | None = None,
    **kwargs: Any,
) -> JobSpec:
    return JobSpec(
        name="t",
        version="1",
        model=ModelRef(entrypoint, kwargs=kwargs, kind=kind),
        inputs=parse_inputs(inputs),
        grad_mode=grad_mode,
        options=options or CompileOptions(),
    )


def tiny_llama(**kw: Any) -> JobSpec:
    return job("farm.zoo.llama:llama", ["int64[2,16]"], preset="tiny", **kw)


def mlp(inputs: str = "float32[4,16]", **kw: Any) -> JobSpec:
    return job("tests.models.broken:mlp", [inputs], **kw)


# --- fingerprint ----------------------------------------------------------------------


FINGERPRINT_SCRIPT = """
import json, sys
from farm.core.specs import JobSpec
from farm.build.trace import trace
print(json.dumps(trace(JobSpec.from_json(json.loads(sys.argv[1]))).to_json()))
"""


def _trace_in_subprocess(spec: JobSpec, hashseed: str) -> dict[str, object]:
    env = {**os.environ, "PYTHONHASHSEED": hashseed,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    out = subprocess.run(
        [sys.executable, "-c", FINGERPRINT_SCRIPT, json.dumps(spec.to_json())],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=300, check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_fingerprint_is_stable_across_processes_and_hash_seeds() -> None:
    spec = tiny_llama()
    a = _trace_in_subprocess(spec, "1")
    b = _trace_in_subprocess(spec, "2")
    here = trace(spec)
    assert a["fingerprint"] == b["fingerprint"] == here.fingerprint
    assert a["graph_hash"] == b["graph_hash"] == here.graph_hash


def test_same_model_twice_in_one_process_gives_same_fingerprint() -> None:
    # The second trace must not be answered by Dynamo's cache of the first.
    first, second = trace(mlp()), trace(mlp())
    assert first.fingerprint == second.fingerprint
    assert second.graph_nodes == first.graph_nodes > 0


@pytest.mark.parametrize(
    "changed",
    [
        mlp(hidden=48),  # a different hidden size
        mlp(act="gelu"),  # a different activation
        mlp("float32[8,16]"),  # a different input shape
        mlp("float32[2..64,16]"),  # the batch dim dynamic
        mlp(grad_mode=GradMode.TRAINING),
        mlp(options=CompileOptions(mode="max-autotune")),
    ],
    ids=["hidden", "activation", "input-shape", "dynamic-dim", "grad-mode", "options"],
)
def test_a_changed_model_or_spec_changes_the_fingerprint(changed: JobSpec) -> None:
    assert trace(changed).fingerprint != trace(mlp()).fingerprint


def test_changed_llama_layer_changes_fingerprint() -> None:
    base = trace(tiny_llama())
    assert trace(tiny_llama(ffn_dim=192)).fingerprint != base.fingerprint
    assert trace(tiny_llama(n_kv_heads=4)).fingerprint != base.fingerprint
    # rope_theta lives only in forward's arithmetic: it must reach the graph.
    assert trace(tiny_llama(rope_theta=500000.0)).fingerprint != base.fingerprint


# --- failures -------------------------------------------------------------------------


def _line_of(marker: str, path: str) -> int:
    for i, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if marker in line:
            return i
    raise AssertionError(f"{marker} not in {path}")


def test_graph_break_names_reason_and_user_source_line() -> None:
    with pytest.raises(GraphBreakError) as info:
        trace(job("tests.models.broken:graph_break_model", ["float32[4,16]"]))
    err = info.value
    expected = f"{broken.__file__}:{_line_of('GRAPH_BREAK_LINE', broken.__file__)}"
    assert err.location == expected
    assert "data-dependent" in err.reason.lower()
    assert expected in str(err) and err.reason in str(err)


def test_raising_factory_gives_model_build_error_with_traceback() -> None:
    with pytest.raises(ModelBuildError) as info:
        trace(job("tests.models.broken:raising_factory", ["float32[4,16]"], message="boom 42"))
    err = info.value
    assert "boom 42" in str(err)
    assert "raising_factory" in err.traceback_text
    assert "Traceback (most recent call last)" in err.traceback_text
    assert "broken.py" in err.traceback_text


def test_errors_survive_pickling() -> None:
    import pickle

    err = GraphBreakError("why", location="m.py:3", detail="all of it")
    back = pickle.loads(pickle.dumps(err))
    assert (type(back), back.reason, back.location, str(back)) == (
        GraphBreakError, "why", "m.py:3", str(err))
    imp = ModelImportError("no", module="a.b", attribute="c", traceback_text="tb")
    back_imp = pickle.loads(pickle.dumps(imp))
    assert (back_imp.module, back_imp.attribute, str(back_imp)) == ("a.b", "c", str(imp))


def test_import_errors_name_module_and_attribute() -> None:
    with pytest.raises(ModelImportError) as info:
        load_callable("farm.zoo.no_such_module:f")
    assert info.value.module == "farm.zoo.no_such_module"
    assert "ModuleNotFoundError" in str(info.value)
    with pytest.raises(ModelImportError) as info:
        load_callable("farm.zoo.llama:no_such_factory")
    assert info.value.attribute == "no_such_factory"
    assert "no_such_factory" in str(info.value)


def test_factory_returning_a_non_module_is_a_build_error() -> None:
    with pytest.raises(ModelBuildError, match=r"expected a torch\.nn\.Module"):
        build_module(ModelRef("farm.zoo.llama:param_count", kwargs=PRESETS["tiny"]))


def test_dynamic_dim_the_model_specialises_is_reported() -> None:
    spec = job("tests.models.broken:specializing_model", ["float32[4..32,16]"])
    with pytest.raises(DynamicDimError) as info:
        trace(spec)
    assert "specialized" in info.value.reason
    assert info.value.location is not None and info.value.location.startswith(broken.__file__)
    # The same model with a static batch is fine.
    trace(job("tests.models.broken:specializing_model", ["float32[4,16]"]))


def test_inputs_the_model_cannot_take_are_a_capture_error_not_a_graph_break() -> None:
    # Token ids given as floats: embedding fails on the fake inputs.
    with pytest.raises(CaptureError) as info:
        trace(job("farm.zoo.llama:llama", ["float32[2,16]"], preset="tiny"))
    assert not isinstance(info.value, GraphBreakError)
    assert info.value.location is not None and "llama.py" in info.value.location


# --- the report -----------------------------------------------------------------------


def test_tiny_llama_traces_whole_with_correct_param_count() -> None:
    report = trace(tiny_llama())
    expected = param_count(**PRESETS["tiny"])
    real = sum(p.numel() for p in llama(preset="tiny").parameters())
    assert report.param_count == expected == real
    assert report.param_bytes == 2 * expected  # bf16
    assert report.buffer_bytes == 0
    assert report.capture == "dynamo+regions"
    assert report.regions == PRESETS["tiny"]["n_layers"]
    assert report.ops["torch._C._nn.linear"] == 7 * PRESETS["tiny"]["n_layers"] + 1
    json.dumps(report.to_json())
    assert TraceReport.from_json(report.to_json()) == report


def test_regions_change_nothing_but_the_capture() -> None:
    with_regions = trace(tiny_llama())
    plain = trace(tiny_llama(), regions=False)
    assert plain.capture == "dynamo"
    assert plain.flops == with_regions.flops
    assert plain.param_count == with_regions.param_count
    assert plain.ops["torch._C._nn.linear"] == with_regions.ops["torch._C._nn.linear"]


def test_llama_flops_match_eager_flop_counter() -> None:
    from torch.utils.flop_counter import FlopCounterMode

    report = trace(tiny_llama())
    with torch.device("meta"):
        model = llama(preset="tiny").eval()
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(torch.zeros(2, 16, dtype=torch.int64, device="meta"))
    assert report.flops == counter.get_total_flops() > 0


@pytest.mark.parametrize("shape", [[8, 64], [2, 8, 64]])
def test_linear_flops_are_2mnk(shape: list[int]) -> None:
    spec = job("tests.models.broken:linear", [f"float32[{','.join(map(str, shape))}]"],
               in_features=64, out_features=32)
    m = 1
    for d in shape[:-1]:
        m *= d
    assert trace(spec).flops == 2 * m * 32 * 64


def test_dynamic_dims_are_accepted_and_flops_use_the_example_size() -> None:
    report = trace(job("tests.models.broken:linear", ["float32[2..64,64]"],
                       in_features=64, out_features=32))
    assert report.flops == 2 * 2 * 32 * 64  # at the example (lowest) size
    llama_dyn = trace(job("farm.zoo.llama:llama", ["int64[2..8,16]"], preset="tiny"))
    assert llama_dyn.fingerprint != trace(tiny_llama()).fingerprint


def test_free_function_and_decorated_forward_trace() -> None:
    fn = trace(job("tests.models.broken:add_one", ["float32[4,4]"], kind="function"))
    assert fn.param_count == 0 and fn.graph_nodes >= 2
    deco = trace(job("tests.models.broken:decorated_forward_model", ["float32[4,16]"]))
    assert deco.param_count == 16 * 16 + 16


# --- building -------------------------------------------------------------------------


def test_build_on_meta_allocates_nothing_and_materialize_is_deterministic() -> None:
    ref = ModelRef("farm.zoo.llama:llama", kwargs={"preset": "tiny"})
    meta = build_module(ref)
    assert isinstance(meta, torch.nn.Module)
    assert all(p.device.type == "meta" for p in meta.parameters())

    a = build_module(ref, device="cpu")
    b = materialize(build_module(ref), "cpu")
    assert isinstance(a, torch.nn.Module)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert isinstance(pa, torch.nn.Parameter), name
        assert torch.equal(pa, pb), name
        assert torch.isfinite(pa.float()).all(), name
    tokens = torch.zeros(2, 16, dtype=torch.int64)
    with torch.no_grad():
        out = a.eval()(tokens)
    assert out.shape == (2, 16, PRESETS["tiny"]["vocab"])
    assert torch.isfinite(out.float()).all()


def test_llama_70b_shape_is_the_requested_one() -> None:
    with torch.device("meta"):
        m = llama(preset="70b")
    assert len(m.layers) == 80
    assert m.layers[0].attn.wq.weight.shape == (8192, 8192)
    assert m.layers[0].attn.wk.weight.shape == (1024, 8192)  # 8 kv heads of 128
    assert m.layers[0].ffn.w1.weight.shape == (28672, 8192)
    n = sum(p.numel() for p in m.parameters())
    assert n == param_count(**PRESETS["70b"])
    assert 68e9 < n < 70e9
