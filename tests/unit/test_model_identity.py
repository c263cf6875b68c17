"""What names a model beyond its graph: the class it is built from and the code it
comes with. Two classes with one graph, or one class in two code packs, are two
fingerprints (so two build keys); a node holding another class than an
artifact's refuses it with the reason; a factory's kwargs are checked against
its signature before it runs."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from farm.core import fingerprint as fp
from farm.core.inputs import parse_inputs
from farm.core.modelref import ModelBuildError, build_module, model_class_name
from farm.core.specs import CompileOptions, GradMode, ModelRef
from farm.node.compiled import class_mismatch


class TwinA(nn.Module):
    def __init__(self, dim: int = 4) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


class TwinB(TwinA):
    pass


def make(dim: int = 4) -> nn.Module:
    return TwinA(dim)


def free(x: object) -> object:
    return x


def key(**change: object) -> str:
    args: dict[str, object] = {
        "graph": "g" * 64, "tensors": ["param fc.weight float32[4, 4]"],
        "inputs": parse_inputs(["float32[2,4]"]), "grad_mode": GradMode.INFERENCE,
        "options": CompileOptions(), "entrypoint": "m:make", "code_digest": "a" * 64,
        "model_class": "m.TwinA"}
    args.update(change)
    return fp.fingerprint(**args)  # type: ignore[arg-type]


def test_the_class_the_code_and_the_entrypoint_are_in_the_fingerprint() -> None:
    base = key()
    assert key() == base
    assert key(model_class="m.TwinB") != base
    assert key(code_digest="b" * 64) != base
    assert key(code_digest=None) != base
    assert key(entrypoint="m:make_b") != base


def test_model_class_name() -> None:
    here = __name__
    assert model_class_name(TwinA()) == f"{here}.TwinA"
    assert model_class_name(TwinB()) == f"{here}.TwinB"
    assert model_class_name(free) == f"{here}.free"


def test_a_node_with_another_class_gets_the_reason() -> None:
    art = {"digest": "d" * 64, "meta": {"model_class": f"{__name__}.TwinA"}}
    assert class_mismatch(art, TwinA()) is None
    why = class_mismatch(art, TwinB())
    assert why is not None and f"was built from {__name__}.TwinA" in why
    assert f"{__name__}.TwinB" in why
    # Artifacts from before the class was recorded: nothing to compare.
    assert class_mismatch({"digest": "d" * 64, "meta": {}}, TwinB()) is None


def test_kwargs_the_factory_cannot_take_fail_before_it_runs() -> None:
    ok = build_module(ModelRef(f"{__name__}:make", {"dim": 3}))
    assert isinstance(ok, TwinA)
    with pytest.raises(ModelBuildError, match=r"cannot take kwargs \{'dimm': 3\}.*make\(dim"):
        build_module(ModelRef(f"{__name__}:make", {"dimm": 3}))


def test_the_compile_stage_refuses_a_graph_the_trace_did_not_fingerprint() -> None:
    from farm.build.steps import GraphMismatch, check_graph
    from farm.build.trace import trace
    from farm.core.specs import JobSpec

    spec = JobSpec(name="m", version="1", model=ModelRef(f"{__name__}:make", {"dim": 4}),
                   inputs=parse_inputs(["float32[2,4]"]), code_digest="c" * 64)
    traced = trace(spec)
    code = check_graph(spec, traced.fingerprint)
    assert code["model_class"] == f"{__name__}.TwinA" and code["code_digest"] == "c" * 64
    # What a factory that builds differently in the compile worker would give.
    with pytest.raises(GraphMismatch, match="not the graph the trace fingerprinted"):
        check_graph(spec, "0" * 64)
