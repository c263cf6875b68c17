"""Targets and selectors: canonical text, round trips, clear errors, local detection."""

from __future__ import annotations

import re
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from farm.core.target import (
    Target,
    TargetError,
    TargetSelector,
    detect_cpu_isa,
    detect_local_target,
    parse_selector,
)

H200 = Target(
    device="cuda",
    gpu_name="NVIDIA H200",
    capability="9.0",
    cuda_version="13.0",
    triton_version="3.6",
    python_version="3.12.3",
    torch_version="2.11.0+cu130",
)
CPU = Target(
    device="cpu",
    python_version="3.11.7",
    torch_version="2.13.0+cpu",
    cpu_isa="avx512",
    threads=2,
)

# --------------------------------------------------------------------------- #
# Canonical text
# --------------------------------------------------------------------------- #


def test_canonical_text() -> None:
    assert str(CPU) == "cpu/python=3.11.7/torch=2.13.0+cpu/isa=avx512/threads=2"
    assert str(H200) == (
        "cuda/gpu=NVIDIA%20H200/cc=9.0/cuda=13.0/triton=3.6/python=3.12.3/torch=2.11.0+cu130"
    )


def test_field_order_does_not_matter_when_parsing() -> None:
    text = "cpu/threads=2/isa=avx512/torch=2.13.0+cpu/python=3.11.7"
    assert Target.parse(text) == CPU


def test_awkward_values_are_quoted() -> None:
    t = Target(
        device="cuda",
        gpu_name="GPU/with=odd%chars ü",
        python_version="3.12.3",
        torch_version="2.11.0+cu130",
        cpu_isa="avx512 avx512_vnni amx_tile",  # torch's own name for AMX
    )
    text = str(t)
    assert "ü" not in text and " " not in text and text.count("/") == 4
    assert Target.parse(text) == t


def test_queue_name() -> None:
    assert CPU.queue == "compile.cpu/python=3.11.7/torch=2.13.0+cpu/isa=avx512/threads=2"


def test_json_round_trip() -> None:
    for t in (CPU, H200):
        assert Target.from_json(t.to_json()) == t


# --------------------------------------------------------------------------- #
# Round trips (hypothesis)
# --------------------------------------------------------------------------- #

values = st.text(min_size=1, max_size=30)
maybe = st.one_of(st.none(), values)
threads = st.one_of(st.none(), st.integers(1, 4096))

cpu_targets = st.builds(
    Target,
    device=st.just("cpu"),
    python_version=values,
    torch_version=values,
    triton_version=maybe,
    cpu_isa=maybe,
    threads=threads,
)
cuda_targets = st.builds(
    Target,
    device=st.just("cuda"),
    python_version=values,
    torch_version=values,
    gpu_name=values,
    capability=maybe,
    cuda_version=maybe,
    triton_version=maybe,
    cpu_isa=maybe,
    threads=threads,
)
selectors = st.builds(
    TargetSelector,
    device=st.one_of(st.none(), st.sampled_from(["cpu", "cuda"])),
    gpu_name=maybe,
    capability=maybe,
    cuda_version=maybe,
    triton_version=maybe,
    python_version=maybe,
    torch_version=maybe,
    cpu_isa=maybe,
    threads=threads,
)


@given(st.one_of(cpu_targets, cuda_targets))
def test_target_round_trip(t: Target) -> None:
    text = str(t)
    assert Target.parse(text) == t
    assert str(Target.parse(text)) == text
    assert Target.from_json(t.to_json()) == t


@given(selectors)
def test_selector_round_trip(sel: TargetSelector) -> None:
    assert TargetSelector.parse(str(sel)) == sel


@given(st.one_of(cpu_targets, cuda_targets))
def test_a_target_selects_itself(t: Target) -> None:
    assert TargetSelector.parse(str(t)).matches(t)


# --------------------------------------------------------------------------- #
# Selectors
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize(
    ("selector", "cpu", "h200"),
    [
        ("*", True, True),
        ("cpu", True, False),
        ("cuda", False, True),
        ("cuda/gpu=NVIDIA%20H200", False, True),
        ("cuda/gpu=NVIDIA%20H100", False, False),
        ("*/python=3.11.7", True, False),
        ("cpu/isa=avx2", False, False),
        ("cpu/threads=2", True, False),
    ],
)
def test_selector_matches(selector: str, cpu: bool, h200: bool) -> None:
    sel = parse_selector(selector)
    assert sel.matches(CPU) is cpu
    assert sel.matches(H200) is h200


# --------------------------------------------------------------------------- #
# Errors
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "empty target"),
        ("   ", "empty target"),
        ("tpu", "bad target 'tpu': device 'tpu' unknown; known: cpu, cuda"),
        ("/python=3.11.7", "bad target '/python=3.11.7': it starts with a device or '*'"),
        ("cpu/color=red", "bad target field 'color=red' in 'cpu/color=red'; known fields: gpu, "),
        ("cpu/python", "bad target field 'python' in 'cpu/python'"),
        ("cpu/python=3.11/python=3.12", "target field 'python' given twice"),
        ("cpu/python=", "target field 'python' has an empty value in 'cpu/python='"),
        ("cpu/threads=two", "threads must be a positive integer in 'cpu/threads=two'"),
        ("cpu/threads=0", "threads must be a positive integer"),
        ("cpu/threads=+2", "threads must be a positive integer"),
        ("cpu/threads=-2", "threads must be a positive integer"),
    ],
)
def test_bad_selector_messages(text: str, message: str) -> None:
    with pytest.raises(TargetError, match=re.escape(message)):
        TargetSelector.parse(text)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("cpu", "incomplete target 'cpu': a full target names its device, python and torch"),
        ("*/python=3.11.7/torch=2.13.0", "incomplete target"),
        ("cuda/python=3.11.7/torch=2.11.0", "a cuda target needs a GPU name"),
        (
            "cpu/gpu=NVIDIA%20H200/python=3.11.7/torch=2.13.0",
            "a cpu target has no GPU, capability or CUDA toolkit",
        ),
    ],
)
def test_bad_target_messages(text: str, message: str) -> None:
    with pytest.raises(TargetError, match=re.escape(message)):
        Target.parse(text)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"device": "tpu"}, "unknown device 'tpu'; known: cpu, cuda"),
        ({"python_version": ""}, "a target names its python and torch versions"),
        ({"threads": 0}, "threads must be a positive integer, got 0"),
        ({"threads": True}, "threads must be a positive integer, got True"),
        ({"cpu_isa": ""}, "target field cpu_isa must be a non-empty string, got ''"),
        ({"cpu_isa": 5}, "target field cpu_isa must be a non-empty string, got 5"),
    ],
)
def test_target_built_in_code_is_checked(kwargs: dict[str, Any], message: str) -> None:
    fields: dict[str, Any] = {**CPU.to_json(), **kwargs}
    with pytest.raises(TargetError, match=re.escape(message)):
        Target(**fields)


def test_from_json_rejects_unknown_fields() -> None:
    with pytest.raises(TargetError, match="unknown target fields: isa"):
        Target.from_json({**CPU.to_json(), "isa": "avx2"})


def test_with_threads() -> None:
    assert CPU.with_threads(8).threads == 8
    assert CPU.with_threads(None).threads is None


# --------------------------------------------------------------------------- #
# This machine
# --------------------------------------------------------------------------- #


def test_detect_local_cpu_target() -> None:
    pytest.importorskip("torch")
    import platform

    import torch

    t = detect_local_target("cpu")
    assert Target.parse(str(t)) == t
    assert t.device == "cpu"
    assert t.python_version == platform.python_version()
    assert t.torch_version == torch.__version__
    assert t.threads == torch.get_num_threads()
    assert t.cpu_isa and t.cpu_isa == detect_cpu_isa()
    assert t.cpu_isa != "INVALID_VEC_ISA"  # Inductor's "no usable ISA" is not an ISA


def test_detect_unknown_device() -> None:
    pytest.importorskip("torch")
    with pytest.raises(TargetError, match="unknown device 'tpu'; known: cpu, cuda"):
        detect_local_target("tpu")


def test_detect_cuda_without_gpu() -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(TargetError, match="no CUDA device on this machine"):
        detect_local_target("cuda")
