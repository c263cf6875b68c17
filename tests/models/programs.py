"""Tiny programs of the kinds the aot_compile guide describes, for the farm's
end-to-end tests: free functions with the same graph but different results,
a model whose buffers its factory computes, and a token model.

Every entrypoint takes no required arguments (factories) or only tensors
(functions), so a job spec can name it directly.
"""

from __future__ import annotations

import torch
from torch import nn


class Boxed:
    """A user-defined result type: a plain class, not a registered pytree node,
    so Dynamo rebuilds it in the artifact's bytecode and the loaded function
    needs this module's globals (``f_globals``) to return it."""

    def __init__(self, value: torch.Tensor, scale: float) -> None:
        self.value = value
        self.scale = scale

    def __repr__(self) -> str:
        return f"Boxed(value={self.value!r}, scale={self.scale!r})"


def add(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return x + y


def add_boxed(x: torch.Tensor, y: torch.Tensor) -> Boxed:
    # The same graph as add(): one aten add. Only the code around it differs.
    return Boxed(x + y, 2.0)


class Rotary(nn.Module):
    """A Llama-style rotary embedding whose ``inv_freq`` buffer the factory
    computes: no ``reset_parameters`` covers it, so a verifier that zeroes
    uncovered buffers would check cos(0) = 1 everywhere."""

    def __init__(self, dim: int = 16, base: float = 10000.0) -> None:
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(x.shape[1], dtype=torch.float32, device=x.device)
        freqs = torch.outer(pos, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        return self.proj(x) * emb.cos() + x * emb.sin()


def rotary() -> Rotary:
    return Rotary()


class TokenModel(nn.Module):
    """Embedding + head: integer inputs index the table, so verifying on
    token 0 only checks one row."""

    def __init__(self, vocab: int = 97, dim: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids))


def token_model() -> TokenModel:
    return TokenModel()


def _seeded_linear(d: int) -> nn.Linear:
    layer = nn.Linear(d, d)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(d, d, generator=gen) / d**0.5)
        layer.bias.copy_(torch.randn(d, generator=gen))
    return layer


# A module the function below captures: torch cannot pickle it into the
# artifact, so the job declares it as external_data and the node supplies it.
# Seeded, so every process that imports this module holds the same weights.
captured = _seeded_linear(8)


def use_captured(x: torch.Tensor) -> torch.Tensor:
    return captured(x).relu() * 2.0
