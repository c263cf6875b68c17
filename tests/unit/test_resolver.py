"""The resolver against a cross product of targets, with no GPU.

Every pair (node target, artifact target) is checked against an oracle written
here from the rules, and against the installed torch's own
``SystemInfo.check_compatibility`` run both ways round; messages are checked
word for word.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import replace
from datetime import datetime, timedelta, timezone
from typing import Any
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from farm.core.inputs import TensorSpec, parse_inputs
from farm.core.specs import CompileOptions, GradMode
from farm.core.target import Target
from registry import resolver
from registry.entities import ArtifactRecord
from registry.resolver import Rejection, Resolution, resolve

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
INPUTS = parse_inputs(["float32[8,64]"])

# --------------------------------------------------------------------------- #
# The cross product of targets
# --------------------------------------------------------------------------- #

TORCHES = ("2.11.0+cu130", "2.13.0+cpu", "2.13.0+cu130")
PYTHONS = ("3.11.7", "3.12.3")
GPUS = (
    ("NVIDIA H200", "9.0"),
    ("NVIDIA H100 80GB HBM3", "9.0"),
    ("NVIDIA A100-SXM4-80GB", "8.0"),
)
TRITONS = ("3.5", "3.6")
CUDAS = ("12.8", "13.0")
ISAS = ("avx2", "avx512")
THREADS = (2, 8)

CPU_TARGETS = [
    Target(device="cpu", python_version=py, torch_version=tv, cpu_isa=isa, threads=n)
    for isa, n, tv, py in itertools.product(ISAS, THREADS, TORCHES, PYTHONS)
]
CUDA_TARGETS = [
    Target(
        device="cuda",
        python_version=py,
        torch_version=tv,
        gpu_name=gpu,
        capability=cc,
        cuda_version=cu,
        triton_version=tr,
    )
    for (gpu, cc), tv, py, tr, cu in itertools.product(GPUS, TORCHES, PYTHONS, TRITONS, CUDAS)
]
_CPU = CPU_TARGETS[0]  # avx2, 2 threads, torch 2.11.0+cu130, python 3.11.7
_GPU = CUDA_TARGETS[0]  # H200 9.0, torch 2.11.0+cu130, python 3.11.7, triton 3.5, cuda 12.8
# Facts a side may not know, and a same-named GPU of another capability.
EDGE_TARGETS = [
    replace(_CPU, threads=None),
    replace(_CPU, cpu_isa=None),
    replace(_CPU, cpu_isa=None, threads=None),
    replace(_GPU, triton_version=None),
    replace(_GPU, capability=None),
    replace(_GPU, capability="9.1"),
    replace(_GPU, cpu_isa="avx512"),  # a cuda artifact that holds CPU kernels
    replace(_GPU, cpu_isa="avx2", threads=8),
]
ALL_TARGETS = CPU_TARGETS + CUDA_TARGETS + EDGE_TARGETS
assert len(set(ALL_TARGETS)) == len(ALL_TARGETS) == 24 + 72 + 8


def art(id: int, target: Target = _CPU, **kw: Any) -> ArtifactRecord:
    values: dict[str, Any] = {
        "id": id,
        "digest": f"{id:064x}",
        "size": 1000,
        "format": "aot_compile",
        "fingerprint": "f" * 64,
        "build_key": f"{id:064x}",
        "inputs": INPUTS,
        "grad_mode": GradMode.INFERENCE,
        "options": CompileOptions(),
        "target": target,
        "created_at": T0,
    }
    values.update(kw)
    return ArtifactRecord(**values)


def only(artifact: ArtifactRecord, node: Target = _CPU, **kw: Any) -> Resolution:
    kw.setdefault("inputs", INPUTS)
    kw.setdefault("grad_mode", GradMode.INFERENCE)
    return resolve([artifact], target=node, **kw)


def reason(artifact: ArtifactRecord, node: Target = _CPU, **kw: Any) -> tuple[str, str]:
    res = only(artifact, node, **kw)
    assert not res.accepted, "expected a rejection"
    (rej,) = res.rejected
    return rej.code, rej.reason


# --------------------------------------------------------------------------- #
# The oracle, written from the rules and not from the resolver
# --------------------------------------------------------------------------- #


def oracle(a: Target, n: Target) -> str | None:
    """The first rule an artifact built for ``a`` breaks on node ``n``, or None."""
    if a.device != n.device:
        return "device"
    if a.python_version != n.python_version:
        return "python"
    if a.torch_version != n.torch_version:
        return "torch"
    if a.device == "cuda":
        if a.cuda_version != n.cuda_version:
            return "cuda"
        if a.triton_version != n.triton_version:
            return "triton"
        if a.gpu_name != n.gpu_name:
            return "gpu"
        if a.capability and n.capability and a.capability != n.capability:
            return "capability"
    isa_checked = a.device == "cpu" or a.cpu_isa is not None
    if isa_checked and (a.cpu_isa is None or a.cpu_isa != n.cpu_isa):
        return "isa"
    if a.threads is not None and a.threads != n.threads:
        return "threads"
    return None


ARTIFACTS = [art(i, t) for i, t in enumerate(ALL_TARGETS)]


@pytest.mark.parametrize("node", ALL_TARGETS, ids=str)
def test_cross_product_matches_oracle(node: Target) -> None:
    res = resolve(ARTIFACTS, target=node, inputs=INPUTS, grad_mode=GradMode.INFERENCE)
    got: dict[int, str | None] = {a.id: None for a in res.accepted}
    got.update({r.artifact.id: r.code for r in res.rejected})
    assert sorted(got) == [a.id for a in ARTIFACTS]
    for a in ARTIFACTS:
        assert got[a.id] == oracle(a.target, node), f"artifact {a.target} on node {node}"
    # A node always loads what was built on a machine exactly like it, unless
    # that machine could not say which ISA it has.
    own = [a for a in ARTIFACTS if a.target == node]
    if node.device == "cuda" or node.cpu_isa:
        assert own and own[0] in res.accepted


def test_cross_product_accepts_only_exact_toolchains() -> None:
    # Among the full targets nothing but the same python/torch/toolkit/Triton/GPU
    # loads: count the accepted pairs independently of the oracle.
    full = CPU_TARGETS + CUDA_TARGETS
    arts = [art(i, t) for i, t in enumerate(full)]
    pairs = sum(
        len(resolve(arts, target=n, inputs=INPUTS, grad_mode=GradMode.INFERENCE).accepted)
        for n in full
    )
    assert pairs == len(full)


def test_cross_product_reaches_every_target_rule() -> None:
    seen: set[str | None] = set()
    for node in ALL_TARGETS:
        seen.update(oracle(a.target, node) for a in ARTIFACTS)
    target_rules = {"device", "python", "torch", "cuda", "triton", "gpu", "capability", "isa"}
    assert seen >= target_rules | {"threads", None}


# --------------------------------------------------------------------------- #
# The installed torch's own check, both ways round
# --------------------------------------------------------------------------- #


def _system_info(cls: Any, t: Target) -> Any:
    triton = tuple(int(p) for p in t.triton_version.split(".")) if t.triton_version else (0, 0)
    return cls(
        python_version=t.python_version,
        torch_version=t.torch_version,
        toolkit_version=t.cuda_version,
        triton_version=triton,
        gpu_name=t.gpu_name,
    )


def _torch_loads(cls: Any, torch: Any, a: Target, n: Target, *, artifact_first: bool) -> bool:
    art_info, node_info = _system_info(cls, a), _system_info(cls, n)
    first, second = (art_info, node_info) if artifact_first else (node_info, art_info)
    with mock.patch.object(torch.cuda, "is_available", lambda: n.device == "cuda"):
        try:
            first.check_compatibility(second, a.device)
        except RuntimeError:
            return False
    return True


def test_never_accepts_what_installed_torch_refuses() -> None:
    package = pytest.importorskip("torch._dynamo.package")
    import torch

    cls = package.SystemInfo
    torch_refused = accepted = 0
    for node in ALL_TARGETS:
        res = resolve(ARTIFACTS, target=node, inputs=INPUTS, grad_mode=GradMode.INFERENCE)
        ok = {a.id for a in res.accepted}
        for a in ARTIFACTS:
            # load_compiled_function: current.check_compatibility(artifact);
            # the precompile cache: artifact.check_compatibility(current).
            by_aot = _torch_loads(cls, torch, a.target, node, artifact_first=False)
            by_cache = _torch_loads(cls, torch, a.target, node, artifact_first=True)
            if not (by_aot and by_cache):
                torch_refused += 1
                assert a.id not in ok, f"torch refuses {a.target} on {node}, resolver accepts"
            accepted += a.id in ok
    assert torch_refused > 0 and accepted > 0


# --------------------------------------------------------------------------- #
# Exact messages, one per rule
# --------------------------------------------------------------------------- #


def test_message_unknown_format() -> None:
    assert reason(art(1, format="onnx")) == (
        "format",
        "unknown format 'onnx'; known: aot_compile, aoti",
    )


def test_message_format_filter() -> None:
    assert reason(art(1, format="aot_compile"), formats=["aoti"]) == (
        "format",
        "format 'aot_compile' is not among the requested formats: aoti",
    )


def test_message_unverified() -> None:
    assert reason(art(1, verified=False)) == (
        "unverified",
        "failed verification: the build worker could not load it in a fresh process "
        "and match eager",
    )


def test_message_device() -> None:
    assert reason(art(1, _GPU), _CPU) == (
        "device",
        "built for device cuda, the node asks for cpu",
    )
    assert reason(art(1, _CPU), _GPU) == (
        "device",
        "built for device cpu, the node asks for cuda",
    )


def test_message_python() -> None:
    assert reason(art(1), replace(_CPU, python_version="3.11.9")) == (
        "python",
        "built with Python 3.11.7, the node runs Python 3.11.9; torch refuses to load it",
    )


def test_message_torch() -> None:
    assert reason(art(1), replace(_CPU, torch_version="2.13.0+cpu")) == (
        "torch",
        "built with torch 2.11.0+cu130, the node runs torch 2.13.0+cpu; torch refuses to load it",
    )


def test_message_cuda() -> None:
    assert reason(art(1, _GPU), replace(_GPU, cuda_version="13.0")) == (
        "cuda",
        "built with CUDA toolkit 12.8, the node has CUDA toolkit 13.0; torch refuses to load it",
    )


def test_message_triton() -> None:
    assert reason(art(1, _GPU), replace(_GPU, triton_version="3.6")) == (
        "triton",
        "built with Triton 3.5, the node has Triton 3.6; "
        "torch refuses a different Triton major.minor",
    )
    assert reason(art(1, _GPU), replace(_GPU, triton_version=None)) == (
        "triton",
        "built with Triton 3.5, the node has no Triton; torch refuses to load it",
    )
    assert reason(art(1, replace(_GPU, triton_version=None)), _GPU) == (
        "triton",
        "built without Triton, the node has Triton 3.5; torch's precompile cache refuses it",
    )


def test_triton_patch_version_does_not_matter() -> None:
    # torch compares (major, minor) only.
    a = art(1, replace(_GPU, triton_version="3.5.0"))
    assert only(a, replace(_GPU, triton_version="3.5.1")).accepted == [a]


def test_message_gpu() -> None:
    assert reason(art(1, _GPU), replace(_GPU, gpu_name="NVIDIA H100 80GB HBM3")) == (
        "gpu",
        "built for GPU 'NVIDIA H200', the node has GPU 'NVIDIA H100 80GB HBM3'; "
        "torch refuses to load it",
    )


def test_message_capability() -> None:
    assert reason(art(1, _GPU), replace(_GPU, capability="9.1")) == (
        "capability",
        "built for compute capability 9.0, the node's GPU has compute capability 9.1",
    )


def test_capability_unknown_on_either_side_is_not_compared() -> None:
    a = art(1, replace(_GPU, capability=None))
    assert only(a, _GPU).accepted == [a]
    b = art(2, _GPU)
    assert only(b, replace(_GPU, capability=None)).accepted == [b]


def test_message_isa() -> None:
    assert reason(art(1, replace(_CPU, cpu_isa="avx512")), _CPU) == (
        "isa",
        "built for CPU vector ISA 'avx512', the node's is 'avx2'; the ISA is baked into "
        "the generated code and torch does not check it (wrong numbers or a crash)",
    )
    assert reason(art(1, replace(_CPU, cpu_isa=None)), _CPU) == (
        "isa",
        "records no CPU vector ISA, so it cannot be matched to the node's ('avx2')",
    )
    assert reason(art(1, _CPU), replace(_CPU, cpu_isa=None)) == (
        "isa",
        "built for CPU vector ISA 'avx2', the node reports no CPU vector ISA",
    )


def test_message_threads() -> None:
    assert reason(art(1, _CPU), replace(_CPU, threads=8)) == (
        "threads",
        "built for 2 threads, the node runs 8 threads; the thread count is "
        "guarded and baked into CPU code",
    )
    assert reason(art(1, _CPU), replace(_CPU, threads=None)) == (
        "threads",
        "built for 2 threads, the node does not report its thread count",
    )


def test_artifact_without_thread_count_is_accepted() -> None:
    a = art(1, replace(_CPU, threads=None))
    assert only(a, replace(_CPU, threads=64)).accepted == [a]


def test_message_grad_mode() -> None:
    assert reason(art(1), grad_mode=GradMode.TRAINING) == (
        "grad_mode",
        "compiled for grad mode inference, requested training; guards pin it",
    )


def test_message_options() -> None:
    a = art(1, options=CompileOptions(mode="max-autotune"))
    assert reason(a, options=CompileOptions()) == (
        "options",
        'compiled with options {"backend":"inductor","guard_filter":"drop-unserializable",'
        '"mode":"max-autotune"}, requested {"backend":"inductor",'
        '"guard_filter":"drop-unserializable","mode":"default"}',
    )
    b = art(2, options=CompileOptions(guard_filter="keep-all"))
    assert reason(b, options=CompileOptions())[0] == "options"


def test_message_inputs() -> None:
    assert reason(art(1), inputs=parse_inputs(["float32[9,64]"])) == (
        "inputs",
        "input specs float32[8,64] do not cover the requested float32[9,64]",
    )


def test_first_broken_rule_is_reported() -> None:
    # Wrong python, wrong grad mode and unverified: the earliest rule wins.
    a = art(1, replace(_CPU, python_version="3.12.3"), verified=False)
    assert reason(a, grad_mode=GradMode.TRAINING)[0] == "unverified"
    b = art(2, replace(_CPU, python_version="3.12.3"))
    assert reason(b, grad_mode=GradMode.TRAINING)[0] == "python"


def test_every_code_is_listed() -> None:
    assert set(resolver.CODES) == {
        "format", "unverified", "device", "python", "torch", "cuda", "triton", "gpu",
        "capability", "isa", "threads", "libstdcxx", "grad_mode", "layout", "options",
        "inputs",
    }  # fmt: skip


def test_rejection_str_names_the_artifact() -> None:
    rej = only(art(7, verified=False)).rejected[0]
    assert isinstance(rej, Rejection)
    assert str(rej).startswith("artifact 7: failed verification")


def test_bad_formats_argument() -> None:
    with pytest.raises(
        ValueError, match="unknown formats requested: onnx; known: aot_compile, aoti"
    ):
        only(art(1), formats=["onnx"])
    with pytest.raises(ValueError, match="sequence of format names"):
        only(art(1), formats="aoti")


# --------------------------------------------------------------------------- #
# Options
# --------------------------------------------------------------------------- #


def test_options_given_must_match_exactly() -> None:
    want = CompileOptions(mode="max-autotune-no-cudagraphs")
    a = art(1, options=want)
    b = art(2)
    res = resolve([a, b], target=_CPU, inputs=INPUTS, grad_mode=GradMode.INFERENCE, options=want)
    assert res.accepted == [a]
    assert [r.code for r in res.rejected] == ["options"]


def test_options_none_accepts_any_and_prefers_default() -> None:
    tuned = art(1, options=CompileOptions(mode="max-autotune"), created_at=T0 + timedelta(1))
    keep = art(2, options=CompileOptions(guard_filter="keep-all"), created_at=T0 + timedelta(2))
    nocg = art(3, options=CompileOptions(mode="max-autotune-no-cudagraphs"))
    default = art(4)
    res = resolve(
        [tuned, keep, nocg, default], target=_CPU, inputs=INPUTS, grad_mode=GradMode.INFERENCE
    )
    assert [a.id for a in res.accepted] == [4, 2, 1, 3]


# --------------------------------------------------------------------------- #
# Preference order
# --------------------------------------------------------------------------- #


def order(cands: Sequence[ArtifactRecord], node: Target = _CPU, **kw: Any) -> list[int]:
    kw.setdefault("inputs", INPUTS)
    res = resolve(cands, target=node, grad_mode=GradMode.INFERENCE, **kw)
    assert not res.rejected, [r.reason for r in res.rejected]
    return [a.id for a in res.accepted]


def test_finished_before_first_call_compiles() -> None:
    # The unfinished one is newer, static and in the preferred format: still last.
    unfinished = art(1, format="aoti", first_call_compiles=True, created_at=T0 + timedelta(9))
    finished = art(2, format="aot_compile", inputs=parse_inputs(["float32[2..64,64]"]))
    assert order([unfinished, finished]) == [2, 1]


def test_a_full_graph_build_of_a_version_takes_over_from_its_per_block_build() -> None:
    """A version submitted per-block (a rebuild in seconds) and again without
    it: nodes get the per-block artifact until the full graph's are there,
    then those (the AOTI package first), though the per-block one is newer."""
    for node in (_CPU, _GPU):
        quick = art(1, node, options=CompileOptions(per_block=True),
                    created_at=T0 + timedelta(1))
        assert order([quick], node) == [1]
        full, package = art(2, node), art(3, node, format="aoti")
        assert order([quick, full], node) == [2, 1]
        assert order([quick, full, package], node) == [3, 2, 1]


def test_format_preference_cpu_aoti_first() -> None:
    assert order([art(1, format="aot_compile"), art(2, format="aoti")], _CPU) == [2, 1]


def test_format_preference_cuda_aoti_first() -> None:
    cands = [art(1, _GPU, format="aot_compile"), art(2, _GPU, format="aoti")]
    assert order(cands, _GPU) == [2, 1]


def test_format_before_shape() -> None:
    static_aot = art(1, format="aot_compile")
    dynamic_aoti = art(2, format="aoti", inputs=parse_inputs(["float32[2..,64]"]))
    assert order([static_aot, dynamic_aoti]) == [2, 1]


def test_static_before_dynamic_narrower_first() -> None:
    cands = [
        art(1, inputs=parse_inputs(["float32[2..,64]"])),
        art(2, inputs=parse_inputs(["float32[2..,2..]"])),
        art(3, inputs=parse_inputs(["float32[2..1024,64]"])),
        art(4, inputs=parse_inputs(["float32[8,64]"])),
        art(5, inputs=parse_inputs(["float32[4..16,64]"])),
        art(6, inputs=parse_inputs(["float32[2..16,2..128]"])),
    ]
    assert order(cands) == [4, 5, 3, 6, 1, 2]


def test_newest_first_then_id() -> None:
    cands = [
        art(5, created_at=T0),
        art(3, created_at=T0 + timedelta(seconds=1)),
        art(4, created_at=T0),
        art(1, created_at=None),
        art(2, created_at=T0 - timedelta(days=1)),
    ]
    assert order(cands) == [3, 4, 5, 2, 1]


def test_naive_created_at_is_utc() -> None:
    # SQLite returns naive datetimes; the registry writes UTC.
    naive = art(1, created_at=datetime(2026, 1, 1, 0, 0, 1))
    aware = art(2, created_at=T0)
    assert order([aware, naive]) == [1, 2]


def test_best() -> None:
    assert only(art(1, verified=False)).best is None
    a = art(2)
    assert only(a).best == a


PERMUTABLE = [
    art(1, format="aoti", created_at=T0),
    art(2, format="aoti", created_at=T0),
    art(3, format="aot_compile", created_at=T0 + timedelta(1)),
    art(4, format="aoti", inputs=parse_inputs(["float32[2..64,64]"])),
    art(5, format="aoti", first_call_compiles=True),
    art(6, format="aoti", created_at=None),
    art(7, format="aoti", verified=False),
    art(8, format="aoti", target=replace(_CPU, threads=8)),
]


@settings(max_examples=50, deadline=None)
@given(st.permutations(PERMUTABLE))
def test_order_is_deterministic(cands: list[ArtifactRecord]) -> None:
    res = resolve(cands, target=_CPU, inputs=INPUTS, grad_mode=GradMode.INFERENCE)
    assert [a.id for a in res.accepted] == [1, 2, 6, 4, 3, 5]
    assert [r.artifact.id for r in res.rejected] == [7, 8]


# --------------------------------------------------------------------------- #
# Dynamic dims
# --------------------------------------------------------------------------- #

DYN = parse_inputs(["float32[2..64,128]"])


@pytest.mark.parametrize(
    "request_text",
    ["float32[2,128]", "float32[8,128]", "float32[64,128]", "float32[2..64,128]",
     "float32[4..16,128]"],
)  # fmt: skip
def test_dynamic_range_serves_every_shape_inside(request_text: str) -> None:
    a = art(1, inputs=DYN)
    assert only(a, inputs=parse_inputs([request_text])).accepted == [a]


@pytest.mark.parametrize(
    "request_text",
    [
        "float32[1,128]",  # torch specialises 1: outside every dynamic range
        "float32[0,128]",
        "float32[65,128]",
        "float32[2..65,128]",  # a request range must fit whole
        "float32[2..,128]",
        "float32[8,64]",
        "float32[8,2..128]",
        "bfloat16[8,128]",
        "float32[8,128,1]",
        "float32[8]",
    ],
)
def test_dynamic_range_rejects_shapes_outside(request_text: str) -> None:
    code, _ = reason(art(1, inputs=DYN), inputs=parse_inputs([request_text]))
    assert code == "inputs"


def test_unbounded_range() -> None:
    a = art(1, inputs=parse_inputs(["float32[2..,128]"]))
    for text in ("float32[2,128]", "float32[100000,128]", "float32[3..,128]"):
        assert only(a, inputs=parse_inputs([text])).accepted == [a]
    assert reason(a, inputs=parse_inputs(["float32[1,128]"]))[0] == "inputs"


def test_several_inputs_each_covered() -> None:
    a = art(1, inputs=parse_inputs(["float32[2..64,128]", "int64[2..64]"]))
    good = parse_inputs(["float32[16,128]", "int64[16]"])
    assert only(a, inputs=good).accepted == [a]
    for bad in (
        ["float32[16,128]"],
        ["float32[16,128]", "int64[65]"],
        ["int64[16]", "float32[16,128]"],
        ["float32[16,128]", "int64[16]", "int64[16]"],
    ):
        assert reason(a, inputs=parse_inputs(bad))[0] == "inputs"


def test_dynamic_message_shows_ranges() -> None:
    _, why = reason(art(1, inputs=DYN), inputs=parse_inputs(["float32[2..,128]"]))
    assert why == "input specs float32[2..64,128] do not cover the requested float32[2..,128]"


@settings(max_examples=200, deadline=None)
@given(
    lo=st.integers(2, 100),
    width=st.integers(0, 100),
    size=st.integers(0, 300),
)
def test_dynamic_cover_property(lo: int, width: int, size: int) -> None:
    artifact_spec = TensorSpec.parse(f"float32[{lo}..{lo + width},4]")
    a = art(1, inputs=(artifact_spec,))
    accepted = bool(only(a, inputs=(TensorSpec.parse(f"float32[{size},4]"),)).accepted)
    assert accepted == (lo <= size <= lo + width)


def test_a_format_rejection_says_why_its_build_has_none_of_the_requested() -> None:
    failed = art(1, meta={"formats_failed": {"aoti": {
        "stage": "compile", "reason": "the AOTI package's module lacks constant4"}}})
    assert reason(failed, formats=["aoti"]) == (
        "format",
        "format 'aot_compile' is not among the requested formats: aoti; its build's aoti "
        "failed at compile: the AOTI package's module lacks constant4",
    )
    verify = art(2, meta={"formats_failed": {"aoti": {"stage": "verify",
                                                      "reason": "output: max abs error 3"}}})
    assert "its build's aoti failed at verify: output: max abs error 3" in reason(
        verify, formats=["aoti"])[1]
    skipped = art(3, meta={"formats_skipped": {"aoti": "AOTI packages are Inductor builds; "
                                                       "backend 'eager' generates no code"}})
    assert reason(skipped, formats=["aoti"])[1].endswith(
        "; its build has no aoti: AOTI packages are Inductor builds; backend 'eager' "
        "generates no code")


def test_a_node_asks_for_a_backend_and_for_disabled_guard_checks() -> None:
    inductor = art(1)
    eager = art(2, options=CompileOptions(backend="eager"))
    unguarded = art(3, options=CompileOptions(disable_guard_check=True))
    cands = [inductor, eager, unguarded]

    def best(options: CompileOptions | None) -> list[int]:
        res = resolve(cands, target=_CPU, inputs=INPUTS, grad_mode=GradMode.INFERENCE,
                      options=options)
        return [a.id for a in res.accepted]

    assert best(CompileOptions(backend="eager")) == [2]
    assert best(CompileOptions(disable_guard_check=True)) == [3]
    assert best(CompileOptions()) == [1]
    # Asking for nothing: never the unguarded one (options only when asked).
    assert best(None) == [1, 2]
    res = resolve([unguarded], target=_CPU, inputs=INPUTS, grad_mode=GradMode.INFERENCE,
                  options=CompileOptions())
    assert "disable_guard_check" in res.rejected[0].reason


# --------------------------------------------------------------------------- #
# Options only when asked: what changes a call's meaning is never a default
# --------------------------------------------------------------------------- #


def test_disable_guard_check_is_not_served_to_a_plain_request_but_is_when_asked() -> None:
    # The attacker's (or a careless team's) build is the newest and the only
    # one there: a plain request still does not get it.
    unguarded = art(1, options=CompileOptions(disable_guard_check=True),
                    created_at=T0 + timedelta(days=1))
    res = only(unguarded)
    assert res.accepted == []
    (rej,) = res.rejected
    assert rej.code == "options"
    assert rej.reason.startswith(
        "built with options the request did not ask for: disable_guard_check"), rej.reason
    # The request that names it gets it.
    asked = only(unguarded, options=CompileOptions(disable_guard_check=True))
    assert asked.accepted == [unguarded]
    # Beside a guarded build, a plain request gets the guarded one and the
    # unguarded one says why not.
    guarded = art(2)
    res = resolve([unguarded, guarded], target=_CPU, inputs=INPUTS,
                  grad_mode=GradMode.INFERENCE)
    assert res.accepted == [guarded]
    assert [r.artifact.id for r in res.rejected] == [1]


def test_cuda_max_autotune_is_served_only_when_asked() -> None:
    tuned = art(1, target=_GPU, options=CompileOptions(mode="max-autotune"))
    (rej,) = only(tuned, _GPU).rejected
    assert rej.code == "options" and "mode=max-autotune" in rej.reason, rej.reason
    assert only(tuned, _GPU, options=CompileOptions(mode="max-autotune")).accepted == [tuned]
    # No CUDA graphs: the same function, only faster; a plain request may have it.
    nocg = art(2, target=_GPU, options=CompileOptions(mode="max-autotune-no-cudagraphs"))
    assert only(nocg, _GPU).accepted == [nocg]
    # On CPU max-autotune has no CUDA graphs either.
    assert only(art(3, options=CompileOptions(mode="max-autotune"))).accepted


def test_unasked_options_rule() -> None:
    from farm.core.specs import unasked_options

    assert unasked_options(CompileOptions(), "cuda") == []
    assert unasked_options(CompileOptions(disable_guard_check=True), "cpu") == [
        "disable_guard_check"]
    assert unasked_options(CompileOptions(mode="max-autotune"), "cpu") == []
    assert len(unasked_options(CompileOptions(mode="max-autotune",
                                              disable_guard_check=True), "cuda")) == 2
    for harmless in (CompileOptions(backend="eager"), CompileOptions(guard_filter="keep-all"),
                     CompileOptions(regional=True), CompileOptions(per_block=True),
                     CompileOptions(weights="fake")):
        assert unasked_options(harmless, "cuda") == [], harmless
