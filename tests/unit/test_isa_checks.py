"""Inductor's ISA test compiles, recorded by the worker once per machine and
answered from that record in its children (farm.core.isa_checks): a child
whose compiler cannot build anything still gets the pick the worker's real
compiler made, and without the record it does not."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from farm.build import zygote
from farm.build.isolation import Isolation
from farm.build.sandbox import isolation_unavailable, run_isolated
from farm.core import isa_checks
from farm.core.cpu_isa import VEC_ISA_OK_ENV

PROBE = '''
import os

def pick(p):
    from torch._inductor.cpu_vec_isa import VecISA, pick_vec_isa
    isa = str(pick_vec_isa())
    cache = os.environ["TORCHINDUCTOR_CACHE_DIR"]
    # What Inductor's test compiles leave: a source and a library per check.
    built = sum(f.endswith((".cpp", ".so")) for _, _, fs in os.walk(cache) for f in fs)
    return {"isa": isa, "built": built, "replaying": hasattr(VecISA.check_build, "farm_answers"),
            "sees_setting": "FARM_ISA_CHECKS" in os.environ}
'''

CXX = shutil.which("g++") or shutil.which("c++") or "g++"


def test_answers_travel_as_text_and_anything_malformed_is_no_answer() -> None:
    answers = {"0123456789abcdef": True, "fedcba9876543210": False}
    assert isa_checks.decode(isa_checks.encode(answers)) == answers
    assert isa_checks.decode(None) == {} and isa_checks.decode("") == {}
    for bad in ("0123456789abcdef:2", "0123456789ABCDEF:1", "0123456789abcdef",
                "0123456789abcdef:1,zz:0", ",".join(["0123456789abcdef:1"] * 65)):
        assert isa_checks.decode(bad) == {}, bad


@pytest.fixture(scope="module")
def worker_answers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """What a compile worker hands its children (``isa_check_env``) after
    making this machine's checked pick with the real compiler, in a process
    of its own (its Inductor caches are its own)."""
    d = tmp_path_factory.mktemp("isa-worker")
    env = {k: v for k, v in os.environ.items() if k != VEC_ISA_OK_ENV}
    env.update(FARM_ISA_CACHE=str(d / "cpu-isa.json"), TORCHINDUCTOR_CACHE_DIR=str(d / "inductor"),
               CXX=CXX)
    code = ("import json; from farm.core.cpu_isa import isa_check_env, detect_cpu_isa; "
            "env = isa_check_env(); print(json.dumps({'env': env, 'isa': detect_cpu_isa()}))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=600, check=True)
    got: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    assert (d / "cpu-isa.checks.json").is_file()  # kept for the machine's next worker
    return got


def _child_pick(tmp_path: Path, env_extra: dict[str, str], *, isolated: bool) -> dict[str, object]:
    code = tmp_path / "code"
    code.mkdir(parents=True)
    (code / "isaprobe.py").write_text(PROBE)
    for d in (tmp_path, code):
        d.chmod(0o755)
    # The worker's compiler, and an Inductor cache of the child's own (the
    # worker's test builds are not there to be loaded).
    env = {"CXX": CXX, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"), **env_extra}
    res = run_isolated("isaprobe:pick", {}, timeout_s=300, memory_mb=3000,
                       import_paths=[code], env_extra=env,
                       isolation=Isolation() if isolated else None, warm=isolated)
    assert res.ok, (res.error, res.stderr_tail)
    return dict(res.value)


@pytest.mark.parametrize("isolated", [
    False,
    pytest.param(True, marks=pytest.mark.skipif(
        isolation_unavailable() is not None, reason="no bubblewrap sandbox on this machine")),
], ids=["fresh child", "zygote's child"])
def test_a_child_answers_the_recorded_checks_without_compiling(
        worker_answers: dict[str, object], tmp_path: Path, isolated: bool) -> None:
    env = dict(worker_answers["env"])  # type: ignore[call-overload]
    assert isa_checks.ISA_CHECKS_ENV in env, env
    # All of the checks replayed, the base ones too (VEC_ISA_OK would skip
    # those, and a machine with only AVX2 would then have none to replay).
    env.pop(VEC_ISA_OK_ENV, None)
    zygote.ZYGOTES.stop_all()
    try:
        with_record = _child_pick(tmp_path / "with", env, isolated=isolated)
        without = _child_pick(tmp_path / "without",
                              {k: v for k, v in env.items() if k != isa_checks.ISA_CHECKS_ENV},
                              isolated=isolated)
    finally:
        zygote.ZYGOTES.stop_all()
    assert with_record["isa"] == worker_answers["isa"] != "", (with_record, worker_answers)
    assert with_record["replaying"] and not without["replaying"], (with_record, without)
    assert not with_record["sees_setting"]  # read and dropped before model code runs
    if not isolated:  # a zygote's child inherits its pick (made in a scratch cache)
        assert with_record["built"] == 0, with_record  # nothing compiled
        assert without["built"] > 0 and without["isa"] == with_record["isa"], without


def test_answers_made_with_another_compiler_are_ignored(
        worker_answers: dict[str, object], monkeypatch: pytest.MonkeyPatch,
        tmp_path: Path) -> None:
    value = dict(worker_answers["env"])[isa_checks.ISA_CHECKS_ENV]  # type: ignore[call-overload]
    other = tmp_path / "g++"
    other.write_text("#!/bin/sh\nexit 1\n")
    other.chmod(0o755)
    installed: list[object] = []
    monkeypatch.setattr(isa_checks, "replay", lambda answers: installed.append(answers) or True)
    monkeypatch.setenv("CXX", CXX)
    assert isa_checks.replay_from_env({isa_checks.ISA_CHECKS_ENV: value}) and installed
    monkeypatch.setenv("CXX", str(other))
    assert not isa_checks.replay_from_env({isa_checks.ISA_CHECKS_ENV: value})
    assert len(installed) == 1


def test_a_failed_check_is_never_handed_on() -> None:
    """A check may fail by chance (a full disk, the load probe's timeout):
    children compile it again rather than inherit the failure."""
    value = isa_checks.for_child({"0123456789abcdef": True, "fedcba9876543210": False})
    assert value.endswith(";0123456789abcdef:1")
    assert isa_checks.for_child({"fedcba9876543210": False}) == ""
    assert not isa_checks.replay({"fedcba9876543210": False})  # nothing to install


def test_a_node_answers_the_recorded_checks_from_the_machines_cache(tmp_path: Path) -> None:
    """A fleet node about to load CPU kernels (``skip_redundant_isa_checks``)
    answers what this machine's first process recorded: its compiler, the
    same one, runs no test compile."""
    log = tmp_path / "compiler.log"
    cxx = tmp_path / "bin" / "g++"
    cxx.parent.mkdir()
    real = next(p for p in ("/usr/bin/g++", "/usr/bin/c++") if os.path.exists(p))
    cxx.write_text(f'#!/bin/sh\necho "$*" >> {log}\nexec {real} "$@"\n')
    cxx.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != VEC_ISA_OK_ENV}
    env.update(FARM_ISA_CACHE=str(tmp_path / "cpu-isa.json"), CXX=str(cxx))
    code = ("import sys; from farm.core.cpu_isa import skip_redundant_isa_checks; "
            "skip_redundant_isa_checks(); "
            "from torch._inductor.cpu_vec_isa import VecISA, pick_vec_isa; "
            "print(hasattr(VecISA.check_build, 'farm_answers'), pick_vec_isa())")

    def node(name: str) -> tuple[str, list[str]]:
        run_env = {**env, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / name)}
        out = subprocess.run([sys.executable, "-c", code], env=run_env, capture_output=True,
                             text=True, timeout=600, check=True)
        lines = log.read_text().splitlines() if log.exists() else []
        log.unlink(missing_ok=True)
        return out.stdout.strip().splitlines()[-1], [x for x in lines if "--version" not in x]

    # (On a CPU with AVX2 only, vec_isa_ok alone leaves no check: the replay
    # must be installed all the same.)

    first, first_runs = node("first")  # makes and records the machine's checked pick
    assert first_runs and first.startswith("False "), (first, first_runs)
    second, second_runs = node("second")
    assert second == "True " + first.split(" ", 1)[1] and second_runs == [], (second, second_runs)
