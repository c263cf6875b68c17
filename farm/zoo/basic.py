"""Small plain-torch models: the demo transformer, the benchmark transformer from
DESIGN.md, and an MLP whose ``forward`` is wrapped by a decorator.

Every model here is fullgraph-compilable, holds Parameters only (no buffers, so
a meta-built module materialised with ``to_empty()`` needs nothing restored), and
takes float inputs, so an input spec alone is enough to call it:

    farm.zoo.basic:mlp                 float32[B, d_in]
    farm.zoo.basic:small_transformer   <dtype>[B, T, dim]
    farm.zoo.basic:bench_transformer   bfloat16[8, 512, 1024]
    farm.zoo.basic:decorated_mlp       float32[B, d_in]
    farm.zoo.basic:literal_mlp         float32[B, d_in] (no AOTI package: a tensor literal)
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from torch import nn

_F = TypeVar("_F", bound=Callable[..., Any])


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


class MLP(nn.Module):
    def __init__(self, d_in: int, hidden: int, d_out: int, *, dtype: torch.dtype) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden, dtype=dtype)
        self.fc2 = nn.Linear(hidden, d_out, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


def mlp(*, d_in: int = 64, hidden: int = 128, d_out: int = 64, dtype: str = "float32") -> MLP:
    """Two linear layers with a GELU: input ``[B, d_in]``."""
    return MLP(d_in, hidden, d_out, dtype=_dtype(dtype))


class Block(nn.Module):
    """Pre-norm transformer block: self-attention (SDPA) and a GELU MLP."""

    def __init__(self, dim: int, heads: int, *, causal: bool, dtype: torch.dtype) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim {dim} is not a multiple of heads {heads}")
        self.heads = heads
        self.causal = causal
        self.norm1 = nn.LayerNorm(dim, dtype=dtype)
        self.qkv = nn.Linear(dim, 3 * dim, dtype=dtype)
        self.proj = nn.Linear(dim, dim, dtype=dtype)
        self.norm2 = nn.LayerNorm(dim, dtype=dtype)
        self.fc1 = nn.Linear(dim, 4 * dim, dtype=dtype)
        self.fc2 = nn.Linear(4 * dim, dim, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(d, dim=-1)
        # [B, T, D] -> [B, H, T, D/H]
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class Transformer(nn.Module):
    """A stack of blocks over hidden states ``[B, T, dim]`` (no embedding table, so
    the input spec is all the farm needs to call it)."""

    def __init__(
        self, *, layers: int, dim: int, heads: int, causal: bool, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            Block(dim, heads, causal=causal, dtype=dtype) for _ in range(layers)
        )
        self.norm = nn.LayerNorm(dim, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.norm(x)


def small_transformer(
    *, layers: int = 2, dim: int = 128, heads: int = 4, dtype: str = "float32",
    causal: bool = True,
) -> Transformer:
    """The demo model: input ``[B, T, dim]`` of ``dtype``."""
    return Transformer(layers=layers, dim=dim, heads=heads, causal=causal, dtype=_dtype(dtype))


def bench_transformer(
    *, layers: int = 8, dim: int = 1024, heads: int = 16, dtype: str = "bfloat16"
) -> Transformer:
    """DESIGN.md's benchmark model: 8 layers, d=1024, bf16; called with
    ``bfloat16[8,512,1024]``. Too slow for CPU tests: use ``small_transformer``."""
    return Transformer(layers=layers, dim=dim, heads=heads, causal=True, dtype=_dtype(dtype))


def _logged(fn: _F) -> _F:
    """A typical real-world decorator: the wrapper closes over ``fn``, so dynamo
    guards on the closure (CLOSURE_MATCH), a guard that cannot be serialized."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


class DecoratedMLP(MLP):
    @_logged
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)


def decorated_mlp(
    *, d_in: int = 64, hidden: int = 128, d_out: int = 64, dtype: str = "float32"
) -> DecoratedMLP:
    """``mlp`` with a decorated ``forward``: saves only with a guard filter that
    drops the unserializable closure guards."""
    return DecoratedMLP(d_in, hidden, d_out, dtype=_dtype(dtype))


class ScaledMLP(MLP):
    """``mlp`` whose forward uses a tensor literal: torch.export lifts it to an
    unnamed constant, which a weight-free AOTI package cannot get from the node."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = torch.tensor([2.0], dtype=x.dtype, device=x.device)
        return super().forward(x) * scale


def literal_mlp(*, d_in: int = 64, hidden: int = 128, d_out: int = 64) -> ScaledMLP:
    return ScaledMLP(d_in, hidden, d_out, dtype=torch.float32)
