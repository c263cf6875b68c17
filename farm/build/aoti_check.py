"""Whether AOTInductor packages built on this host load here, checked once.

On the H200 image (torch 2.11.0+cu130, g++ 13.3) every AOTI package built
there crashed at load, SIGSEGV in ``AOTIModelPackageLoader``'s constructor,
CPU and CUDA alike, torch's own ``aoti_load_package`` too; a package built by
the same torch wheel on another host (g++ 12) loaded and matched eager on that
same H200, and on this CPU host torch 2.11 and 2.13 build packages that load
(``bench/probe_aoti_cuda.py``, ``bench/results/probe_aoti-*``). So whether a
compile worker should build AOTI packages is a property of its host's
toolchain, not of the torch version: the worker builds a tiny weight-free
package, loads and runs it in a child process, and remembers the answer per
machine under a key of torch, the C++ compiler and the device
(``FARM_AOTI_CHECK_CACHE``, else ``~/.cache/torch-farm/aoti-check.json``).

    python -m farm.build.aoti_check [cpu|cuda]     # run the check now, print the answer
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import platform
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from farm.core.cpu_isa import cache_file, cxx_identity, read_cache_file, write_cache_file

log = logging.getLogger(__name__)

CHECK_CACHE_ENV = "FARM_AOTI_CHECK_CACHE"
OK = "ok"
_MAX_ENTRIES = 16
# A first AOTI build on a host compiles its runtime headers: a minute on the H200.
BUILD_TIMEOUT_S = 600
LOAD_TIMEOUT_S = 120


def aoti_loads_here(device: str) -> tuple[bool, str]:
    """(whether an AOTI package built here for ``device`` loads and runs
    here, "ok" or why not). Cached per machine; a build that fails (rather
    than a load that crashes) is not cached, as it may be passing."""
    device = device.split(":")[0]
    path = cache_file(CHECK_CACHE_ENV, "aoti-check.json")
    key = _key(device)
    entries = read_cache_file(path) if path is not None else {}
    hit = entries.get(key)
    if hit is not None:
        return hit == OK, hit
    with _machine_lock(path):
        # Workers starting together on one machine: one probes, the others
        # wait for its answer instead of compiling beside it.
        entries = read_cache_file(path) if path is not None else {}
        hit = entries.get(key)
        if hit is not None:
            return hit == OK, hit
        return _probe_and_store(device, path, key, entries)


def _probe_and_store(
    device: str, path: Path | None, key: str, entries: dict[str, str]
) -> tuple[bool, str]:
    answer, definitive = _probe(device)
    if definitive and path is not None:
        entries.pop(key, None)
        entries[key] = answer
        while len(entries) > _MAX_ENTRIES:
            del entries[next(iter(entries))]
        write_cache_file(path, entries)
    if answer != OK:
        log.warning("AOTI packages built on this host for %s do not load here (%s): "
                    "building aot_compile artifacts only", device, answer)
    return answer == OK, answer


@contextlib.contextmanager
def _machine_lock(path: Path | None) -> Iterator[None]:
    """An exclusive lock next to the cache file (none without a cache)."""
    if path is None:
        yield
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = open(path.with_name(path.name + ".lock"), "a")  # noqa: SIM115
    except OSError:
        yield
        return
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _key(device: str) -> str:
    import torch

    parts = {
        "v": 1,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cxx": cxx_identity(),
        "device": device,
        "cuda": torch.version.cuda if device == "cuda" else None,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def _probe(device: str) -> tuple[str, bool]:
    """Build in one child, load and run in another: (answer, definitive).
    Values are lower-case words only (the cache file's format)."""
    with tempfile.TemporaryDirectory(prefix="farm-aoti-check-") as tmp:
        package = Path(tmp) / "check.pt2"
        steps = (("build", BUILD_TIMEOUT_S), ("load", LOAD_TIMEOUT_S))
        for step, timeout in steps:
            try:
                res = subprocess.run(
                    [sys.executable, "-m", "farm.build.aoti_check", f"--{step}", device,
                     str(package)],
                    capture_output=True, text=True, timeout=timeout,
                )
            except subprocess.TimeoutExpired:
                return f"{step} timed out", step == "load"
            if res.returncode < 0:
                try:
                    name = signal.Signals(-res.returncode).name.lower()
                except ValueError:
                    name = f"signal {-res.returncode}"
                return f"{step} crashed {name}", step == "load"
            if res.returncode != 0:
                tail = (res.stderr or res.stdout).strip().splitlines()[-1:] or [""]
                log.warning("AOTI check %s for %s failed: %s", step, device, tail[0][:300])
                return f"{step} failed", step == "load"
    return OK, True


def _tiny(device: str) -> Any:
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(),
                               torch.nn.Linear(32, 8)).to(device).eval()


def _build(device: str, package: Path) -> None:
    import torch

    model = _tiny(device)
    x = torch.randn(4, 16, device=device)
    with torch.no_grad():
        ep = torch.export.export(model, (x,), strict=False)
    # As farm.build.compile.compile_aoti builds them: weight-free.
    torch._inductor.aoti_compile_and_package(
        ep, package_path=str(package),
        inductor_configs={"aot_inductor.package_constants_in_so": False,
                          "always_keep_tensor_constants": True, "freezing": False},
    )


def _load(device: str, package: Path) -> None:
    import torch

    from farm.node.loader import FORMAT_AOTI, load_artifact

    model = _tiny(device)
    x = torch.randn(4, 16, device=device)
    # The farm's own load path: the node's module supplies the weights.
    fn = load_artifact(package, FORMAT_AOTI, module=model)
    with torch.no_grad():
        got, want = fn(x), model(x)
    if not torch.allclose(got, want, rtol=1e-3, atol=1e-3):
        raise SystemExit("the package's result differs from eager")


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in ("--build", "--load"):
        (_build if args[0] == "--build" else _load)(args[1], Path(args[2]))
        return 0
    device = args[0] if args else "cpu"
    ok, why = aoti_loads_here(device)
    print(f"AOTI packages built here for {device}: {'load' if ok else 'do not load'} ({why})")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
