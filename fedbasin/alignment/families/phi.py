"""Phi (``PhiForCausalLM``, Phi-1/1.5/2): parallel blocks with one LayerNorm, partial rotary.

A block is ``h + Attn(N h) + MLP(N h)``: the one norm ``input_layernorm`` feeds q/k/v and ``fc1``
alike, so its gain folds into all four (``Table.norm2`` None). Only the first
``r_d = int(d_h · partial_rotary_factor)`` dims of a head rotate (rotate-half pairing within
them), as in GPT-NeoX. q/k/v/dense, fc1/fc2 and the head carry biases; the head's bias lives in
vocabulary space and no group element touches it. The module layout is the standard and the file
layout. ``qk_layernorm`` (a LayerNorm over each head's d_h query/key dims) allows no per-head
rotation and is refused.
"""

from __future__ import annotations

from .llama import rotary_fraction
from .registry import Family, register
from .table import Table, prenorm_spec

TABLE = Table(
    name="hf-phi",
    layer="model.layers.{i}.",
    q="self_attn.q_proj", k="self_attn.k_proj", v="self_attn.v_proj", o="self_attn.dense",
    up="mlp.fc1", down="mlp.fc2",
    norm1="input_layernorm", norm2=None, final_norm="model.final_layernorm",
    head="lm_head.weight", writers=(("model.embed_tokens.weight", 1),),
    embedding="model.embed_tokens.weight", head_bias="lm_head.bias",
)  # fmt: skip


def spec(config):
    if getattr(config, "qk_layernorm", False):
        raise ValueError("phi: qk_layernorm=True (a LayerNorm inside every head) is not supported")
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return prenorm_spec(
        TABLE,
        layers=config.num_hidden_layers,
        width=config.hidden_size,
        heads=heads,
        head_dim=head_dim,
        kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        hidden=config.intermediate_size,
        activation="relu" if config.hidden_act == "relu" else "elementwise",
        qkv_bias=True,
        rotary="half",
        rotary_dims=int(head_dim * rotary_fraction(config)),
        tied=bool(getattr(config, "tie_word_embeddings", False)),
    )


def config_fields(shape: dict) -> dict:
    """A new model: the config's defaults (half of each head rotary, GELU), G = H, no dropout."""
    return dict(hidden_size=shape["dim"], num_hidden_layers=shape["depth"], num_attention_heads=shape["heads"],
                num_key_value_heads=shape["heads"], intermediate_size=shape["mlp_dim"],
                resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0)


FAMILY = register(Family(
    classes={"phi": ("PhiForCausalLM", "PhiConfig")},
    spec=spec,
    tie=("model.embed_tokens.weight", "lm_head.weight"),
    config_fields=config_fields,
))  # fmt: skip
