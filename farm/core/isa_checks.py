"""Inductor's ISA test compiles, answered once per machine and replayed.

Inductor picks the vector ISA of its C++ kernels by test-compiling a small
program per candidate and loading it in a fresh Python process
(``VecISA.check_build``). ``TORCHINDUCTOR_VEC_ISA_OK`` skips only each ISA's
base check; the extension checks (AVX512-BF16, VNNI, AMX, AMX-FP16) still
run, in every process that compiles or loads CPU kernels:

- on the 2-core AVX512 machine, 3 checks and 1.5 s per process;
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
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
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
    """``id:1,id:0,...``, sorted, for an environment variable."""
    return ",".join(f"{k}:{int(bool(v))}" for k, v in sorted(answers.items()))


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


def _clear_pick_caches(module: Any) -> None:
    """Forget the answers this process already holds (``functools.cache`` on
    ``valid_vec_isa_list`` and on each ISA's ``__bool__``), so that a
    recording sees every check the pick makes."""
    for value in vars(module).values():
        if getattr(value, "__module__", None) != module.__name__:
            continue  # imported from elsewhere: not the pick's to clear
        if hasattr(value, "cache_clear"):
            value.cache_clear()
        elif isinstance(value, type):
            for attr in vars(value).values():
                if hasattr(attr, "cache_clear"):
                    attr.cache_clear()


@contextlib.contextmanager
def recording() -> Iterator[dict[str, bool]]:
    """Within the block, every check Inductor's ISA pick makes is run for
    real and its answer recorded in the yielded dict. The process's cached
    pick is cleared first, so the record is complete."""
    answers: dict[str, bool] = {}
    module = _vec_isa_module()
    if module is None:
        yield answers
        return
    cls = module.VecISA
    original = cls.check_build

    def check_build(self: Any, code: str) -> bool:
        ok = bool(original(self, code))
        answers[check_id(self, code)] = ok
        return ok

    _clear_pick_caches(module)
    cls.check_build = check_build
    try:
        yield answers
    finally:
        cls.check_build = original


def replay(answers: Mapping[str, bool]) -> bool:
    """From now on in this process, answer each recorded check without
    compiling; others compile as before. Returns whether anything was
    installed (no answers, or no Inductor: nothing)."""
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
    """``replay`` what the parent passed in ``FARM_ISA_CHECKS``."""
    return replay(decode(environ.get(ISA_CHECKS_ENV)))
