"""Llama, Mistral and Qwen2 causal LMs: RMSNorm, SwiGLU, rotate-half RoPE, grouped-query attention.

The module layout is already the standard layout (``nn.Linear`` q/k/v/o, gate/up/down). Query
heads h·r … h·r+r−1 share key/value head h (``num_key_value_heads`` G, r = H/G): heads
permute only with their group, and the per-plane RoPE rotation of a group is shared by all its
query heads. Biases: Qwen2 has q/k/v biases; Llama's ``attention_bias`` adds q/k/v/o biases and
``mlp_bias`` MLP biases; Mistral has none.
"""

from __future__ import annotations

from .registry import Family, register
from .table import Table, prenorm_spec

TABLE = Table(
    name="hf-llama",
    layer="model.layers.{i}.",
    q="self_attn.q_proj", k="self_attn.k_proj", v="self_attn.v_proj", o="self_attn.o_proj",
    up="mlp.up_proj", gate="mlp.gate_proj", down="mlp.down_proj",
    norm1="input_layernorm", norm2="post_attention_layernorm", final_norm="model.norm",
    head="lm_head.weight", writers=(("model.embed_tokens.weight", 1),),
    embedding="model.embed_tokens.weight", norm="rmsnorm",
)  # fmt: skip


def rotary_fraction(config) -> float:
    """``partial_rotary_factor`` of the config's RoPE parameters (1.0: every head dim rotates)."""
    params = getattr(config, "rope_parameters", None) or {}
    if isinstance(params, dict) and "partial_rotary_factor" in params:
        return float(params["partial_rotary_factor"])
    return float(getattr(config, "partial_rotary_factor", 1.0) or 1.0)


def spec(config):
    if rotary_fraction(config) != 1.0:
        raise ValueError(f"{config.model_type}: partial_rotary_factor != 1 is not supported for this family")
    heads = config.num_attention_heads
    qkv_bias = config.model_type == "qwen2" or bool(getattr(config, "attention_bias", False))
    return prenorm_spec(
        TABLE,
        layers=config.num_hidden_layers,
        width=config.hidden_size,
        heads=heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
        kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        hidden=config.intermediate_size,
        activation="gated",
        qkv_bias=qkv_bias,
        o_bias=bool(getattr(config, "attention_bias", False)),
        mlp_bias=bool(getattr(config, "mlp_bias", False)),
        norm_bias=False,
        rotary="half",
        tied=bool(getattr(config, "tie_word_embeddings", False)),
    )


def config_fields(shape: dict) -> dict:
    """A new model: plain multi-head attention (G = H key/value heads), no dropout."""
    return dict(hidden_size=shape["dim"], num_hidden_layers=shape["depth"], num_attention_heads=shape["heads"],
                num_key_value_heads=shape["heads"], intermediate_size=shape["mlp_dim"], attention_dropout=0.0)


FAMILY = register(Family(
    classes={
        "llama": ("LlamaForCausalLM", "LlamaConfig"),
        "mistral": ("MistralForCausalLM", "MistralConfig"),
        "qwen2": ("Qwen2ForCausalLM", "Qwen2Config"),
    },
    spec=spec,
    tie=("model.embed_tokens.weight", "lm_head.weight"),
    config_fields=config_fields,
))  # fmt: skip
