"""Robust aggregation in the aligned basis: cohort screening after alignment, exact robust
aggregators and clipping, and the run config that selects them."""

from __future__ import annotations

import pytest
import torch
from flwr.app import ArrayRecord

from fedbasin.config import resolve_run_config
from fedbasin.strategies.robust import (
    cohort_outliers,
    coordinate_median,
    mad_outliers,
    trimmed_mean,
)
from tests.helpers import VIT, inputs, rel_err, run, spec_of
from tests.test_strategy import (  # noqa: F401
    base_state,
    reply,
    serverapp_identity,
    strategy_for,
    transformed_copies,
)

NODES = (1, 2, 3, 4, 5)


def shifted(base: dict, shifts) -> list[dict]:
    return [{k: v + c for k, v in base.items()} for c in shifts]


def aggregate(shifts, **options):
    """FedAvg path (no alignment) on ``base + c_k``, equal counts; returns (merged − base, metrics)."""
    spec, base = spec_of("vit", VIT), base_state()
    states = shifted(base, shifts)
    strategy = strategy_for(spec, base, alignment=False, **options)
    arrays, metrics = strategy.aggregate_train(2, [reply(n, ArrayRecord(s)) for n, s in zip(NODES, states)])
    merged = arrays.to_torch_state_dict()
    offsets = {k: merged[k] - base[k] for k in base}
    return offsets, metrics, strategy


@pytest.mark.parametrize(
    "options, expected",
    [
        ({"aggregator": "mean"}, (0 + 1 + 2 + 4 + 100) / 5),
        ({"aggregator": "trimmed-mean", "trim_fraction": 0.2}, (1 + 2 + 4) / 3),  # drops 0 and 100
        ({"aggregator": "median"}, 2.0),
        # updates clipped to 1 × the median update norm (that of shift 2): shifts 4 and 100 → 2
        ({"clip_ratio": 1.0}, (0 + 1 + 2 + 2 + 2) / 5),
    ],
)
def test_robust_aggregators_are_exact(options, expected):
    offsets, metrics, _ = aggregate((0, 1, 2, 4, 100), outlier_threshold=0.0, **options)
    for value in offsets.values():
        torch.testing.assert_close(value, torch.full_like(value, expected), rtol=1e-5, atol=1e-4)
    assert metrics["num_clipped"] == 2 if "clip_ratio" in options else "num_clipped" not in metrics


def test_coordinate_statistics_on_small_cohorts():
    states = [{"w": torch.tensor([float(v), -float(v)])} for v in (3, 1, 2, 10)]
    torch.testing.assert_close(coordinate_median(states)["w"], torch.tensor([2.5, -2.5]))
    torch.testing.assert_close(trimmed_mean(states, 0.25)["w"], torch.tensor([2.5, -2.5]))
    torch.testing.assert_close(trimmed_mean(states, 0.0)["w"], torch.tensor([4.0, -4.0]))
    # MAD rule: 10 is far from (1, 1.1, 0.9); values within 1 + 0.15·t of the median never are
    assert mad_outliers([1.0, 1.1, 0.9, 10.0], 3.5) == [3]
    assert mad_outliers([1.0, 1.0, 1.0, 1.5], 3.5) == []
    assert mad_outliers([1.0, 1.0, 1.0, 1.6], 3.5) == [3]
    assert mad_outliers([1.0, 1.0, 1.0, 1.6], 3.5, negligible=2.0) == []
    assert cohort_outliers(states[:2], None, 3.5) == {}  # two models: no majority to judge by


def test_the_cohort_is_judged_in_the_aligned_basis(caplog):
    """Honest replies come in random bases (far apart coordinate-wise); the attacker sits in the
    server's basis but far from the model's function. Only after alignment is the attacker the
    outlier: it is excluded, and the merge keeps the honest function."""
    spec, base = spec_of("vit", VIT), base_state()
    honest = transformed_copies(spec, base, 4, noise=1e-3)
    g = torch.Generator().manual_seed(5)
    # (0.1: raw distance 6.5 against the honest replies' 11; with the server model's tiny gain
    # the honest replies used to look far only through the ill-conditioned bias β/γ)
    attacker = {k: v + 0.1 * torch.randn(v.shape, generator=g) for k, v in base.items()}
    replies = [reply(n, ArrayRecord(s)) for n, s in zip(NODES, [*honest, attacker])]
    strategy = strategy_for(spec, base)
    with caplog.at_level("WARNING", logger="flwr"):
        arrays, metrics = strategy.aggregate_train(2, replies)
    assert metrics["excluded_nodes"] == [5]
    [entry] = strategy.screening[2]["excluded"]
    assert entry["stage"] == "cohort" and "is an outlier" in entry["reason"] and "node 5:" in caplog.text
    x, _ = inputs("vit", VIT, dtype=torch.float32)
    expected = run("vit", VIT, base, x, torch.float32)
    screened = rel_err(run("vit", VIT, arrays.to_torch_state_dict(), x, torch.float32), expected)
    assert screened < 0.05
    # in the raw coordinates the attacker is the closest reply to the server's model
    raw = [sum(float((s[k] - base[k]).norm() ** 2) for k in base) for s in [*honest, attacker]]
    assert min(range(5), key=raw.__getitem__) == 4
    # without screening the attacker moves the merged function
    arrays, _ = strategy_for(spec, base, outlier_threshold=0.0).aggregate_train(2, replies)
    unscreened = rel_err(run("vit", VIT, arrays.to_torch_state_dict(), x, torch.float32), expected)
    assert unscreened > 3 * screened, (screened, unscreened)


def test_coordinate_median_after_alignment_resists_a_huge_reply_without_screening():
    spec, base = spec_of("vit", VIT), base_state()
    honest = transformed_copies(spec, base, 3, noise=1e-3)
    huge = {k: v * 1e3 for k, v in honest[0].items()}  # passes max_abs_weight, outlier rule off
    replies = [reply(n, ArrayRecord(s)) for n, s in zip(NODES, [*honest, huge])]
    x, _ = inputs("vit", VIT, dtype=torch.float32)
    expected = run("vit", VIT, base, x, torch.float32)
    errors = {}
    for how in ("mean", "median", "trimmed-mean"):
        arrays, metrics = strategy_for(spec, base, outlier_threshold=0.0, aggregator=how).aggregate_train(2, replies)
        assert metrics["num_excluded"] == 0
        errors[how] = rel_err(run("vit", VIT, arrays.to_torch_state_dict(), x, torch.float32), expected)
    assert errors["median"] < 0.05 and errors["trimmed-mean"] < 0.05 and errors["mean"] > 1


def test_run_config_selects_the_robust_options():
    config = resolve_run_config({"aggregator": "trimmed-mean", "trim-fraction": 0.1, "clip-ratio": 2,
                                 "outlier-threshold": 0, "max-examples-ratio": 0, "max-num-examples": 50})
    assert (config["aggregator"], config["trim-fraction"], config["clip-ratio"]) == ("trimmed-mean", 0.1, 2.0)
    with pytest.raises(ValueError, match="aggregator='mode'"):
        resolve_run_config({"aggregator": "mode"})
    with pytest.raises(ValueError, match="clip-ratio=-1.0 must be at least 0"):
        resolve_run_config({"clip-ratio": -1.0})
