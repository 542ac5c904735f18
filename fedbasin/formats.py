"""Checkpoint formats: how :mod:`fedbasin.checkpoint` reads, writes, checks and builds one model family.

A :class:`ModelFormat` is the one interface checkpoint I/O dispatches through (it never compares
kind strings). There are two implementations, one per kind of ``config.json``:

* :class:`NativeFormat` — a fedbasin family (:mod:`fedbasin.models.registry`: ``"gpt"``, ``"vit"``);
  ``config.json`` is the config dataclass plus ``"fedbasin_family"``.
* :class:`HFFormat` — a Hugging Face ``model_type`` of the family registry
  (:mod:`fedbasin.alignment.families`); ``config.json`` is the ``PretrainedConfig``'s.

:func:`detect` is the one place a ``config.json`` is told apart; :func:`for_kind` finds a format
by kind name (``save_checkpoint(kind=...)``, :attr:`Checkpoint.format`) and :func:`kind_of` the kind
of an in-memory config.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import json
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from .alignment.adapters import Adapter, fedbasin_adapter
from .models import family as native_family
from .models import names as native_names

FAMILY_FIELD = "fedbasin_family"
MODEL_TYPE_FIELD = "model_type"

# fields of Hugging Face configs that change the function without changing any tensor shape
HF_FUNCTION_FIELDS = ("activation_function", "hidden_act", "layer_norm_epsilon", "layer_norm_eps",
                      "scale_attn_weights", "scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn")


def _hf():
    if importlib.util.find_spec("transformers") is None:
        raise ImportError("Hugging Face checkpoints need transformers: pip install 'fedbasin[hf]'")
    from .alignment import hf

    return hf


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a, b)


class ModelFormat:
    """What checkpoint I/O needs of one model family (the format interface).

    kind: ``"fedbasin"`` or ``"hf"`` (reported, and accepted by ``save_checkpoint(kind=...)``).
    family: the family name, or the Hugging Face ``model_type``.
    data: ``"text"`` or ``"images"``; ``data_values(config)``: the config fields the data fixes,
        in fedbasin names; ``context_length(config)``: tokens per example (None for images).
    reads_torch_weights: whether ``pytorch_model.bin`` is read when there is no safetensors file.
    stores_tied_alias: whether the file holds a tied head as well as the embedding it shares
        (fedbasin: yes, the ``state_dict()``; Hugging Face: no, as ``save_pretrained`` writes it).
    """

    kind: str
    family: str
    reads_torch_weights = False
    stores_tied_alias = True

    entry: Any  # the registered family (NativeFamily or the Hugging Face Family): what the model reads

    @property
    def data(self) -> str:
        return self.entry.data

    def data_values(self, config) -> dict:
        return self.entry.data_values(config)

    def context_length(self, config) -> int | None:
        return self.entry.context_length(config)

    # config

    def config_from_json(self, values: dict):
        """The config of a ``config.json`` object (``TypeError``/``ValueError`` for an invalid one)."""
        raise NotImplementedError

    def config_to_save(self, config):
        """The config object of what ``save_checkpoint`` was given (a config or a dict)."""
        raise NotImplementedError

    def config_json(self, config, dtype: torch.dtype | None = None) -> str:
        """The text of ``config.json`` (``dtype``: the weights' dtype, recorded where the format does)."""
        raise NotImplementedError

    def with_updates(self, config, updates: dict):
        """A copy of ``config`` with ``updates`` (``config`` itself when there are none)."""
        raise NotImplementedError

    def function_fields(self, config) -> dict:
        """Config fields that change the function beyond the tensor shapes (compatibility check)."""
        raise NotImplementedError

    # tensors

    def adapter(self, config) -> Adapter:
        raise NotImplementedError

    def expected_shapes(self, config) -> dict[str, tuple[int, ...]]:
        """Key → shape of ``model.state_dict()`` for this config."""
        raise NotImplementedError

    def tied_pairs(self, config) -> list[tuple[str, str, str]]:
        """(source, alias, config field) for each tie the config declares."""
        raise NotImplementedError

    def config_updates(self, config, state: dict) -> dict:
        """Config fields to change so that ``state`` loads faithfully (a tie whose tensors differ is dropped)."""
        updates = {}
        for source, alias, field_name in self.tied_pairs(config):
            a, b = state.get(source), state.get(alias)
            if a is not None and b is not None and a is not b and not same_values(a, b):
                updates[field_name] = False
        return updates

    def state_from_file(self, config, stored: dict) -> dict:
        """Stored tensors → ``state_dict()`` keys."""
        return stored

    def state_to_file(self, config, state: dict) -> dict:
        """``state_dict()`` keys → what is stored."""
        return state

    def lazy_rename(self, config, path: Path) -> Callable[[str], str] | None:
        """Stored key → module key for streamed reading (None: unchanged); raises ``ValueError``
        for checkpoints that cannot be streamed (not stored in the standard layout)."""
        return None

    def ignores(self, key: str) -> bool:
        """Whether a stored key outside the architecture is one the model class ignores on load."""
        return False

    def build(self, config) -> nn.Module:
        """A fresh module of this config (its weights get loaded after)."""
        raise NotImplementedError


class NativeFormat(ModelFormat):
    """A fedbasin family: ``config.json`` is the config dataclass as JSON plus ``"fedbasin_family"``;
    the weights are the model's ``state_dict()``."""

    kind = "fedbasin"

    def __init__(self, name: str):
        self.entry = native_family(name)  # ValueError "unknown model family ..." for an unknown name
        self.family = name

    def config_from_json(self, values: dict):
        return self.entry.make_config({k: v for k, v in values.items() if k != FAMILY_FIELD})

    def config_to_save(self, config):
        return self.entry.make_config(dataclasses.asdict(config) if dataclasses.is_dataclass(config) else config)

    def config_json(self, config, dtype=None) -> str:
        return json.dumps({FAMILY_FIELD: self.family, **dataclasses.asdict(config)}, indent=2)

    def with_updates(self, config, updates: dict):
        return dataclasses.replace(config, **updates) if updates else config

    def function_fields(self, config) -> dict:
        return dataclasses.asdict(config)

    def adapter(self, config) -> Adapter:
        return fedbasin_adapter(self.family, config)

    def expected_shapes(self, config) -> dict[str, tuple[int, ...]]:
        with torch.device("meta"):  # shapes only: no memory, whatever size the config asks for
            return {k: tuple(v.shape) for k, v in self.entry.build(config).state_dict().items()}

    def tied_pairs(self, config) -> list[tuple[str, str, str]]:
        return self.entry.tied_pairs(config)

    def build(self, config) -> nn.Module:
        return self.entry.build(config)


class HFFormat(ModelFormat):
    """A Hugging Face ``model_type``: a directory ``from_pretrained`` loads (``config.json`` with
    ``"model_type"``; ``model.safetensors``, sharded safetensors or ``pytorch_model.bin``, file key
    layout as ``save_pretrained`` writes it). Everything is asked of the registered family
    (:func:`fedbasin.alignment.families.family`, through :mod:`fedbasin.alignment.hf`)."""

    kind = "hf"
    reads_torch_weights = True
    stores_tied_alias = False

    def __init__(self, model_type: str):
        self.family = model_type  # checked where it is used (the family registry names the supported types)

    @property
    def entry(self):
        from .alignment.families import family

        return family(self.family)

    def config_from_json(self, values: dict):
        return _hf().hf_config_class(self.family).from_dict(values)

    def config_to_save(self, config):
        if isinstance(config, dict):
            config = _hf().hf_config_class(self.family).from_dict(config)
        if getattr(config, "model_type", None) != self.family:
            raise ValueError(
                f"family_or_type {self.family!r} does not match the config's model_type "
                f"{getattr(config, 'model_type', None)!r}"
            )
        return config

    def config_json(self, config, dtype=None) -> str:
        config = copy.deepcopy(config)
        config.architectures = [_hf().SUPPORTED_MODEL_TYPES[self.family]]
        if dtype is not None:
            config.dtype = dtype
        return config.to_json_string(use_diff=True)

    def with_updates(self, config, updates: dict):
        if not updates:
            return config
        config = copy.deepcopy(config)
        for key, value in updates.items():
            setattr(config, key, value)
        return config

    def function_fields(self, config) -> dict:
        return {f: getattr(config, f, None) for f in HF_FUNCTION_FIELDS}

    def adapter(self, config) -> Adapter:
        return _hf().hf_adapter(config)

    def expected_shapes(self, config) -> dict[str, tuple[int, ...]]:
        return _hf().hf_expected_shapes(config)

    def tied_pairs(self, config) -> list[tuple[str, str, str]]:
        pair = _hf().hf_tied_pair(config)
        return [(*pair, "tie_word_embeddings")] if pair else []

    def config_updates(self, config, state: dict) -> dict:
        return _hf().hf_config_updates(config, state)

    def state_from_file(self, config, stored: dict) -> dict:
        return _hf().hf_state_from_file(config, stored)

    def state_to_file(self, config, state: dict) -> dict:
        return _hf().hf_state_to_file(config, state)

    def lazy_rename(self, config, path: Path):
        hf = _hf()
        if hf.family(self.family).to_standard.__name__ != "_same":
            raise ValueError(f"{path}: streamed alignment needs checkpoints stored in the standard layout "
                             f"(Llama/Mistral/Qwen2, fedbasin models); {self.family} is not — use `fedbasin align`")
        expected = hf.hf_expected_shapes(config)
        return lambda key: hf.hf_module_key(config, key, expected)

    def ignores(self, key: str) -> bool:
        return self.entry.ignores(key)

    def build(self, config) -> nn.Module:
        return _hf().hf_model_class(self.family)(config)


# ----------------------------------------------------------------------------------------------
# finding a format


def _native_named(name, config_path: Path) -> ModelFormat:
    if name not in native_names():
        raise ValueError(f"{config_path}: unknown {FAMILY_FIELD} {name!r}; known: {sorted(native_names())}")
    return NativeFormat(name)


def _hf_named(model_type, config_path: Path) -> ModelFormat:
    hf = _hf()
    if model_type not in hf.SUPPORTED_MODEL_TYPES:
        raise ValueError(f"{config_path}: unsupported model_type {model_type!r}; "
                         f"supported: {sorted(hf.SUPPORTED_MODEL_TYPES)}")
    return HFFormat(model_type)


#: kind → (its format class, the ``config.json`` field naming the family, the checked look-up),
#: in the order :func:`detect` tries them
KINDS: dict[str, tuple[type[ModelFormat], str, Callable[[object, Path], ModelFormat]]] = {
    NativeFormat.kind: (NativeFormat, FAMILY_FIELD, _native_named),
    HFFormat.kind: (HFFormat, MODEL_TYPE_FIELD, _hf_named),
}


def detect(values: dict, config_path: Path) -> ModelFormat:
    """The format of a ``config.json`` object (the one config detection): ``"fedbasin_family"``
    marks a fedbasin model, ``"model_type"`` a Hugging Face one. ``ValueError`` (naming
    ``config_path``) for an unknown family or neither field; ``ImportError`` for a Hugging Face
    checkpoint without transformers."""
    for _, field_name, named in KINDS.values():
        if field_name in values:
            return named(values[field_name], config_path)
    raise ValueError(
        f"{config_path}: cannot tell the checkpoint kind: no {FAMILY_FIELD!r} (fedbasin) "
        f"or 'model_type' (Hugging Face) field"
    )


def for_kind(kind: str, family: str) -> ModelFormat:
    """The format of ``family`` of kind ``kind`` (``"fedbasin"`` or ``"hf"``)."""
    if kind not in KINDS:
        raise ValueError(f"kind must be 'fedbasin' or 'hf', got {kind!r}")
    return KINDS[kind][0](family)


def _is_hf_config(config) -> bool:
    try:
        from transformers import PretrainedConfig
    except ImportError:  # transformers is an optional extra
        return False
    return isinstance(config, PretrainedConfig)


def kind_of(config) -> str:
    """``"hf"`` for a transformers ``PretrainedConfig``, else ``"fedbasin"`` (a dataclass or dict)."""
    return HFFormat.kind if _is_hf_config(config) else NativeFormat.kind


__all__ = ["FAMILY_FIELD", "HFFormat", "KINDS", "ModelFormat", "NativeFormat", "detect", "for_kind", "kind_of"]
