"""Norm gains near or at zero (issue 33, item 2): the canonical form and the gauge stay
well-conditioned, so alignment neither amplifies noise by 1/γ nor breaks the cohort screen."""

from __future__ import annotations

import torch
from flwr.app import ArrayRecord

from fedbasin.alignment import canonicalize, to_gauge, weight_match
from fedbasin.strategies.robust import distance
from tests.helpers import VIT, inputs, rel_err, run, spec_of, trained_like
from tests.test_strategy import reply, serverapp_identity, strategy_for  # noqa: F401

NODES = (1, 2, 3, 4, 5)


def tiny_gain_model(dtype=torch.float32) -> dict:
    """The ViT fixture with ordinary gains (|γ| ≥ 0.5) except three dims: 1e-3 (non-zero bias) in
    a block's first norm and in the final norm, and exactly 0 (bias 0) in an MLP norm."""
    spec = spec_of("vit", VIT)
    state = {k: v.detach().clone() for k, v in trained_like("vit", VIT, seed=0, dtype=dtype).state_dict().items()}
    for norm in spec.norms:
        w = state[norm.weight]
        w.copy_(torch.where(w.abs() < 0.5, torch.where(w < 0, -0.5, 0.5), w))
    state["blocks.1.norm1.weight"][3] = 1e-3
    state["norm_f.weight"][2] = 1e-3
    state["blocks.0.norm2.weight"][5] = 0.0
    state["blocks.0.norm2.bias"][5] = 0.0
    return state


def noisy(state: dict, count: int, std: float, seed: int) -> list[dict]:
    """Models trained from ``state``: every weight moved by N(0, std²)."""
    g = torch.Generator().manual_seed(seed)
    return [{k: v + std * torch.randn(v.shape, generator=g, dtype=v.dtype) for k, v in state.items()}
            for _ in range(count)]


def test_gauge_with_tiny_and_zero_reference_gains_is_finite_exact_and_not_amplified():
    spec, base = spec_of("vit", VIT), tiny_gain_model(torch.float64)
    x, _ = inputs("vit", VIT)
    c = canonicalize(spec, base)
    gauged = to_gauge(spec, c.state, c.gains)
    assert all(bool(torch.isfinite(v).all()) for v in gauged.values())
    assert rel_err(run("vit", VIT, c.state, x), run("vit", VIT, base, x)) < 1e-10
    assert rel_err(run("vit", VIT, gauged, x), run("vit", VIT, base, x)) < 1e-10
    for candidate in noisy(base, 3, 0.006, seed=3):
        match = weight_match(spec, base, candidate)
        assert all(bool(torch.isfinite(v).all()) for v in match.state.values())
        assert rel_err(run("vit", VIT, match.state, x), run("vit", VIT, candidate, x)) < 1e-8
        raw = distance(candidate, base)
        # the matched distance (reference's gauge, and the canonical basis the cohort screen
        # reads) is the raw one, not raw / γ (it was 7–18 × raw before)
        assert distance(match.state, gauged) < 1.1 * raw, (distance(match.state, gauged), raw)
        assert distance(match.canonical, c.state) < 1.1 * raw, (distance(match.canonical, c.state), raw)


def test_round_with_tiny_and_zero_global_gains_keeps_honest_replies_and_the_function():
    """Five honest replies trained from a global model with gains 1e-3 and 0: none is excluded,
    and the aligned average is as good as the plain one (outputs against the clients' mean)."""
    spec, base = spec_of("vit", VIT), tiny_gain_model()
    honest = noisy(base, 5, 0.006, seed=7)
    x, _ = inputs("vit", VIT, dtype=torch.float32)
    target = torch.stack([run("vit", VIT, h, x, torch.float32) for h in honest]).mean(0)
    errors = {}
    for alignment in (True, False):
        strategy = strategy_for(spec, base, alignment=alignment)
        arrays, metrics = strategy.aggregate_train(2, [reply(n, ArrayRecord(h)) for n, h in zip(NODES, honest)])
        assert metrics["excluded_nodes"] == []
        errors[alignment] = rel_err(run("vit", VIT, arrays.to_torch_state_dict(), x, torch.float32), target)
    # measured 0.0042 aligned, 0.0041 plain (before the fix: node 5 excluded, 0.033)
    assert errors[True] < 1.1 * errors[False], errors
