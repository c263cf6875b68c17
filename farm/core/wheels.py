"""Wheels and pinned requirements that travel in a code pack.

A user's own wheel (``farm submit --wheel``) or a pinned requirements file
(``--requirements``) goes into the code pack under ``ENV_DIR`` (a name no
``import`` can reach), so the pack's digest, hence the build key, covers the
exact bytes. A build worker installs them once per pack digest into a
directory of their own (``farm.build.codeenv.env_dir``) that the build
children get read-only on their path, after the pack and before the worker's
own packages.

Only pure checks here, shared by the CLI (which refuses early) and the worker
(which refuses whatever reached it another way): a wheel or a pin must never
install torch, triton or the farm itself, which would shadow the worker's
own, and a requirement must be pinned to one version, so that the same pack
always means the same code.
"""

from __future__ import annotations

import os
import re
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

# In a code pack: <ENV_DIR>/wheels/<file>.whl and <ENV_DIR>/requirements.txt.
ENV_DIR = ".farm-env"
WHEELS_DIR = f"{ENV_DIR}/wheels"
REQUIREMENTS_FILE = f"{ENV_DIR}/requirements.txt"
# Distributions and import names the worker's build children must take from
# the worker's own installation: the compiler, its kernels' compiler and the
# farm (whose sandbox entry point the child runs).
PROTECTED_DISTS = frozenset({"torch", "triton", "pytorch-triton", "torch-farm"})
PROTECTED_TOP_LEVELS = frozenset({"torch", "triton", "functorch", "torchgen", "farm",
                                  "registry", "workers"})
_WHEEL_NAME_RE = re.compile(
    r"^(?P<name>[A-Za-z0-9](?:[A-Za-z0-9._]*[A-Za-z0-9])?)-(?P<version>[^-]+)"
    r"(?:-\d[^-]*)?-[^-]+-[^-]+-[^-]+\.whl$")
_PIN_RE = re.compile(
    r"^(?P<name>[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?)\s*==\s*(?P<version>[A-Za-z0-9.+!_-]+)$")
_HASH_RE = re.compile(r"^--hash[=\s]\s*(?P<algo>sha256|sha384|sha512):(?P<hex>[0-9a-fA-F]+)$")


class WheelError(ValueError):
    """A wheel or requirements file the farm will not install; the message says what to do."""


def canonical_name(name: str) -> str:
    """PEP 503's normalised project name: ``Torch_Farm`` and ``torch.farm`` are ``torch-farm``."""
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass(frozen=True)
class Pin:
    name: str  # canonical
    version: str
    hashes: tuple[str, ...] = ()  # "sha256:<hex>", sorted

    def line(self) -> str:
        return " ".join([f"{self.name}=={self.version}", *(f"--hash={h}" for h in self.hashes)])


def _logical_lines(text: str) -> Iterable[tuple[int, str]]:
    """(first line number, text) with comments dropped and ``\\`` continuations joined."""
    buf: list[str] = []
    start = 0
    for number, raw in enumerate(text.splitlines(), start=1):
        line = re.sub(r"(^|\s)#.*$", "", raw).strip()
        if not buf:
            start = number
        if line.endswith("\\"):
            buf.append(line[:-1].strip())
            continue
        buf.append(line)
        joined = " ".join(p for p in buf if p)
        buf = []
        if joined:
            yield start, joined
    if buf and any(buf):
        yield start, " ".join(p for p in buf if p)


def parse_pinned(text: str, *, source: str = "requirements") -> list[Pin]:
    """The pins of a requirements file, sorted by name. Every line must be
    ``name==version``, optionally followed by ``--hash=sha256:<hex>`` options
    (then every line needs one: pip checks all or none). Anything else (a
    range, an unpinned name, a URL, ``-r``, ``-e``, an index option, an
    environment marker) raises ``WheelError`` naming the line."""
    pins: dict[str, Pin] = {}
    for number, line in _logical_lines(text):
        where = f"{source} line {number}: {line!r}"
        head, *options = re.split(r"\s+(?=--)", line)
        m = _PIN_RE.match(head.strip())
        if not m:
            raise WheelError(
                f"{where} is not pinned: every line must be 'name==version' (optionally with "
                "--hash=sha256:...), so the same code pack always installs the same code; "
                "`pip freeze` or `pip-compile --generate-hashes` writes such a file")
        hashes = []
        for opt in options:
            h = _HASH_RE.match(opt.strip())
            if not h:
                raise WheelError(f"{where}: only --hash=sha256:<hex> may follow a pin, not "
                                 f"{opt.strip()!r}; the farm chooses the index itself")
            hashes.append(f"{h.group('algo')}:{h.group('hex').lower()}")
        name = canonical_name(m.group("name"))
        refuse_protected_dist(name, what=where)
        if name in pins:
            raise WheelError(f"{where}: {name} is pinned twice")
        pins[name] = Pin(name, m.group("version"), tuple(sorted(hashes)))
    if not pins:
        raise WheelError(f"{source} pins nothing: leave --requirements out, or pin "
                         "'name==version' lines")
    hashed = [p for p in pins.values() if p.hashes]
    if hashed and len(hashed) != len(pins):
        bare = sorted(p.name for p in pins.values() if not p.hashes)
        raise WheelError(f"{source}: some lines have --hash and {', '.join(bare)} do not; pip "
                         "checks hashes for every line or none: add them "
                         "(`pip-compile --generate-hashes`)")
    return [pins[k] for k in sorted(pins)]


def canonical_requirements(pins: Iterable[Pin]) -> str:
    """The file the pack carries: one sorted pin a line, so that the same pins
    give the same bytes (and digest) whatever the user's file looked like."""
    return "".join(p.line() + "\n" for p in pins)


def refuse_protected_dist(name: str, *, what: str) -> None:
    if canonical_name(name) in PROTECTED_DISTS:
        raise WheelError(
            f"{what}: {canonical_name(name)} is the farm's own (torch, triton and the farm come "
            "from the build worker's installation, never from a code pack, so that every build "
            "of a target uses one compiler): leave it out")


def wheel_top_levels(names: Iterable[str]) -> set[str]:
    """The top-level import names a wheel with these member names installs:
    each first path component (``pkg/``, ``mod.py``, ``ext.cpython-312-...so``)
    and, under ``<dist>.data/purelib|platlib/``, the one after that."""
    tops: set[str] = set()
    for name in names:
        parts = [p for p in name.split("/") if p]
        if not parts or parts[0].endswith(".dist-info"):
            continue
        if parts[0].endswith(".data"):
            if len(parts) < 3 or parts[1] not in ("purelib", "platlib"):
                continue  # scripts, headers, data: not importable
            parts = parts[2:]
        tops.add(parts[0].split(".")[0])
    return tops


def refuse_protected_top_levels(tops: Iterable[str], *, what: str) -> None:
    bad = sorted(set(tops) & PROTECTED_TOP_LEVELS)
    if bad:
        raise WheelError(
            f"{what} installs {', '.join(bad)}, which would shadow the build worker's own "
            "(torch, triton and the farm always come from the worker's installation): "
            "rebuild it without them")


def top_levels_of(path: str | os.PathLike[str]) -> set[str]:
    """The import names the wheel at ``path`` provides (empty for a non-wheel)."""
    try:
        with zipfile.ZipFile(path) as z:
            return wheel_top_levels(z.namelist())
    except (OSError, zipfile.BadZipFile):
        return set()


def check_wheel(path: str | os.PathLike[str]) -> str:
    """The wheel's file name after checking it is a wheel the farm installs:
    a well-formed name and zip, not torch/triton/the farm, installing none of
    their import names. Raises ``WheelError``."""
    p = Path(path)
    m = _WHEEL_NAME_RE.match(p.name)
    if not m:
        raise WheelError(f"{p}: not a wheel file name (name-version-python-abi-platform.whl); "
                         "build one with `pip wheel --no-deps .`")
    refuse_protected_dist(m.group("name"), what=f"wheel {p.name}")
    try:
        with zipfile.ZipFile(p) as z:
            names = z.namelist()
    except (OSError, zipfile.BadZipFile) as exc:
        raise WheelError(f"{p}: not a readable wheel ({exc})") from None
    if not any(n.split("/")[0].endswith(".dist-info") for n in names):
        raise WheelError(f"{p}: no .dist-info directory inside, so pip cannot install it; "
                         "build it with `pip wheel --no-deps .`")
    refuse_protected_top_levels(wheel_top_levels(names), what=f"wheel {p.name}")
    return p.name
