"""The aot_compile guide's tensor-parallel FeedForward (section 7.1), built by
the farm under options.parallel."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# The guide's plan: linear1 column-wise, linear2 row-wise over a 1-D mesh.
PLAN = {"linear1": "colwise", "linear2": "rowwise"}


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.linear1 = nn.Linear(dim, hidden_dim)
        self.linear2 = nn.Linear(hidden_dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear2(F.relu(self.linear1(x)))


def feed_forward(dim: int = 64, hidden_dim: int = 128) -> FeedForward:
    return FeedForward(dim, hidden_dim)
