"""fedbasin model families (one readable file each) and a family registry."""

from __future__ import annotations

from dataclasses import asdict, fields

from torch import nn

from .gpt import GPT, GPTConfig
from .vit import ViT, ViTConfig

FAMILIES: dict[str, tuple[type[nn.Module], type]] = {"vit": (ViT, ViTConfig), "gpt": (GPT, GPTConfig)}


def make_config(family: str, values: dict | None = None):
    """Config dataclass of ``family`` from a dict; unknown fields raise naming the field."""
    if family not in FAMILIES:
        raise ValueError(f"unknown model family {family!r}; known: {sorted(FAMILIES)}")
    config_cls = FAMILIES[family][1]
    values = dict(values or {})
    known = {f.name for f in fields(config_cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"unknown {family} config field(s) {unknown}; known: {sorted(known)}")
    return config_cls(**values)


def build_model(family: str, config=None, seed: int = 0) -> nn.Module:
    """Instantiate a fedbasin model; ``config`` is a dataclass, a dict or None (defaults)."""
    if config is None or isinstance(config, dict):
        config = make_config(family, config)
    return FAMILIES[family][0](config, seed=seed)


def config_dict(config) -> dict:
    return asdict(config)


__all__ = ["GPT", "GPTConfig", "ViT", "ViTConfig", "FAMILIES", "build_model", "make_config", "config_dict"]
