"""ViT (``ViTForImageClassification``): transformers-5 module names are the standard layout.

``save_pretrained`` (and transformers 4) use the legacy names
``vit.encoder.layer.{i}.attention.attention.query`` ...; the file-key renames translate them, and
``to_standard`` accepts either naming.
"""

from __future__ import annotations

import functools
import re

import torch

from .registry import Family, register
from .table import Table, prenorm_spec

# legacy module path inside a layer -> transformers-5 module path
_NAMES = {
    "attention.attention.query": "attention.q_proj",
    "attention.attention.key": "attention.k_proj",
    "attention.attention.value": "attention.v_proj",
    "attention.output.dense": "attention.o_proj",
    "intermediate.dense": "mlp.fc1",
    "output.dense": "mlp.fc2",
    "layernorm_before": "layernorm_before",
    "layernorm_after": "layernorm_after",
}
_LEGACY = {v: k for k, v in _NAMES.items()}
_LAYER = re.compile(r"^vit\.(encoder\.layer|layers)\.(\d+)\.(.+)\.(weight|bias)$")

TABLE = Table(
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


def rename(key: str, legacy: bool) -> str:
    """``key`` in the legacy (``legacy=True``) or transformers-5 ViT naming; others unchanged."""
    m = _LAYER.match(key)
    if m is None:
        return key
    _, layer, module, param = m.groups()
    if legacy:
        return f"vit.encoder.layer.{layer}.{_LEGACY.get(module, module)}.{param}"
    return f"vit.layers.{layer}.{_NAMES.get(module, module)}.{param}"


def rename_all(state: dict, legacy: bool) -> dict:
    out: dict = {}
    for key, value in state.items():
        new = rename(key, legacy)
        if new in out:
            raise ValueError(f"{key} and another key both map to {new} (state mixes two ViT namings?)")
        out[new] = value
    return out


@functools.lru_cache(maxsize=1)
def module_is_legacy() -> bool:
    """Whether the installed transformers names ViT modules the transformers-4 way."""
    import transformers

    tiny = transformers.ViTConfig(image_size=2, patch_size=1, num_channels=1, hidden_size=4,
                                  num_hidden_layers=1, num_attention_heads=1, intermediate_size=4, num_labels=1)
    with torch.device("meta"):
        keys = transformers.ViTForImageClassification(tiny).state_dict().keys()
    return "vit.encoder.layer.0.attention.attention.query.weight" in keys


def spec(config):
    if config.num_labels <= 0:
        raise ValueError("ViTForImageClassification with num_labels=0 has no classifier reading the stream")
    return prenorm_spec(
        TABLE,
        layers=config.num_hidden_layers,
        width=config.hidden_size,
        heads=config.num_attention_heads,
        hidden=config.intermediate_size,
        activation="relu" if config.hidden_act == "relu" else "elementwise",
        qkv_bias=bool(getattr(config, "qkv_bias", True)),
    )


def config_fields(shape: dict) -> dict:
    return dict(patch_size=shape["patch_size"], hidden_size=shape["dim"], num_hidden_layers=shape["depth"],
                num_attention_heads=shape["heads"], intermediate_size=shape["mlp_dim"],
                hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


FAMILY = register(Family(
    classes={"vit": ("ViTForImageClassification", "ViTConfig")},
    spec=spec,
    to_standard=lambda state, config=None: rename_all(state, legacy=False),
    from_standard=lambda state, config=None: rename_all(state, legacy=module_is_legacy()),
    from_file_key=lambda key: rename(key, legacy=module_is_legacy()),
    to_file_key=lambda key: rename(key, legacy=True),
    ignored_file_keys=(r"^vit\.pooler\.",),
    data="images",
    data_fields={"image_size": "image_size", "channels": "num_channels", "num_classes": "num_labels"},
    config_fields=config_fields,
))  # fmt: skip
