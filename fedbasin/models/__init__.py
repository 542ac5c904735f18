"""fedbasin model families (one readable file each) and a family registry (:mod:`.registry`)."""

from __future__ import annotations

from dataclasses import asdict

from torch import nn

from . import gpt, vit
from .gpt import GPT, GPTConfig
from .registry import NativeFamily, family, family_of, names, register
from .vit import ViT, ViTConfig

for _entry in (vit.FAMILY, gpt.FAMILY):  # the order of --model's choices
    register(_entry)

#: family → (module class, config class), for callers that only need the classes
FAMILIES: dict[str, tuple[type[nn.Module], type]] = {name: (family(name).model, family(name).config) for name in names()}


def make_config(family_name: str, values: dict | None = None):
    """Config dataclass of ``family_name`` from a dict; unknown fields raise naming the field."""
    return family(family_name).make_config(values)


def build_model(family_name: str, config=None, seed: int = 0) -> nn.Module:
    """Instantiate a fedbasin model; ``config`` is a dataclass, a dict or None (defaults)."""
    entry = family(family_name)
    if config is None or isinstance(config, dict):
        config = entry.make_config(config)
    return entry.build(config, seed=seed)


def config_dict(config) -> dict:
    return asdict(config)


__all__ = ["GPT", "GPTConfig", "ViT", "ViTConfig", "FAMILIES", "NativeFamily", "build_model", "config_dict", "family",
           "family_of", "make_config", "names", "register"]
