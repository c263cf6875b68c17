"""farm.node.training on an artifact built here (aot_eager, in-process, no
farm): the step loop matches eager from the same init, step after step, and
an artifact of another model is refused before it trains anything."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

from farm.build.compile import compile_artifacts
from farm.core.specs import JobSpec
from farm.core.training import optimizer_tensors
from farm.node.loader import load_artifact
from farm.node.training import compiled_train_step, eager_train_step, train_spec_of

SPEC = {"name": "t", "version": "1", "grad_mode": "training",
        "model": {"entrypoint": "tests.models.training:make", "kind": "training_step",
                  "train": {"loss": "torch.nn.functional:mse_loss", "targets": 1,
                            "optimizer": "AdamW", "optimizer_kwargs": {"lr": 0.01}}},
        "inputs": ["float32[8,8]", "float32[8,1]"], "options": {"backend": "aot_eager"}}


class LocalClient:
    """FarmClient.load's shape, for bytes built in this test."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def load(self, resolved: Any, *, module: Any, class_of: Any = None) -> Any:
        # As FarmClient.load: the class against the signed statement's (here
        # the record's own field stands for it), before anything is loaded.
        from farm.node.compiled import class_mismatch

        art = resolved["artifact"]
        why = class_mismatch(art, class_of, signed={"model_class": art["meta"]["model_class"]})
        if class_of is not None and why is not None:
            raise ValueError(why)
        return load_artifact(self.path, "aot_compile", module=module, trust_unverified=True)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    spec = JobSpec.from_json(SPEC)
    (art,) = compile_artifacts(spec, "cpu", tmp_path_factory.mktemp("train"),
                               aoti_unavailable="training")
    # What resolve answers: the artifact's record, with the class check's field.
    meta = {**art.meta, "model_class": "tests.models.training.Regressor+loss"}
    return {"artifact": {"digest": "0" * 64, "format": art.format, "meta": meta},
            "path": art.path}


def test_compiled_steps_match_eager_from_the_same_init(built: dict[str, Any]) -> None:
    from tests.models.training import make

    torch.manual_seed(0)
    model = make()
    reference = copy.deepcopy(model)
    step = compiled_train_step(LocalClient(built["path"]), built, model)
    eager = eager_train_step(reference, train_spec_of(built["artifact"]))
    assert step.source == "farm" and eager.source == "eager"
    assert built["artifact"]["meta"]["optimizer_step"]["compiled"] is False
    gen = torch.Generator().manual_seed(3)
    losses = []
    for _ in range(3):
        x, y = torch.randn(8, 8, generator=gen), torch.randn(8, 1, generator=gen)
        loss, loss_ref = step(x, y), eager(x, y)
        torch.testing.assert_close(loss, loss_ref)
        for (n, p), (_, q) in zip(step.program.named_parameters(),
                                  eager.program.named_parameters(), strict=True):
            assert p.grad is not None, n
            torch.testing.assert_close(p.grad, q.grad)
            torch.testing.assert_close(p, q)
        names = {id(p): n for n, p in step.program.named_parameters()}
        ref_names = {id(p): n for n, p in eager.program.named_parameters()}
        got, want = (optimizer_tensors(step.optimizer, names),
                     optimizer_tensors(eager.optimizer, ref_names))
        assert sorted(got) == sorted(want) and any(k.endswith(".exp_avg") for k in got)
        for k in want:
            torch.testing.assert_close(got[k], want[k])
        losses.append(float(loss))
    assert losses[0] != losses[-1]


def test_an_artifact_of_another_model_is_refused(built: dict[str, Any]) -> None:
    other = torch.nn.Sequential(torch.nn.Linear(8, 1))
    with pytest.raises(ValueError, match=r"built from tests.models.training.Regressor\+loss"):
        compiled_train_step(LocalClient(built["path"]), built, other)


def test_an_inference_artifact_is_not_a_training_step() -> None:
    with pytest.raises(ValueError, match="not a training step"):
        train_spec_of({"digest": "ab" * 32, "meta": {}})


def test_an_inference_artifact_cannot_train_under_ddp() -> None:
    from farm.node.training import compiled_ddp_module

    resolved = {"artifact": {"digest": "ab" * 32, "meta": {"grad_mode": "inference"}}}
    with pytest.raises(ValueError, match="compiled for inference: it has no backward"):
        compiled_ddp_module(None, resolved, torch.nn.Linear(2, 2))
