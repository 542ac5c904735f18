"""Hugging Face models: adapters and file I/O for every family in :mod:`.families`.

Three key layouts appear here:

* **module layout** — the keys of ``model.state_dict()`` in the installed transformers (what
  ``model.load_state_dict`` accepts). An adapter's ``to_standard``/``from_standard`` translate
  between this layout and the standard layout; ``from_standard(to_standard(sd)) == sd``.
* **standard layout** — what the :class:`SymmetrySpec` describes (torch ``nn.Linear`` layout,
  separate q/k/v); each family module says how its checkpoints differ (GPT-2's Conv1D and fused
  q|k|v, GPT-NeoX's per-head fused q|k|v, ViT's legacy names; Llama/Mistral/Qwen2 need nothing).
* **file layout** — what ``save_pretrained`` writes to ``model.safetensors``: legacy names
  (ViT, GPT-NeoX's ``embed_out``), no head when it is tied to the embedding.
  :func:`hf_state_from_file` and :func:`hf_state_to_file` convert (used by ``fedbasin.checkpoint``).

Keys an adapter does not know (buffers such as GPT-2's legacy ``attn.bias``/``attn.masked_bias``)
pass through untouched. transformers is imported lazily, only when a function here needs it.
"""

from __future__ import annotations

import re

import torch

from .adapters import Adapter
from .families import family, supported

#: model_type → the transformers class fedbasin reads and writes for it.
SUPPORTED_MODEL_TYPES = {t: family(t).classes[t][0] for t in supported()}


# ----------------------------------------------------------------------------------------------
# config / class helpers


def _as_config(config_or_model):
    """(config, model_type) from a ``PretrainedConfig``, a ``PreTrainedModel`` or a config dict."""
    if isinstance(config_or_model, torch.nn.Module):
        config = getattr(config_or_model, "config", None)
        if config is None:
            raise ValueError(f"{type(config_or_model).__name__} is not a Hugging Face model (no .config)")
        model_type = _check_model_type(getattr(config, "model_type", None))
        expected = SUPPORTED_MODEL_TYPES[model_type]
        if type(config_or_model).__name__ != expected:
            raise ValueError(
                f"fedbasin supports {expected} for model_type {model_type!r}, got {type(config_or_model).__name__}"
            )
        return config, model_type
    if isinstance(config_or_model, dict):
        model_type = _check_model_type(config_or_model.get("model_type"))
        return hf_config_class(model_type).from_dict(dict(config_or_model)), model_type
    model_type = _check_model_type(getattr(config_or_model, "model_type", None))
    return config_or_model, model_type


def _check_model_type(model_type) -> str:
    family(model_type)  # raises, naming the supported types
    return model_type


def hf_model_class(model_type: str) -> type:
    """The transformers class fedbasin uses for ``model_type`` (``GPT2LMHeadModel``, ...)."""
    import transformers

    return getattr(transformers, family(model_type).classes[model_type][0])


def hf_config_class(model_type: str) -> type:
    """The transformers config class of ``model_type`` (``GPT2Config``, ``LlamaConfig``, ...)."""
    return family(model_type).config_class(model_type)


def hf_expected_shapes(config) -> dict[str, tuple[int, ...]]:
    """Key → shape of ``model.state_dict()`` for this config (model built on the meta device)."""
    config, model_type = _as_config(config)
    with torch.device("meta"):
        model = hf_model_class(model_type)(config)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def hf_is_tied(config) -> bool:
    """Whether the head shares the token embedding under this config."""
    return hf_tied_pair(config) is not None


def hf_tied_pair(config) -> tuple[str, str] | None:
    """(embedding, head) module keys when the config ties them, else None."""
    config, model_type = _as_config(config)
    if not getattr(config, "tie_word_embeddings", False):
        return None
    return family(model_type).tie


# ----------------------------------------------------------------------------------------------
# public API


def hf_adapter(config_or_model) -> Adapter:
    """Adapter of a Hugging Face model: spec over the standard layout plus layout translation.

    ``config_or_model``: a ``PretrainedConfig``, a config dict with ``model_type``, or a model
    of a supported class (``GPT2LMHeadModel``, ``LlamaForCausalLM``, ...; see
    ``SUPPORTED_MODEL_TYPES``). ``to_standard``/``from_standard`` map the module layout
    (``model.state_dict()`` keys) to the standard layout and back. ``notes``: ``model_type``,
    ``hf_class``, and ``untie_updates`` — the config changes to apply once a tied head has
    been untied (see :func:`hf_config_updates`).
    """
    config, model_type = _as_config(config_or_model)
    fam = family(model_type)
    notes = {
        "model_type": model_type,
        "hf_class": fam.classes[model_type][0],
        "untie_updates": {"tie_word_embeddings": False} if fam.tie else {},
    }
    return Adapter(
        fam.spec(config),
        lambda state: fam.to_standard(state, config),
        lambda state: fam.from_standard(state, config),
        notes,
    )


def hf_config_updates(config, state: dict) -> dict:
    """Config changes needed for ``state`` (module or standard layout) to load faithfully.

    A config with ``tie_word_embeddings=True`` whose head differs from the token embedding
    (e.g. after canonicalisation folded the final norm's gain into the head) needs
    ``{"tie_word_embeddings": False}``; otherwise ``{}``.
    """
    pair = hf_tied_pair(config)
    if pair is None:
        return {}
    emb, head = state.get(pair[0]), state.get(pair[1])
    if head is None or emb is None or head is emb:
        return {}
    if head.shape != emb.shape or not torch.equal(head, emb):
        return {"tie_word_embeddings": False}
    return {}


def hf_state_from_file(config, stored: dict) -> dict:
    """Tensors read from ``model.safetensors`` (any transformers version, with or without the
    base-model prefix) → module layout. Legacy buffers the class ignores are dropped and a tied
    head that was not stored is re-aliased to the token embedding. Keys are only renamed, never
    checked: validate the result against :func:`hf_expected_shapes`."""
    config, model_type = _as_config(config)
    fam = family(model_type)
    expected = hf_expected_shapes(config)
    cls = hf_model_class(model_type)
    prefix = f"{cls.base_model_prefix}."
    extra_ignored = list(getattr(cls, "_keys_to_ignore_on_load_unexpected", None) or [])
    out: dict = {}
    for key, value in stored.items():
        new = hf_module_key(config, key, expected, fam, prefix)
        if new not in expected and (fam.ignores(new) or any(re.search(p, new) for p in extra_ignored)):
            continue
        if new in out:
            raise ValueError(f"stored keys {key!r} and another both map to {new!r}")
        out[new] = value
    pair = hf_tied_pair(config)
    if pair is not None and pair[1] not in out and pair[0] in out:
        out[pair[1]] = out[pair[0]]
    return out


def hf_module_key(config, key: str, expected: dict | None = None, fam=None, prefix: str | None = None) -> str:
    """The module-layout key of a stored key (adds a missing base-model prefix, legacy renames)."""
    config, model_type = _as_config(config)
    fam = fam or family(model_type)
    expected = hf_expected_shapes(config) if expected is None else expected
    prefix = prefix or f"{hf_model_class(model_type).base_model_prefix}."
    candidates = [key] if key.startswith(prefix) or key in expected else [prefix + key, key]
    candidates = [fam.from_file_key(c) for c in candidates]
    return next((c for c in candidates if c in expected), candidates[0])


def hf_state_to_file(config, state: dict) -> dict:
    """Module layout → the keys ``save_pretrained`` writes (legacy names; a tied head is left
    out, as transformers does)."""
    config, model_type = _as_config(config)
    fam = family(model_type)
    pair = hf_tied_pair(config)
    out: dict = {}
    for key, value in state.items():
        if pair is not None and key == pair[1]:
            continue
        new = fam.to_file_key(key)
        if new in out:
            raise ValueError(f"{key} and another key both map to {new} in the file layout")
        out[new] = value
    return out


__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "hf_adapter",
    "hf_config_class",
    "hf_config_updates",
    "hf_expected_shapes",
    "hf_is_tied",
    "hf_model_class",
    "hf_module_key",
    "hf_state_from_file",
    "hf_state_to_file",
    "hf_tied_pair",
]
