"""AlignedFedAvg's round output on clients that really differ (independently trained models):
exactly the example-weighted aligned average, with the right reference; its argument checks."""

from __future__ import annotations

import math

import pytest
import torch
from flwr.app import ArrayRecord

from fedbasin.alignment import (
    RefineResult,
    apply_group,
    canonicalize,
    random_group_element,
    to_gauge,
    weight_match,
)
from fedbasin.options import MatchOptions, RobustOptions
from fedbasin.strategies import AlignedFedAvg

from .helpers import DIGITS_VIT, VIT, max_diff, spec_of, trained_digits_vit
from .test_merge_weights import weighted_mean
from .test_strategy import NODES, reply, serverapp_identity, strategy_for  # noqa: F401  (autouse fixture)

COUNTS = [10, 30, 60]


def clients_and_replies():
    clients = [trained_digits_vit(s) for s in (2, 3, 4)]
    return clients, [reply(n, ArrayRecord(s), c) for n, s, c in zip(NODES, clients, COUNTS)]


def aligned_average(spec, reference: dict, clients: list[dict], weights, include_reference=False) -> dict:
    """gauge_ref(Σ_k w_k g_k·θ_k / Σ_k w_k), g_k from weight matching θ_k to the reference."""
    ref = canonicalize(spec, reference)
    aligned = [weight_match(spec, reference, s).canonical for s in clients]
    if include_reference:
        aligned, weights = [ref.state, *aligned], [weights[0], *weights[1:]]
    return to_gauge(spec, weighted_mean(aligned, weights), ref.gains)


def test_round_output_is_the_example_weighted_aligned_average():
    """Round 2: every client is aligned to the previous global model (weight 0), averaged by num-examples."""
    spec = spec_of("vit", DIGITS_VIT)
    previous = trained_digits_vit(1)
    clients, replies = clients_and_replies()
    arrays, metrics = strategy_for(spec, previous, max_examples_ratio=0.0).aggregate_train(2, replies)
    merged = arrays.to_torch_state_dict()
    expected = aligned_average(spec, previous, clients, COUNTS)
    assert max_diff(merged, expected) < 1e-5
    assert max_diff(expected, aligned_average(spec, previous, clients, [1, 1, 1])) > 0.05
    assert metrics["align_gain"] > 0.05  # trained models: matching raises the objective clearly


def test_round_one_with_independent_inits_aligns_to_the_client_with_most_examples():
    spec = spec_of("vit", DIGITS_VIT)
    clients, replies = clients_and_replies()
    strategy = strategy_for(spec, trained_digits_vit(1), independent_init=True, max_examples_ratio=0.0)
    merged = strategy.aggregate_train(1, replies)[0].to_torch_state_dict()
    # client 2 (60 examples) is the reference: the others are aligned to it, all averaged by count
    order = [2, 0, 1]
    expected = aligned_average(spec, clients[2], [clients[0], clients[1]], [COUNTS[k] for k in order],
                               include_reference=True)
    assert max_diff(merged, expected) < 1e-5
    # another reference gives a clearly different model: the test sees which client was used
    other = aligned_average(spec, clients[0], [clients[1], clients[2]], COUNTS, include_reference=True)
    assert max_diff(expected, other) > 0.05


def test_server_side_refinement_output_is_what_gets_averaged():
    """With ``refine``, the round averages the refined canonical models (by num-examples, in the
    previous global model's gauge) and reports the refinement's selection losses."""
    spec = spec_of("vit", DIGITS_VIT)
    previous = trained_digits_vit(1)
    clients, replies = clients_and_replies()
    refined, order = [], []  # order: the client behind each model refine gets (replies come in content order)

    def refine(reference, others, include_reference):
        assert include_reference is False and len(others) == 3
        for i, s in enumerate(others):
            order.append(next(k for k, c in enumerate(clients) if all(torch.equal(c[n], s[n]) for n in c)))  # a stand-in "refinement": weight matching then one more exact move
            start = weight_match(spec, reference, s).canonical
            refined.append(apply_group(spec, start, random_group_element(spec, 40 + i, dtype=torch.float32)))
        return RefineResult([to_gauge(spec, c, canonicalize(spec, reference).gains) for c in refined], refined,
                            [], initial_loss=2.0, best_loss=1.5, best_step=3)

    arrays, metrics = strategy_for(spec, previous, refine=refine, max_examples_ratio=0.0).aggregate_train(2, replies)
    assert sorted(order) == [0, 1, 2]
    expected = to_gauge(spec, weighted_mean(refined, [COUNTS[k] for k in order]), canonicalize(spec, previous).gains)
    assert max_diff(arrays.to_torch_state_dict(), expected) < 1e-5
    assert max_diff(expected, aligned_average(spec, previous, clients, COUNTS)) > 0.05
    assert metrics["align_gain"] == pytest.approx(0.5) and metrics["refine_heldout_loss"] == pytest.approx(1.5)


@pytest.mark.parametrize("options, message", [
    # the plain keywords are checked by the schema's rules too, named as the keyword
    (dict(mode="rotation"), r"^mode='rotation': expected one of orthogonal \| permutation$"),
    (dict(iterations=0), r"^iterations=0: must be at least 1$"),
    (dict(iterations=2.5), r"^iterations=2.5: expected an integer, got float$"),
    (dict(universe_iterations=0), r"^universe_iterations=0: must be at least 1$"),
    (dict(tol=-1e-3), r"^tol=-0.001: must be at least 0$"),
    (dict(tol=math.nan), r"^tol=nan: must be finite$"),
    (dict(aggregator="mode"), r"^aggregator='mode': expected one of mean \| trimmed-mean \| median$"),
    (dict(trim_fraction=0.5), r"^trim_fraction=0.5: must be below 0.5$"),
    (dict(max_abs_weight=0), r"^max_abs_weight=0: must be greater than 0$"),
    (dict(clip_ratio=-1.0), r"^clip_ratio=-1.0: must be at least 0$"),
    (dict(outlier_threshold=math.inf), r"^outlier_threshold=inf: must be finite$"),
    (dict(max_num_examples=2.5), r"^max_num_examples=2.5: expected an integer, got float$"),
    (dict(refine="learned"), "refine must be callable"),
    (dict(distill="feddf"), "distill must be callable"),
    (dict(refine=lambda *a, **k: None, alignment=False), "refine needs alignment"),
    # option objects are checked by the schema when the strategy is built, not in every round
    (dict(match=MatchOptions(head_weight=-1.0)), r"^MatchOptions.head_weight=-1.0: must be greater than 0$"),
    (dict(match=MatchOptions(head_weight="x")), r"^MatchOptions.head_weight='x': expected a number or auto, got str$"),
    (dict(robust=RobustOptions(max_abs_weight="1e6")), r"^RobustOptions.max_abs_weight='1e6': expected a number"),
])
def test_bad_strategy_arguments_raise_clear_errors(options, message):
    with pytest.raises(ValueError, match=message):
        AlignedFedAvg(spec_of("vit", VIT), **options)


def test_a_count_written_as_a_float_is_still_a_count():
    """max_num_examples is documented as a number: 1e6 (a float) keeps working as the cap 1,000,000."""
    strategy = AlignedFedAvg(spec_of("vit", VIT), max_num_examples=1e6, iterations=3, tol=0)
    assert strategy.max_num_examples == 1_000_000 and isinstance(strategy.max_num_examples, int)
    assert strategy.iterations == 3 and strategy.tol == 0
