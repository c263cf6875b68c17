"""The resolver's libstdc++ rule: an AOTI package whose shared library needs
a GLIBCXX_/CXXABI_ version the node's libstdc++ lacks is refused, with why."""

from __future__ import annotations

from typing import Any

import pytest

from farm.core.inputs import parse_inputs
from farm.core.specs import CompileOptions, GradMode
from farm.core.target import Target
from registry import resolver
from registry.convert import artifact_row, artifact_to_record
from registry.entities import ArtifactRecord

INPUTS = parse_inputs(["bfloat16[8,512,1024]"])
NODE = Target(device="cuda", python_version="3.12.3", torch_version="2.11.0+cu130",
              gpu_name="NVIDIA H200", capability="9.0", cuda_version="13.0",
              triton_version="3.6")
# Ubuntu 24.04's libstdc++ (gcc 14) defines up to GLIBCXX_3.4.33; Debian 12's up to .30.
UBUNTU = ("GLIBCXX_3.4", *(f"GLIBCXX_3.4.{n}" for n in range(1, 34)),
          "CXXABI_1.3", *(f"CXXABI_1.3.{n}" for n in range(1, 16)))
DEBIAN = tuple(v for v in UBUNTU if v not in {f"GLIBCXX_3.4.{n}" for n in (31, 32, 33)})
H200_NEEDS = ("CXXABI_1.3", "CXXABI_1.3.9", "GLIBCXX_3.4", "GLIBCXX_3.4.21", "GLIBCXX_3.4.30")


def art(id: int, needs: tuple[str, ...], fmt: str = "aoti", **kw: Any) -> ArtifactRecord:
    return ArtifactRecord(id=id, digest=f"{id:064x}", size=1, format=fmt, fingerprint="f" * 64,
                          build_key="k" * 64, inputs=INPUTS, grad_mode=GradMode.INFERENCE,
                          options=CompileOptions(), target=NODE, libstdcxx_needs=needs,
                          cxx="/usr/bin/g++: g++ 13.3.0", **kw)


def run(cands: list[ArtifactRecord], provides: tuple[str, ...] | None) -> resolver.Resolution:
    return resolver.resolve(cands, target=NODE, inputs=INPUTS, grad_mode=GradMode.INFERENCE,
                            libstdcxx=provides)


def test_a_package_needing_a_newer_libstdcxx_is_refused_with_the_versions() -> None:
    newer = art(1, (*H200_NEEDS, "GLIBCXX_3.4.32"))
    fallback = art(2, (), fmt="aot_compile")
    res = run([newer, fallback], DEBIAN)
    assert res.accepted == [fallback]
    (rej,) = res.rejected
    assert rej.code == resolver.LIBSTDCXX
    assert rej.reason == (
        "its shared library needs GLIBCXX_3.4.32 from libstdc++ (built with /usr/bin/g++: "
        "g++ 13.3.0), which the node's libstdc++ lacks (newest it has: GLIBCXX_3.4.30); "
        "the dynamic loader refuses it")


@pytest.mark.parametrize("provides", [UBUNTU, DEBIAN])
def test_a_package_whose_needs_are_provided_is_accepted_and_preferred(
    provides: tuple[str, ...]
) -> None:
    pkg, aot = art(1, H200_NEEDS), art(2, (), fmt="aot_compile")
    assert run([aot, pkg], provides).accepted == [pkg, aot]


def test_a_node_that_reports_nothing_is_not_held_to_it() -> None:
    assert run([art(1, ("GLIBCXX_3.4.99",))], None).accepted


def test_an_artifact_that_records_no_needs_is_accepted_everywhere() -> None:
    assert run([art(1, ())], ()).accepted


def test_the_rule_runs_after_the_target_rules() -> None:
    codes = list(resolver.CODES)
    assert codes.index(resolver.THREADS) < codes.index(resolver.LIBSTDCXX) < codes.index(
        resolver.GRAD_MODE)
    other = art(1, ("GLIBCXX_3.4.99",), verified=False)
    assert run([other], DEBIAN).rejected[0].code == resolver.UNVERIFIED


def test_rows_take_the_compiler_columns_from_the_workers_meta() -> None:
    row = artifact_row(digest="a" * 64, size=1, format="aoti", fingerprint="f" * 64,
                       inputs=INPUTS, grad_mode=GradMode.INFERENCE, options=CompileOptions(),
                       target=NODE, meta={"cxx": "/usr/bin/g++: g++ 13.3.0",
                                          "libstdcxx_needs": ["GLIBCXX_3.4.30", "CXXABI_1.3",
                                                              "GLIBCXX_3.4.9"]})
    assert row.cxx == "/usr/bin/g++: g++ 13.3.0"
    assert row.libstdcxx_needs == ["CXXABI_1.3", "GLIBCXX_3.4.9", "GLIBCXX_3.4.30"]
    row.id = 7
    record = artifact_to_record(row)
    assert record.libstdcxx_needs == ("CXXABI_1.3", "GLIBCXX_3.4.9", "GLIBCXX_3.4.30")
    assert record.to_json()["libstdcxx_needs"] == list(record.libstdcxx_needs)
    with pytest.raises(ValueError, match="libstdcxx_needs"):
        artifact_row(digest="a" * 64, size=1, format="aoti", fingerprint="f" * 64,
                     inputs=INPUTS, grad_mode=GradMode.INFERENCE, options=CompileOptions(),
                     target=NODE, meta={"libstdcxx_needs": ["GLIBC_2.34; DROP TABLE"]})


def test_the_api_parses_what_a_node_reports() -> None:
    from farm.core.elf import process_libstdcxx
    from farm.core.specs import SpecError
    from registry.api.resolve import parse_libstdcxx

    assert parse_libstdcxx(None) is None
    assert parse_libstdcxx("GLIBCXX_3.4,CXXABI_1.3.9, GLIBCXX_3.4.30") == {
        "GLIBCXX_3.4", "CXXABI_1.3.9", "GLIBCXX_3.4.30"}
    # What this process would send: every entry passes.
    assert parse_libstdcxx(",".join(process_libstdcxx())) == set(process_libstdcxx())
    with pytest.raises(SpecError, match="not GLIBCXX_/CXXABI_ versions"):
        parse_libstdcxx("GLIBCXX_3.4,GLIBC_2.34")
