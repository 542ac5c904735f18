"""GPT-NeoX / Pythia: fused per-head q|k|v, partial rotary, parallel attention + MLP, LayerNorm."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from .causal_lm import check_cli_and_api, check_group_action, check_planted_recovery, hf_model
from fedbasin.alignment.hf import hf_adapter, hf_state_from_file, hf_state_to_file

VARIANTS = [
    ("gpt_neox", {"rotary_pct": 0.5}),  # Pythia default 0.25 scaled to d_h = 8: 4 rotating dims
    ("gpt_neox", {"rotary_pct": 1.0, "use_parallel_residual": False, "tie_word_embeddings": True}),
    ("gpt_neox", {"rotary_pct": 0.25, "hidden_act": "relu"}),  # 2 rotating dims, ReLU MLP
]


def vid(v):
    return "-".join([v[0]] + [f"{k}={x}" for k, x in v[1].items()])


def test_fused_qkv_splits_per_head():
    """Standard q/k/v compute what the fused module's per-head chunks compute; the round trip is exact."""
    model = hf_model("gpt_neox", rotary_pct=0.5)
    adapter = hf_adapter(model)
    raw = model.state_dict()
    standard = adapter.to_standard(raw)
    back = adapter.from_standard(standard)
    assert list(back) == list(raw) and all(torch.equal(back[k], raw[k]) for k in raw)
    attn = model.gpt_neox.layers[1].attention
    x = torch.randn(3, 32, dtype=torch.float64)
    fused = attn.query_key_value(x).view(3, 4, 24)  # (tokens, heads, q|k|v per head)
    for i, name in enumerate("qkv"):
        p = f"gpt_neox.layers.1.attention.{name}"
        got = F.linear(x, standard[f"{p}.weight"], standard[f"{p}.bias"]).view(3, 4, 8)
        torch.testing.assert_close(got, fused[..., 8 * i:8 * (i + 1)], rtol=0, atol=1e-12)
    a = adapter.spec.attention[0]
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


def test_file_layout_names_the_head_embed_out():
    model = hf_model("gpt_neox", rotary_pct=0.5)
    on_disk = hf_state_to_file(model.config, model.state_dict())
    assert "embed_out.weight" in on_disk and "lm_head.weight" not in on_disk
    hub = {k.removeprefix("gpt_neox."): v for k, v in on_disk.items()}  # hub files may lack the prefix
    hub["layers.0.attention.masked_bias"] = torch.tensor(-1e9)  # old Pythia buffers
    hub["layers.0.attention.rotary_emb.inv_freq"] = torch.ones(2)
    assert hf_state_from_file(model.config, hub).keys() == model.state_dict().keys()


@pytest.mark.parametrize("variant", [VARIANTS[0], VARIANTS[1]], ids=vid)
def test_cli_and_api_outputs_load_with_from_pretrained(variant, tmp_path, capsys):
    model_type, overrides = variant
    check_cli_and_api(model_type, tmp_path, capsys, **overrides)
