"""Precompiled C++ headers for Inductor's CPU kernels: built once per machine,
read-only to every build.

Why. A CPU kernel is one g++ run, and most of it is parsing torch's
``cpp_prefix.h``. With a precompiled header the C++ stage of a 16-layer
Llama's compile took 3.4 s instead of 10.3 s (regional) and 5.5 s instead of
17.1 s (full graph) on 2 cores (docs/benchmarks.md). torch's own way does not
fit a build farm: it keeps the header under ``default_cache_dir()`` (the
sandbox's private ``/tmp``, emptied after every child) and builds it (150 MB,
about 30 s on 2 cores) before it looks for a single kernel, so every build
paid 30 s more instead of 7 s less; and a directory builds write to is one a
hostile build could poison for the next team's kernels.

How:

- The *store* (``FARM_PCH_STORE``, else ``~/.cache/torch-farm/pch``) is
  filled only by ``fill_store``: the compile worker runs it once per machine
  and toolchain, at start and in the background, as a sandboxed child
  (``build_store``) that runs no model code: it compiles one sample kernel,
  and every header torch precompiles for it is copied in under a key of what
  it was built from (``header_key``).
- A build child gets the store in ``TORCH_FARM_PCH_STORE`` and bubblewrap binds
  it read-only (``farm.build.isolation``). ``install`` routes Inductor's
  header precompile (``codecache._precompile_header``) through it: a header
  in the store is used; one that is not is skipped and the kernel compiles
  without, as before. A build never builds a header, nor writes one.
- g++ checks a precompiled header against the compile's own flags and
  silently ignores one that does not fit, reading the header itself: a stale
  or foreign entry costs time, never a different kernel.
- The setting is a define on every kernel's command line, so part of the
  kernels' cache keys: a build with a store always has it on (whether or not
  the header is there yet), and its artifact says so (``precompiled_headers``
  in the bundle). A node adopts it with ``install`` too, without a store,
  so its kernels' keys match the shipped ones and it never builds the 150 MB
  header at load (``farm.node.bundle.adopt_header_precompile``).

AOTInductor packages take their wrapper's header from the store too, once
the fill compiled a sample package with it for the build's compiler
(``aoti_marker``): before that they compile without one. Whether a package
used it is part of its key (``farm.build.aoti_cache``), since its compile
command (in the package) names the header.

    python -m farm.build.pch        # fill this machine's store now, print it
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import sys
import tempfile
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from farm.build import background
from farm.core.precompiled_headers import CHILD_ENV, aoti_marker, install

log = logging.getLogger(__name__)

STORE_ENV = "FARM_PCH_STORE"  # the worker's setting: a directory, or "off"
# 3: the store also holds AOTI's headers, marked per compiler (stores filled
# before are filled again).
_STORE_VERSION = 3
_FILL_TIMEOUT_S = 900.0


def store_dir() -> Path | None:
    """This machine's store (``FARM_PCH_STORE``; "off": none)."""
    from farm.core.cpu_isa import cache_file

    return cache_file(STORE_ENV, "pch")


def _sample_kernels() -> None:
    """Compile kernels of the kinds a CPU build compiles (vectorised
    pointwise and reductions, forward and backward), so every header variant
    they ask for is precompiled."""
    import torch

    def sample(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        y = torch.nn.functional.gelu(x @ w) * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        return torch.softmax(y, dim=-1).sum()

    x = torch.randn(8, 16, requires_grad=True)
    w = torch.randn(16, 16, requires_grad=True)
    torch.compile(sample, backend="inductor", fullgraph=True)(x, w).backward()


def build_store(payload: dict[str, Any]) -> dict[str, Any]:
    """Sandbox entry point: fill ``payload["store"]`` (bound writable to this
    child only) with the headers the sample kernels ask for, and the sample
    AOTI package's unless ``payload["aoti"]`` is false."""
    store = Path(payload["store"])
    if not install(store, fill=True):
        return {"headers": [], "why": "this torch has no header precompile hook"}
    _sample_kernels()
    aoti = (_sample_aoti(store) if payload.get("aoti", True)
            else "not filled: this worker builds no CPU AOTI packages")
    return {"headers": sorted(p.name for p in store.glob("*.h")), "aoti": aoti}


def _sample_aoti(store: Path) -> str:
    """Compile a small AOTI package the way a build does
    (``farm.build.aoti_compile``: the same configs, -march and compiler)
    with the header precompile on, so the headers its wrapper and kernels
    ask for are stored; then mark the store for AOTI and this compiler
    (``aoti_marker``). A failure leaves the mark off: packages compile
    without a header, and the kernels' headers stay."""
    try:
        import torch

        from farm.build.aoti_compile import compile_aoti
        from farm.core.specs import JobSpec
        from farm.zoo.basic import mlp

        spec = JobSpec.from_json({"name": "pch-sample", "version": "1",
                                  "model": {"entrypoint": "farm.zoo.basic:mlp"},
                                  "inputs": ["float32[2,64]"]})
        with tempfile.TemporaryDirectory(prefix="farm-pch-aoti-") as out:
            compile_aoti(spec, mlp().eval(), torch.device("cpu"), Path(out) / "sample.pt2",
                         headers=True)
    except Exception as exc:  # the kernels' headers are still worth keeping
        log.warning("no precompiled headers for AOTI packages: %s: %s", type(exc).__name__, exc)
        return f"not filled: {type(exc).__name__}: {exc}"
    from farm.build.toolchain import inductor_compiler

    # The compiler whose headers these are: a build running another one
    # compiles its packages without (farm.core.precompiled_headers.aoti_store).
    compiler = inductor_compiler()
    aoti_marker(store, compiler).write_text(compiler + "\n")
    return f"filled for {compiler}"


def wants_aoti_sample(device: str, builds_aoti: bool) -> bool:
    """Whether a worker for ``device`` fills the store with the sample AOTI
    package's headers: only where it builds AOTI packages on CPU, the only
    packages that take their wrapper's header from the store
    (``farm.build.aoti_compile``)."""
    return builds_aoti and device == "cpu"


def _marker(store: Path, env: Mapping[str, str], aoti: bool) -> Path:
    """One file per toolchain (and whether its fill took AOTI's headers): the
    store was filled for it."""
    import torch

    parts = {"v": _STORE_VERSION, "torch": torch.__version__,
             "torch_dir": os.path.dirname(torch.__file__), "python": sys.version,
             "env": dict(sorted(env.items())), **({} if aoti else {"aoti": False})}
    digest = hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:24]
    return store / f"filled-{digest}.json"


def fill_store(store: Path | None = None, *, env: Mapping[str, str] | None = None,
               timeout_s: float = _FILL_TIMEOUT_S, aoti: bool = True) -> dict[str, Any]:
    """Fill this machine's store for the worker's toolchain (``env``: what its
    build children get, ``farm.build.steps.toolchain_env``), in a sandboxed
    child, unless done before. ``aoti=False``: a worker that builds no CPU
    AOTI package (``FARM_AOTI=0``, a GPU target, or a compiler whose packages
    do not load) skips the sample package, about a third of the fill, and
    takes a fill with it as done. Returns what it did (``skipped``, ``headers``,
    ``error``); raises nothing."""
    from filelock import FileLock, Timeout

    from farm.build import sandbox
    from farm.build.steps import toolchain_env

    store = store if store is not None else store_dir()
    if store is None:
        return {"skipped": f"{STORE_ENV}=off"}
    env = dict(toolchain_env() if env is None else env)
    env.pop(CHILD_ENV, None)
    store.mkdir(parents=True, exist_ok=True)
    marker = _marker(store, env, aoti)
    # A fill with AOTI's headers holds all that a fill without them does.
    enough = [marker] if aoti else [marker, _marker(store, env, True)]
    try:
        lock = FileLock(str(store.parent / f".{store.name}.lock"), timeout=timeout_s)
        lock.acquire()
    except (OSError, Timeout) as exc:
        return {"error": f"no lock on {store}: {exc}"}
    try:
        done = next((m for m in enough if m.is_file()), None)
        if done is not None:
            return {"skipped": "filled before", "marker": str(done)}
        try:
            isolation = sandbox.build_isolation(writable=[store], what="header precompile")
        except sandbox.SandboxUnavailable as exc:
            return {"error": str(exc)}
        with tempfile.TemporaryDirectory(prefix="farm-pch-cache-") as cache:
            res = sandbox.run_isolated(
                "farm.build.pch:build_store", {"store": str(store), "aoti": aoti},
                timeout_s=timeout_s,
                memory_mb=0, env_extra={**env, "TORCHINDUCTOR_CACHE_DIR": cache},
                isolation=isolation, warm=False)
        if os.geteuid() == 0:
            # The sandbox uid wrote it; nothing but this function may change it.
            _own(store, 0)
        if not res.ok:
            return {"error": res.error or "the header precompile failed"}
        result = dict(res.value or {})
        marker.write_text(json.dumps(result))
        return result
    finally:
        lock.release()


def _own(top: Path, uid: int) -> None:
    for dirpath, _, files in os.walk(top):
        with contextlib.suppress(OSError):
            os.chown(dirpath, uid, uid)
            os.chmod(dirpath, 0o755)
        for f in files:
            with contextlib.suppress(OSError):
                p = Path(dirpath) / f
                os.chown(p, uid, uid, follow_symlinks=False)
                os.chmod(p, 0o644)


def describe_fill(filled: Mapping[str, Any], seconds: float) -> str:
    """One line for a benchmark's header: where the headers came from, or
    why there are none (``fill_store``'s answer, and how long it took)."""
    if "error" in filled:
        return f"none: the fill failed after {seconds:.1f} s ({filled['error']})"
    return (f"from {store_dir()} ({filled.get('skipped') or 'filled'} in {seconds:.1f} s, "
            "once per machine and toolchain)")


def fill_in_background(store: Path | None = None, *,
                       aoti: bool = True) -> threading.Thread | None:
    """``fill_store`` on a daemon thread (once per store in this process):
    builds run meanwhile, compiling without the header until it is there."""
    store = store if store is not None else store_dir()
    if store is None:
        return None

    return background.fill_once(f"pch:{store}:aoti={aoti}", "farm-pch-fill",
                                lambda: fill_store(store, aoti=aoti),
                                f"precompiled headers in {store}")


def child_env() -> dict[str, str]:
    """What a build child gets: the store, where this machine keeps one (made
    here when missing: a build with a store has the setting on, filled or not,
    so kernels keep one cache key from the worker's first build on)."""
    store = store_dir()
    if store is None:
        return {}
    try:
        store.mkdir(parents=True, exist_ok=True)
    except OSError:
        return {}
    return {CHILD_ENV: str(store)}


def main(argv: list[str] | None = None) -> int:
    out = fill_store()
    print(json.dumps({"store": str(store_dir()), **out}, indent=1))
    return 1 if "error" in out else 0


if __name__ == "__main__":
    sys.exit(main())
