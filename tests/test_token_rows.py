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
