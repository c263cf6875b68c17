"""This machine's CPU vector ISA, as Inductor compiles for it, cached per machine.

Inductor's pick test-compiles a C++ program per candidate ISA: 14-16 s of a
2-core fleet node's cold start with a fresh Inductor cache (measured with
``bench/coldstart.py --device cpu``). The answer only changes with the CPU,
torch, the compiler and a few settings, so it is kept in a small JSON file
under a key of exactly those, and only the first process on a machine pays.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import re
import shutil
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from farm.core import isa_checks


def detect_cpu_isa(*, check_compiler: bool = True) -> str:
    """The vector ISA that Inductor bakes into CPU code on this machine.

    Inductor's pick (``pick_vec_isa``, which already folds in
    ``ATEN_CPU_CAPABILITY`` and ``cpp.simdlen``) is what the generated C++ is
    tiled and compiled for, so a node is described by it and compared exactly.
    The name is torch's (``avx2``, ``avx512``, ``avx512 avx512_vnni``, ...),
    except that SVE is named with its width (``sve128``, ``sve256``): torch
    calls NEON and both SVE widths "asimd", and their code is not
    interchangeable.

    ``check_compiler`` (a compile worker describing what it builds for):
    Inductor's pick test-compiles a C++ program per candidate ISA (14-16 s of
    a 2-core machine's start with a fresh Inductor cache), so the answer is
    kept per machine in a small JSON file (``FARM_ISA_CACHE``, see
    ``_isa_cache_path``) under a key of everything it depends on.

    Without it (a fleet node asking which artifacts it can run), on x86: the
    same pick from the CPU's flags alone, which needs no compiler and takes
    milliseconds; what a node can run depends on its CPU, not on whether it
    could compile. Elsewhere the node uses Inductor's (cached) pick.
    """
    isa = "" if check_compiler else _x86_isa_from_cpu_flags()
    if not isa:
        isa = _cached_inductor_isa()
    if isa:
        return isa
    # Inductor has no pick (no C++ compiler, or no ISA it knows). An
    # AOTInductor package still loads, and its kernels must have been built
    # for what this CPU runs, which is ATen's dispatch level ("AVX2" -> "avx2").
    return aten_capability().lower()


def aten_capability() -> str:
    """ATen's CPU dispatch level ("AVX2", "AVX512", "DEFAULT", ...), which is
    also how an AOTI package names the ISA it was built for: no compiler
    needed, unlike Inductor's pick."""
    import torch

    return str(torch.backends.cpu.get_cpu_capability())


# Inductor's x86 ISAs, widest first, by name (``str()`` of its VecISA classes,
# whose words are the CPU flags each needs): pick_vec_isa takes the first
# whose flags the CPU has, unless ATEN_CPU_CAPABILITY names a narrower one.
_X86_ISAS = ("avx512 avx512_vnni amx_tile", "avx512 avx512_vnni", "avx512", "avx2")


def _x86_isa_from_cpu_flags() -> str:
    """``pick_vec_isa``'s answer on x86 from the CPU's flags as torch reads
    them, without Inductor (whose pick needs a working compiler even to say
    what the CPU has: AMX checks the compiler's version); "" elsewhere.
    ``test_a_node_reads_the_isa_from_cpu_flags_without_a_compiler`` holds it
    to Inductor's own pick."""
    import torch

    if platform.machine() not in ("x86_64", "AMD64"):
        return ""
    cpu = torch.cpu
    try:
        avx512 = bool(cpu._is_avx512_supported())
        flags = {
            "avx2": bool(cpu._is_avx2_supported()),
            "avx512": avx512,
            "avx512_vnni": avx512 and bool(cpu._is_vnni_supported()),
            "amx_tile": bool(cpu._is_amx_tile_supported()),
        }
    except AttributeError:  # pragma: no cover - a torch without these probes
        return ""
    valid = [isa for isa in _X86_ISAS if all(flags[f] for f in isa.split())]
    capability = os.environ.get("ATEN_CPU_CAPABILITY")
    if capability == "default":
        return ""
    if capability in ("avx2", "avx512"):
        valid = [isa for isa in valid if capability in isa.split()] or valid
    return valid[0] if valid else ""


def _pick_inductor_isa() -> str:
    """Inductor's own pick, renamed as ``detect_cpu_isa`` documents; "" when
    Inductor has none (no usable compiler or no supported ISA). The expensive
    part: every candidate ISA is test-compiled and loaded."""
    isa = ""
    try:
        from torch._inductor import cpu_vec_isa

        picked = cpu_vec_isa.pick_vec_isa()
        # InvalidVecISA is falsy but its str() is "INVALID_VEC_ISA": no usable
        # compiler or no supported ISA.
        if picked:
            isa = str(picked)
            # By class name: torch 2.13 spells it VecSVE (one class, two
            # widths), older releases VecSVE256.
            if type(picked).__name__.startswith("VecSVE"):
                isa = f"sve{picked.bit_width()}"
    except Exception:  # pragma: no cover - very old torch or a broken toolchain
        isa = ""
    return isa


# --------------------------------------------------------------------------- #
# Skipping Inductor's ISA test compiles where their answer is known
# --------------------------------------------------------------------------- #

VEC_ISA_OK_ENV = "TORCHINDUCTOR_VEC_ISA_OK"


def isa_checks_redundant() -> bool:
    """True when Inductor's ISA test compiles cannot change its pick here.

    Every process with a fresh Inductor cache (a build child, a verification
    child, a node loading a CPU artifact) test-compiles and test-loads a C++
    program per candidate ISA before its first kernel: 10 g++ runs and 10
    dlopen probes (on a loaded 2-core machine 22 of a small MLP's 30 s
    load; bench/cpu_artifact_load.py measures the whole saving). With ``cpp.vec_isa_ok``
    set, Inductor takes every ISA the CPU's flags name as valid. That gives
    the same pick exactly when the checked pick, cached for this machine
    (``FARM_ISA_CACHE``, written by the first process that made it), equals the
    pick from the flags: then the checks are redundant. x86 only; never when
    the operator set TORCHINDUCTOR_VEC_ISA_OK; never before a checked pick is
    cached (so a compiler that cannot build an ISA still shows).
    """
    return _agrees_with_flags(_checked_pick(make_if_missing=False))


def _agrees_with_flags(checked: str | None) -> bool:
    return bool(checked) and checked == _x86_isa_from_cpu_flags()


def _checked_pick(*, make_if_missing: bool) -> str | None:
    """The checked pick this machine's cache holds for the current key; with
    ``make_if_missing``, made now (and stored) when it holds none. None when
    this is not x86 (no flags pick to compare with), the operator set
    TORCHINDUCTOR_VEC_ISA_OK, or there is no cache file to keep it."""
    if platform.machine() not in ("x86_64", "AMD64") or os.environ.get(VEC_ISA_OK_ENV) is not None:
        return None
    slot = _cache_slot()
    if slot is None:
        return None
    path, key = slot
    checked = read_cache_file(path).get(key)
    if checked is None and make_if_missing:
        checked = _cached_inductor_isa()
    return checked


def isa_check_env() -> dict[str, str]:
    """Environment for a child process (build, verification) started by this
    one: ``TORCHINDUCTOR_VEC_ISA_OK=1`` when ``isa_checks_redundant()``.

    Passed explicitly, since a sandboxed child cannot write the cache file (a
    fresh /tmp, no home): so this process makes the checked pick itself, once
    per machine, when the cache does not hold it yet.
    """
    env = {VEC_ISA_OK_ENV: "1"} if _agrees_with_flags(_checked_pick(make_if_missing=True)) else {}
    # What VEC_ISA_OK leaves (the extension checks: BF16, VNNI, AMX), or all
    # of them where the flags disagree: answered from this machine's record.
    value = isa_checks.for_child(recorded_checks())
    if value:
        env[isa_checks.ISA_CHECKS_ENV] = value
    return env


def skip_redundant_isa_checks() -> bool:
    """In this process (a node about to load a CPU artifact): set Inductor's
    ``cpp.vec_isa_ok`` when ``isa_checks_redundant()``. When the cache holds
    no checked pick yet, it is made now, so that the node's next process can
    skip the checks (this one pays what Inductor would have paid at its first
    call, once: Inductor keeps its pick per process). Returns whether
    ``cpp.vec_isa_ok`` was set."""
    known = _checked_pick(make_if_missing=False)
    if known is None:
        _checked_pick(make_if_missing=True)  # for the node's next process
        return False
    # The extension checks that vec_isa_ok leaves (or all of them, where the
    # flags disagree), answered from this machine's record.
    isa_checks.replay(recorded_checks())
    if not _agrees_with_flags(known):
        return False
    from torch._inductor import config

    config.cpp.vec_isa_ok = True
    return True


# --------------------------------------------------------------------------- #
# Per-machine cache of Inductor's ISA pick
# --------------------------------------------------------------------------- #

ISA_CACHE_ENV = "FARM_ISA_CACHE"
# Bump when the key or the naming in _pick_inductor_isa changes. 2: picks are
# made again once, recording their test compiles (farm.core.isa_checks).
_ISA_CACHE_VERSION = 2
_ISA_CACHE_MAX_ENTRIES = 16
# What an entry may hold: torch's names ("avx512 avx512_vnni amx_tile"), ours
# ("sve256") or "" (no compiler). Anything else in the file is ignored.
_ISA_VALUE_RE = re.compile(r"^[a-z0-9_ ]{0,64}$")
# Environment that changes Inductor's pick (or the compiler it picks with).
# Not TORCHINDUCTOR_* wholesale: TORCHINDUCTOR_CACHE_DIR, fresh per process on
# fleet nodes, would make every process miss.
_ISA_ENV_VARS = (
    "ATEN_CPU_CAPABILITY",  # pick_vec_isa's choice among the valid ISAs
    "TORCHINDUCTOR_VEC_ISA_OK",  # cpp.vec_isa_ok: skips the test compiles
    # cpp.simdlen reads no environment variable in torch 2.13 (it is a plain
    # config default); kept in the key in case a release adds it.
    "TORCHINDUCTOR_CPP_SIMDLEN",
    "TORCH_INDUCTOR_INSTALL_GXX",  # compiler search may install gcc via conda
    "CXX",  # cpp.cxx default; also resolved in _cxx_identity
)
_CXX_CANDIDATES = ("g++", "c++", "clang++")


def _cached_inductor_isa() -> str:
    """``_pick_inductor_isa()``, read from the per-machine cache when its key
    is there, and stored there when not. The cache never fails the caller:
    any problem with the file means detecting again."""
    path = _isa_cache_path()
    if path is None:
        return _pick_inductor_isa()
    try:
        key, compiler = _isa_cache_key()
    except Exception:  # pragma: no cover - defensive: a key we cannot build is a miss
        return _pick_inductor_isa()
    entries = read_cache_file(path)
    cached = entries.get(key)
    if cached is not None:
        return cached
    # Every test compile of the pick is recorded, so that children and later
    # processes answer them without compiling (farm.core.isa_checks).
    with isa_checks.recording() as answers:
        isa = _pick_inductor_isa()
    # An empty pick is kept only when no compiler was found: then it cannot
    # change until one is installed, which changes the key. With a compiler it
    # may be a passing failure (full disk, lock timeout) and is not pinned.
    if isa or compiler == "none":
        _put_bounded(entries, key, isa)
        # The answers first: a process that finds the pick finds them too.
        _store_checks(path, key, answers)
        write_cache_file(path, entries)
    return isa


def _checks_path(path: Path) -> Path:
    """Where the recorded test compiles of the picks in ``path`` are kept:
    beside it (``cpu-isa.checks.json``)."""
    return path.with_suffix(".checks.json")


def _store_checks(path: Path, key: str, answers: Mapping[str, bool]) -> None:
    checks_path = _checks_path(path)
    entries = {k: v for k, v in read_json_object(checks_path).items()
               if isinstance(k, str) and isinstance(v, str) and isa_checks.decode(v)}
    _put_bounded(entries, key, isa_checks.encode(answers))
    write_cache_file(checks_path, entries)


def _put_bounded(entries: dict[str, str], key: str, value: str) -> None:
    """``entries[key] = value`` as the newest entry, the oldest dropped
    beyond ``_ISA_CACHE_MAX_ENTRIES``."""
    entries.pop(key, None)
    entries[key] = value
    while len(entries) > _ISA_CACHE_MAX_ENTRIES:
        del entries[next(iter(entries))]


def _cache_slot() -> tuple[Path, str] | None:
    """The cache file and this process's key in it; None when there is no
    file to keep (``off``) or no key to be built."""
    path = _isa_cache_path()
    if path is None:
        return None
    try:
        key, _ = _isa_cache_key()
    except Exception:  # pragma: no cover - defensive, as in _cached_inductor_isa
        return None
    return path, key


def recorded_checks() -> dict[str, bool]:
    """The answers of Inductor's ISA test compiles recorded on this machine
    under the current key (``farm.core.isa_checks``); empty when none are."""
    slot = _cache_slot()
    if slot is None:
        return {}
    path, key = slot
    value = read_json_object(_checks_path(path)).get(key)
    return isa_checks.decode(value) if isinstance(value, str) else {}


def _isa_cache_path() -> Path | None:
    """Where the cache lives: ``$FARM_ISA_CACHE`` (a file; "off" disables it),
    else ``${XDG_CACHE_HOME:-~/.cache}/torch-farm/cpu-isa.json``."""
    return cache_file(ISA_CACHE_ENV, "cpu-isa.json")


def cache_file(env_var: str, name: str) -> Path | None:
    """A per-machine cache file: ``$<env_var>`` (a file; "off" disables it),
    else ``${XDG_CACHE_HOME:-~/.cache}/torch-farm/<name>``.

    Not under ``farm.core.settings``' ``CLIENT_CACHE_DIR`` (default
    ``$FARM_HOME/cache``, the per-user artifact cache): that directory may be
    shared between machines, and reading the settings costs pydantic at import.
    """
    env = os.environ.get(env_var, "").strip()
    if env.lower() == "off":
        return None
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    try:
        # The XDG spec says to ignore a relative XDG_CACHE_HOME.
        base = Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache"
    except RuntimeError:  # no home directory to be found
        return None
    return base / "torch-farm" / name


def _isa_cache_key() -> tuple[str, str]:
    """The cache key (hex digest of everything the pick depends on), and the
    compiler identity in it ("none" when no compiler was found).

    Cheap by design: no ``torch._inductor`` import, no subprocess.
    """
    import torch

    compiler = cxx_identity()
    parts: dict[str, Any] = {
        "v": _ISA_CACHE_VERSION,
        "torch": torch.__version__,
        "platform": sys.platform,
        "machine": platform.machine(),
        "cpu": _cpu_flags_digest(),
        "cxx": compiler,
        "env": {name: os.environ.get(name) for name in _ISA_ENV_VARS},
    }
    overrides = _inductor_overrides()
    if overrides:
        parts["inductor"] = overrides
    text = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest(), compiler


def _inductor_overrides() -> dict[str, str]:
    """Inductor settings changed in code (``config.cpp.simdlen = 8``) rather
    than by the environment the key already holds.

    Seen only when Inductor is already imported: importing it here would cost
    what the cache saves. Values equal to the environment's defaults are left
    out, so a process's key does not change once the pick itself has imported
    Inductor.
    """
    config = sys.modules.get("torch._inductor.config")
    if config is None:
        return {}
    out: dict[str, str] = {}
    try:
        cpp = config.cpp
        if cpp.simdlen is not None:
            out["simdlen"] = repr(cpp.simdlen)
        env_ok = {"1": True, "0": False}.get(os.environ.get("TORCHINDUCTOR_VEC_ISA_OK", ""))
        if cpp.vec_isa_ok != env_ok:
            out["vec_isa_ok"] = repr(cpp.vec_isa_ok)
        default_cxx = "clang++" if sys.platform == "darwin" else "g++"
        if tuple(cpp.cxx) != (None, os.environ.get("CXX", default_cxx)):
            out["cxx"] = repr(cpp.cxx)
    except Exception:  # pragma: no cover - a torch without these settings
        return {}
    return out


def _cpu_flags_digest() -> str:
    """Hash of the CPU's feature flags: the first ``flags`` (x86) or
    ``Features`` (arm, s390x) line of /proc/cpuinfo, else what ``platform``
    says of the processor."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                name, sep, value = line.partition(":")
                if sep and name.strip().lower() in ("flags", "features"):
                    # Sorted: the same set of flags is the same CPU.
                    flags = " ".join(sorted(value.split()))
                    return "flags:" + hashlib.sha256(flags.encode()).hexdigest()
    except OSError:
        pass
    return f"platform:{platform.processor()}/{platform.machine()}"


def cxx_identity() -> str:
    """The C++ compiler Inductor would use, as path, mtime and size (so an
    upgrade in place changes it); "none" when there is none.

    Resolved the cheap way, without running it: ``$CXX``, else the first of
    g++, c++, clang++ on PATH.
    """
    cxx = os.environ.get("CXX", "").strip()
    candidates = (cxx,) if cxx else _CXX_CANDIDATES
    for name in candidates:
        found = shutil.which(name)
        if found is None:
            continue
        try:
            real = os.path.realpath(found)
            st = os.stat(real)
        except OSError:
            continue
        return f"{found}|{real}|{st.st_mtime_ns}|{st.st_size}"
    return "none"


def read_json_object(path: Path) -> dict[Any, Any]:
    """A per-machine cache file's JSON object; empty when the file is missing,
    unreadable or not an object (a corrupt file is then replaced by the next
    write). Shared by every per-machine cache (ISA, compiler, node target)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return {}
    return data if isinstance(data, dict) else {}


def read_cache_file(path: Path) -> dict[str, str]:
    """The ISA cache's entries (those that are ours)."""
    return {
        k: v
        for k, v in read_json_object(path).items()
        if isinstance(k, str) and isinstance(v, str) and _ISA_VALUE_RE.match(v)
    }


def write_cache_file(path: Path, entries: Mapping[str, Any]) -> None:
    """Replace the cache file atomically (temp file + ``os.replace``); errors
    are ignored. Concurrent writers: the last one wins."""
    tmp: str | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(entries, f, indent=1)
        os.replace(tmp, path)
        tmp = None
    except OSError:
        pass
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
