"""Inductor's ISA test compiles, answered once per machine and replayed.

Inductor picks the vector ISA of its C++ kernels by test-compiling a small
program per candidate and loading it in a fresh Python process
(``VecISA.check_build``). ``TORCHINDUCTOR_VEC_ISA_OK`` skips only each ISA's
base check; the extension checks (AVX512-BF16, VNNI, AMX, AMX-FP16) still
run, in every process that compiles or loads CPU kernels:

- on the 2-core AVX512 machine, 4 compiler runs and 1.5-2.2 s per process;
- on an H100 host (AMX; torch 2.11, whose load probe imports torch, in an
  image without bytecode), 33.5 s of a build zygote's 49.6 s start.

An answer depends only on the check itself (the ISA class, its compiler
flags, the program), the compiler, torch and the CPU, which are all in
``farm.core.cpu_isa``'s per-machine cache key. So the process that makes a
machine's checked pick records every answer under that key (``recording``),
a compile worker hands them to its build and verification children in
``FARM_ISA_CHECKS``, and a child (or a node loading CPU kernels) answers each
recorded check from there (``replay``). A check that was not recorded still
compiles, so a different torch asking something new gets a real answer.

Only passed checks are replayed. A failed one may have failed by chance (a
full disk, the load probe's 60 s timeout on a loaded machine), and pinning
it would give every later build a narrower ISA with no sign of why; it
compiles again in each process, as without this module. The answers travel
with a tag of the torch and the compiler they were made with, and a process
with another ignores them.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import threading
from collections.abc import Iterator, Mapping
from typing import Any

ISA_CHECKS_ENV = "FARM_ISA_CHECKS"
# A check's id: 16 hex digits of sha256 over what it compiles (see check_id).
_ID_RE = re.compile(r"^[0-9a-f]{16}$")
# Inductor runs at most a dozen checks per pick; anything longer is not ours.
_MAX_CHECKS = 64


def check_id(isa: Any, code: str) -> str:
    """What identifies one test compile: the ISA's class, the flags it
    compiles with at that moment (the extension checks add theirs for the
    call), and the program."""
    text = f"{type(isa).__name__}\0{getattr(isa, '_arch_flags', '')}\0{code}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def encode(answers: Mapping[str, bool]) -> str:
    """``id:1,id:0,...``, sorted, for the per-machine record."""
    return ",".join(f"{k}:{int(bool(v))}" for k, v in sorted(answers.items()))


def toolchain_tag() -> str:
    """The torch and the compiler (``cpu_isa.cxx_identity``: path, mtime and
    size) that answers were made with, in 12 hex digits: no subprocess."""
    import torch

    from farm.core.cpu_isa import cxx_identity

    text = f"{torch.__version__}\0{cxx_identity()}"
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def for_child(answers: Mapping[str, bool]) -> str:
    """The value of ``FARM_ISA_CHECKS`` for a child: this process's
    toolchain tag and the passed checks ("" when none passed)."""
    passed = _passed(answers)
    return f"{toolchain_tag()};{encode(passed)}" if passed else ""


def _passed(answers: Mapping[str, bool]) -> dict[str, bool]:
    """The checks that passed: the only ones ever handed on or replayed."""
    return {k: True for k, v in answers.items() if v}


def decode(text: str | None) -> dict[str, bool]:
    """``encode``'s text back; anything malformed means no answers at all
    (then every check compiles, as without this module)."""
    answers: dict[str, bool] = {}
    if not text:
        return answers
    items = text.split(",")
    if len(items) > _MAX_CHECKS:
        return {}
    for item in items:
        key, sep, value = item.partition(":")
        if not sep or not _ID_RE.match(key) or value not in ("0", "1"):
            return {}
        answers[key] = value == "1"
    return answers


def _vec_isa_module() -> Any:
    try:
        from torch._inductor import cpu_vec_isa
    except ImportError:  # pragma: no cover - a torch without Inductor
        return None
    return cpu_vec_isa if hasattr(getattr(cpu_vec_isa, "VecISA", None), "check_build") else None


def _already_picked(module: Any) -> bool:
    """This process holds Inductor's pick already (``valid_vec_isa_list`` is
    cached): a pick now asks no check, so there is nothing to record."""
    info = getattr(getattr(module, "valid_vec_isa_list", None), "cache_info", None)
    return info is not None and info().currsize > 0


_RECORDING = threading.Lock()


@contextlib.contextmanager
def recording() -> Iterator[dict[str, bool]]:
    """Within the block, every check Inductor's ISA pick makes, run for real,
    is recorded in the yielded dict. Nothing is recorded (the dict stays
    empty) in a process that already holds a pick, or that answers checks
    from a record: its pick is not made of real checks. Its caches are never
    cleared, so a process's pick is the one it had."""
    answers: dict[str, bool] = {}
    module = _vec_isa_module()
    if (module is None or _already_picked(module)
            or hasattr(module.VecISA.check_build, "farm_answers")
            or not _RECORDING.acquire(blocking=False)):
        yield answers
        return
    cls = module.VecISA
    original = cls.check_build

    def check_build(self: Any, code: str) -> bool:
        ok = bool(original(self, code))
        answers[check_id(self, code)] = ok
        return ok

    cls.check_build = check_build
    try:
        yield answers
    finally:
        cls.check_build = original
        _RECORDING.release()


def replay(answers: Mapping[str, bool]) -> bool:
    """From now on in this process, answer each recorded check that passed
    without compiling; failed ones and others compile as before (module
    docstring). Returns whether anything was installed (no passed checks,
    or no Inductor: nothing)."""
    answers = _passed(answers)
    if not answers:
        return False
    module = _vec_isa_module()
    if module is None:
        return False
    cls = module.VecISA
    current = cls.check_build
    known: dict[str, bool] | None = getattr(current, "farm_answers", None)
    if known is not None:  # already replaying: take the newer answers too
        known.update(answers)
        return True
    known = dict(answers)

    def check_build(self: Any, code: str) -> bool:
        answer = known.get(check_id(self, code))
        return bool(current(self, code)) if answer is None else answer

    check_build.farm_answers = known  # type: ignore[attr-defined]
    cls.check_build = check_build
    return True


def replay_from_env(environ: Mapping[str, str] = os.environ) -> bool:
    """``replay`` what the parent passed in ``FARM_ISA_CHECKS``
    (``for_child``), when it was made with this process's torch and
    compiler."""
    tag, sep, text = (environ.get(ISA_CHECKS_ENV) or "").partition(";")
    if not sep or tag != toolchain_tag():
        return False
    return replay(decode(text))
