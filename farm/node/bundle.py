"""The farm's ``aot_compile`` blob: torch's bytes alone, or a zip bundle of them
and files that go into the loading process's Inductor cache before the load.

``aot_compile.bin``
    torch's bytes (``save_compiled_function``).
``autotune/<2 chars>/<hash>.best_config``
    Triton autotuning results measured on the target GPU: with them the first
    call runs the tuned kernels instead of benchmarking every config.
``bundle.json``
    What the loader needs to use them: ``cpp_compiler``, the compiler as
    Inductor named it on the builder (kernel and ISA-probe keys hash its
    ``-v`` output, which names the compiler as invoked: ``g++`` and
    ``/usr/bin/g++`` give different keys), and ``precompiled_headers``
    (a define on the kernels' command line).
``triton/<hash key>/<kernel>.cubin``
    Every Triton binary a CUDA build compiled, each autotuning config's,
    relative to the build's Triton cache dir; a node puts them in its own
    (``triton_cache_dir`` of ``triton_device`` in ``bundle.json``) before
    loading. torch's own bundle inside the bytes keeps the kernels' static
    launchers but only some of the binaries they name, and one that is
    missing on a fresh node drops that kernel's launcher. A kernel with no
    static launcher at all (a name longer than Triton's 150 characters:
    ``farm.build.kernel_names``) finds its binary here and loads it
    through Triton's cache. Upstream, torch 2.13's ``keep_static_cubin_raw``
    carries the bytes instead; torch 2.11 has no such setting.
``kernels/<2 chars>/<hash>[.main].so``
    The compiled C++ kernels of a CPU build. A CPU ``aot_compile`` artifact
    holds C++ source, and without these a node compiles it again with g++ at
    load: a small MLP's first result in a fresh process on 2 cores took 12.2 s
    as torch's bytes alone, 3.0 s as the bundle (bench/cpu_artifact_load.py,
    bench/results/cpu_artifact_load-20261201.txt).
    Inductor skips the compile when the library already exists at the path
    its key gives (``CppCodeCache.load_async``: a hash of the source and the
    compile command line), so a node whose command line differs (another
    torch installation path, another ISA) just compiles as before.

Names are relative to the Inductor cache dir and the same on every node of a
target. The bytes are part of the artifact, so its sha256 and attestation,
checked before anything is installed or unpickled, cover them.
"""

from __future__ import annotations

import json
import os
import zipfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from farm.core.precompiled_headers import CHILD_ENV, install

MAGIC = b"PK\x03\x04"
ARTIFACT = "aot_compile.bin"
META = "bundle.json"
# section prefix -> the only suffix its entries may have
SECTIONS = {"autotune/": ".best_config", "kernels/": ".so", "triton/": ".cubin"}
_FIXED_DATE = (1980, 1, 1, 0, 0, 0)  # equal inputs give equal bytes


class BundleError(Exception):
    """An entry the loader will not install (it would leave the cache dir, or
    is not of its section's kind)."""


def is_bundle(path: Path) -> bool:
    with open(path, "rb") as fh:
        return fh.read(4) == MAGIC


def write_bundle(path: Path, cache: Path, sections: dict[str, Iterable[Path]],
                 meta: dict[str, Any] | None = None,
                 roots: dict[str, Path] | None = None) -> dict[str, int]:
    """Rewrite ``path`` as a bundle of torch's bytes, ``meta`` and the given
    files under ``cache`` (by section; a section in ``roots`` is named
    relative to its own dir instead); left a plain artifact when there are
    no files. Returns the number of files per section."""
    roots = roots or {}
    picked = {s: sorted({p for p in files if p.is_file()}) for s, files in sections.items()}
    counts = {s: len(files) for s, files in picked.items()}
    if not any(counts.values()):
        return counts
    tmp = path.with_suffix(".bundle")
    # Stored, not deflated: torch's bytes are mostly compressed cubins already.
    with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_STORED) as zf:
        zf.writestr(zipfile.ZipInfo(ARTIFACT, date_time=_FIXED_DATE), path.read_bytes())
        if meta:
            zf.writestr(zipfile.ZipInfo(META, date_time=_FIXED_DATE),
                        json.dumps(meta, sort_keys=True))
        for section, files in picked.items():
            for p in files:
                rel = p.relative_to(roots.get(section, cache)).as_posix()
                _check(section, rel)
                zf.writestr(zipfile.ZipInfo(section + rel, date_time=_FIXED_DATE), p.read_bytes())
    os.replace(tmp, path)
    return counts


def read_bundle(path: Path) -> tuple[bytes, dict[str, dict[str, bytes]], dict[str, Any]]:
    """torch's bytes, each section's files by their name in the cache dir, and
    the bundle's meta ({} when it has none)."""
    with zipfile.ZipFile(path) as zf:
        payload = zf.read(ARTIFACT)
        names = zf.namelist()
        meta = json.loads(zf.read(META)) if META in names else {}
        if not isinstance(meta, dict):
            raise BundleError(f"{META} in artifact bundle is not an object")
        sections: dict[str, dict[str, bytes]] = {s: {} for s in SECTIONS}
        for name in names:
            if name.endswith("/") or name in (ARTIFACT, META):
                continue
            section = next((s for s in SECTIONS if name.startswith(s)), None)
            if section is None:
                raise BundleError(f"unknown entry {name!r} in artifact bundle")
            sections[section][name[len(section):]] = zf.read(name)
    return payload, sections, meta


def _check(section: str, rel: str) -> None:
    if not rel.endswith(SECTIONS[section]):
        raise BundleError(f"bad {section.rstrip('/')} entry {rel!r} in artifact bundle: "
                          f"only {SECTIONS[section]} files")


def section_root(section: str, meta: dict[str, Any]) -> Path | None:
    """Where a section's files go in this process: ``triton/`` into Triton's
    cache dir as Inductor names it for the build's device index (where
    ``reload_cubin_path`` looks), the others into the Inductor cache dir
    (None: ``install_into_cache``'s default)."""
    if section != "triton/":
        return None
    index = meta.get("triton_device", 0)
    if not isinstance(index, int) or isinstance(index, bool) or index < 0:
        raise BundleError(f"bad triton_device {index!r} in artifact bundle")
    from torch._inductor.runtime.cache_dir_utils import triton_cache_dir

    return Path(triton_cache_dir(index))


def install_into_cache(section: str, files: dict[str, bytes], root: Path | None = None) -> int:
    """Put a section's files into this process's Inductor cache dir (``root``,
    else torch's ``cache_dir()``). Files already there are left alone: they
    are this node's own compile of the same key. Returns how many were added."""
    if root is None:
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        root = Path(cache_dir())
    root = root.resolve()
    n = 0
    for rel, data in files.items():
        _check(section, rel)
        dest = (root / rel).resolve()
        if root not in dest.parents:
            raise BundleError(f"bad {section.rstrip('/')} entry {rel!r} in artifact bundle: "
                              "it would leave the cache dir")
        if dest.exists():
            continue
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, dest)
        n += 1
    return n


def adopt_build_compiler(meta: dict[str, Any]) -> bool:
    """Name the C++ compiler as the builder's Inductor did, for this process,
    so the shipped libraries' keys match: only when nothing chose one here
    (no ``CXX``, Inductor's default setting) and the builder's is an absolute
    path to an executable on this machine too; it is then this machine's own
    compiler, the one the artifact was built with. Returns whether it did."""
    cxx = meta.get("cpp_compiler")
    if not isinstance(cxx, str) or not os.path.isabs(cxx) or not os.access(cxx, os.X_OK):
        return False
    if os.environ.get("CXX"):
        return False
    from torch._inductor import config

    if tuple(config.cpp.cxx) != (None, "g++"):
        return False
    config.cpp.cxx = (None, cxx)
    return True


def adopt_header_precompile(meta: dict[str, Any]) -> bool:
    """Precompiled headers on or off in this process as on the builder
    (``precompiled_headers``), unless the operator set
    ``TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS``: the setting is a define on
    the kernels' command line, so in their keys. On, it is on through
    ``farm.core.precompiled_headers.install``: headers from the store a
    worker gave (``TORCH_FARM_PCH_STORE``, a verification child) or none, so
    the node never builds one itself (Inductor's own way builds it, 150 MB
    and about 30 s on 2 cores under /tmp, before it even looks for a kernel
    library). Where this torch has no such hook the setting stays off: the
    shipped kernels' keys then miss and the node compiles them, which is
    still quicker. Returns whether it changed the setting."""
    wanted = meta.get("precompiled_headers")
    if not isinstance(wanted, bool):
        return False
    if os.environ.get("TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS") is not None:
        return False
    from torch._inductor import config

    before = config.cpp_cache_precompile_headers
    if wanted:
        install(os.environ.get(CHILD_ENV))
    else:
        config.cpp_cache_precompile_headers = False
    return bool(config.cpp_cache_precompile_headers != before)
