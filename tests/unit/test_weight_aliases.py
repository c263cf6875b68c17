"""Every way a module's tensors are aliased or absent, through a build's
``to_empty`` and the weights manifest's check (farm.core.aliases,
farm.node.weight_check): tied weights, shared buffers, non-persistent
buffers, parametrizations, lazily created buffers."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize

from farm.core.aliases import tensor_names, to_empty_keeping_aliases, zero_unloaded
from farm.node.weight_check import (
    WeightsMismatch,
    check_weights,
    manifest_mismatch,
    weights_manifest,
)


class TiedLM(nn.Module):
    """A causal LM's shape: the output head is the token embedding."""

    def __init__(self, vocab: int = 50, hidden: int = 8) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, hidden)
        self.block = nn.Linear(hidden, hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(torch.relu(self.block(self.wte(ids))))


def meta_built(cls: type[nn.Module], *args: object) -> nn.Module:
    """What a build does: the factory under the meta device, then to_empty."""
    with torch.device("meta"):
        m = cls(*args)
    return to_empty_keeping_aliases(m, "cpu")


def test_plain_to_empty_unties_weights_which_is_why_the_farm_reties_them() -> None:
    with torch.device("meta"):
        m = TiedLM()
    m.to_empty(device="cpu")
    assert m.lm_head.weight is not m.wte.weight  # torch's behaviour the fix works around
    built = meta_built(TiedLM)
    assert built.lm_head.weight is built.wte.weight
    assert [n for n, _ in built.named_parameters()] == ["wte.weight", "block.weight", "block.bias"]


def test_tied_weights_are_one_entry_per_name_naming_the_shared_tensor() -> None:
    m = weights_manifest(TiedLM())
    assert [(e["name"], e["tensor"]) for e in m] == [
        ("wte.weight", "wte.weight"),
        ("block.weight", "block.weight"),
        ("block.bias", "block.bias"),
        ("lm_head.weight", "wte.weight"),
    ]
    # The module a node loads (built for real) fits the artifact built on meta.
    check_weights(TiedLM(), weights_manifest(meta_built(TiedLM)))


def test_a_node_whose_weights_are_tied_differently_is_refused_both_ways() -> None:
    untied = TiedLM()
    untied.lm_head.weight = nn.Parameter(untied.wte.weight.detach().clone())
    assert manifest_mismatch(weights_manifest(TiedLM()), weights_manifest(untied)) == (
        "lm_head.weight: its own tensor in the module, tied to wte.weight in the artifact "
        "(tie them as the built model does: lm_head.weight = wte.weight)"
    )
    assert manifest_mismatch(weights_manifest(untied), weights_manifest(TiedLM())) == (
        "lm_head.weight: tied to wte.weight in the module (one tensor), its own tensor in "
        "the artifact"
    )
    with pytest.raises(WeightsMismatch, match=r"lm_head\.weight: its own tensor"):
        check_weights(untied, weights_manifest(meta_built(TiedLM)))


def test_a_manifest_from_before_ties_were_recorded_still_checks() -> None:
    """Such a manifest has one entry per tensor and no ``tensor`` field."""
    old = [
        {k: v for k, v in e.items() if k not in ("tensor", "persistent")}
        for e in weights_manifest(TiedLM())
        if e["tensor"] == e["name"]
    ]
    assert manifest_mismatch(old, weights_manifest(TiedLM())) is None
    # The case: an older build had untied the head, the node's is tied.
    with torch.device("meta"):
        broken = TiedLM()
    broken.to_empty(device="cpu")
    old_untied = [
        {k: v for k, v in e.items() if k not in ("tensor", "persistent")}
        for e in weights_manifest(broken)
    ]
    assert manifest_mismatch(old_untied, weights_manifest(TiedLM())) == (
        "lm_head.weight: the module has no such parameter, the artifact was built for float32[50,8]"
    )


class SharedBuffer(nn.Module):
    """One buffer registered on two submodules, and a persistent and a
    non-persistent one of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        scale = torch.ones(4)
        self.a.register_buffer("scale", scale)
        self.b.register_buffer("scale", scale)
        self.register_buffer("position_ids", torch.arange(16).unsqueeze(0), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x) * self.a.scale) * self.b.scale


def test_a_shared_buffer_stays_shared_and_is_named_twice() -> None:
    built = meta_built(SharedBuffer)
    assert built.a.scale is built.b.scale
    names = tensor_names(built)
    assert names["b.scale"] == "a.scale" and names["a.scale"] == "a.scale"
    assert manifest_mismatch(weights_manifest(SharedBuffer()), weights_manifest(built)) is None


def test_non_persistent_buffers_are_marked_and_may_be_absent_on_either_side() -> None:
    m = SharedBuffer()
    assert "position_ids" not in m.state_dict()
    entry = next(e for e in weights_manifest(m) if e["name"] == "position_ids")
    assert entry["persistent"] is False and entry["dtype"] == "int64"
    without = SharedBuffer()
    del without.position_ids
    assert manifest_mismatch(weights_manifest(m), weights_manifest(without)) is None
    assert manifest_mismatch(weights_manifest(without), weights_manifest(m)) is None
    # Present on both sides, it is checked like any other.
    wrong = SharedBuffer()
    wrong.position_ids = torch.arange(8).unsqueeze(0)
    assert manifest_mismatch(weights_manifest(m), weights_manifest(wrong)) == (
        "position_ids: shape [1,8], artifact built for [1,16]"
    )
    # A persistent buffer is never optional.
    lacking = SharedBuffer()
    del lacking.a.scale
    assert manifest_mismatch(weights_manifest(m), weights_manifest(lacking)) == (
        "a.scale: the module has no such buffer, the artifact was built for float32[4]"
    )


def test_a_buffer_that_turned_non_persistent_is_a_difference() -> None:
    m = SharedBuffer()
    other = SharedBuffer()
    ids = other.position_ids
    del other.position_ids
    other.register_buffer("position_ids", ids)  # persistent now: in state_dict
    why = manifest_mismatch(weights_manifest(m), weights_manifest(other))
    assert why is not None and why.startswith("position_ids: persistent True")


class Rotary(nn.Module):
    """A rotary cache made at the first call, as several attention layers do."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.register_buffer(
            "inv_freq", 1.0 / 10000 ** (torch.arange(0, 8, 2) / 8), persistent=False
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not hasattr(self, "cos_cached"):
            t = torch.arange(x.shape[-2], dtype=torch.float32)
            freqs = torch.outer(t, self.inv_freq)
            self.register_buffer("cos_cached", freqs.cos().repeat(1, 2), persistent=False)
        return self.proj(x) * self.cos_cached


def test_a_lazily_created_cache_does_not_refuse_a_module_that_has_run() -> None:
    built = weights_manifest(meta_built(Rotary))
    node = Rotary()
    node(torch.randn(1, 5, 8))  # the node ran it eagerly first (a verifier does)
    assert "cos_cached" in dict(node.named_buffers())
    assert manifest_mismatch(built, weights_manifest(node)) is None
    assert manifest_mismatch(weights_manifest(node), built) is None


class Symmetric(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.triu() + x.triu(1).transpose(-1, -2)


def weight_normed() -> nn.Module:
    """A conv with torch's weight_norm parametrization (wav2vec2's positional
    conv), and a linear with a user parametrization."""
    m = nn.Sequential(nn.Conv1d(4, 4, 3), nn.Linear(4, 4))
    nn.utils.parametrizations.weight_norm(m[0], name="weight", dim=2)
    parametrize.register_parametrization(m[1], "weight", Symmetric())
    return m


def test_parametrizations_are_checked_under_the_names_of_their_stored_tensors() -> None:
    with torch.device("meta"):
        meta = weight_normed()
    built = weights_manifest(to_empty_keeping_aliases(meta, "cpu"))
    names = [e["name"] for e in built]
    assert names == [
        "0.bias",
        "0.parametrizations.weight.original0",
        "0.parametrizations.weight.original1",
        "1.bias",
        "1.parametrizations.weight.original",
    ]
    assert manifest_mismatch(built, weights_manifest(weight_normed())) is None
    # A node module without the parametrization stores the weight itself: refused.
    plain = nn.Sequential(nn.Conv1d(4, 4, 3), nn.Linear(4, 4))
    why = manifest_mismatch(built, weights_manifest(plain))
    assert why == (
        "0.parametrizations.weight.original0: the module has no such parameter, "
        "the artifact was built for float32[1,1,3]"
    )


def test_a_tied_parametrized_weight_stays_tied() -> None:
    def build() -> nn.Module:
        m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        parametrize.register_parametrization(m[0], "weight", Symmetric())
        m[1].parametrizations = m[0].parametrizations  # one ParametrizationList, two owners
        return m

    real = build()
    with torch.device("meta"):
        meta = build()
    built = to_empty_keeping_aliases(meta, "cpu")
    assert built[1].parametrizations.weight.original is built[0].parametrizations.weight.original
    assert manifest_mismatch(weights_manifest(built), weights_manifest(real)) is None


def test_zero_unloaded_zeroes_indices_and_what_no_checkpoint_holds() -> None:
    m = meta_built(SharedBuffer)
    with torch.no_grad():
        m.a.weight.fill_(3.0)
    m.position_ids.fill_(2**40)  # what uninitialised memory can hold: an index out of range
    counts = nn.Parameter(torch.full((3,), 7, dtype=torch.int64), requires_grad=False)
    m.register_parameter("counts", counts)
    zeroed = zero_unloaded(m)
    assert sorted(zeroed) == ["counts", "position_ids"]
    assert int(m.position_ids.abs().max()) == 0 and int(m.counts.abs().max()) == 0
    assert float(m.a.weight[0, 0]) == 3.0  # persistent float weights: the checkpoint's


def test_gpt2_built_on_meta_fits_the_real_gpt2_a_node_loads() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=100, n_positions=32, n_embd=16, n_layer=1, n_head=2)
    real = transformers.GPT2LMHeadModel(config)
    assert real.lm_head.weight is real.transformer.wte.weight
    with torch.device("meta"):
        meta = transformers.GPT2LMHeadModel(config)
    built = weights_manifest(to_empty_keeping_aliases(meta, "cpu"))
    assert next(e for e in built if e["name"] == "lm_head.weight")["tensor"] == (
        "transformer.wte.weight"
    )
    check_weights(real, built)
