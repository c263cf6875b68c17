"""A format torch cannot build does not cost the other: a weight_norm
parametrization fails aot_compile (Dynamo pickles the guards' state and a
parametrized module refuses pickling), and the build still makes, and
records why it has no aot_compile artifact beside, the AOTI package, which
loads against the module (its stored tensors under their parametrization
names, checked by the weights manifest) and matches eager."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from farm.build.compile import compile_artifacts
from farm.core.specs import JobSpec
from farm.node.loader import load_artifact
from farm.node.weight_check import MANIFEST_KEY
from tests.models.archs import PARAMETRIZED_PICKLE, parametrized_conv

pytestmark = pytest.mark.integration


def test_aot_compile_fails_with_torchs_reason_and_the_aoti_package_is_built(
        tmp_path: Path) -> None:
    spec = JobSpec.from_json({"name": "wn", "version": "1",
                              "model": {"entrypoint": "tests.models.archs:parametrized_conv"},
                              "inputs": ["float32[2,4,8]"]})
    (art,) = compile_artifacts(spec, "cpu", tmp_path, aoti_unavailable=None)
    assert art.format == "aoti"
    failed = art.meta["formats_failed"]["aot_compile"]
    assert failed["stage"] == "compile" and PARAMETRIZED_PICKLE in failed["reason"], failed
    names = [e["name"] for e in art.meta[MANIFEST_KEY]]
    assert "conv.parametrizations.weight.original0" in names
    torch.manual_seed(2)
    module = parametrized_conv().eval()
    fn = load_artifact(art.path, "aoti", module=module, trust_unverified=True,
                       weights_manifest=art.meta[MANIFEST_KEY])
    x = torch.randn(2, 4, 8)
    with torch.no_grad():
        assert torch.allclose(fn(x), module(x), atol=1e-5)
