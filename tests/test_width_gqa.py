"""Width embedding of Hugging Face causal LMs with grouped-query attention (Llama) and partial
rotary (GPT-NeoX): the embedded narrow model computes the narrow model's function, alignment in the
wide group keeps it, the client's slots come back exactly, and what cannot embed is refused."""

from __future__ import annotations

import pytest
import torch

from fedbasin.alignment import apply_group, canonicalize, random_group_element, to_gauge
from fedbasin.alignment.hf import hf_adapter
from fedbasin.alignment.width import (
    check_embeddable,
    embed,
    embed_and_align,
    merge_heterogeneous,
    restrict,
)

from .causal_lm import float64_rmsnorm, hf_model, load_state, logits, rel_err  # noqa: F401  (autouse fixture)

LLAMA = {"head_dim": 8, "rms_norm_eps": 0.0}  # eps = 0: the norms embed exactly (width.py)
NEOX = {"layer_norm_eps": 0.0}

PAIRS = {
    # width 32 → 48; key/value groups 2 → 3, 2 query heads per group in both
    "llama-equal-groups": ("llama", dict(LLAMA, num_key_value_heads=2),
                           dict(LLAMA, hidden_size=48, num_attention_heads=6, num_key_value_heads=3)),
    # 2 → 4 query heads per group: narrow group g fills the first 2 query slots of wide group g
    "llama-larger-groups": ("llama", dict(LLAMA, num_key_value_heads=2),
                            dict(LLAMA, hidden_size=48, num_attention_heads=8, num_key_value_heads=2)),
    # multi-head narrow model into a grouped wide one
    "llama-mha-into-gqa": ("llama", dict(LLAMA, num_attention_heads=2, num_key_value_heads=2),
                           dict(LLAMA, hidden_size=48, num_attention_heads=6, num_key_value_heads=3)),
    # partial rotary: 4 of 8 head dims rotate in both
    "neox-partial-rotary": ("gpt_neox", dict(NEOX, rotary_pct=0.5),
                            dict(NEOX, rotary_pct=0.5, hidden_size=48, num_attention_heads=6)),
}


def _pair(name):
    model_type, small, big = PAIRS[name]
    narrow, wide = hf_model(model_type, seed=1, **small), hf_model(model_type, seed=2, **big)
    return model_type, narrow, wide, hf_adapter(narrow), hf_adapter(wide)


@pytest.mark.parametrize("name", PAIRS)
def test_embedded_model_computes_the_same_function(name):
    """embed → same logits (float64 < 1e-10); aligned to the wide model in the wide group → same
    logits; restricting the aligned embedding with its transform gives the narrow model back."""
    model_type, narrow, wide, ad_s, ad_b = _pair(name)
    small, big = ad_s.to_standard(narrow.state_dict()), ad_b.to_standard(wide.state_dict())
    want = logits(narrow)
    embedded = embed(ad_s.spec, small, ad_b.spec, big)
    assert rel_err(logits(load_state(model_type, wide.config, ad_b.from_standard(embedded))), want) < 1e-10
    aligned = embed_and_align(ad_s.spec, small, ad_b.spec, big, iterations=5)
    moved = max(int((hm.perm != torch.arange(hm.perm.numel())).sum()) for hm in aligned.transform.heads)
    assert moved > 0  # the heads really moved in the wide group
    assert rel_err(logits(load_state(model_type, wide.config, ad_b.from_standard(aligned.state))), want) < 1e-10
    canonical = canonicalize(ad_s.spec, small)
    back = restrict(ad_b.spec, aligned.canonical, ad_s.spec, transform=aligned.transform, gains=canonical.gains)
    # the narrow model in its own gauge: itself, except γ = 1 on tiny-gain dims (llama-mha-into-gqa
    # has one, 0.0016 × 0.83; canonical.py), where its gauged form computes the same function
    gauged = to_gauge(ad_s.spec, canonical.state, canonical.gains)
    assert max(float((back[k] - gauged[k]).abs().max()) for k in small) < 1e-10
    assert rel_err(logits(load_state(model_type, narrow.config, ad_s.from_standard(back))), want) < 1e-10


@pytest.mark.parametrize("name", ["llama-larger-groups", "neox-partial-rotary"])
def test_merge_with_a_moved_wide_copy_gives_the_narrow_model_back(name):
    """The wide model is the narrow one embedded and moved by a random wide group element (groups
    and query heads permuted, per-group maps): merging the two and restricting back to the narrow
    model's slots returns the narrow model (planted alignment recovered)."""
    model_type, narrow, wide, ad_s, ad_b = _pair(name)
    small = ad_s.to_standard(narrow.state_dict())
    g = random_group_element(ad_b.spec, 3, "orthogonal")
    planted = apply_group(ad_b.spec, embed(ad_s.spec, small, ad_b.spec, ad_b.to_standard(wide.state_dict())), g)
    result = merge_heterogeneous([ad_s.spec, ad_b.spec], [small, planted], iterations=50, tol=1e-12)
    back = result.restricted(0)
    assert max(float((back[k] - small[k]).abs().max()) for k in small) < 1e-6
    assert rel_err(logits(load_state(model_type, narrow.config, ad_s.from_standard(back))), logits(narrow)) < 1e-6


@pytest.mark.parametrize("small, big, message", [
    (dict(LLAMA, num_key_value_heads=1), dict(LLAMA, hidden_size=48, num_attention_heads=6, num_key_value_heads=3),
     "more query heads per key/value head"),
    (dict(LLAMA, num_key_value_heads=4), dict(LLAMA, hidden_size=48, num_attention_heads=6, num_key_value_heads=3),
     "more key/value heads"),
])
def test_groups_that_cannot_embed_are_refused(small, big, message):
    spec_s, spec_b = hf_adapter(hf_model("llama", **small)).spec, hf_adapter(hf_model("llama", **big)).spec
    with pytest.raises(ValueError, match=message):
        check_embeddable(spec_s, spec_b)


def test_different_rotating_dims_are_refused():
    spec_s = hf_adapter(hf_model("gpt_neox", **dict(NEOX, rotary_pct=0.5))).spec
    spec_b = hf_adapter(hf_model("gpt_neox", **dict(NEOX, rotary_pct=0.25, hidden_size=48,
                                                     num_attention_heads=6))).spec
    with pytest.raises(ValueError, match="rotating dims"):
        check_embeddable(spec_s, spec_b)
