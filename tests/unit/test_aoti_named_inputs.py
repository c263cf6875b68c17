"""An AOTI package of a keyword/dict-input program: the loader takes a call's
tensors from the places the input specs name, in the package's order, and a
call that does not fit is a guard failure, as Dynamo's would be."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from farm.node.loader import GUARD_FAILURE, AOTIFunction


class Runner:
    def __init__(self) -> None:
        self.calls: list[list[Any]] = []

    def __call__(self, *flat: Any) -> Any:
        self.calls.append(list(flat))
        return flat


def function(inputs: list[str]) -> tuple[AOTIFunction, Runner]:
    from farm.core.inputs import parse_inputs

    specs = parse_inputs(inputs)
    checks = [{"dtype": s.dtype, "device": "cpu", "dims": [[d.lo, d.hi] for d in s.dims],
               **({"name": s.name} if s.name else {})} for s in specs]
    runner = Runner()
    meta = {"inputs": [str(s) for s in specs], "input_checks": checks}
    return AOTIFunction(runner, None, [], meta), runner


def test_keywords_and_dict_keys_reach_the_package_in_its_order() -> None:
    fn, runner = function(["input_ids=int64[1,4]", "batch.x=float32[2]", "batch.a=float32[3]"])
    ids, x, a = torch.zeros(1, 4, dtype=torch.int64), torch.ones(2), torch.ones(3)
    with torch.no_grad():
        fn(input_ids=ids, batch={"x": x, "a": a})
    # Canonical order: keywords by name, a dict's keys sorted.
    (flat,) = runner.calls
    assert [t.shape for t in flat] == [torch.Size([3]), torch.Size([2]), torch.Size([1, 4])]


@pytest.mark.parametrize(("call", "words"), [
    ({"batch": {"x": torch.ones(2)}}, "no keyword 'input_ids'"),
    ({"input_ids": torch.zeros(1, 4, dtype=torch.int64), "batch": {"x": torch.ones(2)},
      "extra": torch.ones(1)}, "keyword 'extra', which no input spec describes"),
    ({"input_ids": torch.zeros(1, 5, dtype=torch.int64), "batch": {"x": torch.ones(2)}},
     "size 5 outside 4"),
])
def test_a_call_that_does_not_fit_is_a_guard_failure(call: dict[str, Any], words: str) -> None:
    fn, runner = function(["input_ids=int64[1,4]", "batch.x=float32[2]"])
    with torch.no_grad(), pytest.raises(RuntimeError, match=GUARD_FAILURE) as info:
        fn(**call)
    assert words in str(info.value)
    assert runner.calls == []


def test_a_positional_package_refuses_keywords() -> None:
    fn, _ = function(["float32[2]"])
    with torch.no_grad(), pytest.raises(RuntimeError, match="positional inputs only"):
        fn(x=torch.ones(2))
