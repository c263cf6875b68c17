"""Models for the training-step and DDP tests: a small MLP regressor whose
job trains it with a loss and an optimizer (model kind ``training_step``)."""

from __future__ import annotations

import torch
from torch import nn


class Regressor(nn.Module):
    def __init__(self, dim: int = 8, hidden: int = 16) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.fc2 = nn.Linear(hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.norm(self.fc1(x))))


def make(dim: int = 8, hidden: int = 16) -> Regressor:
    return Regressor(dim, hidden)
