"""farm.build.toolchain + farm.build.aoti_check: the compile worker's C++
compiler, the first candidate whose AOTI packages build, link the shared
libstdc++ and load here; chosen once per machine."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from farm.build import aoti_check, toolchain
from farm.build.toolchain import Probe


def fake_compiler(d: Path, name: str) -> str:
    p = d / name
    p.write_text("#!/bin/sh\necho 'fake 1.0'\n")
    p.chmod(p.stat().st_mode | stat.S_IXUSR)
    return str(p)


def cxx_wrapper(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A ``$CXX`` off PATH, as the GPU image sets one (/opt/gcc/bin/g++)."""
    other = tmp_path / "opt"
    other.mkdir()
    wrapper = fake_compiler(other, "wrapper-g++")
    monkeypatch.setenv("CXX", wrapper)
    return wrapper


@pytest.fixture
def bin_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
            undo_compiler_choice: None) -> Path:
    """A PATH of its own, a cache file of its own, no CXX; what the test's
    compiler choices change goes back after it (``undo_compiler_choice``:
    left at one of these fake compilers, which "compile" nothing and exit 0,
    Inductor failed every later compile of the test process)."""
    d = tmp_path / "bin"
    d.mkdir()
    monkeypatch.setenv("PATH", str(d))
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.delenv(toolchain.CXX_BEFORE_CHOICE_ENV, raising=False)
    monkeypatch.setenv("FARM_AOTI_CHECK_CACHE", str(tmp_path / "aoti-check.json"))
    monkeypatch.setattr(toolchain, "_current", None)
    return d


class Probes:
    """Answers per compiler name; records what was probed."""

    def __init__(self, answers: dict[str, list[Probe]]) -> None:
        self.answers = answers
        self.calls: list[tuple[str, str]] = []

    def __call__(self, device: str, cxx: str) -> Probe:
        self.calls.append((device, os.path.basename(cxx)))
        return self.answers[os.path.basename(cxx)].pop(0)


def test_candidates_cxx_first_then_path_then_versioned_newest_first(
    bin_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gxx = fake_compiler(bin_dir, "g++")
    cxx_link = bin_dir / "c++"
    cxx_link.symlink_to(gxx)  # the same file by another name: tried once
    g12 = fake_compiler(bin_dir, "g++-12")
    g9 = fake_compiler(bin_dir, "g++-9")
    other = tmp_path / "opt"
    other.mkdir()
    wrapper = fake_compiler(other, "g++")
    monkeypatch.setenv("CXX", wrapper)
    assert toolchain.candidates() == [wrapper, gxx, g12, g9]


def test_a_missing_cxx_is_listed_and_rejected(
    bin_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_compiler(bin_dir, "g++")
    monkeypatch.setenv("CXX", "/nowhere/g++")
    probes = Probes({"g++": [Probe("ok")]})
    choice = toolchain.choose_compiler("cpu", probe=probes)
    assert choice.cxx == str(bin_dir / "g++")
    assert choice.rejected == (("/nowhere/g++", "not found or not executable"),)


def test_the_first_that_passes_is_chosen_and_remembered(
    bin_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    wrapper = cxx_wrapper(tmp_path, monkeypatch)
    gxx = fake_compiler(bin_dir, "g++")
    fake_compiler(bin_dir, "g++-12")
    static = "links no shared libstdc++.so.6 (a static copy)"
    probes = Probes({"wrapper-g++": [Probe(static)], "g++": [Probe("ok", linkage={"x": 1})]})
    choice = toolchain.choose_compiler("cuda:0", probe=probes)
    assert choice.cxx == gxx and choice.ok
    assert choice.rejected == ((wrapper, static),)
    assert choice.identity == f"{gxx}: fake 1.0"
    assert choice.linkage == {"x": 1}
    # Cached per machine: a second worker does not probe again (g++-12 never was).
    again = toolchain.choose_compiler("cuda", probe=probes)
    assert again == choice
    assert probes.calls == [("cuda", "wrapper-g++"), ("cuda", "g++")]
    stored = json.loads((tmp_path / "aoti-check.json").read_text())
    assert [v["cxx"] for v in stored.values()] == [gxx]


def test_a_changed_compiler_is_checked_again(bin_dir: Path) -> None:
    gxx = fake_compiler(bin_dir, "g++")
    probes = Probes({"g++": [Probe("ok"), Probe("load crashed sigsegv")]})
    assert toolchain.choose_compiler("cpu", probe=probes).ok
    Path(gxx).write_text("#!/bin/sh\necho 'fake 2.0, upgraded in place'\n")
    assert not toolchain.choose_compiler("cpu", probe=probes).ok
    assert len(probes.calls) == 2


def test_devices_are_checked_apart(bin_dir: Path) -> None:
    fake_compiler(bin_dir, "g++")
    probes = Probes({"g++": [Probe("ok"), Probe("load crashed sigsegv")]})
    assert toolchain.choose_compiler("cpu", probe=probes).ok
    assert not toolchain.choose_compiler("cuda", probe=probes).ok
    assert toolchain.choose_compiler("cpu", probe=probes).ok
    assert probes.calls == [("cpu", "g++"), ("cuda", "g++")]


def test_a_passing_failure_is_asked_again_a_definitive_one_is_not(bin_dir: Path) -> None:
    fake_compiler(bin_dir, "g++")
    probes = Probes({"g++": [Probe("build failed: disk full", definitive=False),
                             Probe("load crashed sigsegv"), Probe("ok")]})
    assert toolchain.choose_compiler("cpu", probe=probes).why_not() == (
        f"{bin_dir / 'g++'}: build failed: disk full")
    assert not toolchain.choose_compiler("cpu", probe=probes).ok
    assert not toolchain.choose_compiler("cpu", probe=probes).ok  # remembered
    assert len(probes.calls) == 2


def test_off_never_caches(bin_dir: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("FARM_AOTI_CHECK_CACHE", "off")
    fake_compiler(bin_dir, "g++")
    probes = Probes({"g++": [Probe("ok"), Probe("ok")]})
    toolchain.choose_compiler("cpu", probe=probes)
    toolchain.choose_compiler("cpu", probe=probes)
    assert len(probes.calls) == 2
    assert not (tmp_path / "aoti-check.json").exists()


def test_a_corrupt_or_old_cache_is_probed_again(bin_dir: Path, tmp_path: Path) -> None:
    fake_compiler(bin_dir, "g++")
    (tmp_path / "aoti-check.json").write_text(json.dumps({"k": "ok", "j": {"cxx": 3}}))
    probes = Probes({"g++": [Probe("ok")]})
    assert toolchain.choose_compiler("cpu", probe=probes).ok
    assert len(probes.calls) == 1


def test_the_chosen_compiler_becomes_the_process_and_its_childrens(
    bin_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch._inductor.config as config

    gxx = fake_compiler(bin_dir, "g++")
    before = config.cpp.cxx
    monkeypatch.setattr(aoti_check, "compiler_for", toolchain.compiler_for)
    monkeypatch.setattr("farm.build.aoti_check.probe_compiler", lambda d, c: Probe("ok"))
    assert aoti_check.aoti_loads_here("cpu") == (True, "ok")
    try:
        assert os.environ["CXX"] == gxx
        assert config.cpp.cxx == (None, gxx)
        from farm.build.steps import compile_env

        assert compile_env("/tmp/b")["CXX"] == gxx
    finally:
        config.cpp.cxx = before


def test_no_passing_compiler_says_why(bin_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_compiler(bin_dir, "g++")
    monkeypatch.setattr("farm.build.aoti_check.probe_compiler",
                        lambda d, c: Probe("load crashed sigsegv"))
    ok, why = aoti_check.aoti_loads_here("cuda")
    assert not ok and why == f"{bin_dir / 'g++'}: load crashed sigsegv"


def test_a_crashing_child_is_named_by_its_signal(monkeypatch: pytest.MonkeyPatch) -> None:
    import subprocess

    class Done:
        def __init__(self, rc: int) -> None:
            self.returncode, self.stdout, self.stderr = rc, "", "boom"

    monkeypatch.setattr(aoti_check, "quick_linkage", lambda cxx, tmp: None)
    codes = iter([-11])
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: Done(next(codes)))
    got = aoti_check.probe_compiler("cpu", "/usr/bin/g++")
    assert (got.reason, got.definitive) == ("build crashed sigsegv", False)
    codes = iter([1])
    got = aoti_check.probe_compiler("cpu", "/usr/bin/g++")
    assert (got.reason, got.definitive) == ("build failed: boom", False)


@pytest.mark.skipif(__import__("shutil").which("g++") is None, reason="needs g++")
def test_the_quick_linkage_check_rejects_a_static_libstdcxx(tmp_path: Path) -> None:
    import shutil

    gxx = shutil.which("g++")
    assert gxx is not None
    assert aoti_check.quick_linkage(gxx, tmp_path) is None  # links libstdc++.so.6
    # A compiler like the H200 image's wrapper: its libstdc++.so link dangles,
    # so the linker takes libstdc++.a.
    wrapper = tmp_path / "static-g++"
    wrapper.write_text(f'#!/bin/sh\nexec {gxx} -static-libstdc++ "$@"\n')
    wrapper.chmod(0o755)
    got = aoti_check.quick_linkage(str(wrapper), tmp_path)
    assert got is not None and got.definitive
    assert got.reason.startswith("links no shared libstdc++.so.6")


def test_a_build_child_adopts_the_workers_compiler_and_never_probes(
    bin_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A sandboxed compile child has no cached answer of its own (it sees neither
    # the worker's cache file nor its home): without the worker's choice in its
    # payload, it ran the whole check again in every build.
    from farm.build import compile as compile_mod

    gxx = fake_compiler(bin_dir, "g++")
    probes = Probes({"g++": [Probe("ok")]})
    monkeypatch.setattr(aoti_check, "probe_compiler", probes)
    compile_mod._use_chosen_compiler("cpu", gxx)
    assert probes.calls == []
    assert toolchain.current_compiler() == gxx and os.environ["CXX"] == gxx
    # Without one, the child asks this machine's check (here: a probe).
    monkeypatch.setattr(toolchain, "_current", None)
    compile_mod._use_chosen_compiler("cpu")
    assert probes.calls == [("cpu", "g++")]


def test_the_chosen_compiler_does_not_change_the_question(
    bin_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The worker chooses at start and sets CXX to its choice; its pool
    # children inherit that CXX and ask again before every build. They must
    # get the cached answer, not probe every compiler anew (seen on a GPU
    # host: ~95 s before the first build compiled).
    wrapper = cxx_wrapper(tmp_path, monkeypatch)
    gxx = fake_compiler(bin_dir, "g++")
    probes = Probes({"wrapper-g++": [Probe("links no shared libstdc++.so.6")],
                     "g++": [Probe("ok"), Probe("ok")]})
    assert toolchain.compiler_for("cuda", probe=probes).cxx == gxx
    assert os.environ["CXX"] == gxx
    # A child process inherits the environment as it is now.
    child_env = dict(os.environ)
    assert toolchain.candidates(child_env) == [wrapper, gxx]
    assert toolchain.compiler_for("cuda", probe=probes).cxx == gxx
    assert probes.calls == [("cuda", "wrapper-g++"), ("cuda", "g++")]
