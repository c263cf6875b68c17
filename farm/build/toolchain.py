"""The C++ compiler a compile worker builds with, chosen by what it builds.

Inductor compiles with ``config.cpp.cxx``, whose default is ``$CXX`` (else
``g++``), not with the ``g++`` that happens to be first on PATH. On the H200
image ``CXX=/opt/gcc/bin/g++``: a wrapper whose ``libstdc++.so`` link
dangles, so it silently linked ``libstdc++.a`` into every AOTInductor package,
and a second libstdc++ in the process crashed the loader in ``std::regex``.
``/usr/bin/g++`` on the same machine built packages that loaded and matched
eager.

So the worker does not trust a compiler by name. Candidates, in order:
``$CXX``, then ``g++`` and ``c++`` on PATH, then every ``g++-N`` on PATH
(newest first); the same file reached by two names is tried once. Each must

1. build a tiny AOTI package in a fresh process (``farm.build.aoti_check``),
2. link it against the shared libstdc++ (``NEEDED libstdc++.so.6``, read from
   the ELF file by ``farm.core.elf``), needing no symbol version that the
   libstdc++ this process runs lacks, and
3. load it in another fresh process and match eager.

The first that passes is used (``use_compiler``: ``CXX`` for every child the
worker starts, and Inductor's ``cpp.cxx`` in this process); the rejected ones
are logged with the reason. The choice is kept per machine in
``FARM_AOTI_CHECK_CACHE`` (else ``~/.cache/torch-farm/aoti-check.json``) under
a key of torch, Python, the device and every candidate's path, size and
mtime, so a compiler installed, removed or upgraded in place is checked again.

    python -m farm.build.toolchain [cpu|cuda]    # choose now, print the choice
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import platform
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from farm.core.cpu_isa import cache_file, read_json_object, write_cache_file

log = logging.getLogger(__name__)

CHECK_CACHE_ENV = "FARM_AOTI_CHECK_CACHE"
# The machine's own CXX (empty: none), kept by the first use_compiler for
# candidates() in this process and in every child that inherits the chosen one.
CXX_BEFORE_CHOICE_ENV = "TORCH_FARM_CXX_BEFORE_CHOICE"
_CACHE_VERSION = 2  # v1 held one word per key (farm.build.aoti_check before the choice)
_MAX_ENTRIES = 16
_GXX_N_RE = re.compile(r"^g\+\+-([0-9]+(?:\.[0-9]+)*)$")
# Lock waits: a first AOTI build on a host takes a minute; several candidates more.
LOCK_TIMEOUT_S = 1800.0


@dataclass(frozen=True)
class Probe:
    """One candidate's check: ``reason`` is "ok" or why it was rejected;
    ``definitive`` is False for a failure that may pass later (a build that
    failed or timed out) rather than a property of the compiler."""

    reason: str
    definitive: bool = True
    linkage: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.reason == "ok"


@dataclass(frozen=True)
class Choice:
    """The compiler chosen for a device (None: none passed) and those rejected."""

    cxx: str | None
    identity: str | None = None
    rejected: tuple[tuple[str, str], ...] = ()
    linkage: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.cxx is not None

    def why_not(self) -> str:
        if not self.rejected:
            return "no C++ compiler found ($CXX, g++, c++, g++-N on PATH)"
        return "; ".join(f"{c}: {r}" for c, r in self.rejected)

    def to_json(self) -> dict[str, Any]:
        return {"cxx": self.cxx, "identity": self.identity,
                "rejected": [list(r) for r in self.rejected], "linkage": self.linkage}

    @classmethod
    def from_json(cls, data: Any) -> Choice | None:
        """None for anything that is not a stored choice (a v1 entry, a corrupt one)."""
        if not isinstance(data, dict):
            return None
        cxx, identity, rejected = data.get("cxx"), data.get("identity"), data.get("rejected")
        linkage = data.get("linkage") or {}
        if not (cxx is None or isinstance(cxx, str)) or not isinstance(rejected, list):
            return None
        if not (identity is None or isinstance(identity, str)) or not isinstance(linkage, dict):
            return None
        pairs = []
        for r in rejected:
            if not (isinstance(r, list) and len(r) == 2 and all(isinstance(x, str) for x in r)):
                return None
            pairs.append((r[0], r[1]))
        return cls(cxx=cxx, identity=identity, rejected=tuple(pairs), linkage=linkage)


# --------------------------------------------------------------------------- #
# Candidates and identities
# --------------------------------------------------------------------------- #


def candidates(env: Mapping[str, str] | None = None) -> list[str]:
    """Compiler paths to try, in order: ``$CXX``, ``g++`` and ``c++`` on PATH,
    then ``g++-N`` on PATH by N, highest first. A ``$CXX`` that names nothing
    runnable is still listed (as given): it is rejected with that reason."""
    env = os.environ if env is None else env
    path = env.get("PATH", os.defpath)
    out: list[str] = []
    seen: set[str] = set()

    def add(found: str | None, shown: str | None = None) -> None:
        if found is None:
            if shown:
                out.append(shown)
            return
        real = os.path.realpath(found)
        if real in seen:
            return
        seen.add(real)
        out.append(found)

    # The CXX the machine gave, not the one use_compiler set: otherwise the
    # worker's pool children (which inherit the chosen CXX) asked for another
    # candidate list, missed the machine's cached answer and probed every
    # compiler again, ~95 s before the first build on a GPU host compiled.
    cxx = env.get(CXX_BEFORE_CHOICE_ENV, env.get("CXX", "")).strip()
    if cxx:
        # CXX may carry flags ("g++ -m64"); Inductor takes it as one program name.
        add(shutil.which(cxx, path=path), cxx)
    for name in ("g++", "c++"):
        add(shutil.which(name, path=path))
    versioned: list[tuple[tuple[int, ...], str]] = []
    for d in path.split(os.pathsep):
        try:
            names = os.listdir(d or ".")
        except OSError:
            continue
        for n in names:
            m = _GXX_N_RE.match(n)
            if m:
                versioned.append((tuple(int(x) for x in m.group(1).split(".")), os.path.join(d, n)))
    for _, p in sorted(versioned, key=lambda v: v[0], reverse=True):
        if os.access(p, os.X_OK):
            add(p)
    return out


def file_identity(path: str) -> str:
    """Path, resolved path, mtime and size: changes when the file does."""
    try:
        real = os.path.realpath(path)
        st = os.stat(real)
    except OSError:
        return f"{path}|missing"
    return f"{path}|{real}|{st.st_mtime_ns}|{st.st_size}"


def compiler_identity(path: str) -> str:
    """What an artifact records of its compiler: the path Inductor ran and the
    first line of ``--version`` (``/usr/bin/g++: g++ (Ubuntu 13.3.0-6ubuntu2~24.04) 13.3.0``)."""
    try:
        res = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30)
        first = (res.stdout or res.stderr).strip().splitlines()[:1]
        version = first[0] if first else f"exit {res.returncode}"
    except (OSError, subprocess.SubprocessError) as exc:
        version = f"--version failed: {type(exc).__name__}"
    return f"{path}: {version}"[:256]


# --------------------------------------------------------------------------- #
# The process's compiler
# --------------------------------------------------------------------------- #

_current: str | None = None


def use_compiler(cxx: str) -> None:
    """Make ``cxx`` the compiler of this process and of every child it starts:
    ``CXX`` (read by Inductor's config at import, and inherited), and Inductor's
    ``cpp.cxx`` when its config is already imported."""
    global _current
    _current = cxx
    os.environ.setdefault(CXX_BEFORE_CHOICE_ENV, os.environ.get("CXX", ""))
    os.environ["CXX"] = cxx
    config = sys.modules.get("torch._inductor.config")
    if config is not None:
        config.cpp.cxx = (None, cxx)


def current_compiler() -> str | None:
    """The compiler ``use_compiler`` set in this process, if any."""
    return _current


def inductor_compiler() -> str:
    """The compiler Inductor will run in this process (its own lookup)."""
    from torch._inductor.cpp_builder import get_cpp_compiler

    return str(get_cpp_compiler())


# --------------------------------------------------------------------------- #
# Choosing, cached per machine
# --------------------------------------------------------------------------- #

ProbeFn = Callable[[str, str], Probe]


def choose_compiler(device: str, *, probe: ProbeFn | None = None,
                    env: Mapping[str, str] | None = None) -> Choice:
    """The first candidate whose AOTI packages for ``device`` build, link the
    shared libstdc++ and load here; cached per machine. Does not change the
    process (``compiler_for`` does)."""
    device = device.split(":")[0]
    if probe is None:
        from farm.build.aoti_check import probe_compiler as probe
    assert probe is not None
    cands = candidates(env)
    path = cache_file(CHECK_CACHE_ENV, "aoti-check.json")
    key = _key(device, cands)
    hit = _read(path).get(key) if path is not None else None
    if hit is not None:
        return hit
    with _machine_lock(path):
        # Workers starting together: one probes, the others take its answer.
        entries = _read(path) if path is not None else {}
        hit = entries.get(key)
        if hit is not None:
            return hit
        choice, definitive = _probe_all(device, cands, probe)
        if definitive and path is not None:
            _store(path, key, choice)
    return choice


def compiler_for(device: str, *, probe: ProbeFn | None = None) -> Choice:
    """``choose_compiler``, and ``use_compiler`` of what it chose."""
    choice = choose_compiler(device, probe=probe)
    if choice.cxx is not None:
        use_compiler(choice.cxx)
    return choice


def _probe_all(device: str, cands: list[str], probe: ProbeFn) -> tuple[Choice, bool]:
    rejected: list[tuple[str, str]] = []
    definitive = True
    for cxx in cands:
        if shutil.which(cxx) is None:
            rejected.append((cxx, "not found or not executable"))
            continue
        result = probe(device, cxx)
        if result.ok:
            for c, why in rejected:
                log.warning("C++ compiler %s rejected for %s builds: %s", c, device, why)
            log.info("C++ compiler for %s builds: %s", device, cxx)
            # Chosen: cached even after a passing failure of an earlier
            # candidate (a working compiler is what the worker needs).
            return Choice(cxx=cxx, identity=compiler_identity(cxx), rejected=tuple(rejected),
                          linkage=result.linkage), True
        rejected.append((cxx, result.reason))
        definitive = definitive and result.definitive
    choice = Choice(cxx=None, rejected=tuple(rejected))
    log.warning("no C++ compiler builds AOTI packages for %s that load here (%s): "
                "building aot_compile artifacts only", device, choice.why_not())
    return choice, definitive


def _key(device: str, cands: list[str]) -> str:
    import torch

    parts = {
        "v": _CACHE_VERSION,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "device": device,
        "cuda": torch.version.cuda if device == "cuda" else None,
        "candidates": [file_identity(c) for c in cands],
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def _read(path: Path | None) -> dict[str, Choice]:
    if path is None:
        return {}
    out: dict[str, Choice] = {}
    for k, v in read_json_object(path).items():
        choice = Choice.from_json(v)
        if isinstance(k, str) and choice is not None:
            out[k] = choice
    return out


def _store(path: Path, key: str, choice: Choice) -> None:
    entries: dict[str, Any] = {k: v.to_json() for k, v in _read(path).items() if k != key}
    entries[key] = choice.to_json()
    while len(entries) > _MAX_ENTRIES:
        del entries[next(iter(entries))]
    write_cache_file(path, entries)


@contextlib.contextmanager
def _machine_lock(path: Path | None) -> Iterator[None]:
    """An exclusive lock next to the cache file (none without a cache)."""
    if path is None:
        yield
        return
    from filelock import FileLock, Timeout

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = FileLock(str(path.with_name(path.name + ".lock")), timeout=LOCK_TIMEOUT_S)
        lock.acquire()
    except (OSError, Timeout):
        # No lock to be had: probing beside another process is slower, not wrong.
        yield
        return
    try:
        yield
    finally:
        lock.release()


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = list(sys.argv[1:] if argv is None else argv)
    device = args[0] if args else "cpu"
    print(f"candidates: {', '.join(candidates()) or '(none)'}")
    choice = choose_compiler(device)
    for cxx, why in choice.rejected:
        print(f"rejected {cxx}: {why}")
    if choice.ok:
        print(f"chosen for {device}: {choice.identity}; linkage {json.dumps(choice.linkage)}")
        return 0
    print(f"no compiler for {device}: {choice.why_not()}")
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
