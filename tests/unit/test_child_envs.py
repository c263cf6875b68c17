"""A compile worker's children share one warm zygote where they can: the
compile child and the verification of its aot_compile artifact carry the
same import-time environment (farm.build.steps.toolchain_env), and only the
cold-node verification of an AOTI package, which must see no compiler,
differs. A trace child forks from a zygote of its own that has not
imported Inductor."""

from __future__ import annotations

import os
from pathlib import Path

from farm.build import zygote
from farm.build.child_env import without_compilers
from farm.build.steps import compile_env
from farm.build.verify import verifier_env


def _import_time(env: dict[str, str]) -> str:
    """The key ``zygote.Zygotes.take`` uses, for one sandbox user and limit."""
    return zygote.zygote_key(env, uid=1000, memory_mb=6000.0)


def test_compile_and_aot_compile_verification_fork_from_one_zygote(tmp_path: Path) -> None:
    base = dict(os.environ)
    compiling = {**base, **compile_env(tmp_path / "build")}
    verifying = {**base, **verifier_env(str(tmp_path / "verify"), cold_node=False)}
    assert compiling["TORCHINDUCTOR_CACHE_DIR"] != verifying["TORCHINDUCTOR_CACHE_DIR"]
    assert _import_time(compiling) == _import_time(verifying)


def test_a_cold_node_verification_sees_no_compiler_and_gets_its_own(tmp_path: Path) -> None:
    cold = {**without_compilers(), **verifier_env(str(tmp_path / "verify"), cold_node=True)}
    assert "CXX" not in cold
    compiling = {**os.environ, **compile_env(tmp_path / "build")}
    assert _import_time(cold) != _import_time(compiling)


def test_a_trace_child_gets_a_zygote_without_inductor_and_a_build_child_never_does() -> None:
    trace, build = (zygote.preload_for(t) for t in ("farm.build.steps:trace_step",
                                                    "farm.build.steps:compile_step"))
    assert zygote.preload_for("farm.build.verify:verify_step") == build
    assert "torch._inductor.compile_fx" in zygote.PRELOADS[build]
    assert "torch._inductor.compile_fx" not in zygote.PRELOADS[trace]
    assert set(zygote.PRELOADS[trace]) < set(zygote.PRELOADS[build])
    env = dict(os.environ)
    assert (zygote.zygote_key(env, uid=1000, memory_mb=6000.0, preload=trace)
            != zygote.zygote_key(env, uid=1000, memory_mb=6000.0, preload=build))
