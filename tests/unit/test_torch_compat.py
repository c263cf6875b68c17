"""What the farm adds to the torch releases it supports (farm.core.torch_compat)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from farm.core.torch_compat import enable_aot_compile


def calls_a_builtin(x: Any) -> Any:
    return type(x)


def test_a_saved_function_whose_bytecode_loads_a_builtin_is_made_and_runs() -> None:
    """torch 2.11 made a saved function's globals from its graph inputs and
    imports only, and failed on bytecode that calls ``type`` ("Missing
    required external references"); here a runtime env as 2.11 saved it
    (no builtins in its globals) makes its function, which runs."""
    convert_frame = pytest.importorskip("torch._dynamo.convert_frame")
    env_cls = getattr(convert_frame, "GraphRuntimeEnv", None)
    if env_cls is None:
        pytest.skip("this torch has no aot_compile runtime env")
    values = {"bytecode": calls_a_builtin.__code__, "import_sources": {}, "used_globals": {},
              "external_refs": {"type"}}
    env = env_cls(**{f.name: values.get(f.name) for f in dataclasses.fields(env_cls)
                     if f.init and (f.name in values or (f.default is dataclasses.MISSING
                                    and f.default_factory is dataclasses.MISSING))})
    enable_aot_compile()
    fn = env.forward_callable("__backend", lambda *a: None)
    assert fn(3) is int
    assert env.used_globals == {"type": type}


def test_the_farm_adds_nothing_twice() -> None:
    enable_aot_compile()
    from torch._dynamo.convert_frame import GraphRuntimeEnv

    first = GraphRuntimeEnv.forward_callable
    enable_aot_compile()
    assert GraphRuntimeEnv.forward_callable is first
