"""The family registry: :class:`Family` (how one Hugging Face ``model_type`` is read, written and
aligned) and the ``model_type`` → family table that each family module fills by :func:`register`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable

from ..spec import SymmetrySpec


def _same(state: dict, config=None) -> dict:
    return dict(state)


def _key_same(key: str) -> str:
    return key


@dataclass(frozen=True)
class Family:
    """How fedbasin reads, writes and aligns one Hugging Face ``model_type``.

    classes: ``config.model_type`` → (model class, config class) names in transformers, e.g.
        ``{"llama": ("LlamaForCausalLM", "LlamaConfig")}``; one family may serve several types.
    spec: config → :class:`SymmetrySpec` over the standard layout (raises ``ValueError`` for
        configs whose symmetries it does not cover).
    to_standard, from_standard: ``(state, config) → state``, module layout (``model.state_dict()``
        keys) ↔ standard layout; ``from_standard(to_standard(sd)) == sd``. Default: the module
        layout is standard.
    from_file_key, to_file_key: key renames between what ``save_pretrained`` writes and the
        module layout (ViT's transformers-4 names); default unchanged.
    ignored_file_keys: regexes of stored keys the class ignores on load (legacy buffers).
    tie: (embedding, head) module keys shared when ``config.tie_word_embeddings`` is true.
    """

    classes: dict[str, tuple[str, str]]
    spec: Callable[[object], SymmetrySpec]
    to_standard: Callable[[dict, object], dict] = _same
    from_standard: Callable[[dict, object], dict] = _same
    from_file_key: Callable[[str], str] = _key_same
    to_file_key: Callable[[str], str] = _key_same
    ignored_file_keys: tuple[str, ...] = ()
    tie: tuple[str, str] | None = None
    notes: dict = field(default_factory=dict)

    @property
    def model_types(self) -> tuple[str, ...]:
        return tuple(self.classes)

    def ignores(self, key: str) -> bool:
        return any(re.search(pattern, key) for pattern in self.ignored_file_keys)


_REGISTRY: dict[str, Family] = {}


def register(entry: Family) -> Family:
    for model_type in entry.model_types:
        if model_type in _REGISTRY:
            raise ValueError(f"model_type {model_type!r} is registered twice")
        _REGISTRY[model_type] = entry
    return entry


def supported() -> list[str]:
    """Every registered ``model_type``, sorted."""
    return sorted(_REGISTRY)


def family(model_type) -> Family:
    """The registered family of ``model_type`` (``ValueError`` naming the supported ones)."""
    if model_type not in _REGISTRY:
        raise ValueError(
            f"no fedbasin adapter for Hugging Face model_type {model_type!r}; supported: {supported()}"
        )
    return _REGISTRY[model_type]
