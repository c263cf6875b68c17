"""How a build chooses its weights (farm.build.weightless.build_for_compile and
farm.build.fake_weights), with the GPU's memory figures stubbed: the decision
and the messages are plain Python; a FakeTensor on "cuda" needs no GPU."""

from __future__ import annotations

import pytest
import torch

import farm.build.weightless as weightless
from farm.build.fake_weights import WeightsPlan, describe_failure
from farm.core.specs import JobSpec

GIB = 1024**3


def job(weights: str | None = None, **options: object) -> JobSpec:
    opts: dict[str, object] = dict(options)
    if weights is not None:
        opts["weights"] = weights
    return JobSpec.from_json({"name": "m", "version": "1",
                              "model": {"entrypoint": "farm.zoo.basic:mlp"},
                              "inputs": ["float32[4,64]"], "options": opts})


@pytest.fixture
def tiny_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """A build GPU with 1 KiB free: no model's weights fit."""
    monkeypatch.setattr(weightless, "usable_gpu_memory", lambda device: (1024, 2048))


def test_auto_builds_fake_weights_on_cuda_when_they_do_not_fit(tiny_gpu: None) -> None:
    from torch._subclasses.fake_tensor import FakeTensor

    model, plan = weightless.build_for_compile(job(), torch.device("cuda"))
    assert plan.mode == "fake"
    assert plan.why.startswith("they do not fit the build device: the model's weights take")
    assert plan.does_not_fit is not None
    w = model.fc1.weight
    assert isinstance(w, FakeTensor) and w.device.type == "cuda" and not model.training


def test_empty_keeps_the_early_failure_with_the_numbers(tiny_gpu: None) -> None:
    with pytest.raises(weightless.ModelDoesNotFit, match=r"weights take 0\.0 GiB, and cuda "
                                                          r"has 0\.0 of 0\.0 GiB free"):
        weightless.build_for_compile(job("empty"), torch.device("cuda"))


def test_a_tensor_parallel_build_that_does_not_fit_says_fake_cannot_help(
        tiny_gpu: None) -> None:
    parallel = {"world_size": 2, "mesh_shape": [2], "mesh_dim_names": ["tp"],
                "plan": {"fc1": "colwise", "fc2": "rowwise"}}
    with pytest.raises(weightless.ModelDoesNotFit, match="a fake-weight build cannot help: a "
                                                          "tensor-parallel build"):
        weightless.build_for_compile(job(parallel=parallel), torch.device("cuda"))


def test_cpu_and_weights_that_fit_build_as_before() -> None:
    model, plan = weightless.build_for_compile(job(), torch.device("cpu"))
    assert plan.mode == "empty" and plan.why == "they fit the build device"
    assert type(model.fc1.weight) is torch.nn.Parameter


def test_fake_on_request_on_cpu() -> None:
    model, plan = weightless.build_for_compile(job("fake"), torch.device("cpu"))
    assert plan.to_json() == {"mode": "fake", "why": "asked for (options.weights fake)"}
    assert model.fc1.weight.device.type == "cpu"
    assert type(model.fc1.weight).__name__ == "FakeTensor"


def test_a_failed_fake_build_keeps_the_numbers_and_adds_torchs_reason() -> None:
    plan = WeightsPlan("fake", "x", does_not_fit="the model's weights take 2.0 GiB, and ...")
    msg = describe_failure(plan, RuntimeError("No CUDA GPUs are available\nmore"))
    assert msg == ("the model's weights take 2.0 GiB, and .... A fake-weight build (no memory "
                   "for the weights) was tried and torch could not do it: RuntimeError: No CUDA "
                   "GPUs are available")


def test_the_fit_check_sees_a_per_process_memory_fraction(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (100 * GIB, 140 * GIB))
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction",
                        lambda device=None: 1.0 / 140, raising=False)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: GIB // 4)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    free, total = weightless.usable_gpu_memory(torch.device("cuda"))
    assert (free, total) == (GIB - GIB // 4, 140 * GIB)
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction",
                        lambda device=None: 1.0, raising=False)
    assert weightless.usable_gpu_memory(torch.device("cuda")) == (100 * GIB, 140 * GIB)
