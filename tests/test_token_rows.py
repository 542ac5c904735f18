"""Weight matching restricted to the token rows seen in training (untrained rows are noise)."""

from __future__ import annotations

import torch

from fedbasin.alignment import apply_group, canonicalize, random_group_element, to_gauge, weight_match
from fedbasin.alignment.matching import token_indexed_keys

from .helpers import GPT, inputs, rel_err, run, spec_of, trained_like

CONFIG = dict(GPT, vocab_size=400)


def _planted_with_noisy_unseen_rows(seen: torch.Tensor):
    """A reference, and a transformed copy of it whose unseen token rows are replaced by noise."""
    spec = spec_of("gpt", CONFIG)
    ref = trained_like("gpt", CONFIG, seed=1).state_dict()
    canon = canonicalize(spec, ref)
    g = random_group_element(spec, 3, state=canon.state)
    moved = to_gauge(spec, apply_group(spec, canon.state, g), canon.gains)
    unseen = torch.ones(CONFIG["vocab_size"], dtype=torch.bool)
    unseen[seen] = False
    noise = torch.Generator().manual_seed(7)
    for key in token_indexed_keys(spec, ref):
        moved[key] = moved[key].clone()
        moved[key][unseen] = torch.randn(int(unseen.sum()), moved[key].shape[1], generator=noise, dtype=torch.float64)
    return spec, ref, moved


def test_token_indexed_keys_are_the_embedding_and_the_head():
    spec = spec_of("gpt", CONFIG)
    assert token_indexed_keys(spec, trained_like("gpt", CONFIG, seed=1).state_dict()) == {"tok_emb.weight",
                                                                                            "head.weight"}


def test_matching_on_seen_rows_recovers_the_planted_map_that_noise_hides():
    seen = torch.arange(0, 400, 8)  # 50 of 400 tokens were seen in training
    spec, ref, moved = _planted_with_noisy_unseen_rows(seen)
    restricted = weight_match(spec, ref, moved, iterations=30, tol=0.0, token_rows=seen)
    everything = weight_match(spec, ref, moved, iterations=30, tol=0.0)
    # the function of the candidate is kept (all rows transformed, not only the matched ones)
    probe, _ = inputs("gpt", CONFIG)
    assert rel_err(run("gpt", CONFIG, restricted.state, probe), run("gpt", CONFIG, moved, probe)) < 1e-9
    # on the seen rows and every block, the restricted match undoes the planted map exactly
    keys = [k for k in ref if k not in token_indexed_keys(spec, ref)]
    assert max(float((restricted.state[k] - ref[k]).abs().max()) for k in keys) < 1e-8
    for key in token_indexed_keys(spec, ref):
        assert torch.allclose(restricted.state[key][seen], ref[key][seen], atol=1e-8)
    # matching every row lets the noise pull the maps away from the planted one
    assert max(float((everything.state[k] - ref[k]).abs().max()) for k in keys) > 1e-3


def test_token_weights_from_counts():
    from fedbasin.alignment.matching import token_weights

    ids = torch.tensor([1, 1, 1, 1, 3, 5, 5, 5, 5, 5, 5, 5, 5, 5])  # counts: 1→4, 3→1, 5→9
    for weighting, expected in (("seen", [1.0, 1.0, 1.0]), ("sqrt", [2.0, 1.0, 3.0]), ("count", [4.0, 1.0, 9.0])):
        w = token_weights(ids, 7, weighting)
        e = torch.tensor(expected, dtype=torch.float64)
        assert torch.allclose(w[[1, 3, 5]], e / e.mean()) and float(w[[0, 2, 4, 6]].abs().sum()) == 0.0
    try:
        token_weights(ids, 7, "log")
    except ValueError as exc:
        assert "token weighting" in str(exc)
    else:
        raise AssertionError("an unknown token weighting was accepted")


def test_weighted_token_rows_keep_the_function_and_recover_the_planted_map():
    """Float weights: zero-weight rows are left out like unseen ids; the others count w_t times."""
    seen = torch.arange(0, 400, 8)
    spec, ref, moved = _planted_with_noisy_unseen_rows(seen)
    weights = torch.zeros(400, dtype=torch.float64)
    weights[seen] = torch.linspace(0.1, 5.0, len(seen), dtype=torch.float64)
    weighted = weight_match(spec, ref, moved, iterations=30, tol=0.0, token_rows=weights)
    probe, _ = inputs("gpt", CONFIG)
    assert rel_err(run("gpt", CONFIG, weighted.state, probe), run("gpt", CONFIG, moved, probe)) < 1e-9
    keys = [k for k in ref if k not in token_indexed_keys(spec, ref)]
    assert max(float((weighted.state[k] - ref[k]).abs().max()) for k in keys) < 1e-8
    # weights of one (the "seen" weighting) are exactly the id mask
    ones = (weights > 0).double()
    by_ids = weight_match(spec, ref, moved, iterations=5, tol=0.0, token_rows=seen)
    by_ones = weight_match(spec, ref, moved, iterations=5, tol=0.0, token_rows=ones)
    assert max(float((by_ids.state[k] - by_ones.state[k]).abs().max()) for k in ref) < 1e-12


def test_token_weights_change_the_match_and_bad_weights_are_refused():
    """Weights are not a no-op: on noisy (non-planted) pairs the weighted match differs from the mask."""
    spec = spec_of("gpt", CONFIG)
    ref = trained_like("gpt", CONFIG, seed=1).state_dict()
    cand = trained_like("gpt", CONFIG, seed=2).state_dict()
    seen = torch.arange(0, 400, 2)
    weights = torch.zeros(400, dtype=torch.float64)
    weights[seen] = torch.exp(torch.linspace(-3.0, 3.0, len(seen), dtype=torch.float64))
    masked = weight_match(spec, ref, cand, iterations=5, tol=0.0, token_rows=seen)
    weighted = weight_match(spec, ref, cand, iterations=5, tol=0.0, token_rows=weights)
    assert max(float((masked.state[k] - weighted.state[k]).abs().max()) for k in ref) > 1e-4
    for bad in (torch.ones(399, dtype=torch.float64), -torch.ones(400, dtype=torch.float64),
                torch.full((400,), float("nan"), dtype=torch.float64), torch.zeros(400, dtype=torch.float64)):
        try:
            weight_match(spec, ref, cand, iterations=1, token_rows=bad)
        except ValueError as exc:
            assert "token" in str(exc)
        else:
            raise AssertionError(f"bad token weights accepted: {bad[:3]}")
