"""Width-heterogeneous models: exact embedding, restriction, alignment, merging, errors."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
import torch

from fedbasin.alignment import (
    apply_group,
    canonicalize,
    compose,
    random_group_element,
    to_gauge,
    weight_match,
)
from fedbasin.alignment.width import (
    check_embeddable,
    default_residual_map,
    embed,
    inverse,
    merge_heterogeneous,
    restrict,
    width_factor,
)

from .helpers import inputs, max_diff, rel_err, run, spec_of, trained_like

BASE = {
    "vit": dict(image_size=8, patch_size=4, channels=1, num_classes=5, depth=2),
    "gpt": dict(vocab_size=23, block_size=12, depth=2),
}


def pair(family, norm="layernorm", activation="gelu", position="learned", bias=True, norm_eps=0.0):
    """(narrow, wide) configs: d 16 → 24, heads 2 → 3 (d_h = 8 both), MLP 20 → 32."""
    small = dict(BASE[family], dim=16, heads=2, mlp_dim=20, norm=norm, activation=activation, bias=bias,
                 norm_eps=norm_eps)
    if family == "gpt":
        small["position"] = position
    return small, dict(small, dim=24, heads=3, mlp_dim=32)


PAIRS = [("vit", pair("vit", norm, act)) for norm, act in itertools.product(("layernorm", "rmsnorm"), ("gelu", "swiglu"))]
PAIRS += [("gpt", pair("gpt", norm, act, pos)) for norm, act, pos in
          itertools.product(("layernorm", "rmsnorm"), ("gelu", "swiglu"), ("learned", "rope"))]
PAIRS += [("vit", pair("vit", "layernorm", "relu", bias=False)), ("gpt", pair("gpt", "rmsnorm", "relu", "rope", False))]


def pair_id(p) -> str:
    family, (small, _) = p
    return "-".join([family, small["norm"][:3], small["activation"], small.get("position", ""),
                     "bias" if small["bias"] else "nobias"]).replace("--", "-")


def setup(p, seed=1):
    family, (small, big) = p
    narrow = trained_like(family, small, seed=seed).state_dict()
    wide = trained_like(family, big, seed=seed + 1).state_dict()
    return family, small, big, spec_of(family, small), spec_of(family, big), narrow, wide


def test_default_residual_map_is_valid():
    for d_s, d_b in ((1, 5), (8, 8), (16, 24), (7, 64)):
        o = default_residual_map(d_s, d_b)
        assert torch.allclose(o @ o.T, torch.eye(d_s, dtype=o.dtype), atol=1e-13)
        assert torch.allclose(o.sum(0), torch.full((d_b,), width_factor(d_s, d_b), dtype=o.dtype), atol=1e-13)
    assert torch.allclose(default_residual_map(8, 8), torch.eye(8, dtype=torch.float64), atol=1e-13)


@pytest.mark.parametrize("p", PAIRS, ids=pair_id)
def test_embedding_is_function_preserving_float64(p):
    family, small, big, spec_s, spec_b, narrow, wide = setup(p)
    x, _ = inputs(family, small)
    expected = run(family, small, narrow, x)
    embedded = embed(spec_s, narrow, spec_b, wide)
    assert rel_err(run(family, big, embedded, x), expected) < 1e-10
    # any other admissible residual map works too: the default composed with a wide group element
    o = default_residual_map(16, 24) @ random_group_element(spec_b, 5, state=wide).residual
    assert rel_err(run(family, big, embed(spec_s, narrow, spec_b, wide, o), x), expected) < 1e-10


@pytest.mark.parametrize("p", PAIRS[:2], ids=pair_id)
def test_embedding_with_norm_eps_is_exact_only_up_to_eps(p):
    family, small, big, spec_s, spec_b, narrow, wide = setup(p)
    small, big = dict(small, norm_eps=None), dict(big, norm_eps=None)  # LayerNorm 1e-5 / RMSNorm 1e-6
    x, _ = inputs(family, small)
    err = rel_err(run(family, big, embed(spec_s, narrow, spec_b, wide), x), run(family, small, narrow, x))
    assert 1e-10 < err < 1e-3


@pytest.mark.parametrize("p", PAIRS[::3], ids=pair_id)
def test_embed_then_restrict_is_the_identity(p):
    family, small, big, spec_s, spec_b, narrow, wide = setup(p)
    gains = canonicalize(spec_s, narrow).gains
    embedded = embed(spec_s, narrow, spec_b, wide)
    assert max_diff(restrict(spec_b, embedded, spec_s, gains=gains), narrow) < 1e-12
    # the same after an arbitrary wide group element, when restrict is told which one
    g = random_group_element(spec_b, 9, state=wide)
    moved = to_gauge(spec_b, apply_group(spec_b, embedded, g), canonicalize(spec_b, wide).gains)
    assert max_diff(restrict(spec_b, moved, spec_s, transform=g, gains=gains), narrow) < 1e-12
    x, _ = inputs(family, small)
    assert rel_err(run(family, big, moved, x), run(family, small, narrow, x)) < 1e-10


def test_inverse_undoes_a_group_element():
    *_, spec_b, _, wide = setup(PAIRS[-3])  # RoPE: non-orthogonal plane scalings
    g = random_group_element(spec_b, 4, scales=True, state=wide)
    state = canonicalize(spec_b, wide).state
    assert max_diff(apply_group(spec_b, apply_group(spec_b, state, g), inverse(g)), state) < 1e-12
    assert max_diff(apply_group(spec_b, state, compose(g, inverse(g))), state) < 1e-12


@pytest.mark.parametrize("p", PAIRS[::2], ids=pair_id)
def test_weight_matching_recovers_a_transformed_embedding(p):
    """The embedded model is an ordinary wide model: a random wide group element (which composes O
    into another admissible map O R) is function preserving and weight matching undoes it."""
    family, small, big, spec_s, spec_b, narrow, wide = setup(p)
    embedded = embed(spec_s, narrow, spec_b, wide)
    g = random_group_element(spec_b, 13, state=wide)
    moved = apply_group(spec_b, embedded, g)
    o = default_residual_map(16, 24) @ g.residual
    assert torch.allclose(o @ o.T, torch.eye(16, dtype=o.dtype), atol=1e-12)
    assert torch.allclose(o.sum(0), torch.full((24,), width_factor(16, 24), dtype=o.dtype), atol=1e-12) or \
        small["norm"] == "rmsnorm"
    x, _ = inputs(family, small)
    assert rel_err(run(family, big, moved, x), run(family, small, narrow, x)) < 1e-10
    result = weight_match(spec_b, embedded, moved, iterations=50, tol=1e-12)
    assert max_diff(result.state, embedded) < 1e-8
    assert result.objective[-1] == pytest.approx(1.0, abs=1e-9)


@pytest.mark.parametrize("p", [PAIRS[0], PAIRS[7]], ids=pair_id)
def test_merging_a_wide_model_with_its_exact_restriction(p):
    """Wide client W = g·embed(N) (non-trivial gains), narrow client N' = a narrow-group transform of
    N, i.e. an exact restriction of W. Aligned merging across widths must find the planted embedding:
    the merged wide model is W for any weights, and each client receives exactly itself back.
    Averaging without alignment breaks the function."""
    family, small, big, spec_s, spec_b, narrow, wide = setup(p)
    g = random_group_element(spec_b, 17, state=wide)
    w = to_gauge(spec_b, apply_group(spec_b, embed(spec_s, narrow, spec_b, wide), g), canonicalize(spec_b, wide).gains)
    c = canonicalize(spec_s, narrow)
    n = to_gauge(spec_s, apply_group(spec_s, c.state, random_group_element(spec_s, 19, state=narrow)), c.gains)
    assert max_diff(restrict(spec_b, w, spec_s, transform=g, gains=c.gains), narrow) < 1e-12

    result = merge_heterogeneous([spec_s, spec_b], [n, w], weights=[3, 1], iterations=50, tol=1e-12)
    assert result.widest == 1 and result.members[0].embedded and not result.members[1].embedded
    x, _ = inputs(family, small)
    expected = run(family, small, narrow, x)
    assert rel_err(run(family, big, result.state, x), expected) < 1e-8
    assert max_diff(result.state, w) < 1e-8
    assert max_diff(result.restricted(0), n) < 1e-8
    assert max_diff(result.restricted(1), w) < 1e-8
    m = result.members[0]
    assert rel_err(run(family, small, restrict(spec_b, result.state, spec_s, m.residual_map, m.transform), x),
                   expected) < 1e-8

    universe = merge_heterogeneous([spec_s, spec_b], [n, w], iterations=50, tol=1e-12, universe_iterations=2,
                                   universe_tol=-1.0)
    assert all(m.transform is not None for m in universe.members)  # round 2 also moves the widest
    assert max_diff(universe.restricted(0), n) < 1e-8 and max_diff(universe.restricted(1), w) < 1e-8

    plain = merge_heterogeneous([spec_s, spec_b], [n, w], weights=[3, 1], align=False)
    assert rel_err(run(family, big, plain.state, x), expected) > 1e-2


def test_non_embeddable_pairs_raise_clear_errors():
    family, small, _, spec_s, spec_b, narrow, wide = setup(PAIRS[4])  # GPT
    with pytest.raises(ValueError, match="wider"):
        embed(spec_b, wide, spec_s, narrow)
    more_heads = replace(spec_s, attention=tuple(replace(a, num_heads=4) for a in spec_s.attention))
    with pytest.raises(ValueError, match="more heads"):  # only in specs where H·d_h ≠ d (fedbasin: d = H·d_h)
        check_embeddable(more_heads, spec_b)
    other_dh = dict(small, heads=4)  # d_h 4
    with pytest.raises(ValueError, match="head width 4 vs 8"):
        embed(spec_of(family, other_dh), trained_like(family, other_dh, 1).state_dict(), spec_b)
    deeper = dict(small, depth=3)
    with pytest.raises(ValueError, match="different depth"):
        embed(spec_of(family, deeper), trained_like(family, deeper, 1).state_dict(), spec_b)
    vocab = dict(small, vocab_size=30)
    with pytest.raises(ValueError, match=r"head\.weight.*vocabulary"):
        embed(spec_of(family, vocab), trained_like(family, vocab, 1).state_dict(), spec_b, wide)
    rms = dict(small, norm="rmsnorm")
    with pytest.raises(ValueError, match="norm kind"):
        embed(spec_of(family, rms), trained_like(family, rms, 1).state_dict(), spec_b)
    wider_mlp = dict(small, mlp_dim=40)
    with pytest.raises(ValueError, match="more MLP units"):
        embed(spec_of(family, wider_mlp), trained_like(family, wider_mlp, 1).state_dict(), spec_b)
    with pytest.raises(ValueError, match="not orthonormal"):
        embed(spec_s, narrow, spec_b, wide, residual_map=2 * default_residual_map(16, 24))
    coordinate = torch.eye(24, dtype=torch.float64)[:16]  # orthonormal rows but 1_s O ≠ c 1_b
    with pytest.raises(ValueError, match="LayerNorm models need"):
        embed(spec_s, narrow, spec_b, wide, residual_map=coordinate)
    with pytest.raises(ValueError, match=r"shape \(16, 16\)"):
        embed(spec_s, narrow, spec_b, wide, residual_map=torch.eye(16, dtype=torch.float64))
    vit_family, (vit_small, _) = PAIRS[0]
    with pytest.raises(ValueError, match="cannot be embedded"):
        merge_heterogeneous([spec_of(vit_family, vit_small), spec_b],
                            [trained_like(vit_family, vit_small, 1).state_dict(), wide])
    with pytest.raises(ValueError, match="at least 2"):
        merge_heterogeneous([spec_b], [wide])
