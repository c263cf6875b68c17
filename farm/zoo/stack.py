"""A stack of residual layers where one layer can differ: the model of "a new
version that changes one layer" (``bench/build_cost.py``).

    farm.zoo.stack:stack   float32[B, width]

``changed`` (a layer index, -1 for none) gives that layer SiLU instead of GELU:
the graph is the same but for that layer's activation, as when a new version
edits one block of a model.

``distinct=True`` gives each layer a hidden width of its own (``width + 8 *
index``, up and back down): layers that compile to kernels of their own, as
in a model whose blocks differ, where identical layers share one kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Layer(nn.Module):
    def __init__(self, width: int, *, act: str, hidden: int | None = None) -> None:
        super().__init__()
        self.fc = nn.Linear(width, hidden or width)
        self.down = nn.Linear(hidden, width) if hidden else None
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        h = F.silu(h) if self.act == "silu" else F.gelu(h)
        if self.down is not None:
            h = self.down(h)
        return x + h


class Stack(nn.Module):
    def __init__(self, layers: int, width: int, changed: int, distinct: bool = False) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            Layer(width, act="silu" if i == changed else "gelu",
                  hidden=width + 8 * i if distinct else None)
            for i in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def stack(*, layers: int = 16, width: int = 64, changed: int = -1,
          distinct: bool = False) -> Stack:
    """``layers`` residual Linear+GELU layers; layer ``changed`` uses SiLU;
    ``distinct``: each layer of a hidden width of its own."""
    if not -1 <= changed < layers:
        raise ValueError(f"changed must be -1 (none) or a layer index below {layers}, "
                         f"got {changed}")
    return Stack(layers, width, changed, distinct)
