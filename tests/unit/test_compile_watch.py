"""The verifier's compile watch tells a Triton kernel compiled on the node
from one answered by the binaries the artifact shipped (Triton's cache), so a
build is flagged "first call still compiles" only for real compiles."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from farm.build.compile_watch import CompileWatch, compiled_in

triton_heuristics = pytest.importorskip("torch._inductor.runtime.triton_heuristics")


def test_a_triton_cache_hit_is_not_a_compile(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "triton"
    (cache / "ab12").mkdir(parents=True)
    (cache / "ab12" / "shipped.cubin").write_bytes(b"\x7fELF")  # unpacked from the artifact
    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache))

    def precompile_config(self: Any, cfg: str) -> str:
        # Triton's cache: a miss compiles and writes the kernel's binary.
        if cfg == "miss":
            (cache / "cd34").mkdir()
            (cache / "cd34" / "new.cubin").write_bytes(b"\x7fELF")
        return cfg

    cls = triton_heuristics.CachingAutotuner
    monkeypatch.setattr(cls, "_precompile_config", precompile_config)
    kernel = SimpleNamespace(triton_meta={"device": 0})
    watch = CompileWatch()
    watch.install()
    try:
        with watch.phase() as loaded:
            assert cls._precompile_config(kernel, "hit") == "hit"
        with watch.phase() as compiled:
            cls._precompile_config(kernel, "miss")
    finally:
        watch.uninstall()
    assert loaded == {"triton_cache_loads": 1}
    assert not compiled_in(loaded)
    assert compiled == {"triton_compiles": 1}
    assert compiled_in(compiled)
    assert cls._precompile_config is precompile_config  # uninstalled
