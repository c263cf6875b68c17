"""What a shared library links and which libstdc++ symbol versions it needs.

Read from the ELF file itself (section headers, ``.dynamic``,
``.gnu.version_r`` and ``.gnu.version_d``), with no ``readelf`` or
``objdump``: fleet nodes have no binutils, and a node asks what its own
libstdc++ provides on every start (milliseconds).

Two facts the farm needs from it:

- a compile worker checks that an AOTInductor ``.so`` links the shared
  libstdc++ (``NEEDED libstdc++.so.6``) rather than a static copy: on the H200
  image a compiler whose ``libstdc++.so`` link dangled linked ``libstdc++.a``
  into every package, and two copies in one process crashed in ``std::regex``;
- an artifact records the ``GLIBCXX_*``/``CXXABI_*`` versions its ``.so``
  needs, and a node reports the ones its libstdc++ defines, so the resolver
  refuses a package the node's dynamic loader would refuse
  (``version `GLIBCXX_3.4.32' not found``).
"""

from __future__ import annotations

import functools
import os
import re
import struct
import zipfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

LIBSTDCXX = "libstdc++.so.6"
# The symbol-version namespaces of libstdc++ (GLIBCXX_3.4.21, CXXABI_1.3.13,
# and the TM and floating-point ones such as CXXABI_FLOAT128).
LIBSTDCXX_VERSION_RE = re.compile(r"^(GLIBCXX|CXXABI)_[A-Za-z0-9_.]+$")

_SHT_DYNAMIC = 6
_SHT_GNU_VERDEF = 0x6FFFFFFD
_SHT_GNU_VERNEED = 0x6FFFFFFE
_DT_NULL, _DT_NEEDED, _DT_SONAME = 0, 1, 14
_VER_FLG_BASE = 0x1
# An AOTI package's shared libraries are a few MB; a multi-GB "library" is not one.
MAX_ELF_BYTES = 1 << 30


class ElfError(ValueError):
    """Not an ELF file this module can read (or a truncated or corrupt one)."""


@dataclass(frozen=True)
class ElfLinkage:
    """The dynamic-linking facts of one ELF file."""

    needed: tuple[str, ...] = ()  # DT_NEEDED, in order
    soname: str | None = None
    # Versions required from each needed file (.gnu.version_r), by file name.
    version_needs: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # Versions this file defines (.gnu.version_d), its base (soname) entry left out.
    version_defs: tuple[str, ...] = ()

    @property
    def links_shared_libstdcxx(self) -> bool:
        return LIBSTDCXX in self.needed

    @property
    def libstdcxx_needs(self) -> tuple[str, ...]:
        """GLIBCXX_/CXXABI_ versions needed from libstdc++, sorted."""
        return libstdcxx_versions(self.version_needs.get(LIBSTDCXX, ()))


def libstdcxx_versions(names: Iterable[str]) -> tuple[str, ...]:
    """The libstdc++ symbol versions among ``names``, deduplicated and sorted
    in version order (GLIBCXX_3.4.9 before GLIBCXX_3.4.10)."""
    return tuple(sorted({n for n in names if LIBSTDCXX_VERSION_RE.match(n)}, key=version_key))


def version_key(name: str) -> tuple[object, ...]:
    """Sort key of a symbol version: its namespace, then its numbers as numbers."""
    head, _, rest = name.partition("_")
    parts = re.split(r"[._]", rest)
    return (head, tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in parts))


def missing_versions(needs: Sequence[str], provides: Iterable[str]) -> tuple[str, ...]:
    """The versions in ``needs`` that ``provides`` lacks, in version order."""
    have = set(provides)
    return libstdcxx_versions(n for n in needs if n not in have)


def parse_elf(data: bytes) -> ElfLinkage:
    """The linkage of an ELF file held in ``data``. Raises ElfError."""
    if len(data) < 64 or data[:4] != b"\x7fELF":
        raise ElfError("not an ELF file")
    cls, order = data[4], data[5]
    if cls not in (1, 2) or order not in (1, 2):
        raise ElfError(f"unknown ELF class {cls} or byte order {order}")
    bo = "<" if order == 1 else ">"
    is64 = cls == 2
    try:
        if is64:
            shoff, = struct.unpack_from(bo + "Q", data, 0x28)
            shentsize, shnum, shstrndx = struct.unpack_from(bo + "HHH", data, 0x3A)
            sh_fmt, dyn_fmt = bo + "IIQQQQIIQQ", bo + "qQ"
        else:
            shoff, = struct.unpack_from(bo + "I", data, 0x20)
            shentsize, shnum, shstrndx = struct.unpack_from(bo + "HHH", data, 0x2E)
            sh_fmt, dyn_fmt = bo + "IIIIIIIIII", bo + "iI"
        if shoff == 0 or shnum == 0:
            raise ElfError("no section headers (a stripped-to-the-bone file)")
        if shentsize < struct.calcsize(sh_fmt):
            raise ElfError(f"section header entries of {shentsize} bytes")
        sections = []
        for i in range(shnum):
            (_name, sh_type, _flags, _addr, offset, size, link, info, _align,
             _entsize) = struct.unpack_from(sh_fmt, data, shoff + i * shentsize)
            sections.append((sh_type, offset, size, link, info))
        del shstrndx  # section names are not needed: types say what each is

        def strtab(index: int) -> tuple[int, int]:
            if not 0 <= index < len(sections):
                raise ElfError(f"string table index {index} out of range")
            _t, off, size, _l, _i = sections[index]
            if off + size > len(data):
                raise ElfError("string table past the end of the file")
            return off, size

        def string(table: tuple[int, int], at: int) -> str:
            off, size = table
            if not 0 <= at < size:
                raise ElfError(f"string offset {at} outside its table")
            end = data.find(b"\0", off + at, off + size)
            if end < 0:
                raise ElfError("unterminated string")
            return data[off + at:end].decode("utf-8", "replace")

        needed: list[str] = []
        soname: str | None = None
        version_needs: dict[str, tuple[str, ...]] = {}
        version_defs: list[str] = []
        dyn_size = struct.calcsize(dyn_fmt)
        for sh_type, offset, size, link, info in sections:
            if offset + size > len(data) and sh_type in (
                _SHT_DYNAMIC, _SHT_GNU_VERNEED, _SHT_GNU_VERDEF
            ):
                raise ElfError("a dynamic section runs past the end of the file")
            if sh_type == _SHT_DYNAMIC:
                table = strtab(link)
                for at in range(offset, offset + size - dyn_size + 1, dyn_size):
                    tag, val = struct.unpack_from(dyn_fmt, data, at)
                    if tag == _DT_NULL:
                        break
                    if tag == _DT_NEEDED:
                        needed.append(string(table, val))
                    elif tag == _DT_SONAME:
                        soname = string(table, val)
            elif sh_type == _SHT_GNU_VERNEED:
                table = strtab(link)
                at = offset
                for _ in range(info):  # sh_info: the number of Verneed entries
                    _ver, cnt, file_off, aux, nxt = struct.unpack_from(bo + "HHIII", data, at)
                    names: list[str] = []
                    aux_at = at + aux
                    for _ in range(cnt):
                        _hash, _flags, _other, name_off, aux_next = struct.unpack_from(
                            bo + "IHHII", data, aux_at)
                        names.append(string(table, name_off))
                        if aux_next == 0:
                            break
                        aux_at += aux_next
                    file = string(table, file_off)
                    version_needs[file] = version_needs.get(file, ()) + tuple(names)
                    if nxt == 0:
                        break
                    at += nxt
            elif sh_type == _SHT_GNU_VERDEF:
                table = strtab(link)
                at = offset
                for _ in range(info):  # sh_info: the number of Verdef entries
                    _ver, flags, _ndx, cnt, _hash, aux, nxt = struct.unpack_from(
                        bo + "HHHHIII", data, at)
                    if cnt and not flags & _VER_FLG_BASE:
                        name_off, = struct.unpack_from(bo + "I", data, at + aux)
                        version_defs.append(string(table, name_off))
                    if nxt == 0:
                        break
                    at += nxt
    except struct.error as exc:
        raise ElfError(f"truncated ELF file: {exc}") from exc
    return ElfLinkage(needed=tuple(needed), soname=soname, version_needs=version_needs,
                      version_defs=tuple(version_defs))


def read_elf(path: str | os.PathLike[str]) -> ElfLinkage:
    """``parse_elf`` of a file on disk."""
    p = Path(path)
    if p.stat().st_size > MAX_ELF_BYTES:
        raise ElfError(f"{p} is larger than {MAX_ELF_BYTES} bytes")
    return parse_elf(p.read_bytes())


def package_libraries(package: str | os.PathLike[str]) -> dict[str, ElfLinkage]:
    """The linkage of every shared library inside an AOTInductor package (a
    zip), by member name. Raises ElfError for a member that is not ELF."""
    out: dict[str, ElfLinkage] = {}
    with zipfile.ZipFile(package) as zf:
        for info in zf.infolist():
            if not info.filename.endswith(".so"):
                continue
            if info.file_size > MAX_ELF_BYTES:
                raise ElfError(f"{info.filename} is larger than {MAX_ELF_BYTES} bytes")
            with zf.open(info) as f:
                out[info.filename] = parse_elf(f.read())
    return out


def package_linkage(package: str | os.PathLike[str]) -> dict[str, object]:
    """What an AOTI package's libraries need, as an artifact records it:
    ``{"libraries": N, "links_shared_libstdcxx": bool, "libstdcxx_needs": [...]}``
    (the union over its libraries; every library must link it shared)."""
    libs = package_libraries(package)
    needs: set[str] = set()
    for lib in libs.values():
        needs.update(lib.libstdcxx_needs)
    return {
        "libraries": len(libs),
        "links_shared_libstdcxx": bool(libs) and all(
            lib.links_shared_libstdcxx for lib in libs.values()),
        "libstdcxx_needs": list(libstdcxx_versions(needs)),
    }


def loaded_libstdcxx() -> str | None:
    """The path of the libstdc++ this process has mapped (after ``import
    torch``, it always has), from ``/proc/self/maps``; None elsewhere."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            for line in f:
                path = line.rstrip("\n").split(maxsplit=5)[-1]
                if os.path.basename(path).startswith("libstdc++.so"):
                    return path
    except OSError:
        return None
    return None


def libstdcxx_provides(path: str | None = None) -> tuple[str, ...]:
    """The GLIBCXX_/CXXABI_ versions that this process's libstdc++ (or
    ``path``) defines, sorted; () when there is none to read."""
    path = path or loaded_libstdcxx()
    if path is None:
        import ctypes.util

        found = ctypes.util.find_library("stdc++")
        if found is None:
            return ()
        path = found if os.path.isabs(found) else _first_loaded_or_none(found)
        if path is None:
            return ()
    try:
        return libstdcxx_versions(read_elf(path).version_defs)
    except (OSError, ElfError):
        return ()


@functools.cache
def process_libstdcxx() -> tuple[str, ...]:
    """``libstdcxx_provides()`` of this process, read once (what a fleet node
    reports with every resolve: a millisecond, no compiler)."""
    return libstdcxx_provides()


def _first_loaded_or_none(name: str) -> str | None:
    """Load ``name`` with the dynamic loader and return the path it mapped."""
    import ctypes

    try:
        ctypes.CDLL(name)
    except OSError:
        return None
    return loaded_libstdcxx()


def describe(data: bytes) -> str:
    """One line for logs: what ``data`` links and needs from libstdc++."""
    link = parse_elf(data)
    needs = link.libstdcxx_needs
    return (f"NEEDED {', '.join(link.needed) or '(none)'}; libstdc++ versions needed: "
            f"{needs[-1] if needs else '(none)'} and {max(len(needs) - 1, 0)} older")


__all__ = [
    "LIBSTDCXX",
    "LIBSTDCXX_VERSION_RE",
    "ElfError",
    "ElfLinkage",
    "describe",
    "libstdcxx_provides",
    "libstdcxx_versions",
    "loaded_libstdcxx",
    "missing_versions",
    "package_libraries",
    "package_linkage",
    "parse_elf",
    "process_libstdcxx",
    "read_elf",
]
