"""Phi: parallel attention + MLP read one LayerNorm, partial rotary, biases everywhere (head too)."""

from __future__ import annotations

import pytest

from fedbasin.alignment.hf import hf_adapter

from .causal_lm import (
    check_cli_and_api,
    check_group_action,
    check_planted_recovery,
    hf_config,
    hf_model,
)

VARIANTS = [
    ("phi", {}),  # Phi-2's layout: half of each head rotary (d_h = 8: 4 rotating dims), GELU
    ("phi", {"num_key_value_heads": 2, "partial_rotary_factor": 1.0, "tie_word_embeddings": True}),
    ("phi", {"partial_rotary_factor": 0.25, "hidden_act": "relu"}),  # 2 rotating dims, ReLU MLP
]


def vid(v):
    return "-".join([v[0]] + [f"{k}={x}" for k, x in v[1].items()])


def test_one_norm_feeds_attention_and_mlp():
    spec = hf_adapter(hf_config("phi")).spec
    first = spec.norms[0]
    assert first.weight == "model.layers.0.input_layernorm.weight"
    assert {k.rsplit(".", 2)[-2] for k, _ in first.readers} == {"q_proj", "k_proj", "v_proj", "fc1"}
    assert len(spec.norms) == 2 + 1  # one per layer and the final one
    a = spec.attention[0]
    assert (a.rotary, a.rotated, a.head_dim) == ("half", 4, 8)


@pytest.mark.parametrize("variant", VARIANTS, ids=vid)
def test_random_group_element_keeps_logits(variant):
    model_type, overrides = variant
    check_group_action(model_type, hf_model(model_type, **overrides), modes=("orthogonal", "permutation"),
                       scales=True)


@pytest.mark.parametrize("variant", VARIANTS, ids=vid)
def test_planted_symmetry_is_recovered(variant):
    model_type, overrides = variant
    check_planted_recovery(hf_model(model_type, **overrides))


def test_cli_and_api_outputs_load_with_from_pretrained(tmp_path, capsys):
    check_cli_and_api("phi", tmp_path, capsys)


def test_qk_layernorm_is_refused_clearly():
    with pytest.raises(ValueError, match="qk_layernorm"):
        hf_adapter(hf_config("phi", qk_layernorm=True))
