"""Deliberately broken models for tests and fault drills. All tiny.

Each factory takes no required arguments so a job spec can name it directly,
e.g. ``tests.models.broken:graph_break_model`` with input ``float32[4,16]``.
"""

from __future__ import annotations

import ctypes
import functools
import os
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

DIM = 16


class GraphBreakModel(nn.Module):
    """Python control flow on a tensor's value: Dynamo cannot put it in one graph."""

    def __init__(self, dim: int = DIM) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        if y.sum() > 0:  # GRAPH_BREAK_LINE: the tests look for this line number
            y = y * 2
        return y


def graph_break_model(dim: int = DIM) -> nn.Module:
    return GraphBreakModel(dim)


def raising_factory(message: str = "factory failed on purpose") -> nn.Module:
    raise RuntimeError(message)


def hanging_model(seconds: float | None = None) -> nn.Module:
    """Sleeps forever (or ``seconds``): the trace task's time limit must end it."""
    deadline = None if seconds is None else time.monotonic() + seconds
    while deadline is None or time.monotonic() < deadline:
        time.sleep(1.0)
    return nn.Linear(DIM, DIM)


def crashing_model(how: str = "abort") -> nn.Module:
    """Kills its own process: a worker must survive its child dying this way."""
    if how == "segfault":
        ctypes.string_at(0)  # reads address 0: SIGSEGV
    os.abort()  # SIGABRT
    raise AssertionError("unreachable")


def hungry_model(chunk_mb: int = 256) -> nn.Module:
    """Allocates (and touches, so RSS really grows) until something stops it: the
    trace task's memory limit must."""
    hoard: list[bytearray] = []
    while True:
        hoard.append(bytearray(b"\x01" * (chunk_mb << 20)))


def _scaled(scale: float) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            return fn(self, *args, **kwargs) * scale

        return wrapper

    return deco


class DecoratedForwardModel(nn.Module):
    """``forward`` wrapped by a decorator whose closure holds the original function.

    Dynamo guards the closure cell by identity (CLOSURE_MATCH on
    ``type(self).__dict__['forward'].__closure__[0].cell_contents``; older torch
    calls it ID_MATCH), which cannot be serialized: with a keep-all guard filter,
    torch 2.13's ``save_compiled_function`` raises PackageError. (2.13's
    ``aot_compile`` drops such guards itself when given no guard_filter_fn.)"""

    def __init__(self, dim: int = DIM) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    @_scaled(0.5)
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(x))


def decorated_forward_model(dim: int = DIM) -> nn.Module:
    return DecoratedForwardModel(dim)


def mlp(dim: int = DIM, hidden: int = 32, act: str = "relu") -> nn.Module:
    """A healthy two-layer MLP (its knobs change the fingerprint in tests)."""
    acts: dict[str, type[nn.Module]] = {"relu": nn.ReLU, "gelu": nn.GELU, "silu": nn.SiLU}
    return nn.Sequential(nn.Linear(dim, hidden), acts[act](), nn.Linear(hidden, dim))


def linear(in_features: int = 64, out_features: int = 32, bias: bool = False) -> nn.Module:
    """A single Linear, for checking FLOP counts (2*M*N*K)."""
    return nn.Linear(in_features, out_features, bias=bias)


def add_one(x: torch.Tensor) -> torch.Tensor:
    """A free function (``kind='function'``)."""
    return torch.sin(x) + 1


class SpecializingModel(nn.Module):
    """Pins its batch size in Python: marking that dim dynamic must fail the trace."""

    def __init__(self, dim: int = DIM) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 4:
            return self.fc(x) * 2
        return self.fc(x)


def specializing_model(dim: int = DIM) -> nn.Module:
    return SpecializingModel(dim)
