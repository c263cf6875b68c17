"""The per-machine cache of Inductor's CPU ISA pick (``FARM_ISA_CACHE``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from farm.core import cpu_isa as target
from farm.core.cpu_isa import detect_cpu_isa
from tests.slowdown import scaled


@pytest.fixture(autouse=True)
def isa_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every test gets its own cache file, and a fixed compiler."""
    path = tmp_path / "cache" / "cpu-isa.json"
    monkeypatch.setenv("FARM_ISA_CACHE", str(path))
    monkeypatch.setenv("CXX", str(fake_compiler(tmp_path / "bin" / "g++", b"gcc one")))
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    return path


def fake_compiler(path: Path, content: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content)
    path.chmod(0o755)  # shutil.which only finds executables
    return path


class Detector:
    """Stands in for the expensive pick and counts its calls."""

    def __init__(self, answer: str = "avx512") -> None:
        self.answer = answer
        self.calls = 0

    def __call__(self) -> str:
        self.calls += 1
        return self.answer


@pytest.fixture
def detector(monkeypatch: pytest.MonkeyPatch) -> Detector:
    d = Detector()
    monkeypatch.setattr(target, "_pick_inductor_isa", d)
    return d


def test_second_call_reads_the_cache(detector: Detector, isa_cache: Path) -> None:
    assert detect_cpu_isa() == "avx512"
    assert detector.calls == 1
    assert list(json.loads(isa_cache.read_text()).values()) == ["avx512"]
    assert detect_cpu_isa() == "avx512"
    assert detector.calls == 1


def test_another_compiler_misses(
    detector: Detector, isa_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert detect_cpu_isa() == "avx512"
    other = fake_compiler(tmp_path / "bin" / "clang++", b"clang")
    monkeypatch.setenv("CXX", str(other))
    detector.answer = "avx2"
    assert detect_cpu_isa() == "avx2"
    assert detector.calls == 2
    # Both machines' answers are kept, each under its own key.
    assert sorted(json.loads(isa_cache.read_text()).values()) == ["avx2", "avx512"]
    assert detect_cpu_isa() == "avx2"
    assert detector.calls == 2


def test_compiler_upgraded_in_place_misses(
    detector: Detector, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert detect_cpu_isa() == "avx512"
    fake_compiler(tmp_path / "bin" / "g++", b"gcc two, a longer binary")
    assert detect_cpu_isa() == "avx512"
    assert detector.calls == 2


def test_env_that_changes_the_pick_misses(
    detector: Detector, monkeypatch: pytest.MonkeyPatch
) -> None:
    detect_cpu_isa()
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    detect_cpu_isa()
    assert detector.calls == 2
    # A fresh Inductor cache dir per process must not defeat the cache.
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/tmp/some-fresh-dir")
    detect_cpu_isa()
    assert detector.calls == 2


def test_inductor_setting_changed_in_code_misses(
    detector: Detector, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("torch")
    # Inductor reads CXX once, at import: not the fake one, for later tests' sake.
    monkeypatch.delenv("CXX")
    from torch._inductor import config

    detect_cpu_isa()
    detect_cpu_isa()
    assert detector.calls == 1  # Inductor imported, defaults only: same key
    # config.patch, not monkeypatch: undoing setattr on Inductor's config
    # proxy deletes the setting.
    with config.patch({"cpp.simdlen": 256}):
        detect_cpu_isa()
    assert detector.calls == 2
    detect_cpu_isa()
    assert detector.calls == 2


@pytest.mark.parametrize(
    "content",
    [b"{not json", b"\xff\xfe\x00garbage", b"[1, 2, 3]", b'{"k": 5}', b"[" * 100_000],
)
def test_corrupt_cache_is_ignored_and_rewritten(
    detector: Detector, isa_cache: Path, content: bytes
) -> None:
    isa_cache.parent.mkdir(parents=True)
    isa_cache.write_bytes(content)
    assert detect_cpu_isa() == "avx512"
    assert detector.calls == 1
    assert list(json.loads(isa_cache.read_text()).values()) == ["avx512"]
    assert detect_cpu_isa() == "avx512"
    assert detector.calls == 1


def test_off_never_writes(
    detector: Detector, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FARM_ISA_CACHE", "off")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    before = sorted(tmp_path.rglob("*"))
    assert detect_cpu_isa() == "avx512"
    assert detect_cpu_isa() == "avx512"
    assert detector.calls == 2
    assert sorted(tmp_path.rglob("*")) == before


def test_default_location_is_under_xdg_cache_home(
    detector: Detector, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("FARM_ISA_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    detect_cpu_isa()
    assert (tmp_path / "xdg" / "torch-farm" / "cpu-isa.json").is_file()


@pytest.mark.parametrize("where", ["parent_is_a_file", "path_is_a_directory"])
def test_unwritable_location_still_detects(
    detector: Detector, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    # By shape rather than permissions: these tests may run as root.
    if where == "parent_is_a_file":
        (tmp_path / "file").write_text("")
        path = tmp_path / "file" / "cpu-isa.json"
    else:
        path = tmp_path / "dir"
        path.mkdir()
    monkeypatch.setenv("FARM_ISA_CACHE", str(path))
    assert detect_cpu_isa() == "avx512"
    assert detect_cpu_isa() == "avx512"
    assert detector.calls == 2
    if where == "path_is_a_directory":
        assert list(path.iterdir()) == []  # no temp file left behind


def test_entries_are_bounded(
    detector: Detector, isa_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for i in range(target._ISA_CACHE_MAX_ENTRIES + 5):
        monkeypatch.setenv("ATEN_CPU_CAPABILITY", f"cap{i}")
        detect_cpu_isa()
    assert len(json.loads(isa_cache.read_text())) == target._ISA_CACHE_MAX_ENTRIES


def test_empty_pick_is_cached_only_without_a_compiler(
    isa_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    d = Detector(answer="")
    monkeypatch.setattr(target, "_pick_inductor_isa", d)
    # A compiler is there but the pick failed: maybe passing, so not pinned.
    first = detect_cpu_isa()
    assert first  # ATen's level, the fallback
    assert not isa_cache.exists()
    # No compiler at all: stable until one is installed, which changes the key.
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    assert detect_cpu_isa() == first
    assert detect_cpu_isa() == first
    assert d.calls == 2
    assert list(json.loads(isa_cache.read_text()).values()) == [""]


def test_real_detection_twice(
    isa_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("torch")
    real_cxx = target.shutil.which("g++") or target.shutil.which("c++")
    if real_cxx is None:
        pytest.skip("no C++ compiler on this machine")
    monkeypatch.setenv("CXX", real_cxx)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    real_pick = target._pick_inductor_isa
    calls: list[str] = []

    def counted() -> str:
        calls.append(real_pick())
        return calls[-1]

    monkeypatch.setattr(target, "_pick_inductor_isa", counted)
    from torch._inductor import config

    # Inductor reads CXX once, at import, perhaps under another test's fake one.
    with config.patch({"cpp.cxx": (None, real_cxx)}):
        first = detect_cpu_isa()
        assert first and first != "INVALID_VEC_ISA"
        assert calls == [first]
        assert list(json.loads(isa_cache.read_text()).values()) == [first]
        assert detect_cpu_isa() == first
        assert calls == [first]


def test_a_node_reads_the_isa_from_cpu_flags_without_a_compiler(tmp_path: Path) -> None:
    """A fleet node's ISA (no test compiles) is the compile worker's on the same
    machine, also with no C++ compiler on PATH, so the resolver matches them."""
    import subprocess
    import sys

    from farm.build.child_env import without_compilers

    monkey_env = {k: v for k, v in without_compilers().items() if k != "CXX"}
    monkey_env["FARM_ISA_CACHE"] = "off"
    code = ("import time; from farm.core.cpu_isa import detect_cpu_isa; t = time.perf_counter(); "
            "isa = detect_cpu_isa(check_compiler=False); "
            "print(isa); print(time.perf_counter() - t)")
    out = subprocess.run([sys.executable, "-c", code], env=monkey_env, capture_output=True,
                         text=True, check=True, cwd=Path(__file__).resolve().parents[2])
    isa, seconds = out.stdout.split("\n")[:2]
    assert isa == _real_pick()
    # No test compiles (those take 14-16 s on 2 cores); scaled: the machine may be busy.
    assert float(seconds) < scaled(5)


def _real_pick() -> str:
    import os

    os.environ.pop("CXX", None)  # the fixture's fake compiler
    return target._pick_inductor_isa()
