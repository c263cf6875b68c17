"""Targets: what an artifact is only valid for.

A ``Target`` holds the machine and toolchain facts that decide whether torch
can load an artifact and compute the same result with it: the fields torch's
own ``SystemInfo.check_compatibility`` compares (python, torch, CUDA toolkit,
Triton major.minor, GPU name), plus the ones torch does not check but bakes
into generated code (CPU vector ISA, thread count) and the compute capability.

Canonical form (round-trips through ``Target.parse``)::

    cpu/python=3.11.7/torch=2.13.0+cpu/isa=avx512/threads=2
    cuda/gpu=NVIDIA%20H200/cc=9.0/cuda=13.0/triton=3.6/python=3.12.3/torch=2.11.0+cu130

A ``TargetSelector`` is the same syntax with any fields left out
(``cpu``, ``cuda/gpu=NVIDIA%20H200``): it matches every target that has the
given fields. Users submit selectors; workers have full targets.
"""

from __future__ import annotations

import platform
import re
from dataclasses import dataclass, fields, replace
from typing import Any
from urllib.parse import quote, unquote

from farm.core.cpu_isa import detect_cpu_isa

DEVICES = ("cpu", "cuda")
_FIELD_ORDER = ("gpu", "cc", "cuda", "triton", "python", "torch", "isa", "threads")
_ATTR = {
    "gpu": "gpu_name",
    "cc": "capability",
    "cuda": "cuda_version",
    "triton": "triton_version",
    "python": "python_version",
    "torch": "torch_version",
    "isa": "cpu_isa",
    "threads": "threads",
}


_THREADS_RE = re.compile(r"^[0-9]+$")


class TargetError(ValueError):
    """A target or selector that does not parse or does not make sense; the message says why."""


def _check_fields(obj: TargetSelector | Target) -> None:
    # Shared by selectors and targets, so one built in code obeys the same
    # rules as one parsed from text (and its str() parses back to it).
    for f in fields(obj):
        value = getattr(obj, f.name)
        if value is None:
            continue
        if f.name == "threads":
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise TargetError(f"threads must be a positive integer, got {value!r}")
        elif not isinstance(value, str) or not value:
            raise TargetError(f"target field {f.name} must be a non-empty string, got {value!r}")


def _quote(value: str) -> str:
    return quote(value, safe=".+-_")


@dataclass(frozen=True)
class TargetSelector:
    """A partial target: every field that is set must match."""

    device: str | None = None
    gpu_name: str | None = None
    capability: str | None = None
    cuda_version: str | None = None
    triton_version: str | None = None
    python_version: str | None = None
    torch_version: str | None = None
    cpu_isa: str | None = None
    threads: int | None = None

    def __post_init__(self) -> None:
        if self.device is not None and self.device not in DEVICES:
            raise TargetError(f"unknown device {self.device!r}; known: {', '.join(DEVICES)}")
        _check_fields(self)

    def matches(self, target: Target) -> bool:
        return all(
            getattr(self, f.name) is None or getattr(self, f.name) == getattr(target, f.name)
            for f in fields(self)
        )

    def __str__(self) -> str:
        parts = [self.device or "*"]
        for key in _FIELD_ORDER:
            value = getattr(self, _ATTR[key])
            if value is not None:
                parts.append(f"{key}={_quote(str(value))}")
        return "/".join(parts)

    @classmethod
    def parse(cls, text: str) -> TargetSelector:
        text = text.strip()
        if not text:
            raise TargetError("empty target")
        head, *rest = text.split("/")
        values: dict[str, Any] = {}
        if not head:
            raise TargetError(f"bad target {text!r}: it starts with a device or '*'")
        if head != "*":
            if head not in DEVICES:
                raise TargetError(
                    f"bad target {text!r}: device {head!r} unknown; known: {', '.join(DEVICES)}"
                )
            values["device"] = head
        for part in rest:
            key, sep, value = part.partition("=")
            if not sep or key not in _ATTR:
                raise TargetError(
                    f"bad target field {part!r} in {text!r}; "
                    f"known fields: {', '.join(_FIELD_ORDER)}"
                )
            if _ATTR[key] in values:
                raise TargetError(f"target field {key!r} given twice in {text!r}")
            raw = unquote(value)
            if not raw:
                raise TargetError(f"target field {key!r} has an empty value in {text!r}")
            if key == "threads":
                # Digits only: int() takes "+2" and "0_2", two more spellings of
                # one target that would then name two different queues.
                if not _THREADS_RE.match(raw) or int(raw) < 1:
                    raise TargetError(f"threads must be a positive integer in {text!r}")
                values["threads"] = int(raw)
            else:
                values[_ATTR[key]] = raw
        return cls(**values)


@dataclass(frozen=True)
class Target:
    """One build target. Fields that do not apply to the device are None."""

    device: str
    python_version: str
    torch_version: str
    gpu_name: str | None = None
    capability: str | None = None
    cuda_version: str | None = None
    triton_version: str | None = None  # major.minor, as torch compares it
    cpu_isa: str | None = None
    threads: int | None = None

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise TargetError(f"unknown device {self.device!r}; known: {', '.join(DEVICES)}")
        if not self.python_version or not self.torch_version:
            raise TargetError("a target names its python and torch versions")
        _check_fields(self)
        if self.device == "cuda" and not self.gpu_name:
            raise TargetError("a cuda target needs a GPU name")
        if self.device == "cpu" and (self.gpu_name or self.cuda_version or self.capability):
            raise TargetError("a cpu target has no GPU, capability or CUDA toolkit")

    def __str__(self) -> str:
        return str(TargetSelector(**{f.name: getattr(self, f.name) for f in fields(self)}))

    @property
    def queue(self) -> str:
        """The Celery queue that this target's compile workers consume."""
        return f"compile.{self}"

    @classmethod
    def parse(cls, text: str) -> Target:
        sel = TargetSelector.parse(text)
        if sel.device is None or sel.python_version is None or sel.torch_version is None:
            raise TargetError(
                f"incomplete target {text!r}: a full target names its device, python and torch"
            )
        return cls(**{f.name: getattr(sel, f.name) for f in fields(sel)})

    def to_json(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Target:
        unknown = set(data) - {f.name for f in fields(cls)}
        if unknown:
            raise TargetError(f"unknown target fields: {', '.join(sorted(unknown))}")
        values: dict[str, Any] = {f.name: data.get(f.name) for f in fields(cls)}
        return cls(**values)

    def with_threads(self, threads: int | None) -> Target:
        return replace(self, threads=threads)


def parse_selector(text: str) -> TargetSelector:
    return TargetSelector.parse(text)


# Distribution names Triton ships under (PyTorch's nightlies use the second).
TRITON_DISTRIBUTIONS = ("triton", "pytorch-triton")


def triton_major_minor() -> str | None:
    """Triton's version from its package metadata: ``import triton`` would cost
    a fleet node 0.8 s of its cold start (measured on the H200) just to read it."""
    from importlib import metadata

    for dist in TRITON_DISTRIBUTIONS:
        try:
            version = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
        return ".".join(version.split("+")[0].split(".")[:2])
    return None


def detect_local_target(device: str | None = None, *, check_compiler: bool = True) -> Target:
    """Describe this machine as a target for ``device`` (default: cuda if present).

    ``check_compiler=False`` is for a fleet node (see ``detect_cpu_isa``): its
    CPU ISA comes from the CPU's flags, with no test compiles.
    """
    import torch

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    common = {
        "python_version": platform.python_version(),
        "torch_version": torch.__version__,
    }
    if device == "cpu":
        return Target(
            device="cpu",
            cpu_isa=detect_cpu_isa(check_compiler=check_compiler),
            threads=torch.get_num_threads(),
            **common,
        )
    if device == "cuda":
        if not torch.cuda.is_available():
            raise TargetError("no CUDA device on this machine")
        major, minor = torch.cuda.get_device_capability()
        return Target(
            device="cuda",
            gpu_name=torch.cuda.get_device_name(),
            capability=f"{major}.{minor}",
            cuda_version=torch.version.cuda,
            triton_version=triton_major_minor(),
            **common,
        )
    raise TargetError(f"unknown device {device!r}; known: {', '.join(DEVICES)}")
