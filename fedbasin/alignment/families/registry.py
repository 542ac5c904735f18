"""The family registry: :class:`Family` (how one Hugging Face ``model_type`` is read, written and
aligned) and the ``model_type`` → family table that each family module fills by :func:`register`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable

from ..spec import SymmetrySpec

DATA_KINDS = ("text", "images")


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
    data: what the model reads: ``"text"`` (token ids → next-token logits) or ``"images"``
        (pixels → class logits); the data a command is given must be of this kind.
    data_fields: fedbasin data field → config attribute, for the fields the data fixes
        (``vocab_size`` and ``block_size``, the context length, for text; ``image_size``,
        ``channels``, ``num_classes`` for images). The one place a context length is read.
    config_fields: ``values → config keyword arguments`` for a new model, from fedbasin's shape
        vocabulary (``dim``, ``depth``, ``heads``, ``mlp_dim``; ``patch_size`` for images), with
        every dropout 0; the data fields are added from ``data_fields``. None: fedbasin does not
        build new models of this family (``fedbasin train --model hf-<model_type>``).
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
    data: str = "text"
    data_fields: dict[str, str] = field(
        default_factory=lambda: {"vocab_size": "vocab_size", "block_size": "max_position_embeddings"})
    config_fields: Callable[[dict], dict] | None = None

    def __post_init__(self):
        if self.data not in DATA_KINDS:
            raise ValueError(f"{self.model_types}: data {self.data!r} is not one of {DATA_KINDS}")

    @property
    def model_types(self) -> tuple[str, ...]:
        return tuple(self.classes)

    def data_values(self, config) -> dict:
        """The fields the data fixes, in fedbasin names (``{"vocab_size": …, "block_size": …}``)."""
        return {name: getattr(config, attribute) for name, attribute in self.data_fields.items()}

    def context_length(self, config) -> int | None:
        """Tokens per example the model takes (None for a model without one, e.g. a ViT)."""
        attribute = self.data_fields.get("block_size")
        value = getattr(config, attribute, None) if attribute else None
        return int(value) if value else None

    def config_class(self, model_type: str) -> type:
        """The transformers config class of ``model_type`` (``LlamaConfig``, ...)."""
        import transformers

        return getattr(transformers, self.classes[model_type][1])

    def new_config(self, model_type: str, shape: dict, data: dict):
        """A transformers config of ``model_type`` for a new model: ``data``'s fields (``data_fields``)
        plus ``config_fields`` of ``shape`` (shape names ``shape`` leaves unset take ``data``'s value,
        e.g. an image source's patch size)."""
        if self.config_fields is None:
            raise ValueError(f"fedbasin cannot build a new {model_type} model; trainable: {trainable()}")
        fields = {attribute: data[name] for name, attribute in self.data_fields.items()}
        return self.config_class(model_type)(**fields, **self.config_fields({**data, **shape}))

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


def trainable() -> list[str]:
    """Every registered ``model_type`` whose family builds new models (``config_fields``), sorted."""
    return [t for t in supported() if _REGISTRY[t].config_fields is not None]


def family(model_type) -> Family:
    """The registered family of ``model_type`` (``ValueError`` naming the supported ones)."""
    if model_type not in _REGISTRY:
        raise ValueError(
            f"no fedbasin adapter for Hugging Face model_type {model_type!r}; supported: {supported()}"
        )
    return _REGISTRY[model_type]
