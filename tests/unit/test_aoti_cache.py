"""The AOTI package cache's key (farm.build.aoti_cache): the same exported
program, wherever its code lives, has one key; anything the package is
compiled from changes it. Real torch.export of small models, no compile."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from farm.build.aoti_cache import (
    cached_package,
    graph_text,
    keep_package,
    package_key,
    toolchain,
)

MODEL_SOURCE = """
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self, act="gelu"):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.act = act

    def forward(self, x):
        y = self.fc(x)
        return torch.nn.functional.gelu(y) if self.act == "gelu" else torch.nn.functional.silu(y)
"""
CONFIGS = {"freezing": False, "aot_inductor.metadata": {"farm": '{"inputs":["float32[2,8]"]}'}}
CPU = torch.device("cpu")


def net_from(directory: Path, name: str, *, pad_lines: int = 0, **kwargs: Any) -> torch.nn.Module:
    """``Net`` from a file of its own in ``directory`` (as a code pack
    unpacked under its digest), ``pad_lines`` blank lines above it."""
    directory.mkdir(parents=True)
    path = directory / f"{name}.py"
    path.write_text("\n" * pad_lines + MODEL_SOURCE)
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod.Net(**kwargs)  # type: ignore[no-any-return]


def export(model: torch.nn.Module, shape: tuple[int, ...] = (2, 8)) -> Any:
    return torch.export.export(model, (torch.randn(shape),), strict=False)


def key(ep: Any, configs: dict[str, Any] = CONFIGS, cxx: str = "g++ 12") -> str:
    return package_key(ep, configs, CPU, cxx)


def test_the_same_model_from_two_code_packs_has_one_key(tmp_path: Path) -> None:
    a = export(net_from(tmp_path / "pack-a", "farm_test_net_a"))
    b = export(net_from(tmp_path / "pack-b", "farm_test_net_b", pad_lines=7))
    # Both graphs say where their source is, and the places differ ...
    assert str(tmp_path / "pack-a") in a.graph_module.print_readable(print_output=False)
    # ... which the key leaves out.
    assert "pack-a" not in graph_text(a)
    assert key(a) == key(b)


def test_what_the_package_is_compiled_from_changes_the_key(tmp_path: Path) -> None:
    base = export(net_from(tmp_path / "base", "farm_test_net_base"))
    other_op = export(net_from(tmp_path / "silu", "farm_test_net_silu", act="silu"))
    other_shape = export(net_from(tmp_path / "shape", "farm_test_net_shape"), (3, 8))
    keys = {
        key(base),
        key(other_op),
        key(other_shape),
        key(base, {**CONFIGS, "freezing": True}),
        key(base, {**CONFIGS, "aot_inductor.metadata": {"farm": '{"inputs":["float32[3,8]"]}'}}),
        key(base, cxx="clang 16"),
    }
    assert len(keys) == 6


def test_a_cuda_package_is_keyed_by_the_gpus_generation(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ep = export(net_from(tmp_path / "cuda", "farm_test_net_cuda"))
    cuda = torch.device("cuda")
    keys = set()
    for capability in ((9, 0), (8, 0)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None, c=capability: c)
        assert toolchain(cuda, "g++ 12")["capability"] == list(capability)
        keys.add(package_key(ep, CONFIGS, cuda, "g++ 12"))
    keys.add(package_key(ep, CONFIGS, CPU, "g++ 12"))
    assert len(keys) == 3


def test_a_kept_package_is_found_under_its_key_only(tmp_path: Path) -> None:
    package = tmp_path / "aoti.pt2"
    package.write_bytes(b"package bytes")
    cache = tmp_path / "cache" / "farm-aoti"
    assert cached_package(cache, "k1") is None
    keep_package(cache, "k1", package)
    found = cached_package(cache, "k1")
    assert found is not None and found.read_bytes() == b"package bytes"
    assert cached_package(cache, "k2") is None
    assert [p.name for p in cache.iterdir()] == ["k1.pt2"]  # no temporary file left
