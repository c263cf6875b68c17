"""Compile options and failed formats on this machine's CPU, each compile in
a sandboxed child and each verification in a fresh process (as a compile
worker runs them):

- ``--mode max-autotune`` gets an AOTI package that loads with the node's
  own weights (max-autotune's CPP GEMM template used to prepack a weight
  into a constant no node can supply: "module lacks constant4");
- an inductor build of a program that returns its own type: its AOTI
  package cannot be exported, which is recorded as a failed format with
  torch's reason, and its aot_compile artifact is verified by value.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from farm.build.sandbox import build_isolation
from farm.build.verify import verify_artifact
from farm.core.specs import JobSpec
from tests.fixtures import builds

pytestmark = [pytest.mark.integration, pytest.mark.slow,
              pytest.mark.xdist_group("compile_options")]

TIMEOUT_S = 900
MEMORY_MB = 12000


def compile_in_child(spec: JobSpec, out_dir: Path,
                     formats: list[str] | None = None) -> dict[str, Any]:
    # Sandboxed as a worker's child (forked from the warm zygote: out_dir is
    # in the slot) for the farm's own models; the test models are no code
    # pack here, so their child is a plain one that imports from the checkout.
    own = spec.model.entrypoint.startswith("farm.")
    res = builds.compile_in_child(spec, out_dir, formats=formats, timeout_s=TIMEOUT_S,
                                  memory_mb=MEMORY_MB, isolated=own)
    assert res.ok, f"{res.describe()}\n{res.traceback}\n{res.stderr_tail[-3000:]}"
    return {a["format"]: a for a in res.value["artifacts"]}


def test_max_autotune_aoti_package_loads_with_the_nodes_weights(build_tmp: Path) -> None:
    spec = JobSpec.from_json({
        "name": "mlp", "version": "1",
        "model": {"entrypoint": "farm.zoo.basic:mlp",
                  "kwargs": {"d_in": 32, "hidden": 64, "d_out": 32}},
        "inputs": ["float32[4,32]"], "options": {"mode": "max-autotune"}})
    arts = compile_in_child(spec, build_tmp, formats=["aoti"])
    meta = arts["aoti"]["meta"]
    assert meta["gemm_backends"] == "ATEN"
    # Every constant the package wants is one of the module's own tensors.
    assert meta["constants"] == 4
    report = verify_artifact(spec, arts["aoti"]["path"], "aoti", device="cpu",
                             timeout_s=TIMEOUT_S, memory_mb=MEMORY_MB,
                             isolation=build_isolation())
    assert report.ok, report.error
    assert not report.compiles_on_node
    (out,) = report.outputs
    assert out["max_abs_err"] <= out["tol"]


def test_a_failed_format_is_recorded_with_its_reason_and_the_other_verified_by_value(
    tmp_path: Path,
) -> None:
    spec = JobSpec.from_json({
        "name": "boxed", "version": "1",
        "model": {"entrypoint": "tests.models.programs:add_boxed", "kind": "function"},
        "inputs": ["float32[4,8]", "float32[4,8]"]})
    arts = compile_in_child(spec, tmp_path)
    assert set(arts) == {"aot_compile"}
    meta = arts["aot_compile"]["meta"]
    failed = meta["formats_failed"]["aoti"]
    assert failed["stage"] == "compile"
    assert "torch.export failed" in failed["reason"] and "Boxed" in failed["reason"]
    assert meta["formats_skipped"] == {}
    report = verify_artifact(spec, arts["aot_compile"]["path"], "aot_compile", device="cpu",
                             timeout_s=TIMEOUT_S, memory_mb=MEMORY_MB)
    assert report.ok, report.error
    assert [o["output"] for o in report.outputs] == ["output.value"]
