"""Precompiled C++ headers from a read-only store (farm.build.pch,
farm.core.precompiled_headers): a build uses what the store holds, never
builds a header itself, and cannot change the store another build reads."""

from __future__ import annotations

import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from farm.build.isolation import Isolation
from farm.build.sandbox import run_isolated
from farm.core import precompiled_headers
from farm.core.precompiled_headers import CHILD_ENV, header_key
from tests.sandbox_required import require_sandbox


@pytest.fixture
def hook(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[str, str]]]:
    """torch's own header precompile replaced by one that records its calls
    (it would build 150 MB), the farm's hook and Inductor's setting restored
    afterwards."""
    from torch._inductor import codecache
    from torch._inductor import config as inductor_config

    calls: list[tuple[str, str]] = []

    def torch_precompile(header: str, cmd: str, **options: Any) -> str:
        calls.append((header, cmd))
        raise AssertionError("torch's header precompile ran")

    monkeypatch.setattr(codecache, "_precompile_header", torch_precompile)
    monkeypatch.setattr(precompiled_headers, "_installed", {})
    with inductor_config.patch({"cpp_cache_precompile_headers": False}):
        yield calls


PREFIX = "torch/csrc/inductor/cpp_prefix.h"
OPTIONS = {"device_type": "cpu", "shared": True}


def _ask_for_a_header() -> str | None:
    """What Inductor's kernel compile asks before every CPU kernel (the call
    in ``CppCodeCache.load_async``), as it asks it."""
    from torch._inductor import codecache

    return codecache._precompile_header(PREFIX, "g++ i -O3", **OPTIONS)  # type: ignore[no-any-return]


def test_without_a_store_no_header_is_built(hook: list[tuple[str, str]]) -> None:
    from torch._inductor import config as inductor_config

    assert precompiled_headers.install(None)
    assert inductor_config.cpp_cache_precompile_headers  # the define, as the builder had it
    assert _ask_for_a_header() is None  # the kernel compiles without
    assert hook == []


def test_a_header_missing_from_the_store_is_skipped_not_built(
        hook: list[tuple[str, str]], tmp_path: Path) -> None:
    store = tmp_path / "store"
    store.mkdir()
    assert precompiled_headers.install(store)
    before = dict(precompiled_headers.counts)
    assert _ask_for_a_header() is None
    assert precompiled_headers.counts["missing"] == before["missing"] + 1
    assert hook == [] and list(store.iterdir()) == []


def test_a_header_in_the_store_is_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                       hook: list[tuple[str, str]]) -> None:
    from torch._inductor import codecache

    store = tmp_path / "store"
    store.mkdir()
    assert precompiled_headers.install(store)
    options = {"device_type": "cpu", "shared": True}
    key = header_key("torch/csrc/inductor/cpp_prefix.h", "g++ i -O3", options)
    (store / f"{key}.h").write_text("#include <torch/csrc/inductor/cpp_prefix.h>\n")
    (store / f"{key}.h.gch").write_bytes(b"gch")
    got = codecache._precompile_header("torch/csrc/inductor/cpp_prefix.h", "g++ i -O3",
                                       **options)
    assert got == str(store / f"{key}.h")
    other = codecache._precompile_header("torch/csrc/inductor/cpp_prefix.h", "g++ i -O2",
                                         **options)
    assert other is None and hook == []


class _Isa:
    """Like Inductor's VecISA: its str names the ISA, its repr an address."""

    def __str__(self) -> str:
        return "avx512"

    def __repr__(self) -> str:
        return f"<_Isa at {id(self):#x}>"


def test_the_key_is_the_same_in_every_process() -> None:
    # The store is filled by one process and read by others: an ISA object's
    # repr (an address) in the key made every reader miss.
    a = header_key("h", "cmd", {"vec_isa": _Isa(), "shared": True})
    b = header_key("h", "cmd", {"shared": True, "vec_isa": _Isa()})
    assert a == b
    assert a != header_key("h", "cmd -mavx2", {"vec_isa": _Isa(), "shared": True})


ATTACK = textwrap.dedent('''
    import os
    from pathlib import Path


    def attack(p):
        store = Path(os.environ["TORCH_FARM_PCH_STORE"])
        out = {"read": (store / "k.h.gch").read_bytes().decode()}
        for name, act in {
            "overwrite": lambda: (store / "k.h.gch").write_bytes(b"poisoned"),
            "replace": lambda: os.replace(store / "k.h", store / "k.h.gch"),
            "unlink": lambda: (store / "k.h.gch").unlink(),
            "add": lambda: (store / "evil.h.gch").write_bytes(b"x"),
            "chmod": lambda: os.chmod(store / "k.h.gch", 0o666),
        }.items():
            try:
                act()
                out[name] = "done"
            except OSError as exc:
                out[name] = type(exc).__name__
        return out
''')


@pytest.mark.parametrize("warm", [False, True], ids=["fresh child", "forked child"])
def test_a_build_child_cannot_change_the_store(
        warm: bool, build_tmp_factory: Callable[[str], Path], tmp_path: Path) -> None:
    require_sandbox()
    store = tmp_path / "pch"
    store.mkdir()
    (store / "k.h.gch").write_bytes(b"trusted")
    (store / "k.h").write_text("#include <x.h>\n")
    code = build_tmp_factory("pch-attack")
    (code / "pchattack.py").write_text(ATTACK)
    build = build_tmp_factory("pch-build")
    res = run_isolated("pchattack:attack", {}, timeout_s=120, memory_mb=2000,
                       import_paths=[code], env_extra={CHILD_ENV: str(store)},
                       isolation=Isolation(writable=(str(build),)), warm=warm)
    assert res.ok, (res.error, res.traceback, res.stderr_tail)
    v = res.value
    assert v.pop("read") == "trusted"  # the store is there to read
    assert set(v.values()) == {"OSError"}, v  # EROFS, every one
    assert sorted(p.name for p in store.iterdir()) == ["k.h", "k.h.gch"]
    assert (store / "k.h.gch").read_bytes() == b"trusted"


def test_a_node_that_adopts_the_builders_setting_never_builds_a_header(
        hook: list[tuple[str, str]], monkeypatch: pytest.MonkeyPatch) -> None:
    from torch._inductor import config as inductor_config

    from farm.node import bundle

    monkeypatch.delenv("TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS", raising=False)
    monkeypatch.delenv(CHILD_ENV, raising=False)
    assert bundle.adopt_header_precompile({"precompiled_headers": True})
    assert inductor_config.cpp_cache_precompile_headers  # the shipped kernels' keys
    assert _ask_for_a_header() is None  # a kernel the bundle lacked: compiled without
    assert hook == []


PROBE = textwrap.dedent('''
    import torch


    def compile_kernel(p):
        from farm.core import precompiled_headers

        precompiled_headers.install_from_env()
        f = torch.compile(lambda x: torch.nn.functional.gelu(x) + x.mean(-1, keepdim=True))
        f(torch.randn(4, 40))
        return precompiled_headers.counts
''')


def test_the_workers_store_serves_its_build_children(
        build_tmp_factory: Callable[[str], Path], tmp_path: Path) -> None:
    """What one sandboxed process precompiled, a build child finds: the same
    key from another process, the same compiler and flags."""
    import os

    from farm.build import pch
    from farm.build.steps import toolchain_env

    require_sandbox()
    store = tmp_path / "pch"
    # A worker that builds no CPU AOTI package (FARM_AOTI=0, a GPU target)
    # fills the kernels' headers only: no AOTI mark, and the sample package's
    # time saved.
    filled = pch.fill_store(store, aoti=False)
    assert filled.get("headers"), filled
    assert filled["aoti"] == "not filled: this worker builds no CPU AOTI packages", filled
    assert not list(store.glob("aoti-headers-*"))
    assert pch.fill_store(store, aoti=False)["skipped"] == "filled before"
    if os.geteuid() == 0:  # the sandbox uid wrote it; the worker owns it now
        assert {p.stat().st_uid for p in store.iterdir()} == {0}
    code = build_tmp_factory("pch-probe")
    (code / "pchprobe.py").write_text(PROBE)
    build = build_tmp_factory("pch-build")
    env = {**toolchain_env(), CHILD_ENV: str(store),
           "TORCHINDUCTOR_CACHE_DIR": str(build / "inductor")}
    res = run_isolated("pchprobe:compile_kernel", {}, timeout_s=300, memory_mb=4000,
                       import_paths=[code], env_extra=env,
                       isolation=Isolation(writable=(str(build),)))
    assert res.ok, (res.error, res.traceback, res.stderr_tail)
    assert res.value["used"] >= 1 and res.value["missing"] == 0, res.value


def test_aoti_packages_use_the_store_only_where_it_was_filled_for_their_compiler(
        hook: list[tuple[str, str]], tmp_path: Path) -> None:
    """A package compiled with the header setting on and its header missing
    is slower than one with it off: the store serves AOTI's headers only
    where its fill marked them for the very compiler the build runs."""
    assert precompiled_headers.aoti_store("/usr/bin/g++") is None  # no store installed
    assert precompiled_headers.install(tmp_path)
    assert precompiled_headers.aoti_store("/usr/bin/g++") is None  # not filled for AOTI
    precompiled_headers.aoti_marker(tmp_path, "g++").write_text("g++\n")
    assert precompiled_headers.aoti_store("/usr/bin/g++") is None  # another command
    assert precompiled_headers.aoti_store("g++") == str(tmp_path)
    # A second worker's fill for its own compiler leaves the first one's mark:
    # both compilers' packages use the store.
    precompiled_headers.aoti_marker(tmp_path, "/usr/bin/g++").write_text("/usr/bin/g++\n")
    assert precompiled_headers.aoti_store("/usr/bin/g++") == str(tmp_path)
    assert precompiled_headers.aoti_store("g++") == str(tmp_path)


def test_a_fill_without_aoti_does_not_count_for_a_worker_that_builds_aoti_packages(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fill's mark says whether it took AOTI's headers: a worker with
    AOTI on, after one without, fills the store again; a worker without,
    after one with, takes that fill as done. (The sandboxed fill itself is
    the test above's; here its child is replaced, to see what it is asked.)"""
    from farm.build import pch, sandbox
    from farm.build.sandbox import SandboxResult

    asked: list[bool] = []

    def fake_fill(target: str, payload: dict[str, Any], **_: Any) -> SandboxResult:
        assert target == "farm.build.pch:build_store"
        asked.append(payload["aoti"])
        return SandboxResult(ok=True, value={"headers": [], "aoti": "fake"})

    monkeypatch.setattr(sandbox, "build_isolation", lambda **_: None)
    monkeypatch.setattr(sandbox, "run_isolated", fake_fill)
    env = {"CXX": "g++"}
    without, with_aoti = tmp_path / "without", tmp_path / "with"
    assert "skipped" not in pch.fill_store(without, env=env, aoti=False)
    assert "skipped" not in pch.fill_store(without, env=env, aoti=True)
    assert asked == [False, True]
    assert "skipped" not in pch.fill_store(with_aoti, env=env, aoti=True)
    assert pch.fill_store(with_aoti, env=env, aoti=False)["skipped"] == "filled before"
    assert asked == [False, True, True]
    # Which workers take the sample: CPU ones that build AOTI packages.
    assert pch.wants_aoti_sample("cpu", True)
    assert not pch.wants_aoti_sample("cuda", True) and not pch.wants_aoti_sample("cpu", False)
