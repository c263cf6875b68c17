"""farm.node.bundle: the aot_compile blob with files for the Inductor cache,
and farm.core.cpu_isa's rule for skipping Inductor's ISA test compiles."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from farm.core import cpu_isa
from farm.node import bundle


def _cache(tmp_path: Path) -> Path:
    cache = tmp_path / "cache"
    for rel, data in {"ab/cafe.best_config": b"{}", "cd/cdef.so": b"\x7fELF1",
                      "ef/cef0.main.so": b"\x7fELF2", "gh/other.so": b"unused"}.items():
        (cache / rel).parent.mkdir(parents=True, exist_ok=True)
        (cache / rel).write_bytes(data)
    return cache


def test_a_bundle_round_trips_and_installs_only_what_is_missing(tmp_path: Path) -> None:
    cache = _cache(tmp_path)
    art = tmp_path / "aot_compile.bin"
    art.write_bytes(b"torch bytes")
    counts = bundle.write_bundle(
        art, cache, {"autotune/": [cache / "ab/cafe.best_config"],
                     "kernels/": [cache / "cd/cdef.so", cache / "ef/cef0.main.so"]},
        meta={"cpp_compiler": "/usr/bin/g++", "precompiled_headers": False})
    assert counts == {"autotune/": 1, "kernels/": 2}
    assert bundle.is_bundle(art)
    payload, sections, meta = bundle.read_bundle(art)
    assert payload == b"torch bytes"
    assert sections["kernels/"] == {"cd/cdef.so": b"\x7fELF1", "ef/cef0.main.so": b"\x7fELF2"}
    assert meta == {"cpp_compiler": "/usr/bin/g++", "precompiled_headers": False}

    node = tmp_path / "node"
    (node / "cd").mkdir(parents=True)
    (node / "cd/cdef.so").write_bytes(b"the node's own")
    assert bundle.install_into_cache("kernels/", sections["kernels/"], root=node) == 1
    assert (node / "cd/cdef.so").read_bytes() == b"the node's own"  # left alone
    assert (node / "ef/cef0.main.so").read_bytes() == b"\x7fELF2"


def test_triton_binaries_ship_from_the_builds_triton_cache_into_the_nodes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A CUDA build's Triton binaries are named relative to its own Triton
    cache dir, not the Inductor cache, and a node puts them where Inductor's
    ``reload_cubin_path`` looks: Triton's cache dir for the build's device."""
    cache = _cache(tmp_path)
    triton = tmp_path / "triton-cache"
    cubin = triton / "HASHKEY" / "triton_poi_fused_add_0.cubin"
    cubin.parent.mkdir(parents=True)
    cubin.write_bytes(b"\x7fELFcubin")
    (triton / "HASHKEY" / "triton_poi_fused_add_0.ptx").write_text("not shipped")
    art = tmp_path / "aot_compile.bin"
    art.write_bytes(b"torch bytes")
    counts = bundle.write_bundle(art, cache, {"autotune/": [cache / "ab/cafe.best_config"],
                                              "triton/": [cubin]},
                                 meta={"triton_device": 0}, roots={"triton/": triton})
    assert counts == {"autotune/": 1, "triton/": 1}
    _, sections, meta = bundle.read_bundle(art)
    assert sections["triton/"] == {"HASHKEY/triton_poi_fused_add_0.cubin": b"\x7fELFcubin"}

    node_triton = tmp_path / "node-triton"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(node_triton))
    root = bundle.section_root("triton/", meta)
    assert root == node_triton
    assert bundle.section_root("autotune/", meta) is None  # the Inductor cache, as before
    assert bundle.install_into_cache("triton/", sections["triton/"], root=root) == 1
    assert (node_triton / "HASHKEY/triton_poi_fused_add_0.cubin").read_bytes() == b"\x7fELFcubin"
    monkeypatch.delenv("TRITON_CACHE_DIR")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    # Without TRITON_CACHE_DIR: Inductor's own place for the device's binaries.
    assert bundle.section_root("triton/", {"triton_device": 1}) == tmp_path / "inductor/triton/1"
    for bad in (-1, "0", True, None):
        with pytest.raises(bundle.BundleError, match="triton_device"):
            bundle.section_root("triton/", {"triton_device": bad})


def test_same_inputs_give_the_same_bundle_bytes(tmp_path: Path) -> None:
    cache = _cache(tmp_path)
    out = []
    for name in ("a", "b"):
        art = tmp_path / name
        art.write_bytes(b"torch bytes")
        bundle.write_bundle(art, cache, {"kernels/": [cache / "ef/cef0.main.so",
                                                      cache / "cd/cdef.so"]})
        out.append(art.read_bytes())
    assert out[0] == out[1]


def test_nothing_to_ship_leaves_a_plain_artifact(tmp_path: Path) -> None:
    art = tmp_path / "aot_compile.bin"
    art.write_bytes(b"torch bytes")
    assert bundle.write_bundle(art, tmp_path, {"kernels/": [], "autotune/": []},
                               meta={"cpp_compiler": "g++"}) == {"kernels/": 0, "autotune/": 0}
    assert art.read_bytes() == b"torch bytes"


@pytest.mark.parametrize(("section", "rel"), [
    ("kernels/", "../../evil.so"), ("kernels/", "ab/evil.py"),
    ("autotune/", "ab/evil.so"), ("autotune/", "/etc/evil.best_config"),
    ("triton/", "../evil.cubin"), ("triton/", "HASH/evil.so"), ("triton/", "HASH/k.json"),
])
def test_entries_that_leave_the_cache_or_their_kind_are_refused(
        tmp_path: Path, section: str, rel: str) -> None:
    with pytest.raises(bundle.BundleError):
        bundle.install_into_cache(section, {rel: b""}, root=tmp_path / "c")


def test_an_unknown_entry_is_refused(tmp_path: Path) -> None:
    import zipfile

    art = tmp_path / "a.bin"
    with zipfile.ZipFile(art, "w") as zf:
        zf.writestr(bundle.ARTIFACT, b"x")
        zf.writestr("scripts/run.sh", b"x")
    with pytest.raises(bundle.BundleError, match="unknown entry"):
        bundle.read_bundle(art)


def test_the_builders_compiler_is_adopted_only_when_nothing_chose_one(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from torch._inductor import config

    monkeypatch.delenv("CXX", raising=False)
    fake = tmp_path / "g++"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    # config.patch, not monkeypatch: undoing setattr on Inductor's config
    # proxy deletes the setting (and later tests of this process lose it).
    with config.patch({"cpp.cxx": (None, "g++")}):
        assert not bundle.adopt_build_compiler({"cpp_compiler": "g++"})  # not a path
        assert not bundle.adopt_build_compiler({"cpp_compiler": str(tmp_path / "no-such-g++")})
        monkeypatch.setenv("CXX", "clang++")
        assert not bundle.adopt_build_compiler({"cpp_compiler": str(fake)})
        monkeypatch.delenv("CXX")
        assert bundle.adopt_build_compiler({"cpp_compiler": str(fake)})
        assert config.cpp.cxx == (None, str(fake))


def test_header_setting_follows_the_builder_unless_the_operator_set_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from torch._inductor import config

    monkeypatch.delenv("TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS", raising=False)
    with config.patch({"cpp_cache_precompile_headers": True}):
        assert bundle.adopt_header_precompile({"precompiled_headers": False})
        assert config.cpp_cache_precompile_headers is False
        assert not bundle.adopt_header_precompile({})
        monkeypatch.setenv("TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS", "1")
        assert not bundle.adopt_header_precompile({"precompiled_headers": True})


def test_isa_checks_are_redundant_only_when_the_checked_pick_is_cached_and_agrees(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    path = tmp_path / "cpu-isa.json"
    monkeypatch.setenv(cpu_isa.ISA_CACHE_ENV, str(path))
    monkeypatch.delenv(cpu_isa.VEC_ISA_OK_ENV, raising=False)
    monkeypatch.setattr(cpu_isa, "_isa_cache_key", lambda: ("k", "g++"))
    monkeypatch.setattr(cpu_isa, "_x86_isa_from_cpu_flags", lambda: "avx512")
    assert not cpu_isa.isa_checks_redundant()  # nothing cached yet
    path.write_text(json.dumps({"k": "avx2"}))
    assert not cpu_isa.isa_checks_redundant()  # the compiler narrowed the pick
    path.write_text(json.dumps({"k": "avx512"}))
    assert cpu_isa.isa_checks_redundant()
    assert cpu_isa.isa_check_env() == {"TORCHINDUCTOR_VEC_ISA_OK": "1"}
    monkeypatch.setenv(cpu_isa.VEC_ISA_OK_ENV, "0")  # the operator's word
    assert not cpu_isa.isa_checks_redundant()
    assert cpu_isa.isa_check_env() == {}
