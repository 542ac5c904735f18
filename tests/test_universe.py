"""Universe matching on independently trained models: re-aligning every model to the running
average pulls the aligned models closer together than aligning once to a single reference."""

from __future__ import annotations

import pytest
from flwr.app import ArrayRecord

from fedbasin.alignment import canonicalize, merge

from .helpers import DIGITS_VIT, spec_of, trained_digits_vit
from .test_strategy import NODES, reply, serverapp_identity, strategy_for  # noqa: F401  (autouse fixture)


def centroid_distance(spec, result, states, reference=0) -> float:
    """D = Σ_k ‖g_k·θ_k − U‖² (canonical weights) for the final alignments g_k and merged model U.

    With ``weighting="uniform"`` matching maximises ⟨U, g·θ_k⟩, i.e. minimises ‖g·θ_k − U‖²
    (the group keeps norms), and U = mean minimises D for fixed g_k: universe matching is block
    coordinate descent on D, single-reference alignment is its first block step.
    """
    aligned = [m.canonical for m in result.matches]
    if len(aligned) < len(states):  # one pass: the reference itself was not matched
        aligned.insert(reference, canonicalize(spec, states[reference]).state)
    keys = sorted(spec.keys())
    return sum(float((a[k].double() - result.canonical[k].double()).pow(2).sum()) for a in aligned for k in keys)


@pytest.mark.parametrize("weighting", ["uniform", "rms"])
def test_universe_passes_reduce_the_distance_to_the_centroid(weighting):
    spec = spec_of("vit", DIGITS_VIT)
    states = [trained_digits_vit(s) for s in (1, 2, 3, 4)]
    distances = []
    for passes in (1, 2, 3):
        result = merge(spec, states, universe_iterations=passes, universe_tol=-1.0, weighting=weighting)
        assert len(result.universe_change) == passes
        distances.append(centroid_distance(spec, result, states))
    # measured (seeds 1-4): uniform 161.7 → 155.1 → 154.3, rms 168.9 → 160.2 → 158.7
    assert distances[1] < distances[0] * 0.98 and distances[2] <= distances[1]
    # the merged model changes less and less from pass to pass
    assert result.universe_change[2] < result.universe_change[1] < result.universe_change[0]


def test_universe_stops_when_the_merge_no_longer_moves():
    spec = spec_of("vit", DIGITS_VIT)
    states = [trained_digits_vit(s) for s in (1, 2, 3)]
    result = merge(spec, states, universe_iterations=20, universe_tol=0.05)
    assert 2 <= len(result.universe_change) < 20  # more than one pass, and it stopped early
    assert result.universe_change[-1] < 0.05 <= min(result.universe_change[:-1])


def test_strategy_universe_passes_are_the_merge_universe_passes(monkeypatch):
    """AlignedFedAvg(universe_iterations=3): the round's model is the 3-pass universe merge with the
    previous global model as first target (weight 0), and it differs from the single pass.

    Weight matching runs without maps-only sweeps here: they converge further into a flat optimum
    where the strategy's lean path (released replies restored in place, block-wise averages)
    rounds differently from merge() and the maps move by it (1.8e-4 in the weights after 3
    passes, against 1e-6 without them)."""
    from fedbasin.alignment import matching

    monkeypatch.setattr(matching, "INNER_SWEEPS", 0)
    spec = spec_of("vit", DIGITS_VIT)
    previous = trained_digits_vit(1)
    clients = [trained_digits_vit(s) for s in (2, 3, 4)]
    counts = [10, 30, 60]
    replies = [reply(n, ArrayRecord(s), c) for n, s, c in zip(NODES, clients, counts)]
    strategy = strategy_for(spec, previous, universe_iterations=3, max_examples_ratio=0)  # the counts are the weights
    arrays, metrics = strategy.aggregate_train(2, replies)
    merged = arrays.to_torch_state_dict()
    assert metrics["universe_passes"] == 3
    three = merge(spec, [previous, *clients], [0, *counts], universe_iterations=3)
    one = merge(spec, [previous, *clients], [0, *counts], universe_iterations=1)
    assert max(float((merged[k] - three.state[k]).abs().max()) for k in merged) < 1e-5
    assert max(float((merged[k] - one.state[k]).abs().max()) for k in merged) > 1e-2
