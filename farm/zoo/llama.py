"""A Llama-shaped decoder in plain torch: RMSNorm, rotary embeddings, grouped-query
attention (``n_kv_heads`` < ``n_heads``) and a SwiGLU MLP.

Written for weight-free building: the module holds Parameters only, no buffers.
The rotary tables are computed inside ``forward`` from Python constants, so
``rope_theta`` reaches the captured graph (and the fingerprint) as a constant,
and a model built on the meta device and materialised with ``to_empty()`` needs
no buffer values restored to be correct.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

# Named shapes; ``llama(preset=...)`` starts from one and keyword arguments override it.
PRESETS: dict[str, dict[str, Any]] = {
    # Small enough for unit tests: traces in well under a second.
    "tiny": {
        "vocab": 256,
        "dim": 64,
        "n_layers": 2,
        "n_heads": 4,
        "n_kv_heads": 2,
        "ffn_dim": 160,
    },
    # Llama-2/3-70B shape: 80 layers, hidden 8192, 64 query and 8 key-value heads.
    "70b": {
        "vocab": 32000,
        "dim": 8192,
        "n_layers": 80,
        "n_heads": 64,
        "n_kv_heads": 8,
        "ffn_dim": 28672,
    },
    # Llama-3.1-405B shape: 126 layers, hidden 16384, 128 query and 8 key-value heads.
    "405b": {
        "vocab": 128256,
        "dim": 16384,
        "n_layers": 126,
        "n_heads": 128,
        "n_kv_heads": 8,
        "ffn_dim": 53248,
    },
}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, *, eps: float, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 as the reference implementation does: bf16 variance
        # loses too much precision.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return h.to(x.dtype) * self.weight


def rotary_tables(
    seq_len: int, head_dim: int, *, theta: float, device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables, each [seq_len, head_dim // 2]."""
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    )
    t = torch.arange(seq_len, device=device, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq)
    return freqs.cos().to(dtype), freqs.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs of x [batch, heads, seq, head_dim] (the half-split convention)."""
    x1, x2 = x.chunk(2, dim=-1)
    cos = cos[None, None]
    sin = sin[None, None]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Attention(nn.Module):
    def __init__(
        self, dim: int, n_heads: int, n_kv_heads: int, *, dtype: torch.dtype | None
    ) -> None:
        super().__init__()
        if dim % n_heads:
            raise ValueError(f"dim {dim} is not a multiple of n_heads {n_heads}")
        if n_heads % n_kv_heads:
            raise ValueError(f"n_heads {n_heads} is not a multiple of n_kv_heads {n_kv_heads}")
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads
        self.head_dim = dim // n_heads
        kv_dim = n_kv_heads * self.head_dim
        self.wq = nn.Linear(dim, dim, bias=False, dtype=dtype)
        self.wk = nn.Linear(dim, kv_dim, bias=False, dtype=dtype)
        self.wv = nn.Linear(dim, kv_dim, bias=False, dtype=dtype)
        self.wo = nn.Linear(dim, dim, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q = apply_rotary(q, cos, sin)
        k = apply_rotary(k, cos, sin)
        # Expand kv heads explicitly rather than SDPA's enable_gqa, which torch 2.11's
        # CPU math path and some backends do not all accept.
        rep = self.n_heads // self.n_kv_heads
        if rep > 1:
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, ffn_dim: int, *, dtype: torch.dtype | None) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, ffn_dim, bias=False, dtype=dtype)
        self.w3 = nn.Linear(dim, ffn_dim, bias=False, dtype=dtype)
        self.w2 = nn.Linear(ffn_dim, dim, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(
        self,
        dim: int,
        n_heads: int,
        n_kv_heads: int,
        ffn_dim: int,
        *,
        eps: float,
        dtype: torch.dtype | None,
    ) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(dim, eps=eps, dtype=dtype)
        self.attn = Attention(dim, n_heads, n_kv_heads, dtype=dtype)
        self.ffn_norm = RMSNorm(dim, eps=eps, dtype=dtype)
        self.ffn = FeedForward(dim, ffn_dim, dtype=dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.ffn(self.ffn_norm(x))


class Llama(nn.Module):
    """Token ids [batch, seq] (int64) -> logits [batch, seq, vocab]."""

    def __init__(
        self,
        *,
        vocab: int,
        dim: int,
        n_layers: int,
        n_heads: int,
        n_kv_heads: int,
        ffn_dim: int,
        eps: float = 1e-5,
        rope_theta: float = 10000.0,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.head_dim = dim // n_heads
        self.rope_theta = rope_theta
        self.embed = nn.Embedding(vocab, dim, dtype=dtype)
        self.layers = nn.ModuleList(
            Block(dim, n_heads, n_kv_heads, ffn_dim, eps=eps, dtype=dtype) for _ in range(n_layers)
        )
        self.norm = RMSNorm(dim, eps=eps, dtype=dtype)
        self.output = nn.Linear(dim, vocab, bias=False, dtype=dtype)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        cos, sin = rotary_tables(
            tokens.shape[1], self.head_dim, theta=self.rope_theta, device=h.device, dtype=h.dtype
        )
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.output(self.norm(h))


def llama(
    *,
    preset: str | None = None,
    vocab: int | None = None,
    dim: int | None = None,
    n_layers: int | None = None,
    n_heads: int | None = None,
    n_kv_heads: int | None = None,
    ffn_dim: int | None = None,
    eps: float = 1e-5,
    rope_theta: float = 10000.0,
    dtype: str = "bfloat16",
) -> Llama:
    """Factory (``farm.zoo.llama:llama``). Without a preset every shape argument but
    ``vocab`` (default 32000) is required; with one, given arguments override it."""
    base: dict[str, Any] = {}
    if preset is not None:
        if preset not in PRESETS:
            raise ValueError(f"unknown llama preset {preset!r}; known: {', '.join(PRESETS)}")
        base = dict(PRESETS[preset])
    given = {
        "vocab": vocab,
        "dim": dim,
        "n_layers": n_layers,
        "n_heads": n_heads,
        "n_kv_heads": n_kv_heads,
        "ffn_dim": ffn_dim,
    }
    base.update({k: v for k, v in given.items() if v is not None})
    base.setdefault("vocab", 32000)
    if base.get("n_heads") is not None:
        base.setdefault("n_kv_heads", base["n_heads"])
    missing = sorted(k for k in given if base.get(k) is None)
    if missing:
        raise ValueError(f"llama() needs {', '.join(missing)} (or a preset: {', '.join(PRESETS)})")
    torch_dtype = getattr(torch, dtype, None)
    if not isinstance(torch_dtype, torch.dtype) or not torch_dtype.is_floating_point:
        raise ValueError(f"llama() dtype must be a floating torch dtype name, got {dtype!r}")
    return Llama(eps=eps, rope_theta=rope_theta, dtype=torch_dtype, **base)


def tiny(**overrides: Any) -> Llama:
    """The test shape (``farm.zoo.llama:tiny``)."""
    return llama(preset="tiny", **overrides)


def llama_70b(**overrides: Any) -> Llama:
    """The 70B shape (``farm.zoo.llama:llama_70b``); build it on meta, never for real."""
    return llama(preset="70b", **overrides)


def param_count(
    *, vocab: int, dim: int, n_layers: int, n_heads: int, n_kv_heads: int, ffn_dim: int
) -> int:
    """Closed-form parameter count, to check a trace's count against."""
    kv_dim = n_kv_heads * (dim // n_heads)
    per_layer = 2 * dim * dim + 2 * dim * kv_dim + 3 * dim * ffn_dim + 2 * dim
    return 2 * vocab * dim + n_layers * per_layer + dim


__all__ = ["PRESETS", "Llama", "llama", "llama_70b", "param_count", "tiny"]
