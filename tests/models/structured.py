"""Models called with keyword and structured inputs, for the farm's end-to-end
tests of named input specs (``input_ids=int64[1,16]``, ``batch.x=float32[4,8]``).

``hf_llama`` is ``transformers``' own ``LlamaForCausalLM`` from a small config
(nothing downloaded), called as users call it: ``model(input_ids=...,
attention_mask=...)``, returning its ``CausalLMOutputWithPast``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

VOCAB = 128


def hf_llama(layers: int = 2) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    fields: dict[str, Any] = {
        "vocab_size": VOCAB, "hidden_size": 64, "num_hidden_layers": layers,
        "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
        "max_position_embeddings": 256, "attn_implementation": "sdpa",
        # A KV cache in the output is state the caller threads through: a
        # different program from the forward pass served here.
        "use_cache": False,
    }
    config = LlamaConfig(**fields)
    return LlamaForCausalLM(config)


class DictModel(nn.Module):
    """``forward(batch)`` with a dict of tensors, returning a dict."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        self.gate = nn.Linear(dim, 1)

    def forward(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        h = self.proj(batch["x"]) * batch["mask"]
        return {"hidden": h, "score": self.gate(h).squeeze(-1) + batch["bias"]}


def dict_model() -> DictModel:
    return DictModel()
