"""fedbasin's own model families, registered like the Hugging Face ones (:mod:`fedbasin.alignment.families`).

A model module (``gpt.py``, ``vit.py``) declares a :class:`NativeFamily`: its module and config
classes, what data it reads and which config fields that data fixes, its tie, and the input side
of its symmetry spec. :func:`register` records it and hands the spec part to
:func:`fedbasin.alignment.adapters.fedbasin_adapter`; checkpoint I/O (:mod:`fedbasin.formats`) and the
CLI ask :func:`family` and never branch on a family name.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Callable

from torch import nn

from fedbasin.alignment.adapters import Inputs, register_native

DATA_KINDS = ("text", "images")


@dataclass(frozen=True)
class NativeFamily:
    """One fedbasin model family.

    name: the family's name (``"gpt"``), written as ``"fedbasin_family"`` in ``config.json``.
    model, config: the ``nn.Module`` class (built as ``model(config, seed=seed)``) and its config dataclass.
    data: what the model reads: ``"text"`` (token ids → next-token logits) or ``"images"``
        (pixels → class logits).
    data_fields: the config fields the data fixes (``vocab_size``, ``block_size``, the context
        length, for text; ``image_size``, ``channels``, ``num_classes`` for images).
    inputs: config → :class:`~fedbasin.alignment.adapters.Inputs`, the family's part of its
        symmetry spec (embeddings, ties).
    tie: (embedding, head, config flag): the head shares the embedding when the flag is true.
    """

    name: str
    model: type[nn.Module]
    config: type
    data: str
    data_fields: tuple[str, ...]
    inputs: Callable[[object], Inputs]
    tie: tuple[str, str, str] | None = None

    def __post_init__(self):
        if self.data not in DATA_KINDS:
            raise ValueError(f"{self.name}: data {self.data!r} is not one of {DATA_KINDS}")

    def make_config(self, values: dict | None = None):
        """Config dataclass from a dict; unknown fields raise naming the field."""
        values = dict(values or {})
        known = {f.name for f in fields(self.config)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown {self.name} config field(s) {unknown}; known: {sorted(known)}")
        for f in fields(self.config):  # a value of the default's type (an int where a float is expected)
            kind = type(f.default)
            if f.name not in values or kind not in (bool, int, float, str):
                continue
            value = values[f.name]
            if not (type(value) is kind or (kind is float and type(value) is int)):
                raise ValueError(f"{self.name} config field {f.name} is {value!r}; expected {kind.__name__}")
            if kind is int and value < 1:  # every integer field is a size or a count
                raise ValueError(f"{self.name} config field {f.name} is {value}; expected a positive integer")
        return self.config(**values)

    def build(self, config, seed: int = 0) -> nn.Module:
        return self.model(config, seed=seed)

    def data_values(self, config) -> dict:
        """The fields the data fixes (``{"vocab_size": …, "block_size": …}``)."""
        return {name: getattr(config, name) for name in self.data_fields}

    def context_length(self, config) -> int | None:
        """Tokens per example the model takes (None for a model without one, e.g. a ViT)."""
        return int(config.block_size) if "block_size" in self.data_fields else None

    def tied_pairs(self, config) -> list[tuple[str, str, str]]:
        """(embedding, head, config flag) for the tie the config declares, if any."""
        return [self.tie] if self.tie and getattr(config, self.tie[2]) else []


_REGISTRY: dict[str, NativeFamily] = {}


def register(entry: NativeFamily) -> NativeFamily:
    if entry.name in _REGISTRY:
        raise ValueError(f"fedbasin family {entry.name!r} is registered twice")
    register_native(entry.name, entry.inputs)
    _REGISTRY[entry.name] = entry
    return entry


def names() -> list[str]:
    """Every registered family, in registration order."""
    return list(_REGISTRY)


def family(name) -> NativeFamily:
    """The registered family ``name`` (``ValueError`` naming the known ones)."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown model family {name!r}; known: {sorted(_REGISTRY)}")
    return _REGISTRY[name]


def family_of(config) -> NativeFamily | None:
    """The family whose config class ``config`` is an instance of (None: not a fedbasin config)."""
    return next((f for f in _REGISTRY.values() if isinstance(config, f.config)), None)
