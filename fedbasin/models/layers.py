"""Building blocks shared by the ViT and the GPT: pre-norm Transformer block.

State-dict layout (the "standard layout" every symmetry spec refers to), torch ``nn.Linear``
convention ``weight`` of shape (out, in):

    norm1.{weight,bias}   attn.{q,k,v}.{weight,bias} (H*d_h, d)   attn.o.{weight,bias} (d, H*d_h)
    norm2.{weight,bias}   mlp.{up,gate}.{weight,bias} (n, d)      mlp.down.{weight,bias} (d, n)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

NORMS = ("layernorm", "rmsnorm")
ACTIVATIONS = ("gelu", "relu", "swiglu")


class RMSNorm(nn.Module):
    """``y = x / sqrt(mean(x²) + eps) * γ`` (no bias, no centring)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


NORM_EPS = {"layernorm": 1e-5, "rmsnorm": 1e-6}  # defaults when a config's norm_eps is None


def make_norm(kind: str, dim: int, bias: bool, eps: float | None = None) -> nn.Module:
    """LayerNorm or RMSNorm of width ``dim``; ``eps=None`` takes the kind's default (``NORM_EPS``)."""
    if kind in NORM_EPS and eps is None:
        eps = NORM_EPS[kind]
    if kind == "layernorm":
        return nn.LayerNorm(dim, eps=eps, bias=bias)
    if kind == "rmsnorm":
        return RMSNorm(dim, eps=eps)
    raise ValueError(f"norm must be one of {NORMS}, got {kind!r}")


def rope_tables(seq_len: int, head_dim: int, base: float = 10000.0, dtype=torch.float32):
    """cos/sin tables (seq_len, head_dim/2) for rotary positions; plane j pairs dims j and j+d_h/2."""
    inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.arange(seq_len, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each plane (x_j, x_{j+d_h/2}) of x (B, H, T, d_h) by the position's angle."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    cos, sin = cos[: x.shape[-2]].to(x.dtype), sin[: x.shape[-2]].to(x.dtype)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, bias: bool, causal: bool, rope_len: int = 0):
        super().__init__()
        if dim % heads:
            raise ValueError(f"width {dim} is not divisible by {heads} heads")
        self.heads, self.head_dim, self.causal = heads, dim // heads, causal
        self.q = nn.Linear(dim, dim, bias=bias)
        self.k = nn.Linear(dim, dim, bias=bias)
        self.v = nn.Linear(dim, dim, bias=bias)
        self.o = nn.Linear(dim, dim, bias=bias)
        self.rope_len = rope_len
        if rope_len:
            if self.head_dim % 2:
                raise ValueError("rotary positions need an even head width")
            cos, sin = rope_tables(rope_len, self.head_dim)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        split = lambda t: t.view(B, T, self.heads, self.head_dim).transpose(1, 2)  # noqa: E731
        q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
        if self.rope_len:
            q, k = apply_rope(q, self.rope_cos, self.rope_sin), apply_rope(k, self.rope_cos, self.rope_sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return self.o(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int, activation: str, bias: bool):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
        self.activation = activation
        self.up = nn.Linear(dim, hidden, bias=bias)
        self.gate = nn.Linear(dim, hidden, bias=bias) if activation == "swiglu" else None
        self.down = nn.Linear(hidden, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.activation == "swiglu":
            h = F.silu(self.gate(x)) * self.up(x)
        elif self.activation == "relu":
            h = F.relu(self.up(x))
        else:
            h = F.gelu(self.up(x))
        return self.down(h)


class Block(nn.Module):
    """Pre-norm block: ``h += Attn(N1(h)); h += MLP(N2(h))``."""

    def __init__(self, dim, heads, mlp_dim, norm, activation, bias, causal, rope_len=0, norm_eps=None):
        super().__init__()
        self.norm1 = make_norm(norm, dim, bias, norm_eps)
        self.attn = Attention(dim, heads, bias, causal, rope_len)
        self.norm2 = make_norm(norm, dim, bias, norm_eps)
        self.mlp = MLP(dim, mlp_dim, activation, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


def init_weights(model: nn.Module, seed: int, std: float = 0.02) -> None:
    """Seeded GPT-2-style init: weights ~ N(0, std²), biases 0, norm gains 1. The normal draws
    are made in float64 and rounded to the parameter's dtype: float32 draws go through vectorised
    transcendental kernels whose last bits depend on the CPU (AVX2 vs AVX-512 vs scalar), so the
    same seed would give slightly different models on different machines."""
    generator = torch.Generator().manual_seed(seed)
    norms = {id(m) for m in model.modules() if isinstance(m, (nn.LayerNorm, RMSNorm))}
    with torch.no_grad():
        for module in model.modules():
            for name, p in module.named_parameters(recurse=False):
                if id(module) in norms:
                    p.fill_(1.0 if name == "weight" else 0.0)
                elif name == "bias":
                    p.zero_()
                else:
                    p.copy_(torch.randn(p.shape, generator=generator, dtype=torch.float64) * std)
