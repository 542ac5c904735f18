"""Vision Transformer: patch embedding, cls token, learned positions, pre-norm blocks."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from fedbasin.alignment.adapters import Inputs

from .layers import Block, init_weights, make_norm
from .registry import NativeFamily


@dataclass
class ViTConfig:
    image_size: int = 8
    patch_size: int = 2
    channels: int = 1
    num_classes: int = 10
    dim: int = 64
    depth: int = 2
    heads: int = 4
    mlp_dim: int = 128
    norm: str = "layernorm"  # layernorm | rmsnorm
    activation: str = "gelu"  # gelu | relu | swiglu
    bias: bool = True
    norm_eps: float | None = None  # None: LayerNorm 1e-5, RMSNorm 1e-6 (0 makes width embedding exact)

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


class ViT(nn.Module):
    """logits = head(N_f(h)[:, 0]), h = blocks([cls; patches] + pos)."""

    family = "vit"

    def __init__(self, config: ViTConfig, seed: int = 0):
        super().__init__()
        c = self.config = config
        if c.image_size % c.patch_size:
            raise ValueError(f"image_size {c.image_size} is not a multiple of patch_size {c.patch_size}")
        self.patch_emb = nn.Conv2d(c.channels, c.dim, c.patch_size, stride=c.patch_size, bias=c.bias)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, c.dim))
        self.pos_emb = nn.Parameter(torch.zeros(1, c.num_patches + 1, c.dim))
        self.blocks = nn.ModuleList(
            Block(c.dim, c.heads, c.mlp_dim, c.norm, c.activation, c.bias, causal=False, norm_eps=c.norm_eps)
            for _ in range(c.depth)
        )
        self.norm_f = make_norm(c.norm, c.dim, c.bias, c.norm_eps)
        self.head = nn.Linear(c.dim, c.num_classes)
        init_weights(self, seed)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.patch_emb(images).flatten(2).transpose(1, 2)  # (B, P, d)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_emb
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm_f(x)[:, 0])


def _inputs(c: ViTConfig) -> Inputs:
    """Patch embedding, cls token and positions feed the residual stream."""
    return Inputs(residual=(("patch_emb.weight", 0), ("cls_token", 2), ("pos_emb", 2))
                  + ((("patch_emb.bias", 0),) if c.bias else ()))


FAMILY = NativeFamily("vit", ViT, ViTConfig, data="images", data_fields=("image_size", "channels", "num_classes"),
                      inputs=_inputs)
