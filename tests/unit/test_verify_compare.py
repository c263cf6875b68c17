"""The verifier compares a program's results by value and by type, never by
identity, and reports each output's error and tolerance; integer inputs are
drawn from their declared range or the model's embedding size; the build key
sees what a program returns."""

from __future__ import annotations

import collections
import dataclasses

import pytest
import torch

from farm.build.compare import Worst, compare_tree
from farm.build.verify import VerifyReport, describe_input_values
from farm.core.fingerprint import return_structure
from farm.core.inputs import parse_inputs
from farm.core.modelref import (
    ModelBuildError,
    build_real,
    check_value_ranges,
    embedding_size,
    example_inputs,
)
from farm.core.specs import ModelRef
from tests.models.programs import Boxed, TokenModel, add, add_boxed


def compare(got: object, ref: object) -> Worst:
    worst = Worst()
    compare_tree(got, ref, worst, None)
    return worst


def test_a_user_type_is_compared_by_its_attributes_not_its_identity() -> None:
    x = torch.randn(3, 4)
    same = compare(Boxed(x.clone(), 2.0), Boxed(x, 2.0))
    assert same.failures == []
    assert [o["output"] for o in same.finish()] == ["output.value"]
    off = compare(Boxed(x + 1, 2.0), Boxed(x, 2.0))
    assert off.failures and "output.value: max abs error 1" in off.failures[0]
    scale = compare(Boxed(x, 3.0), Boxed(x, 2.0))
    assert scale.failures == ["output.scale: 3.0 != eager's 2.0"]
    # The plain function's Tensor where the program returns Boxed: the wrong answer.
    wrong = compare(x, Boxed(x, 2.0))
    assert wrong.failures == [
        "output: artifact returned torch.Tensor, eager tests.models.programs.Boxed"]


def test_containers_pytree_nodes_and_dataclasses_by_structure_and_value() -> None:
    @dataclasses.dataclass
    class Out:
        logits: torch.Tensor
        extra: dict[str, torch.Tensor]

    nt = collections.namedtuple("nt", "a b")
    x, y = torch.randn(2), torch.randn(3, dtype=torch.float64)
    ref = (nt(x, [y]), Out(x, {"k": y}))
    got = (nt(x.clone(), [y.clone()]), Out(x.clone(), {"k": y + 1e-12}))
    worst = compare(got, ref)
    assert worst.failures == []
    leaves = {o["output"]: o for o in worst.finish()}
    assert set(leaves) == {"output[0].leaf0", "output[0].leaf1", "output[1].logits",
                           "output[1].extra['k']"}
    assert leaves["output[1].extra['k']"]["dtype"] == "float64"
    k = leaves["output[1].extra['k']"]
    assert 0 < k["max_abs_err"] <= k["tol"]
    assert compare((x, x), [x, x]).failures == [
        "output: artifact returned builtins.tuple, eager builtins.list"]
    assert "keys ['j'], eager ['k']" in compare({"j": x}, {"k": x}).failures[0]


def test_each_output_error_and_tolerance_are_in_the_summary() -> None:
    report = VerifyReport(ok=True, max_abs_err=1e-6, tol=1e-4, outputs=[
        {"output": "output[0]", "max_abs_err": 1e-6, "tol": 1e-4},
        {"output": "output[1]", "max_abs_err": 0.0, "tol": 1e-5}])
    assert "per output output[0] 1e-06 <= 0.0001, output[1] 0 <= 1e-05" in report.summary()


def test_integer_inputs_come_from_the_declared_range_or_the_embedding() -> None:
    (declared,) = example_inputs(parse_inputs(["int64[4,64]{10..20}"]), device="cpu", seed=1,
                                 mark_dynamic=False)
    assert int(declared.min()) >= 10 and int(declared.max()) <= 20
    assert len(declared.unique()) > 5
    (from_embed,) = example_inputs(parse_inputs(["int64[4,64]"]), device="cpu", seed=1,
                                   mark_dynamic=False, int_high=97)
    assert int(from_embed.max()) <= 96 and len(from_embed.unique()) > 20
    model = TokenModel()
    assert embedding_size(model) == ("embed", 97)
    assert describe_input_values(parse_inputs(["int64[1,16]"]), ("embed", 97)) == [
        "int64[1,16]: uniform in 0..96 (nn.Embedding embed: 97 entries)"]
    with pytest.raises(ModelBuildError, match=r"has 97 entries \(ids 0..96\); the range is "
                                         r"inclusive: declare \{0..96\}"):
        check_value_ranges(parse_inputs(["int64[1,16]{0..97}"]), ("embed", 97))


def test_a_real_build_computes_its_buffers() -> None:
    rot = build_real(ModelRef("tests.models.programs:rotary"), device="cpu", seed=3)
    assert isinstance(rot, torch.nn.Module)
    inv = rot.get_buffer("inv_freq")
    assert bool((inv > 0).all()) and float(inv[0]) == 1.0
    again = build_real(ModelRef("tests.models.programs:rotary"), device="cpu", seed=3)
    assert torch.equal(again.proj.weight, rot.proj.weight)


def test_the_return_structure_tells_apart_programs_with_one_graph() -> None:
    x = torch.empty(4, 8, device="meta")
    plain, boxed = return_structure(add(x, x)), return_structure(add_boxed(x, x))
    assert plain == "Tensor:float32/2"
    assert boxed == "tests.models.programs.Boxed(scale=float,value=Tensor:float32/2)"
    assert return_structure((x, {"a": x})) == "tuple(Tensor:float32/2,dict('a':Tensor:float32/2))"


def test_a_real_build_with_uninitialised_values_is_caught() -> None:
    from farm.build.compare import non_finite

    model = TokenModel()
    assert non_finite(model) is None
    with torch.no_grad():
        model.head.bias[3] = float("nan")
    assert non_finite(model) == "head.bias"
