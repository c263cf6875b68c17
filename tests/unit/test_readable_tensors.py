"""Fake tensors' reprs in an error, as dtype and shape (farm.core.text)."""

from __future__ import annotations

from farm.core.text import readable_tensors

# What Dynamo said for mlp() traced with float32[8,63] (torch 2.13).
LINEAR = (
    "Dynamo failed to run FX node with fake tensors: call_function <built-in function "
    "linear>(*(FakeTensor(..., device='meta', size=(8, 63)), Parameter(FakeTensor(..., "
    "device='meta', size=(128, 64), requires_grad=True)), Parameter(FakeTensor(..., "
    "device='meta', size=(128,), requires_grad=True))), **{}): got RuntimeError('a and b "
    "must have same reduction dim, but got [8, 63] X [64, 128].')"
)


def test_the_op_and_each_arguments_dtype_and_shape_remain() -> None:
    out = readable_tensors(LINEAR)
    assert out == (
        "Dynamo failed to run FX node with fake tensors: call_function <built-in "
        "function linear>(*(float32[8,63], param float32[128,64], param "
        "float32[128]), **{}): got RuntimeError('a and b must have same reduction "
        "dim, but got [8, 63] X [64, 128].')"
    )


def test_dtypes_symbolic_sizes_scalars_and_devices() -> None:
    text = (
        "f(FakeTensor(..., size=(8,), dtype=torch.int64), FakeTensor(..., device='cuda:0', "
        "size=(s0, 4), dtype=torch.float16), FakeTensor(..., size=()))"
    )
    assert readable_tensors(text) == "f(int64[8], float16[s0,4] on cuda:0, float32[])"


def test_text_without_fake_tensors_is_unchanged() -> None:
    text = "RuntimeError: tensor(1.) and Parameter containing: x"
    assert readable_tensors(text) == text
