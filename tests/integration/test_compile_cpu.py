"""Compile for this machine's CPU target and verify in fresh processes.

Every compile runs in a sandboxed child as a compile worker runs it (its
directory in the test process's zygote slot, tests/fixtures/slot.py, so the
child forks from a warm sandboxed interpreter), and every verification in
another sandboxed child with an empty Inductor cache; the AOTI package's
verifier also has no C++ compiler on PATH.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from farm.build.sandbox import build_isolation
from farm.build.verify import VerifyReport, verify_artifact
from farm.core.specs import JobSpec
from tests.fixtures.builds import compile_in_child, fill_header_store

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TIMEOUT_S = 900
MEMORY_MB = 12000


def job(entrypoint: str, inputs: list[str], *, grad_mode: str = "inference",
        guard_filter: str = "drop-unserializable", name: str = "m") -> JobSpec:
    return JobSpec.from_json({
        "name": name,
        "version": "1",
        "model": {"entrypoint": entrypoint, "kwargs": {}},
        "inputs": inputs,
        "grad_mode": grad_mode,
        "options": {"guard_filter": guard_filter},
    })


def compile_child(spec: JobSpec, out_dir: Path, formats: list[str] | None = None) -> Any:
    return compile_in_child(spec, out_dir, formats=formats, timeout_s=TIMEOUT_S,
                            memory_mb=MEMORY_MB)


def artifacts(spec: JobSpec, out_dir: Path, formats: list[str] | None = None) -> dict[str, Any]:
    res = compile_child(spec, out_dir, formats)
    assert res.ok, f"{res.describe()}\n{res.traceback}\n{res.stderr_tail[-3000:]}"
    return {a["format"]: a for a in res.value["artifacts"]}


def verified(spec: JobSpec, art: dict[str, Any]) -> VerifyReport:
    report = verify_artifact(spec, art["path"], art["format"], device="cpu",
                             timeout_s=TIMEOUT_S, memory_mb=MEMORY_MB,
                             isolation=build_isolation())
    assert report.ok, report.error
    return report


def sha256(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


MlpBuild = tuple[JobSpec, dict[str, Any], Any]


@pytest.fixture(scope="module")
def mlp_inference(build_tmp_factory: Callable[[str], Path]) -> MlpBuild:
    """The MLP's spec, its artifacts by format, and the build child's result."""
    spec = job("farm.zoo.basic:mlp", ["float32[4,64]"])
    fill_header_store()  # test_aoti_package_is_reproducible builds it again
    res = compile_child(spec, build_tmp_factory("mlp"))
    assert res.ok, f"{res.describe()}\n{res.traceback}\n{res.stderr_tail[-3000:]}"
    return spec, {a["format"]: a for a in res.value["artifacts"]}, res


def test_mlp_inference_builds_both_formats_and_matches_eager(
    mlp_inference: MlpBuild,
) -> None:
    spec, arts, _ = mlp_inference
    assert set(arts) == {"aot_compile", "aoti"}
    aot, aoti = arts["aot_compile"], arts["aoti"]
    assert aot["meta"]["guards"]["tensors"], "tensor guards must be kept"
    assert aot["meta"]["global_state"]["grad_enabled"] is False
    assert aoti["meta"]["weights_in_package"] is False
    # The package is far smaller than a build with weights would need to be
    # only for big models; here: it exists and names its constants.
    assert aoti["meta"]["constants"] == 4
    # Its wrapper compiled with the header the worker's store holds for this
    # compiler (farm.build.pch), and it still loads and matches eager below.
    assert aoti["meta"]["precompiled_header"] is True

    r_aot = verified(spec, aot)
    # A CPU aot_compile artifact is C++ source, and ships the kernel libraries
    # its build compiled (farm.node.bundle): the verifier's fresh, empty cache
    # gets them from the artifact, and neither its load nor its first call
    # runs g++ (Inductor's ISA test compiles are skipped too: this session's
    # checked pick is cached, farm.core.cpu_isa.isa_checks_redundant).
    assert aot["meta"]["cpu_kernels"] >= 1
    assert not r_aot.load_compiled, r_aot.load_events
    assert not r_aot.first_call_compiled

    r_aoti = verified(spec, aoti)
    assert r_aoti.cold_node == {"compilers_on_path": {}, "cache_dir_empty": True}
    assert not r_aoti.load_compiled and not r_aoti.first_call_compiled
    assert r_aoti.max_abs_err is not None and r_aoti.max_abs_err <= (r_aoti.tol or 0)


def test_the_build_log_says_where_the_packages_seconds_went(mlp_inference: MlpBuild) -> None:
    """The child's account splits the AOTI package into export, lowering,
    codegen, the C++ compile and the rest, as the worker keeps it: a cold
    package's C++ compile is real seconds, and the parts add up to no more
    than the child's wall time."""
    from farm.build import stage_times

    _, arts, res = mlp_inference
    assert arts["aoti"]["meta"]["package_cache"]["hit"] is False
    stages = res.stages
    assert set(stage_times.AOTI_STAGES) <= set(stages), stages
    assert stages[stage_times.AOTI_CXX] > 0.5, stages  # a g++ run and a link, at least
    assert stages[stage_times.AOTI_EXPORT] > 0, stages
    assert sum(v for k, v in stages.items() if k != stage_times.OTHER) <= res.wall_s + 1e-2


def test_aoti_package_is_reproducible(
    mlp_inference: MlpBuild, build_tmp: Path
) -> None:
    spec, arts, _ = mlp_inference
    again = artifacts(spec, build_tmp, ["aoti"])["aoti"]
    assert sha256(again["path"]) == sha256(arts["aoti"]["path"])


def test_training_artifact_runs_backward_with_eagers_gradients(build_tmp: Path) -> None:
    spec = job("farm.zoo.basic:mlp", ["float32[4,64]"], grad_mode="training")
    arts = artifacts(spec, build_tmp)
    assert set(arts) == {"aot_compile"}, "AOTI has no backward: training builds aot_compile only"
    assert arts["aot_compile"]["meta"]["global_state"]["grad_enabled"] is True
    report = verified(spec, arts["aot_compile"])
    assert report.grad_max_abs_err is not None and report.grad_tol is not None
    assert report.grad_max_abs_err <= report.grad_tol
    assert not report.first_call_compiled  # the backward was compiled ahead too

    res = compile_child(spec, build_tmp / "aoti", ["aoti"])
    assert not res.ok and res.error_type == "farm.build.compile_common.CompileError"


def test_dynamic_batch_artifact_serves_two_sizes(build_tmp: Path) -> None:
    spec = job("farm.zoo.basic:mlp", ["float32[2..16,64]"])
    arts = artifacts(spec, build_tmp)
    for fmt in ("aot_compile", "aoti"):
        report = verified(spec, arts[fmt])
        # Batch 2 (the example) and batch 5, with no recompile for the second.
        assert report.sizes_checked == [[[2, 64]], [[5, 64]]], fmt
        assert not report.first_call_compiled, (fmt, report.first_call_events)


def test_decorated_forward_saves_with_the_guard_filter(build_tmp: Path) -> None:
    spec = job("farm.zoo.basic:decorated_mlp", ["float32[4,64]"])
    art = artifacts(spec, build_tmp, ["aot_compile"])["aot_compile"]
    guards = art["meta"]["guards"]
    assert guards["policy"] == "drop-unserializable"
    assert "CLOSURE_MATCH" in {d["type"] for d in guards["dropped"]}
    # Only unserializable guards went: tensors, shapes and global state stay.
    dropped_types = {d["type"] for d in guards["dropped"]}
    assert not {"TENSOR_MATCH", "GLOBAL_STATE", "SHAPE_ENV"} & dropped_types
    assert guards["kept"].get("TENSOR_MATCH", 0) >= 5  # 4 parameters and the input
    verified(spec, art)

    strict = job("farm.zoo.basic:decorated_mlp", ["float32[4,64]"], guard_filter="keep-all")
    res = compile_child(strict, build_tmp / "strict", ["aot_compile"])
    assert not res.ok
    assert "cannot be serialized" in (res.error or ""), res.error


def test_tensor_literal_gets_no_aoti_package_but_an_aot_compile_one(build_tmp: Path) -> None:
    spec = job("farm.zoo.basic:literal_mlp", ["float32[4,64]"])
    arts = artifacts(spec, build_tmp)
    assert set(arts) == {"aot_compile"}
    assert "register_buffer" in arts["aot_compile"]["meta"]["aoti_skipped"]
    res = compile_child(spec, build_tmp / "explicit", ["aoti"])
    assert not res.ok and res.error_type == "farm.build.compile_common.AOTIUnsupported"


def test_verifier_rejects_an_artifact_for_another_model(
    mlp_inference: MlpBuild,
) -> None:
    _, arts, _ = mlp_inference
    other = JobSpec.from_json({**job("farm.zoo.basic:mlp", ["float32[4,64]"]).to_json(),
                               "model": {"entrypoint": "farm.zoo.basic:mlp",
                                         "kwargs": {"hidden": 96}}})
    for fmt in ("aot_compile", "aoti"):
        report = verify_artifact(other, arts[fmt]["path"], fmt, device="cpu",
                                 timeout_s=TIMEOUT_S, memory_mb=MEMORY_MB,
                                 isolation=build_isolation())
        assert not report.ok, fmt
        assert report.error


def test_autotune_bundle_loads_and_installs_its_configs(
    mlp_inference: MlpBuild, build_tmp: Path
) -> None:
    """The bundle a CUDA build ships (torch's bytes plus ``.best_config``
    files): the loader installs the configs into the node's Inductor cache,
    and the artifact inside still verifies in a fresh process. The tuning
    itself needs a GPU; bench/gpu_farm.py proves it on the H200."""
    import shutil

    from farm.node.bundle import is_bundle, read_bundle, write_bundle

    spec, arts, _ = mlp_inference
    path = build_tmp / "bundle.bin"
    shutil.copy(arts["aot_compile"]["path"], path)
    _, shipped, meta = read_bundle(path)  # a CPU build's own bundle: its kernels
    cache = build_tmp / "cache"
    (cache / "ab").mkdir(parents=True)
    (cache / "ab" / "cafe.best_config").write_text('{"XBLOCK": 128, "num_warps": 4}')
    for rel, data in shipped["kernels/"].items():
        (cache / rel).parent.mkdir(parents=True, exist_ok=True)
        (cache / rel).write_bytes(data)
    kernels = [cache / rel for rel in shipped["kernels/"]]
    # Rebundled from torch's bytes alone, with a config beside the kernels.
    payload, _, _ = read_bundle(path)
    path.write_bytes(payload)
    counts = write_bundle(path, cache, {"autotune/": [cache / "ab" / "cafe.best_config"],
                                        "kernels/": kernels}, meta=meta)
    assert counts == {"autotune/": 1, "kernels/": len(kernels)}
    assert is_bundle(path)
    report = verified(spec, {**arts["aot_compile"], "path": str(path)})
    assert report.max_abs_err is not None and report.max_abs_err <= (report.tol or 0)

    # Installing refuses entries that would escape the cache dir, or that are
    # not of their section's kind.
    from farm.node.bundle import BundleError, install_into_cache

    with pytest.raises(BundleError):
        install_into_cache("autotune/", {"../../evil.best_config": b"{}"}, root=build_tmp / "c")
    with pytest.raises(BundleError):
        install_into_cache("kernels/", {"ab/evil.py": b""}, root=build_tmp / "c")
