"""Colluders (issue 33): up to half the cohort cannot own the count weights, two equal camps fail
the round, proxy-loss screening excludes a label-flipped reply, and a clean cohort is untouched."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from flwr.app import ArrayRecord

from fedbasin.config import resolve_run_config
from fedbasin.strategies.robust import capped_counts, equal_split
from tests.helpers import VIT, inputs, run, spec_of
from tests.test_strategy import (  # noqa: F401
    base_state,
    reply,
    serverapp_identity,
    strategy_for,
    transformed_copies,
)


def merged_offset(states, counts, base, **options) -> tuple[float | None, dict, object]:
    """FedAvg path on ``states`` with ``counts``: (mean offset of the merge from ``base`` or None, metrics, strategy)."""
    strategy = strategy_for(spec_of("vit", VIT), base, alignment=False, **options)
    arrays, metrics = strategy.aggregate_train(
        2, [reply(n, ArrayRecord(s), c) for n, s, c in zip((1, 2, 3, 4, 5), states, counts)])
    if arrays is None:
        return None, metrics, strategy
    merged = arrays.to_torch_state_dict()
    return float(torch.cat([(merged[k] - base[k]).reshape(-1) for k in base]).mean()), metrics, strategy


def test_two_colluders_of_four_get_at_most_the_stated_weight_share():
    """Two honest nodes claim 100 examples, two colluders 1e6 each (within max-num-examples): the
    colluders' share of the averaging weight is at most f·ρ / (f·ρ + ⌊K/2⌋ + 1 − f) = 2/3 at the
    default ρ = 1, and here (equal honest counts) exactly f / K = 1/2."""
    base = base_state()
    shifts = (0.0, 1.0, 10.0, 10.0)
    states = [{k: v + c for k, v in base.items()} for c in shifts]
    offset, metrics, _ = merged_offset(states, [100, 100, 10**6, 10**6], base, outlier_threshold=0.0)
    share = (offset - 0.5) / (10.0 - 0.5)  # honest mean 0.5, colluders 10
    assert metrics["capped_nodes"] == [3, 4]
    assert share == pytest.approx(0.5, abs=1e-4)
    # the bound over cohorts: whatever f ≤ ⌊K/2⌋ colluders report, their weight share stays below it
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        size = int(torch.randint(2, 9, (1,), generator=g))
        colluders = int(torch.randint(1, size // 2 + 1, (1,), generator=g))
        ratio = float(torch.tensor([1.0, 2.0, 10.0])[torch.randint(0, 3, (1,), generator=g)])
        honest = (10 ** (3 * torch.rand(size - colluders, generator=g))).tolist()
        hostile = (10 ** (12 * torch.rand(colluders, generator=g))).tolist()
        weights, _ = capped_counts(honest + hostile, 10**6, ratio)
        share = sum(weights[len(honest):]) / sum(weights)
        assert share <= colluders * ratio / (colluders * ratio + size // 2 + 1 - colluders) + 1e-9


def camps(spec, base, far: float, seed: int = 3) -> list[dict]:
    """Two camps of two models each: copies of ``base`` and of ``base`` moved by ``far`` (random
    direction), each copy in a random basis with small noise. ``far`` about the weights' scale
    (0.1) gives another function (outputs 130 % apart) whose copies still align alike; at 0.3 the
    copies of the moved model align to ``base`` in different ways (13 apart within the camp, 23
    across): such camps looked split only through the ill-conditioned β/γ of base's tiny gain."""
    g = torch.Generator().manual_seed(seed)
    other = {k: v + far * torch.randn(v.shape, generator=g) for k, v in base.items()}
    return [*transformed_copies(spec, base, 2, noise=1e-2), *transformed_copies(spec, other, 2, noise=1e-2)]


@pytest.mark.parametrize("alignment", [False, True])
def test_an_even_split_keeps_the_previous_model_and_says_so(alignment, caplog):
    spec, base = spec_of("vit", VIT), base_state()
    states = camps(spec, base, far=0.1)
    if not alignment:  # the same camps in one basis
        g = torch.Generator().manual_seed(1)
        states = [*[{k: v + 1e-2 * torch.randn(v.shape, generator=g) for k, v in base.items()} for _ in range(2)],
                  *[{k: v + 0.3 for k, v in base.items()} for _ in range(2)]]
    strategy = strategy_for(spec, base, alignment=alignment)
    with caplog.at_level("WARNING", logger="flwr"):
        arrays, metrics = strategy.aggregate_train(2, [reply(n, ArrayRecord(s)) for n, s in zip((1, 2, 3, 4), states)])
    assert arrays is None and metrics["round_failed"] == 1 and metrics["num_excluded"] == 0
    failure = strategy.screening[2]["failed"]
    assert failure.startswith("no majority") and "[1, 2] and [3, 4]" in failure
    assert "round 2 failed (no majority" in caplog.text and "keeping the previous global model" in caplog.text


def test_a_clean_cohort_is_untouched():
    """Honest, unlike cohorts aggregate as before: no cap with equal counts, no split for K = 4
    even when the clients pair up somewhat (two label mixes), none for K = 2 however far apart."""
    base = base_state()
    g = torch.Generator().manual_seed(4)
    shared = [{k: 0.1 * torch.randn(v.shape, generator=g) for k, v in base.items()} for _ in range(2)]
    states = [{k: v + shared[i // 2][k] + 0.1 * torch.randn(v.shape, generator=g) for k, v in base.items()}
              for i in range(4)]  # pairs share a component: cross / within distance about 1.4
    assert equal_split(states) is None
    offset, metrics, strategy = merged_offset(states, [100] * 4, base)
    assert offset is not None and metrics["round_failed"] == 0 and metrics["num_excluded"] == 0
    assert metrics["capped_nodes"] == [] and strategy.screening[2]["failed"] == ""
    expected = sum(float(torch.cat([(s[k] - base[k]).reshape(-1) for k in base]).mean()) for s in states) / 4
    assert offset == pytest.approx(expected, abs=1e-5)
    far = [base, {k: v + 5.0 for k, v in base.items()}]
    offset, metrics, _ = merged_offset(far, [100, 100], base)
    assert metrics["round_failed"] == 0 and offset == pytest.approx(2.5, abs=1e-4)


def flipped(state: dict) -> dict:
    """The same model with its classes in reverse order: it predicts ``C − 1 − y`` for ``y``."""
    return {k: v.flip(0) if k.startswith("head.") else v for k, v in state.items()}


@pytest.mark.parametrize("hostile", [1, 2])
def test_proxy_screening_excludes_label_flipped_replies(hostile):
    """The server's proxy split labels inputs as the honest model does; label-flipped replies
    (one of four, and two of four: the 50 % case) have a much higher proxy loss and are excluded
    before alignment; the honest ones are kept."""
    spec, base = spec_of("vit", VIT), base_state()
    base = {k: 5 * v if k.startswith("head.") else v for k, v in base.items()}  # confident, like a trained model
    x, _ = inputs("vit", VIT, dtype=torch.float32, seed=1)
    x = torch.cat([x, inputs("vit", VIT, dtype=torch.float32, seed=2)[0]])
    labels = run("vit", VIT, base, x, torch.float32).argmax(-1)

    def proxy_loss(state):
        return float(F.cross_entropy(run("vit", VIT, state, x, torch.float32), labels))

    copies = transformed_copies(spec, base, 4, noise=1e-3)
    states = copies[:4 - hostile] + [flipped(c) for c in copies[4 - hostile:]]
    assert proxy_loss(states[-1]) > 1.5 * proxy_loss(states[0])
    replies = [reply(n, ArrayRecord(s)) for n, s in zip((1, 2, 3, 4), states)]
    strategy = strategy_for(spec, base, proxy_loss=proxy_loss, proxy_screening=0.5)
    arrays, metrics = strategy.aggregate_train(2, replies)
    hostile_nodes = list(range(5 - hostile, 5))
    # (listed in the cohort's content order, which depends on the CPU's rounding: compared as a set)
    assert sorted(metrics["excluded_nodes"]) == hostile_nodes and metrics["round_failed"] == 0
    assert all(e["stage"] == "proxy" and "proxy loss" in e["reason"] for e in strategy.screening[2]["excluded"])
    assert proxy_loss(arrays.to_torch_state_dict()) == pytest.approx(proxy_loss(base), abs=0.05)
    # without the option the flipped replies are averaged in
    _, metrics = strategy_for(spec, base, outlier_threshold=0.0).aggregate_train(2, replies)
    assert metrics["excluded_nodes"] == []


def test_proxy_screening_is_a_run_config_option_that_needs_a_proxy_split():
    assert resolve_run_config({"proxy-screening": 0.5, "proxy-size": 100})["proxy-screening"] == 0.5
    with pytest.raises(ValueError, match="proxy-screening=0.5 needs proxy-size >= 10"):
        resolve_run_config({"proxy-screening": 0.5})
    with pytest.raises(ValueError, match="proxy-screening=-1.0 must be at least 0"):
        resolve_run_config({"proxy-screening": -1.0, "proxy-size": 100})
