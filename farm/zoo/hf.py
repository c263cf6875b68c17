"""A real architecture from the ``transformers`` package: Llama from a small
config, random weights, nothing downloaded.

The wrapper returns logits only (``use_cache=False``): a KV cache object in
the output would be state the artifact's caller has to thread through, which
is a different program than the one users serve for a forward pass.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class LlamaLogits(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, use_cache=False).logits


# Real configs' shapes (config.json of the published checkpoints; nothing is
# downloaded): Llama-3-70B, and Llama-3.1-405B's 126 layers of hidden 16384.
PRESETS: dict[str, dict[str, Any]] = {
    "70b": {"vocab": 128256, "hidden": 8192, "layers": 80, "heads": 64, "kv_heads": 8,
            "intermediate": 28672, "max_positions": 8192, "rope_theta": 500000.0},
    "405b": {"vocab": 128256, "hidden": 16384, "layers": 126, "heads": 128, "kv_heads": 8,
             "intermediate": 53248, "max_positions": 131072, "rope_theta": 500000.0},
}


def llama_preset(preset: str = "70b", *, dtype: str = "bfloat16") -> nn.Module:
    """``llama`` with a published model's shape (``PRESETS``); build it on the
    meta device (the trace stage does), never for real."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; known: {', '.join(PRESETS)}")
    return llama(**PRESETS[preset], dtype=dtype)


def llama(
    *,
    vocab: int = 32000,
    hidden: int = 1024,
    layers: int = 4,
    heads: int = 16,
    kv_heads: int = 4,
    intermediate: int = 2816,
    max_positions: int = 2048,
    rope_theta: float = 10000.0,
    dtype: str = "bfloat16",
) -> nn.Module:
    """``transformers.LlamaForCausalLM`` with a small config; input ``int64[B,T]``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    fields: dict[str, Any] = {
        "vocab_size": vocab,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "intermediate_size": intermediate,
        "max_position_embeddings": max_positions,
        "rope_theta": rope_theta,
        "attn_implementation": "sdpa",
        "torch_dtype": getattr(torch, dtype),
    }
    config = LlamaConfig(**fields)
    model = LlamaForCausalLM(config).to(getattr(torch, dtype))
    return LlamaLogits(model)
