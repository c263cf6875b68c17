"""farm.core.elf: linkage and libstdc++ symbol versions read from ELF files,
checked against tiny libraries built here with g++ (and readelf, where present)."""

from __future__ import annotations

import re
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest

from farm.core import elf

GXX = shutil.which("g++")
needs_gxx = pytest.mark.skipif(GXX is None, reason="needs g++")

SOURCE = r"""
#include <regex>
#include <string>
extern "C" int matches(const char* s) {
    return std::regex_match(std::string(s), std::regex("cuda(:[0-9]+)?"));
}
"""


def build(tmp: Path, name: str, *flags: str) -> Path:
    src = tmp / "lib.cpp"
    src.write_text(SOURCE)
    out = tmp / name
    assert GXX is not None
    subprocess.run([GXX, "-shared", "-fPIC", "-O0", *flags, str(src), "-o", str(out)],
                   check=True, capture_output=True)
    return out


def readelf_versions(path: Path, what: str) -> list[str] | None:
    tool = shutil.which("readelf")
    if tool is None:
        return None
    out = subprocess.run([tool, "-V", "-W", str(path)], capture_output=True, text=True,
                         check=True).stdout
    # readelf -V prints the definitions section first, then the needs.
    start = out.find(".gnu.version_d" if what == "defs" else ".gnu.version_r")
    if start < 0:
        return []
    section = out[start:]
    end = section.find("\nVersion ", 1)
    section = section if end < 0 else section[:end]
    found = re.findall(r"(?:Name|Version): *((?:GLIBCXX|CXXABI)_[\w.]+)", section)
    return list(elf.libstdcxx_versions(found))


@needs_gxx
def test_a_library_built_with_g_plus_plus_links_the_shared_libstdcxx(tmp_path: Path) -> None:
    lib = build(tmp_path, "libshared.so")
    link = elf.read_elf(lib)
    assert link.links_shared_libstdcxx
    assert "libc.so.6" in link.needed
    assert link.libstdcxx_needs  # std::regex needs GLIBCXX_3.4.x at least
    assert all(v.startswith(("GLIBCXX_", "CXXABI_")) for v in link.libstdcxx_needs)
    ref = readelf_versions(lib, "needs")
    if ref is not None:
        assert list(link.libstdcxx_needs) == ref


@needs_gxx
def test_a_static_libstdcxx_is_seen(tmp_path: Path) -> None:
    try:
        lib = build(tmp_path, "libstatic.so", "-static-libstdc++")
    except subprocess.CalledProcessError:
        pytest.skip("this g++ has no static libstdc++")
    link = elf.read_elf(lib)
    assert not link.links_shared_libstdcxx
    assert link.libstdcxx_needs == ()


@needs_gxx
def test_a_package_reports_the_union_of_its_libraries(tmp_path: Path) -> None:
    shared = build(tmp_path, "libshared.so")
    pkg = tmp_path / "model.pt2"
    with zipfile.ZipFile(pkg, "w") as zf:
        zf.write(shared, "model/data/aotinductor/model/abc.so")
        zf.writestr("model/data/aotinductor/model/abc.cpp", "// source")
    got = elf.package_linkage(pkg)
    assert got["libraries"] == 1 and got["links_shared_libstdcxx"] is True
    assert got["libstdcxx_needs"] == list(elf.read_elf(shared).libstdcxx_needs)


def test_this_process_libstdcxx_provides_its_versions() -> None:
    import torch  # noqa: F401  (maps libstdc++, as on every node)

    path = elf.loaded_libstdcxx()
    assert path is not None and "libstdc++" in path
    provides = elf.libstdcxx_provides()
    assert "GLIBCXX_3.4" in provides and "CXXABI_1.3" in provides
    ref = readelf_versions(Path(path), "defs")
    if ref is not None:
        assert list(provides) == ref


@needs_gxx
def test_what_a_library_needs_is_what_this_libstdcxx_provides(tmp_path: Path) -> None:
    import torch  # noqa: F401

    link = elf.read_elf(build(tmp_path, "libshared.so"))
    assert elf.missing_versions(link.libstdcxx_needs, elf.libstdcxx_provides()) == ()
    assert elf.missing_versions(["GLIBCXX_3.4.99", "GLIBCXX_3.4"], ["GLIBCXX_3.4"]) == (
        "GLIBCXX_3.4.99",)


def test_versions_sort_as_numbers() -> None:
    assert elf.libstdcxx_versions(
        ["GLIBCXX_3.4.10", "CXXABI_1.3.9", "GLIBCXX_3.4.9", "GLIBC_2.34", "CXXABI_1.3.13"]
    ) == ("CXXABI_1.3.9", "CXXABI_1.3.13", "GLIBCXX_3.4.9", "GLIBCXX_3.4.10")


@pytest.mark.parametrize("data", [b"", b"MZ" + b"\0" * 100, b"\x7fELF" + b"\x02\x01" + b"\0" * 20,
                                  b"\x7fELF\x03\x01" + b"\0" * 80])
def test_what_is_not_an_elf_file_is_refused(data: bytes) -> None:
    with pytest.raises(elf.ElfError):
        elf.parse_elf(data)


@needs_gxx
def test_a_truncated_library_is_refused(tmp_path: Path) -> None:
    data = build(tmp_path, "libshared.so").read_bytes()
    for cut in (64, len(data) // 2, len(data) - 100):
        with pytest.raises(elf.ElfError):
            elf.parse_elf(data[:cut])
