"""Triton kernel names the farm's builds give Inductor stay under the 150
characters Triton names its cache files by (farm.build.kernel_names)."""

from __future__ import annotations

import pytest

from farm.build import kernel_names


def test_a_long_fused_name_is_cut_and_a_short_one_kept() -> None:
    long = "fused__scaled_dot_product_efficient_attention__to_copy__unsafe_view_add_arange_" \
           "bitwise_and_bmm_cat_clone_cos_expand_index_le_mul_neg_new_ones_scalar_tensor_sin"
    cut = kernel_names.short(long)
    assert long.startswith(cut) and len(cut) <= kernel_names.MAX_FUSED
    assert not cut.endswith("_")
    # The whole kernel name, as Inductor joins it: under Triton's 150.
    assert len("_".join(["triton", "poi", cut, "12345"])) < 150
    assert kernel_names.short("fused_add_mul") == "fused_add_mul"


def test_installed_inductor_names_kernels_short(monkeypatch: pytest.MonkeyPatch) -> None:
    triton_codegen = pytest.importorskip("torch._inductor.codegen.triton")
    monkeypatch.setattr(triton_codegen, "get_fused_kernel_name",
                        lambda nodes, descriptive: "fused_" + "_".join(nodes))
    assert kernel_names.install()
    assert triton_codegen.get_fused_kernel_name(["add"] * 100, "original_aten") == \
        kernel_names.short("fused_" + "_".join(["add"] * 100))
    installed = triton_codegen.get_fused_kernel_name
    assert kernel_names.install()  # once: not wrapped again
    assert triton_codegen.get_fused_kernel_name is installed
