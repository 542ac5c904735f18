"""GPT-style decoder: token embedding, learned or rotary positions, causal pre-norm blocks."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from fedbasin.alignment.adapters import Inputs

from .layers import Block, init_weights, make_norm
from .registry import NativeFamily


@dataclass
class GPTConfig:
    vocab_size: int = 65
    block_size: int = 64
    dim: int = 64
    depth: int = 2
    heads: int = 4
    mlp_dim: int = 256
    norm: str = "layernorm"  # layernorm | rmsnorm
    activation: str = "gelu"  # gelu | relu | swiglu
    bias: bool = True
    position: str = "learned"  # learned | rope
    tie_embeddings: bool = False
    norm_eps: float | None = None  # None: LayerNorm 1e-5, RMSNorm 1e-6 (0 makes width embedding exact)


class GPT(nn.Module):
    """logits = head(N_f(h)), h = blocks(tok_emb[ids] (+ pos_emb)); causal attention."""

    family = "gpt"

    def __init__(self, config: GPTConfig, seed: int = 0):
        super().__init__()
        c = self.config = config
        if c.position not in ("learned", "rope"):
            raise ValueError(f"position must be 'learned' or 'rope', got {c.position!r}")
        self.tok_emb = nn.Embedding(c.vocab_size, c.dim)
        self.pos_emb = nn.Embedding(c.block_size, c.dim) if c.position == "learned" else None
        rope_len = c.block_size if c.position == "rope" else 0
        self.blocks = nn.ModuleList(
            Block(c.dim, c.heads, c.mlp_dim, c.norm, c.activation, c.bias, causal=True, rope_len=rope_len,
                  norm_eps=c.norm_eps)
            for _ in range(c.depth)
        )
        self.norm_f = make_norm(c.norm, c.dim, c.bias, c.norm_eps)
        self.head = nn.Linear(c.dim, c.vocab_size, bias=False)
        init_weights(self, seed)
        if c.tie_embeddings:
            self.head.weight = self.tok_emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.shape[1] > self.config.block_size:
            raise ValueError(f"sequence length {ids.shape[1]} exceeds block_size {self.config.block_size}")
        x = self.tok_emb(ids)
        if self.pos_emb is not None:
            x = x + self.pos_emb.weight[: ids.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm_f(x))


def _inputs(c: GPTConfig) -> Inputs:
    """Token (and learned position) embeddings feed the residual stream; the head may share the token embedding."""
    return Inputs(
        residual=(("tok_emb.weight", 1),) + ((("pos_emb.weight", 1),) if c.position == "learned" else ()),
        tied=(("tok_emb.weight", "head.weight"),) if c.tie_embeddings else (),
        embedding_keys=("tok_emb.weight",),
    )


FAMILY = NativeFamily("gpt", GPT, GPTConfig, data="text", data_fields=("vocab_size", "block_size"), inputs=_inputs,
                      tie=("tok_emb.weight", "head.weight", "tie_embeddings"))
