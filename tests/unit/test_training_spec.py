"""The training_step job spec: its train section parses back to itself,
names the program in the fingerprint, and refuses what cannot be built."""

from __future__ import annotations

import pytest
import torch

from farm.core.modelref import build_module, build_real, model_class_name
from farm.core.specs import JobSpec, SpecError
from farm.core.training import LossStep, make_optimizer, optimizer_tensors


def job(**train: object) -> dict[str, object]:
    return {"name": "t", "version": "1", "grad_mode": "training",
            "model": {"entrypoint": "tests.models.training:make", "kind": "training_step",
                      "train": {"loss": "torch.nn.functional:mse_loss", **train}},
            "inputs": ["float32[8,8]", "float32[8,1]"]}


def test_train_section_round_trips_and_names_the_program() -> None:
    spec = JobSpec.from_json(job(optimizer="AdamW", optimizer_kwargs={"lr": 0.01}))
    assert JobSpec.from_json(spec.to_json()) == spec
    assert spec.to_json()["model"]["train"] == {
        "loss": "torch.nn.functional:mse_loss", "targets": 1, "optimizer": "AdamW",
        "optimizer_kwargs": {"lr": 0.01}}
    other = JobSpec.from_json(job(optimizer="SGD", optimizer_kwargs={"lr": 0.01}))
    # Two ways to train one model: two programs, two fingerprints.
    assert spec.model.identity != other.model.identity
    assert spec.model.identity.startswith("tests.models.training:make|train:")
    # A plain factory's identity is its entrypoint: existing keys do not move.
    plain = JobSpec.from_json({**job(), "model": {"entrypoint": "tests.models.training:make"}})
    assert plain.model.identity == "tests.models.training:make"
    assert "train" not in plain.to_json()["model"]


@pytest.mark.parametrize(("change", "words"), [
    ({"grad_mode": "inference"}, "set grad_mode 'training'"),
    ({"inputs": ["float32[8,1]"]}, "at least one input before the loss's targets"),
    ({"model": {"entrypoint": "tests.models.training:make", "kind": "training_step"}},
     "needs a train section"),
    ({"model": {"entrypoint": "tests.models.training:make",
                "train": {"loss": "torch.nn.functional:mse_loss"}}}, "only that kind"),
])
def test_bad_training_jobs_say_what_to_do(change: dict[str, object], words: str) -> None:
    with pytest.raises(SpecError, match=words):
        JobSpec.from_json({**job(), **change})


@pytest.mark.parametrize(("train", "words"), [
    ({"loss": "mse"}, "bad train.loss"),
    ({"loss": "torch.nn.functional:mse_loss", "optimizer": "torch.optim.SGD"},
     "a torch.optim class name"),
    ({"loss": "torch.nn.functional:mse_loss", "targets": -1}, "count of trailing inputs"),
    ({"loss": "torch.nn.functional:mse_loss", "lr": 0.1}, "unknown train fields: lr"),
])
def test_bad_train_sections(train: dict[str, object], words: str) -> None:
    data = job()
    data["model"] = {**data["model"], "train": train}  # type: ignore[dict-item]
    with pytest.raises(SpecError, match=words):
        JobSpec.from_json(data)


def test_the_build_compiles_the_loss_step_of_the_factory_module() -> None:
    spec = JobSpec.from_json(job(optimizer="SGD", optimizer_kwargs={"lr": 0.1, "momentum": 0.9}))
    meta = build_module(spec.model, device="meta")
    real = build_real(spec.model, device="cpu")
    assert isinstance(meta, LossStep) and isinstance(real, LossStep)
    assert model_class_name(real) == "tests.models.training.Regressor+loss"
    x, y = torch.randn(8, 8), torch.randn(8, 1)
    loss = real(x, y)
    assert loss.dim() == 0
    torch.testing.assert_close(loss, torch.nn.functional.mse_loss(real.model(x), y))
    assert spec.model.train is not None
    opt = make_optimizer(spec.model.train, real.parameters())
    assert opt.defaults["foreach"] is True and opt.defaults["momentum"] == 0.9
    loss.backward()
    opt.step()
    names = {id(p): n for n, p in real.named_parameters()}
    assert sorted(optimizer_tensors(opt, names)) == sorted(
        f"{n}.momentum_buffer" for n, _ in real.named_parameters())


def test_torch_cannot_aot_compile_an_optimizer_step() -> None:
    """Why the farm runs the optimizer step uncompiled (farm.core.training):
    Optimizer.step graph-breaks on purpose, and aot_compile needs one full
    graph. When a torch release lifts this, this test fails, and the farm
    can compile the step as a second program."""
    from farm.core.torch_compat import enable_aot_compile

    enable_aot_compile()
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=True)
    model(torch.randn(3, 4)).sum().backward()
    with pytest.raises(Exception, match="graph_break"):
        torch.compile(opt.step, fullgraph=True, backend="eager").aot_compile(((), {}))


def test_farm_submit_loss_makes_a_training_step(monkeypatch: pytest.MonkeyPatch) -> None:
    from farm.app import cli, commands

    calls: list[object] = []

    class FakeClient:
        def submit(self, spec: object, *, source: object = None) -> dict[str, object]:
            calls.append(spec)
            return {"id": "j1", "state": "queued", "code": None}

    monkeypatch.setattr(commands, "farm_client", lambda args: FakeClient())
    argv = ["submit", "farm.zoo.basic:mlp", "--name", "m", "--version", "1",
            "-i", "float32[8,8]", "-i", "float32[8,1]", "--loss", "torch.nn.functional:mse_loss",
            "--optimizer", "AdamW", "--optimizer-kwargs", '{"lr": 0.01}']
    assert cli.main(argv) == 0
    (spec,) = calls
    assert isinstance(spec, JobSpec)
    assert spec.model.kind == "training_step" and spec.grad_mode.value == "training"
    assert spec.model.train is not None
    assert spec.model.train.to_json() == {"loss": "torch.nn.functional:mse_loss", "targets": 1,
                                          "optimizer": "AdamW", "optimizer_kwargs": {"lr": 0.01}}
    # A training step of a free function does not exist: said, not submitted.
    assert cli.main([*argv, "--function"]) != 0
    assert len(calls) == 1
