"""GPT-NeoX / Pythia (``GPTNeoXForCausalLM``): fused per-head q|k|v, partial rotary, parallel blocks.

``attention.query_key_value`` (3·H·d_h, d) stores, for every head h, its q, k and v rows one
after another (rows ``h·3d_h + [0, d_h)`` are q of head h, then k, then v); ``to_standard``
splits it into ``attention.{q,k,v}`` (H·d_h, d) and ``from_standard`` interleaves them back.
Only the first ``r_d = int(d_h · partial_rotary_factor)`` dims of a head rotate (rotate-half
pairing within them); the rest admit any orthogonal map. ``use_parallel_residual``
(``h + Attn(N1 h) + MLP(N2 h)``) has the same symmetries as sequential blocks: both norms read h.
The file layout names the head ``embed_out.weight`` (module: ``lm_head.weight``).
"""

from __future__ import annotations

import re

import torch

from .llama import rotary_fraction
from .registry import Family, register
from .table import Table, prenorm_spec

TABLE = Table(
    name="hf-gpt-neox",
    layer="gpt_neox.layers.{i}.",
    q="attention.q", k="attention.k", v="attention.v", o="attention.dense",
    up="mlp.dense_h_to_4h", down="mlp.dense_4h_to_h",
    norm1="input_layernorm", norm2="post_attention_layernorm", final_norm="gpt_neox.final_layer_norm",
    head="lm_head.weight", writers=(("gpt_neox.embed_in.weight", 1),),
    embedding="gpt_neox.embed_in.weight",
)  # fmt: skip

_FUSED = re.compile(r"^(gpt_neox\.layers\.\d+\.attention\.)query_key_value\.(weight|bias)$")
_SPLIT = re.compile(r"^(gpt_neox\.layers\.\d+\.attention\.)([qkv])\.(weight|bias)$")


def to_standard(state: dict, config) -> dict:
    H = config.num_attention_heads
    out: dict = {}
    for key, value in state.items():
        m = _FUSED.match(key)
        if m is None:
            out[key] = value
            continue
        prefix, param = m.groups()
        per_head = value.reshape(H, 3, -1, *value.shape[1:])  # (H, q|k|v, d_h[, d])
        for i, name in enumerate("qkv"):
            new = f"{prefix}{name}.{param}"
            if new in state:
                raise ValueError(f"{new} appears in both the GPT-NeoX and the standard layout")
            out[new] = per_head[:, i].reshape(-1, *value.shape[1:]).clone()
    return out


def from_standard(state: dict, config) -> dict:
    H = config.num_attention_heads
    out: dict = {}
    for key, value in state.items():
        m = _SPLIT.match(key)
        if m is None:
            out[key] = value
            continue
        prefix, _, param = m.groups()
        fused = f"{prefix}query_key_value.{param}"
        if fused in out:
            continue
        names = [f"{prefix}{n}.{param}" for n in "qkv"]
        missing = [n for n in names if n not in state]
        if missing:
            raise ValueError(f"cannot fuse {fused}: missing {missing}")
        parts = [state[n].reshape(H, -1, *state[n].shape[1:]) for n in names]
        out[fused] = torch.stack(parts, 1).reshape(-1, *value.shape[1:])
    return out


def spec(config):
    heads = config.num_attention_heads
    head_dim = config.hidden_size // heads
    act = getattr(config, "hidden_act", "gelu")
    return prenorm_spec(
        TABLE,
        layers=config.num_hidden_layers,
        width=config.hidden_size,
        heads=heads,
        hidden=config.intermediate_size,
        activation="relu" if act == "relu" else "elementwise",
        qkv_bias=bool(getattr(config, "attention_bias", True)),
        o_bias=bool(getattr(config, "attention_bias", True)),
        rotary="half",
        rotary_dims=int(head_dim * rotary_fraction(config)),
        tied=bool(getattr(config, "tie_word_embeddings", False)),
    )


def config_fields(shape: dict) -> dict:
    """A new model: the config's defaults (a quarter of each head rotary, parallel blocks), no dropout."""
    return dict(hidden_size=shape["dim"], num_hidden_layers=shape["depth"], num_attention_heads=shape["heads"],
                intermediate_size=shape["mlp_dim"], hidden_dropout=0.0, attention_dropout=0.0)


FAMILY = register(Family(
    classes={"gpt_neox": ("GPTNeoXForCausalLM", "GPTNeoXConfig")},
    spec=spec,
    to_standard=to_standard,
    from_standard=from_standard,
    from_file_key=lambda key: "lm_head.weight" if key == "embed_out.weight" else key,
    to_file_key=lambda key: "embed_out.weight" if key == "lm_head.weight" else key,
    ignored_file_keys=(r"\.attention\.bias$", r"\.attention\.masked_bias$", r"\.rotary_emb\.inv_freq$"),
    tie=("gpt_neox.embed_in.weight", "lm_head.weight"),
    data="text",
    data_fields={"vocab_size": "vocab_size", "block_size": "max_position_embeddings"},
    config_fields=config_fields,
))  # fmt: skip
