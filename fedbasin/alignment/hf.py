"""Adapters for Hugging Face ``GPT2LMHeadModel`` and ``ViTForImageClassification``.

Three key layouts appear here:

* **module layout** — the keys of ``model.state_dict()`` in the installed transformers (what
  ``model.load_state_dict`` accepts). An adapter's ``to_standard``/``from_standard`` translate
  between this layout and the standard layout; ``from_standard(to_standard(sd)) == sd``.
* **standard layout** — what the :class:`SymmetrySpec` describes (torch ``nn.Linear`` layout,
  separate q/k/v):

  - GPT-2 stores ``Conv1D`` weights as (in, out) and fuses q|k|v in ``attn.c_attn`` (d, 3d).
    ``to_standard`` splits and transposes them into ``transformer.h.{i}.attn.{q,k,v,o}`` and
    ``transformer.h.{i}.mlp.{up,down}`` (weight (out, in), bias); every other key is unchanged.
  - ViT (transformers 5) already uses ``nn.Linear``; the standard keys are its module keys
    ``vit.layers.{i}.attention.{q,k,v,o}_proj``, ``vit.layers.{i}.mlp.{fc1,fc2}``.
    ``to_standard`` also accepts the transformers-4 / on-disk names
    (``vit.encoder.layer.{i}.attention.attention.query`` ...).
* **file layout** — what ``save_pretrained`` writes to ``model.safetensors``: transformers 5 still
  writes the ViT legacy names above, and omits GPT-2's ``lm_head.weight`` when it is tied.
  :func:`hf_state_from_file` and :func:`hf_state_to_file` convert (used by ``fedbasin.checkpoint``).

Keys an adapter does not know (buffers such as GPT-2's legacy ``attn.bias``/``attn.masked_bias``)
pass through untouched. transformers is imported lazily, only when a function here needs it.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

import torch

from .adapters import Adapter
from .spec import AttentionSpec, Linear, MLPSpec, Norm, SymmetrySpec

#: model_type → the transformers class fedbasin reads and writes for it.
SUPPORTED_MODEL_TYPES = {"gpt2": "GPT2LMHeadModel", "vit": "ViTForImageClassification"}

# Extra keys that old or base-model checkpoints carry and the model class ignores on load.
_IGNORED_FILE_KEYS = {
    "gpt2": (r"\.attn\.bias$", r"\.attn\.masked_bias$"),
    "vit": (r"^vit\.pooler\.",),
}


# ----------------------------------------------------------------------------------------------
# config / class helpers


def _as_config(config_or_model):
    """(config, model_type) from a ``PretrainedConfig``, a ``PreTrainedModel`` or a config dict."""
    if isinstance(config_or_model, torch.nn.Module):
        config = getattr(config_or_model, "config", None)
        if config is None:
            raise ValueError(
                f"{type(config_or_model).__name__} is not a Hugging Face model (no .config)"
            )
        model_type = _check_model_type(getattr(config, "model_type", None))
        expected = SUPPORTED_MODEL_TYPES[model_type]
        if type(config_or_model).__name__ != expected:
            raise ValueError(
                f"fedbasin supports {expected} for model_type {model_type!r}, "
                f"got {type(config_or_model).__name__}"
            )
        return config, model_type
    if isinstance(config_or_model, dict):
        model_type = _check_model_type(config_or_model.get("model_type"))
        return hf_config_class(model_type).from_dict(dict(config_or_model)), model_type
    model_type = _check_model_type(getattr(config_or_model, "model_type", None))
    return config_or_model, model_type


def _check_model_type(model_type) -> str:
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"no fedbasin adapter for Hugging Face model_type {model_type!r}; "
            f"supported: {sorted(SUPPORTED_MODEL_TYPES)}"
        )
    return model_type


def hf_model_class(model_type: str) -> type:
    """The transformers class fedbasin uses for ``model_type`` (``GPT2LMHeadModel``, ...)."""
    import transformers

    return getattr(transformers, SUPPORTED_MODEL_TYPES[_check_model_type(model_type)])


def hf_config_class(model_type: str) -> type:
    """The transformers config class of ``model_type`` (``GPT2Config``, ``ViTConfig``)."""
    import transformers

    return {"gpt2": transformers.GPT2Config, "vit": transformers.ViTConfig}[
        _check_model_type(model_type)
    ]


def hf_expected_shapes(config) -> dict[str, tuple[int, ...]]:
    """Key → shape of ``model.state_dict()`` for this config (model built on the meta device)."""
    config, model_type = _as_config(config)
    with torch.device("meta"):
        model = hf_model_class(model_type)(config)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def hf_is_tied(config) -> bool:
    """Whether the GPT-2 head shares the token embedding under this config."""
    return bool(getattr(config, "tie_word_embeddings", False))


# ----------------------------------------------------------------------------------------------
# GPT-2: Conv1D (in, out) with fused q|k|v  <->  standard nn.Linear layout

_GPT2_RAW = re.compile(
    r"^transformer\.h\.(\d+)\.(attn\.c_attn|attn\.c_proj|mlp\.c_fc|mlp\.c_proj)\.(weight|bias)$"
)
_GPT2_STD = re.compile(
    r"^transformer\.h\.(\d+)\.(attn\.q|attn\.k|attn\.v|attn\.o|mlp\.up|mlp\.down)\.(weight|bias)$"
)
_GPT2_RENAME = {"attn.c_proj": "attn.o", "mlp.c_fc": "mlp.up", "mlp.c_proj": "mlp.down"}
_GPT2_UNRENAME = {v: k for k, v in _GPT2_RENAME.items()}


def _gpt2_to_standard(state: dict) -> dict:
    out: dict = {}
    for key, value in state.items():
        m = _GPT2_RAW.match(key)
        if m is None:
            if key in out:
                raise ValueError(f"{key} appears in both the GPT-2 and the standard layout")
            out[key] = value
            continue
        layer, module, param = m.groups()
        prefix = f"transformer.h.{layer}."
        if module == "attn.c_attn":
            d = value.shape[-1] // 3
            parts = value.split(d, dim=-1)
            # clone: the three parts must not share storage with each other or the input
            new = {
                f"{prefix}attn.{n}.{param}": (p.T if param == "weight" else p).clone()
                for n, p in zip("qkv", parts)
            }
        else:
            new = {
                f"{prefix}{_GPT2_RENAME[module]}.{param}": value.T if param == "weight" else value
            }
        for k, v in new.items():
            if k in out or k in state:
                raise ValueError(f"{k} appears in both the GPT-2 and the standard layout")
            out[k] = v.contiguous()
    return out


def _gpt2_from_standard(state: dict) -> dict:
    out: dict = {}
    for key, value in state.items():
        m = _GPT2_STD.match(key)
        if m is None:
            if key in out:
                raise ValueError(f"{key} appears in both the GPT-2 and the standard layout")
            out[key] = value
            continue
        layer, module, param = m.groups()
        prefix = f"transformer.h.{layer}."
        if module in ("attn.q", "attn.k", "attn.v"):
            fused = f"{prefix}attn.c_attn.{param}"
            if fused in out:  # already built from the first of q/k/v
                continue
            names = [f"{prefix}attn.{n}.{param}" for n in "qkv"]
            missing = [n for n in names if n not in state]
            if missing:
                raise ValueError(f"cannot fuse {fused}: missing {missing}")
            parts = [state[n].T if param == "weight" else state[n] for n in names]
            new_key, new = fused, torch.cat(parts, dim=-1)
        else:
            new_key = f"{prefix}{_GPT2_UNRENAME[module]}.{param}"
            new = value.T.contiguous() if param == "weight" else value
        if new_key in out or new_key in state:
            raise ValueError(f"{new_key} appears in both the GPT-2 and the standard layout")
        out[new_key] = new
    return out


def _gpt2_spec(config) -> SymmetrySpec:
    if getattr(config, "add_cross_attention", False):
        raise ValueError(
            "GPT-2 with add_cross_attention=True (cross-attention blocks) is not supported"
        )
    d = config.n_embd
    return _prenorm_spec(
        _GPT2_TABLE,
        layers=config.n_layer,
        width=d,
        heads=config.n_head,
        hidden=config.n_inner if config.n_inner is not None else 4 * d,
        activation="relu" if config.activation_function == "relu" else "elementwise",
        qkv_bias=True,
        tied=hf_is_tied(config),
    )


# ----------------------------------------------------------------------------------------------
# ViT: transformers-5 module names (standard) <-> transformers-4 / on-disk names

# legacy module path inside a layer -> transformers-5 module path
_VIT_NAMES = {
    "attention.attention.query": "attention.q_proj",
    "attention.attention.key": "attention.k_proj",
    "attention.attention.value": "attention.v_proj",
    "attention.output.dense": "attention.o_proj",
    "intermediate.dense": "mlp.fc1",
    "output.dense": "mlp.fc2",
    "layernorm_before": "layernorm_before",
    "layernorm_after": "layernorm_after",
}
_VIT_LEGACY = {v: k for k, v in _VIT_NAMES.items()}
_VIT_LAYER = re.compile(r"^vit\.(encoder\.layer|layers)\.(\d+)\.(.+)\.(weight|bias)$")


def _vit_rename(key: str, legacy: bool) -> str:
    """``key`` in the legacy (``legacy=True``) or transformers-5 ViT naming; others unchanged."""
    m = _VIT_LAYER.match(key)
    if m is None:
        return key
    _, layer, module, param = m.groups()
    if legacy:
        module = _VIT_LEGACY.get(module, module)
        return f"vit.encoder.layer.{layer}.{module}.{param}"
    module = _VIT_NAMES.get(module, module)
    return f"vit.layers.{layer}.{module}.{param}"


def _rename_all(state: dict, rename) -> dict:
    out: dict = {}
    for key, value in state.items():
        new = rename(key)
        if new in out:
            raise ValueError(
                f"{key} and another key both map to {new} (state mixes two ViT namings?)"
            )
        out[new] = value
    return out


@functools.lru_cache(maxsize=1)
def _vit_module_is_legacy() -> bool:
    """Whether the installed transformers names ViT modules the transformers-4 way."""
    import transformers

    tiny = transformers.ViTConfig(
        image_size=2,
        patch_size=1,
        num_channels=1,
        hidden_size=4,
        num_hidden_layers=1,
        num_attention_heads=1,
        intermediate_size=4,
        num_labels=1,
    )
    with torch.device("meta"):
        keys = transformers.ViTForImageClassification(tiny).state_dict().keys()
    return "vit.encoder.layer.0.attention.attention.query.weight" in keys


def _vit_spec(config) -> SymmetrySpec:
    if config.num_labels <= 0:
        raise ValueError(
            "ViTForImageClassification with num_labels=0 has no classifier reading the stream"
        )
    return _prenorm_spec(
        _VIT_TABLE,
        layers=config.num_hidden_layers,
        width=config.hidden_size,
        heads=config.num_attention_heads,
        hidden=config.intermediate_size,
        activation="relu" if config.hidden_act == "relu" else "elementwise",
        qkv_bias=bool(getattr(config, "qkv_bias", True)),
        tied=False,
    )


# ----------------------------------------------------------------------------------------------
# specs: one table of standard-layout names per architecture, one builder


@dataclass(frozen=True)
class _Table:
    """Standard-layout names of a pre-norm Transformer (``{i}``: layer index).

    Linear modules are named without ``.weight``/``.bias``; norms have weight and bias.
    ``writers``: (key, residual axis) of the embeddings; ``head`` reads ``final_norm`` (axis 1).
    """

    name: str
    layer: str
    q: str
    k: str
    v: str
    o: str
    up: str
    down: str
    norm1: str
    norm2: str
    final_norm: str
    head: str
    writers: tuple[tuple[str, int], ...]
    embedding: str | None = None  # token embedding (indexed by token id), tied to the head


_GPT2_TABLE = _Table(
    name="hf-gpt2",
    layer="transformer.h.{i}.",
    q="attn.q", k="attn.k", v="attn.v", o="attn.o", up="mlp.up", down="mlp.down",
    norm1="ln_1", norm2="ln_2", final_norm="transformer.ln_f", head="lm_head.weight",
    writers=(("transformer.wte.weight", 1), ("transformer.wpe.weight", 1)),
    embedding="transformer.wte.weight",
)  # fmt: skip

_VIT_TABLE = _Table(
    name="hf-vit",
    layer="vit.layers.{i}.",
    q="attention.q_proj", k="attention.k_proj", v="attention.v_proj", o="attention.o_proj",
    up="mlp.fc1", down="mlp.fc2", norm1="layernorm_before", norm2="layernorm_after",
    final_norm="vit.layernorm", head="classifier.weight",
    writers=(
        ("vit.embeddings.patch_embeddings.projection.weight", 0),
        ("vit.embeddings.patch_embeddings.projection.bias", 0),
        ("vit.embeddings.cls_token", 2),
        ("vit.embeddings.position_embeddings", 2),
    ),
)  # fmt: skip


def _prenorm_spec(
    t: _Table, layers, width, heads, hidden, activation, qkv_bias, tied
) -> SymmetrySpec:
    """Spec of ``layers`` LayerNorm pre-norm blocks named by ``t`` (biases on o/up/down)."""
    if width % heads:
        raise ValueError(f"{t.name}: width {width} is not divisible by {heads} heads")
    norms, attention, mlp, residual = [], [], [], []
    for i in range(layers):
        p = t.layer.format(i=i)
        q, k, v = (
            Linear(f"{p}{n}.weight", f"{p}{n}.bias" if qkv_bias else None) for n in (t.q, t.k, t.v)
        )
        o, up, down = (Linear(f"{p}{n}.weight", f"{p}{n}.bias") for n in (t.o, t.up, t.down))
        attention.append(AttentionSpec(q, k, v, o, heads, width // heads))
        mlp.append(MLPSpec(up, down, None, activation, hidden))
        readers1 = ((q.weight, 1), (k.weight, 1), (v.weight, 1))
        readers2 = ((up.weight, 1),)
        n1, n2 = f"{p}{t.norm1}", f"{p}{t.norm2}"
        norms += [
            Norm("layernorm", f"{n1}.weight", f"{n1}.bias", readers1),
            Norm("layernorm", f"{n2}.weight", f"{n2}.bias", readers2),
        ]
        writers = ((o.weight, 0), (o.bias, 0), (down.weight, 0), (down.bias, 0))
        residual += [*readers1, *readers2, *writers, (f"{n1}.bias", 0), (f"{n2}.bias", 0)]
    nf = t.final_norm
    norms.append(Norm("layernorm", f"{nf}.weight", f"{nf}.bias", ((t.head, 1),)))
    residual += [*t.writers, (f"{nf}.bias", 0), (t.head, 1)]
    return SymmetrySpec(
        width=width,
        residual=tuple(residual),
        norms=tuple(norms),
        attention=tuple(attention),
        mlp=tuple(mlp),
        tied=((t.embedding, t.head),) if tied and t.embedding else (),
        name=t.name,
        embedding_keys=(t.embedding,) if t.embedding else (),
    )


# ----------------------------------------------------------------------------------------------
# public API


def hf_adapter(config_or_model) -> Adapter:
    """Adapter of a Hugging Face model: spec over the standard layout plus layout translation.

    ``config_or_model``: a ``PretrainedConfig``, a config dict with ``model_type``, or a
    ``GPT2LMHeadModel`` / ``ViTForImageClassification``. ``to_standard``/``from_standard`` map
    the module layout (``model.state_dict()`` keys) to the standard layout and back. ``notes``:
    ``model_type``, ``hf_class``, and ``untie_updates`` — the config changes to apply once a tied
    head has been untied (see :func:`hf_config_updates`).
    """
    config, model_type = _as_config(config_or_model)
    notes = {
        "model_type": model_type,
        "hf_class": SUPPORTED_MODEL_TYPES[model_type],
        "untie_updates": {},
    }
    if model_type == "gpt2":
        notes["untie_updates"] = {"tie_word_embeddings": False}
        return Adapter(_gpt2_spec(config), _gpt2_to_standard, _gpt2_from_standard, notes)
    spec = _vit_spec(config)
    legacy = _vit_module_is_legacy()
    return Adapter(
        spec,
        lambda state: _rename_all(state, lambda k: _vit_rename(k, legacy=False)),
        lambda state: _rename_all(state, lambda k: _vit_rename(k, legacy=legacy)),
        notes,
    )


def hf_config_updates(config, state: dict) -> dict:
    """Config changes needed for ``state`` (module or standard layout) to load faithfully.

    GPT-2 with ``tie_word_embeddings=True`` whose ``lm_head.weight`` differs from
    ``transformer.wte.weight`` (e.g. after canonicalisation folded ``ln_f``'s gain into the head)
    needs ``{"tie_word_embeddings": False}``; otherwise ``{}``.
    """
    config, model_type = _as_config(config)
    if model_type == "gpt2" and hf_is_tied(config):
        head, emb = state.get("lm_head.weight"), state.get("transformer.wte.weight")
        if head is None or emb is None or head is emb:
            return {}
        if head.shape != emb.shape or not torch.equal(head, emb):
            return {"tie_word_embeddings": False}
    return {}


def hf_state_from_file(config, stored: dict) -> dict:
    """Tensors read from ``model.safetensors`` (any transformers version, with or without the
    base-model prefix) → module layout. Legacy buffers the class ignores are dropped and a tied
    ``lm_head.weight`` that was not stored is re-aliased to the token embedding. Keys are only
    renamed, never checked: validate the result against :func:`hf_expected_shapes`."""
    config, model_type = _as_config(config)
    expected = hf_expected_shapes(config)
    cls = hf_model_class(model_type)
    prefix = f"{cls.base_model_prefix}."
    legacy = _vit_module_is_legacy()
    ignore = list(_IGNORED_FILE_KEYS[model_type]) + list(
        getattr(cls, "_keys_to_ignore_on_load_unexpected", None) or []
    )
    out: dict = {}
    for key, value in stored.items():
        candidates = [key] if key.startswith(prefix) or key in expected else [prefix + key, key]
        if model_type == "vit":
            candidates = [_vit_rename(c, legacy) for c in candidates]
        new = next((c for c in candidates if c in expected), candidates[0])
        if new not in expected and any(re.search(pat, new) for pat in ignore):
            continue
        if new in out:
            raise ValueError(f"stored keys {key!r} and another both map to {new!r}")
        out[new] = value
    tied_head_missing = hf_is_tied(config) and "lm_head.weight" not in out
    if model_type == "gpt2" and tied_head_missing and "transformer.wte.weight" in out:
        out["lm_head.weight"] = out["transformer.wte.weight"]
    return out


def hf_state_to_file(config, state: dict) -> dict:
    """Module layout → the keys ``save_pretrained`` writes (ViT legacy names; a tied GPT-2
    ``lm_head.weight`` is left out, as transformers does)."""
    config, model_type = _as_config(config)
    if model_type == "vit":
        return _rename_all(state, lambda k: _vit_rename(k, legacy=True))
    out = dict(state)
    if hf_is_tied(config):
        out.pop("lm_head.weight", None)
    return out


__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "hf_adapter",
    "hf_config_class",
    "hf_config_updates",
    "hf_expected_shapes",
    "hf_model_class",
    "hf_state_from_file",
    "hf_state_to_file",
]
