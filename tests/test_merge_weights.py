"""Weights of the aligned average, on independently trained models (where weighting is visible)."""

from __future__ import annotations

import re

import math

import pytest
import torch

from fedbasin.alignment import average_states, canonicalize, merge, to_gauge, weight_match
from fedbasin.alignment.width import embed, merge_heterogeneous

from .helpers import cli_error, DIGITS_VIT, VIT, max_diff, spec_of, trained_digits_vit, trained_like


def weighted_mean(states: list[dict], weights: list[float]) -> dict:
    """Σ_k w_k θ_k / Σ_k w_k, written out here (independent of the library's average_states)."""
    return {k: sum(w * s[k].double() for w, s in zip(weights, states)) / sum(weights) for k in states[0]}


def test_aligned_merge_is_the_weighted_average_of_the_aligned_models():
    """merge(θ_0, θ_1, θ_2; w) = gauge_0(Σ w_k g_k·θ_k / Σ w_k), each g_k found by matching θ_k to θ_0."""
    spec = spec_of("vit", DIGITS_VIT)
    states = [trained_digits_vit(s) for s in (1, 2, 3)]
    weights = [1.0, 2.0, 5.0]
    ref = canonicalize(spec, states[0])
    aligned = [ref.state] + [weight_match(spec, states[0], s).canonical for s in states[1:]]
    expected = to_gauge(spec, weighted_mean(aligned, weights), ref.gains)
    uniform = to_gauge(spec, weighted_mean(aligned, [1.0, 1.0, 1.0]), ref.gains)
    assert max_diff(expected, uniform) > 0.05  # the clients really differ: weights are visible

    result = merge(spec, states, weights=weights)
    assert max_diff(result.state, expected) < 1e-5
    # only the ratios count
    assert max_diff(merge(spec, states, weights=[w * 7 for w in weights]).state, expected) < 1e-5
    # a single non-zero weight returns that (aligned) model
    assert max_diff(merge(spec, states[:2], weights=[1.0, 0.0]).state, states[0]) < 1e-6
    assert max_diff(merge(spec, states[:2], weights=[0.0, 1.0]).state,
                    weight_match(spec, states[0], states[1]).state) < 1e-5


def test_plain_average_uses_the_weights_too():
    spec = spec_of("vit", DIGITS_VIT)
    a, b = trained_digits_vit(1), trained_digits_vit(2)
    result = merge(spec, [a, b], weights=[1.0, 3.0], align=False)
    ca, cb = canonicalize(spec, a).state, canonicalize(spec, b).state
    for key in a:
        torch.testing.assert_close(result.canonical[key], 0.25 * ca[key] + 0.75 * cb[key], rtol=1e-5, atol=1e-6)


def test_width_merge_weights_the_embedded_models():
    """merge_heterogeneous = merge of (embedded narrow, wide) with the same weights, wide as reference."""
    small = dict(VIT, dim=16, heads=2, mlp_dim=20)
    big = dict(small, dim=24, heads=3, mlp_dim=32)
    spec_s, spec_b = spec_of("vit", small), spec_of("vit", big)
    narrow = trained_like("vit", small, seed=1).state_dict()
    wide = trained_like("vit", big, seed=2).state_dict()
    result = merge_heterogeneous([spec_s, spec_b], [narrow, wide], weights=[3.0, 1.0])
    expected = merge(spec_b, [embed(spec_s, narrow, spec_b, wide), wide], weights=[3.0, 1.0], reference=1)
    assert max_diff(result.state, expected.state) < 1e-12
    other = merge_heterogeneous([spec_s, spec_b], [narrow, wide], weights=[1.0, 1.0])
    assert max_diff(result.state, other.state) > 1e-2


@pytest.mark.parametrize("weights, message", [
    ([1.0], "got 1 merge weights for 2 models"),
    ([1.0, 2.0, 3.0], "got 3 merge weights for 2 models"),
    ([1.0, -0.5], "non-negative"),
    ([0.0, 0.0], "positive sum"),
    ([1.0, math.nan], "finite"),
    ([math.inf, 1.0], "finite"),
])
def test_bad_merge_weights_raise_clear_errors(weights, message):
    spec = spec_of("vit", VIT)
    states = [trained_like("vit", VIT, seed=s).state_dict() for s in (1, 2)]
    with pytest.raises(ValueError, match=message):
        merge(spec, states, weights=weights)
    with pytest.raises(ValueError, match=message):
        merge(spec, states, weights=weights, align=False)


def test_average_states_rejects_weights_without_a_finite_positive_sum():
    state = trained_like("vit", VIT, seed=1).state_dict()
    for weights in ([0.0, 0.0], [1.0, math.nan], [math.inf, 1.0]):
        with pytest.raises(ValueError, match="merge weights"):
            average_states([state, state], weights)


def test_reference_index_out_of_range():
    spec = spec_of("vit", VIT)
    states = [trained_like("vit", VIT, seed=s).state_dict() for s in (1, 2)]
    for reference in (2, -1):
        with pytest.raises(ValueError, match=f"reference index {reference} out of range for 2 models"):
            merge(spec, states, reference=reference)


def test_cli_merge_weights(tmp_path, capsys):
    """`fedbasin merge --weights 1,3` on two trained checkpoints writes the weighted aligned average."""
    from fedbasin.checkpoint import load_checkpoint, save_checkpoint
    from fedbasin.cli import main
    from fedbasin.models import make_config

    spec = spec_of("vit", DIGITS_VIT)
    a, b = trained_digits_vit(1), trained_digits_vit(2)
    for name, state in (("a", a), ("b", b)):
        save_checkpoint(tmp_path / name, "vit", make_config("vit", DIGITS_VIT), state)
    assert main(["merge", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "m"),
                 "--weights", "1,3"]) == 0
    capsys.readouterr()
    merged = load_checkpoint(tmp_path / "m").state
    assert max_diff(merged, merge(spec, [a, b], weights=[1, 3]).state) < 1e-5
    assert max_diff(merged, merge(spec, [a, b]).state) > 0.05
    message = cli_error(capsys, ["merge", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "n"), "--weights", "1,x"])
    assert "weight 1 is 'x', not a number" in message
    assert re.search(">= 0", cli_error(capsys, ["merge", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "n"), "--weights", "1,-1"]))
    assert not (tmp_path / "n").exists()


def test_combiners_are_declared_and_plain_callables_are_wrapped():
    """The merge's ``combine`` is a :class:`Combiner` (default :class:`WeightedAverage`); a plain
    ``(states, weights)`` callable, and a combiner that never reports entries through ``on_key``,
    give the default's merge bitwise, universe passes included."""
    from fedbasin.alignment import Combiner, WeightedAverage, as_combiner

    spec = spec_of("vit", VIT)
    states = [trained_like("vit", VIT, seed=s).state_dict() for s in (1, 2, 3)]
    options = dict(weights=[0.0, 1.0, 2.0], universe_iterations=2, universe_tol=-1.0, iterations=2)

    class Silent(Combiner):  # never calls on_key
        calls = 0

        def combine(self, states, weights, on_key=None):
            Silent.calls += 1
            return average_states(states, weights)

    expected = merge(spec, states, **options)
    for combine in (WeightedAverage(), average_states, lambda s, w: average_states(s, w), Silent()):
        result = merge(spec, [dict(s) for s in states], combine=combine, **options)
        assert all(torch.equal(result.state[k], expected.state[k]) for k in expected.state)
        assert result.universe_change == expected.universe_change
    assert Silent.calls == 2
    assert isinstance(as_combiner(None), WeightedAverage) and isinstance(as_combiner(average_states), WeightedAverage)
    with pytest.raises(TypeError, match="Combiner"):
        merge(spec, states, combine="mean")
    with pytest.raises(TypeError):
        Combiner()  # combine() is abstract
