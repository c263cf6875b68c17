"""AOTI packages reused across builds of the same exported program.

torch caches none of an AOTInductor build: ``aoti_compile_and_package``
lowers the exported graph and compiles its C++ wrapper and kernels anew
every time (on CPU most of it is g++ on the wrapper, about 10 CPU-s for a
small MLP), and the farm runs it in an empty cache on purpose
(``farm.build.aoti_support.reproducible_cache_dir``: a warm cache changes the
package's bytes). So every new build key paid a cold AOTI build, even where
only something outside the graph changed: a new version of the same code,
a comment, a renamed model.

A package is a function of what it is compiled from: the exported graph
(with every node's shapes, dtypes and strides, the graph signature, the
dynamic ranges), the Inductor configs the farm passes (which hold the
farm's metadata: inputs, constants, ISA, -march, threads), the compiler and
the toolchain, and the cache path it is compiled under. ``package_key``
hashes all of it, and the build compiles under a path named by that key, so
equal keys give equal bytes whether the package came from the cache or not.

The package is kept in the build's Inductor cache
(``<inductor cache>/farm-aoti/<key>.pt2``), which the worker prefills from
and harvests into the project's shared compile cache
(``farm.build.compile_cache``), as ``farm.build.blocks`` keeps per-block
functions: shared only within a project, and every artifact, cached or not,
is still checked (its libstdc++ linkage) and verified against eager in a
fresh process before it is stored.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path
from typing import Any

import torch

from farm.build.blocks import store_bytes
from farm.core.specs import canonical_json

CACHE_SUBDIR = "farm-aoti"
# Bump when what the farm puts into a package changes without the configs
# showing it: older entries then stop matching.
KEY_VERSION = 1


def graph_text(ep: Any) -> str:
    """The exported program as text: every node with its shapes, dtypes,
    strides and devices (nested graphs included), its signature, its
    dynamic ranges and its call structure; not where its source is."""
    gm = ep.graph_module
    try:
        code = gm.print_readable(print_output=False, include_stride=True, include_device=True)
    except TypeError:  # a torch whose print_readable has no such options
        code = gm.print_readable(print_output=False)
    # Where each op's source line is ("# File: <path>:<line> in forward,
    # code: ...") is left out: a code pack lives under a directory named by
    # its digest, so it would tell two packs of the same model apart, and
    # the package holds none of it (its sources name ops, not files).
    code = "\n".join(line for line in code.splitlines()
                     if not line.lstrip().startswith("# File:"))
    return "\n".join([
        code,
        str(ep.graph_signature),
        repr(sorted((str(k), str(v)) for k, v in ep.range_constraints.items())),
        str(ep.call_spec.in_spec),
        str(ep.call_spec.out_spec),
    ])


def toolchain(device: torch.device, cxx: str) -> dict[str, Any]:
    """What compiles the package besides the configs: torch, Python, the C++
    compiler and, for CUDA, the GPU generation, CUDA and Triton."""
    out: dict[str, Any] = {"torch": torch.__version__, "python": sys.version, "cxx": cxx,
                           "device": device.type}
    if device.type == "cuda":
        try:
            import triton  # type: ignore[import-not-found,unused-ignore]

            triton_version = str(triton.__version__)
        except ImportError:  # Inductor's CUDA codegen needs it; the key must not
            triton_version = "none"
        out.update(capability=list(torch.cuda.get_device_capability(device)),
                   cuda=torch.version.cuda, triton=triton_version)
    return out


def package_key(ep: Any, configs: dict[str, Any], device: torch.device, cxx: str, *,
                header_store: str | None = None) -> str:
    """``header_store``: the precompiled-header store the wrapper is
    compiled with (its path is in the package's compile command)."""
    what = {
        "version": KEY_VERSION,
        "graph": hashlib.sha256(graph_text(ep).encode()).hexdigest(),
        # repr, not JSON: configs may hold values JSON has no form for.
        "configs": repr(sorted((k, repr(v)) for k, v in configs.items())),
        "toolchain": toolchain(device, cxx),
        "header_store": header_store,
    }
    return hashlib.sha256(canonical_json(what).encode()).hexdigest()


def cached_package(cache: Path, key: str) -> Path | None:
    p = cache / f"{key}.pt2"
    return p if p.is_file() else None


def keep_package(cache: Path, key: str, package: Path) -> None:
    """Copy ``package`` into ``cache`` under ``key``, atomically as a
    per-block function is kept (the harvest, or a second build of the same
    key on this host, may read it meanwhile)."""
    store_bytes(cache / f"{key}.pt2", package.read_bytes())


__all__ = ["CACHE_SUBDIR", "cached_package", "graph_text", "keep_package", "package_key",
           "toolchain"]
