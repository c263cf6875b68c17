"""Regional compilation's pieces: which blocks become regions, the class
patch that is undone, the guards it drops, and the option's stored text."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from farm.build.regions import (
    RegionsUnavailable,
    compile_regions,
    region_guard_prefixes,
    repeated_blocks,
)
from farm.core.specs import CompileOptions, SpecError
from farm.zoo.llama import Block, tiny


def test_repeated_blocks_are_the_layers() -> None:
    with torch.device("meta"):
        model = tiny(n_layers=3)
    names = [n for n, _ in repeated_blocks(model)]
    assert names == ["layers.0", "layers.1", "layers.2"]


def test_compile_regions_decorates_the_class_and_undoes_it() -> None:
    with torch.device("meta"):
        model = tiny(n_layers=2)
    original = Block.__dict__["forward"]
    with compile_regions(model) as blocks:
        assert blocks == {"farm.zoo.llama.Block": 2}
        assert Block.__dict__["forward"] is not original
    assert Block.__dict__["forward"] is original


def test_a_model_without_repeated_blocks_is_refused_in_words() -> None:
    with pytest.raises(RegionsUnavailable, match="needs a block class repeated"), \
            compile_regions(nn.Sequential(nn.Linear(2, 2))):
        pass


def test_guard_prefixes_name_each_blocks_forward_closure() -> None:
    with torch.device("meta"):
        model = tiny(n_layers=2)
    assert region_guard_prefixes(model)[1] == (
        "dict(type(module._modules['layers']._modules['1']).__dict__)['forward'].__closure__")


def test_regional_option_is_recorded_only_when_set() -> None:
    # Options stored before it keep their exact text (and build keys).
    assert CompileOptions().canonical() == (
        '{"backend":"inductor","guard_filter":"drop-unserializable","mode":"default"}')
    regional = CompileOptions.from_json({"backend": "eager", "regional": True})
    assert regional.regional and regional.to_json()["regional"] is True
    assert CompileOptions.from_json(regional.to_json()) == regional
    assert CompileOptions.from_json({"regional": "false"}) == CompileOptions()
    with pytest.raises(SpecError, match="regional must be true or false"):
        CompileOptions.from_json({"regional": "yes"})
