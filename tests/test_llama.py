"""Llama / Mistral / Qwen2: RMSNorm, SwiGLU, rotate-half RoPE, grouped-query attention, tied heads."""

from __future__ import annotations

import pytest
import torch

from .causal_lm import (
    check_cli_and_api,
    check_group_action,
    check_planted_recovery,
    float64_rmsnorm,  # noqa: F401  (autouse fixture)
    hf_config,
    hf_model,
)
from fedbasin.alignment import canonicalize, random_group_element
from fedbasin.alignment.group import HeadMap, apply_head_map
from fedbasin.alignment.hf import hf_adapter

VARIANTS = [
    ("llama", {"num_key_value_heads": 2}),  # GQA, 2 query heads per key/value head
    ("llama", {"num_key_value_heads": 1, "attention_bias": True, "mlp_bias": True, "tie_word_embeddings": True}),
    ("mistral", {"num_key_value_heads": 4, "head_dim": 6}),  # plain MHA, head_dim ≠ width / heads
    ("qwen2", {"num_key_value_heads": 2, "tie_word_embeddings": True}),  # q/k/v biases
]


def vid(v):
    return "-".join([v[0]] + [f"{k}={x}" for k, x in v[1].items()])


@pytest.mark.parametrize("variant", VARIANTS, ids=vid)
def test_random_group_element_keeps_logits(variant):
    model_type, overrides = variant
    adapter = check_group_action(model_type, hf_model(model_type, **overrides), modes=("orthogonal", "permutation"),
                                 scales=True)
    a = adapter.spec.attention[0]
    assert a.rotary == "half" and a.kv_heads == hf_config(model_type, **overrides).num_key_value_heads
    assert adapter.spec.norm_kind == "rmsnorm" and adapter.spec.mlp[0].gate is not None


@pytest.mark.parametrize("variant", VARIANTS, ids=vid)
def test_planted_symmetry_is_recovered(variant):
    model_type, overrides = variant
    check_planted_recovery(hf_model(model_type, **overrides))


@pytest.mark.parametrize("variant", VARIANTS[:2], ids=vid)
def test_planted_sign_flips_of_gated_units_are_recovered_when_signed_matching_is_on(variant, monkeypatch):
    """A gated unit is unchanged when its up row (and bias) and down column change sign; with
    ``SIGNED_GATED_UNITS`` the matching finds planted flips (off by default: no barrier fell, journal §32)."""
    import fedbasin.alignment.matching as matching

    model_type, overrides = variant
    monkeypatch.setattr(matching, "SIGNED_GATED_UNITS", True)
    result = check_planted_recovery(hf_model(model_type, **overrides), signed=True)
    assert any(n.scale is not None and bool((n.scale < 0).any()) for n in result.transform.neurons)


def test_gqa_head_maps_respect_key_value_groups():
    """Query heads move only with their key/value group; a per-query-head rotation would break QK."""
    model = hf_model("llama", num_key_value_heads=2)
    adapter = hf_adapter(model)
    spec = adapter.spec
    a = spec.attention[0]
    for seed in range(5):
        g = random_group_element(spec, seed)
        blocks = g.heads[0].perm.reshape(2, 2) // 2
        assert bool((blocks == blocks[:, :1]).all())
        assert g.heads[0].qk.shape[0] == 2  # one QK map per key/value group
    state = canonicalize(spec, adapter.to_standard(model.state_dict())).state
    with pytest.raises(ValueError, match="splits a key/value group"):
        apply_head_map(a, dict(state), HeadMap(torch.tensor([0, 2, 1, 3])))
    # swapping the two query heads of one group is exact (they share K and V)
    from .causal_lm import load_state, logits, rel_err

    moved = dict(state)
    apply_head_map(a, moved, HeadMap(torch.tensor([1, 0, 2, 3])))
    back = load_state("llama", model.config, adapter.from_standard(moved))
    assert rel_err(logits(back), logits(load_state("llama", model.config, adapter.from_standard(state)))) < 1e-10


def test_rope_rotation_must_be_per_plane_in_the_half_pairing():
    """A rotation mixing dims j and j+1 (the interleaved pairing) is not a symmetry of HF Llama."""
    from .causal_lm import load_state, logits, rel_err
    from fedbasin.alignment.group import plane_rotations

    model = hf_model("llama", num_key_value_heads=2)
    adapter = hf_adapter(model)
    spec = adapter.spec
    state = canonicalize(spec, adapter.to_standard(model.state_dict())).state
    angles = torch.full((2, 4), 0.7, dtype=torch.float64)
    want = logits(model)
    for layout, exact in (("half", True), ("interleaved", False)):
        moved = dict(state)
        apply_head_map(spec.attention[0], moved, HeadMap(torch.arange(4), plane_rotations(angles, 8, layout)))
        err = rel_err(logits(load_state("llama", model.config, adapter.from_standard(moved))), want)
        assert (err < 1e-10) == exact, (layout, err)


def test_partial_rotary_llama_is_refused_clearly():
    config = hf_config("llama", num_key_value_heads=2)
    config.rope_parameters = {**config.rope_parameters, "partial_rotary_factor": 0.5}
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        hf_adapter(config)


@pytest.mark.parametrize("variant", [VARIANTS[0], VARIANTS[3]], ids=vid)
def test_cli_and_api_outputs_load_with_from_pretrained(variant, tmp_path, capsys):
    model_type, overrides = variant
    check_cli_and_api(model_type, tmp_path, capsys, **overrides)


@pytest.mark.parametrize("variant", [VARIANTS[0], ("llama", {"num_key_value_heads": 2, "mlp_bias": True})], ids=vid)
def test_gated_mlp_neurons_scale_exactly_and_refinement_learns_them(variant):
    """SwiGLU ``down(silu(gate·x) ⊙ up·x)``: scaling ``up``'s rows by s > 0 and ``down``'s columns by 1/s
    keeps the function (the larger, invertible group), and learned refinement in that group carries
    one learnable scale per hidden unit."""
    from fedbasin.alignment.parametrize import _Delta

    model_type, overrides = variant
    model = hf_model(model_type, **overrides)
    adapter = hf_adapter(model)
    spec, state = adapter.spec, adapter.to_standard(model.state_dict())
    g = random_group_element(spec, 3, mode="invertible", state=state)
    assert all(n.scale is not None and float((n.scale - 1).abs().max()) > 0.1 for n in g.neurons)
    from fedbasin.alignment import apply_group, to_gauge

    c = canonicalize(spec, state)
    moved = to_gauge(spec, apply_group(spec, c.state, g), c.gains)
    up = spec.mlp[0].up.weight
    assert not torch.allclose(moved[up].norm(dim=1), state[up].norm(dim=1), rtol=1e-3)  # the rows did scale
    x = torch.randint(0, model.config.vocab_size, (2, 8))
    with torch.no_grad():
        expected = model(x).logits
        model.load_state_dict(adapter.from_standard(moved))
        assert torch.allclose(model(x).logits, expected, rtol=1e-9, atol=1e-9)
    delta = _Delta(spec, state, "fixed", 1.0, group="invertible")
    assert delta.scaled_mlps == list(range(len(spec.mlp)))
