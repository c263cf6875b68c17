"""Whether AOTInductor packages built on this host load here, checked once.

On the H200 image (torch 2.11.0+cu130) every AOTI package built there crashed
at load, SIGSEGV in ``AOTIModelPackageLoader``'s constructor: Inductor
compiled with ``$CXX`` (``/opt/gcc/bin/g++``), which linked a static copy of
libstdc++ into the package (``farm.build.toolchain`` says how). So the answer
is a property of the compiler a worker uses, and the worker chooses one that
passes (``farm.build.toolchain.choose_compiler``); this module is the check
each candidate must pass: build a tiny weight-free package with it in one
child process, read the package's ELF linkage, load and run it in another
child and compare with eager. The answer is kept per machine
(``FARM_AOTI_CHECK_CACHE``, else ``~/.cache/torch-farm/aoti-check.json``).

    python -m farm.build.aoti_check [cpu|cuda]     # choose now, print the answer
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from farm.build.toolchain import CHECK_CACHE_ENV, Probe, compiler_for

log = logging.getLogger(__name__)

OK = "ok"
# A first AOTI build on a host compiles its runtime headers: a minute on the H200.
BUILD_TIMEOUT_S = 600
LOAD_TIMEOUT_S = 120
_INFO = "inductor.json"


def aoti_loads_here(device: str) -> tuple[bool, str]:
    """(whether an AOTI package built here for ``device`` loads and runs
    here, "ok" or why not). Chooses this machine's compiler for ``device``
    (cached per machine) and makes it this process's (``CXX``)."""
    choice = compiler_for(device)
    return (True, OK) if choice.ok else (False, choice.why_not())


def probe_compiler(device: str, cxx: str) -> Probe:
    """Build with ``cxx`` in one child, check the linkage, load and run in
    another child. Reasons are short phrases (they go into logs and build
    metadata); a build that fails or times out is not definitive."""
    from farm.core.elf import ElfError, libstdcxx_provides, missing_versions, package_linkage

    with tempfile.TemporaryDirectory(prefix="farm-aoti-check-") as tmp:
        # Seconds, where an AOTI build takes a minute: a compiler that links
        # a static libstdc++ into a trivial library would into a package too.
        early = quick_linkage(cxx, Path(tmp))
        if early is not None:
            return early
        package = Path(tmp) / "check.pt2"
        env = {**os.environ, "CXX": cxx,
               # A fresh Inductor cache: a kernel another compiler built must
               # not stand in for this one's.
               "TORCHINDUCTOR_CACHE_DIR": str(Path(tmp) / "inductor"),
               "TRITON_CACHE_DIR": str(Path(tmp) / "triton")}
        failed = _child("build", device, package, env, BUILD_TIMEOUT_S)
        if failed is not None:
            return failed
        info = _read_info(package)
        used = info.get("inductor_cxx")
        if used != cxx:
            return Probe(f"inductor compiled with {used!r}, not {cxx!r}", definitive=True)
        try:
            linkage = package_linkage(package)
        except (ElfError, OSError, ValueError) as exc:
            return Probe(f"package unreadable: {exc}", definitive=True)
        if not linkage["links_shared_libstdcxx"]:
            return Probe("links no shared libstdc++.so.6 (a static copy: two libstdc++ "
                         "in one process crash)", linkage=linkage)
        needs = linkage["libstdcxx_needs"]
        assert isinstance(needs, list)
        missing = missing_versions(needs, libstdcxx_provides())
        if missing:
            return Probe(f"needs {', '.join(missing)}, which this process's libstdc++ lacks",
                         linkage=linkage)
        failed = _child("load", device, package, env, LOAD_TIMEOUT_S)
        if failed is not None:
            return Probe(failed.reason, failed.definitive, linkage)
        return Probe(OK, linkage=linkage)


_QUICK_SOURCE = r"""
#include <regex>
#include <string>
extern "C" int farm_matches(const char* s) {
    return std::regex_match(std::string(s), std::regex("cuda(:[0-9]+)?"));
}
"""


def quick_linkage(cxx: str, tmp: Path) -> Probe | None:
    """A trivial C++ shared library built with ``cxx`` the way Inductor links
    (``-shared -fPIC``): a Probe when it links no shared libstdc++ (or cannot
    be built), None when the full check should go on."""
    from farm.core.elf import ElfError, read_elf

    src, lib = tmp / "quick.cpp", tmp / "libquick.so"
    src.write_text(_QUICK_SOURCE)
    try:
        res = subprocess.run([cxx, "-shared", "-fPIC", "-O0", str(src), "-o", str(lib)],
                             capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.SubprocessError) as exc:
        return Probe(f"cannot build a shared library: {type(exc).__name__}", definitive=False)
    if res.returncode != 0:
        tail = (res.stderr or res.stdout).strip().splitlines()[-1:] or [""]
        return Probe(f"cannot build a shared library: {tail[0][:160]}", definitive=False)
    try:
        link = read_elf(lib)
    except (ElfError, OSError) as exc:
        return Probe(f"built an unreadable library: {exc}")
    if not link.links_shared_libstdcxx:
        return Probe("links no shared libstdc++.so.6 (a static copy: two libstdc++ "
                     "in one process crash)", linkage={"needed": list(link.needed)})
    return None


def _child(step: str, device: str, package: Path, env: dict[str, str],
           timeout: float) -> Probe | None:
    try:
        res = subprocess.run(
            [sys.executable, "-m", "farm.build.aoti_check", f"--{step}", device, str(package)],
            capture_output=True, text=True, timeout=timeout, env=env,
        )
    except subprocess.TimeoutExpired:
        return Probe(f"{step} timed out", definitive=step == "load")
    if res.returncode < 0:
        try:
            name = signal.Signals(-res.returncode).name.lower()
        except ValueError:
            name = f"signal {-res.returncode}"
        return Probe(f"{step} crashed {name}", definitive=step == "load")
    if res.returncode != 0:
        tail = (res.stderr or res.stdout).strip().splitlines()[-1:] or [""]
        log.warning("AOTI check %s for %s with %s failed: %s", step, device, env.get("CXX"),
                    tail[0][:300])
        return Probe(f"{step} failed: {tail[0][:160]}", definitive=step == "load")
    return None


def _read_info(package: Path) -> dict[str, Any]:
    try:
        data = json.loads(package.with_name(_INFO).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


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
    # As farm.build.aoti_compile.compile_aoti builds them: weight-free.
    from farm.build.toolchain import inductor_compiler

    # What Inductor itself will run: the parent checks it is the candidate.
    package.with_name(_INFO).write_text(json.dumps({"inductor_cxx": inductor_compiler()}))
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
    fn = load_artifact(package, FORMAT_AOTI, module=model, trust_unverified=True)  # its own probe
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
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    ok, why = aoti_loads_here(device)
    print(f"AOTI packages built here for {device}: {'load' if ok else 'do not load'} ({why}); "
          f"CXX={os.environ.get('CXX')}")
    return 0 if ok else 1


__all__ = ["CHECK_CACHE_ENV", "OK", "aoti_loads_here", "probe_compiler", "quick_linkage"]


if __name__ == "__main__":
    raise SystemExit(main())
