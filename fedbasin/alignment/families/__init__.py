"""Hugging Face model families: one small module per family, found through one registry.

A family module declares a :class:`Family`: the transformers class and config class it reads
and writes, its symmetry table (a :class:`~fedbasin.alignment.families.table.Table` of
standard-layout names plus the config fields that size it), and its key/layout translation
(module layout ↔ standard layout, file layout ↔ module layout). I/O code (``hf.py``,
``fedbasin.checkpoint``) asks :func:`family` and never branches on a model type.

Adding a family = one module here that calls :func:`register` (and an import line below). The
registry itself lives in ``registry.py``, which the family modules import (no cycle through this package).
"""

from __future__ import annotations

from . import gpt2, gpt_neox, llama, phi, vit  # noqa: F401  (each module registers its family)
from .registry import Family, family, register, supported, trainable

__all__ = ["Family", "family", "register", "supported", "trainable"]
