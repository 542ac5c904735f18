"""The CPU speed paths of weight matching give the results of the plain ones: the MLP score
accumulated in place, single-threaded SVDs, and per-layer steps run in worker threads."""

from __future__ import annotations

import dataclasses
import math
import threading

import pytest
import torch

from fedbasin.alignment import canonicalize, matching, weight_match
from fedbasin.alignment.matching import (
    _layers_disjoint,
    _Matcher,
    _Objective,
    one_thread,
    procrustes,
)

from .helpers import GPT, spec_of, trained_like

WIDE = dict(GPT, dim=32, depth=3, heads=4, mlp_dim=48)
POLAR_SIZE = matching.POLAR_BY_EIGH_FROM + 44  # a residual width whose Procrustes goes through eigh


def _pair(config, dtype=torch.float64):
    a = trained_like("gpt", config, seed=0, dtype=dtype).state_dict()
    b = trained_like("gpt", config, seed=1, dtype=dtype).state_dict()
    return a, b


@pytest.mark.parametrize("activation,bias", [("gelu", True), ("swiglu", False), ("relu", True)])
def test_neuron_scores_equal_the_product_of_concatenated_neuron_rows(activation, bias):
    """score[i, j] = Σ_p w_p ⟨row i of θ_ref,p, row j of θ_p⟩ over up (and gate) rows, their biases
    and down columns, as one product of concatenated rows (the textbook form), float64."""
    config = dict(WIDE, activation=activation, bias=bias)
    spec = spec_of("gpt", config)
    a, b = _pair(config)
    ref = canonicalize(spec, a, "reference").state
    cand = canonicalize(spec, b, "candidate").state
    matcher = _Matcher(spec, ref, _Objective(spec, ref, cand, "rms"), "orthogonal")
    for m in spec.mlp:
        rows = [(k, False) for lin in (m.up, m.gate) if lin for k in (lin.weight, lin.bias) if k]
        rows += [(m.down.weight, True)]
        assert (m.gate is not None) == (activation == "swiglu") and bool(m.up.bias) == bias

        def side(state, weighted, rows=rows):
            cols = []
            for key, transpose in rows:
                x = state[key].T if transpose else state[key]
                x = x.reshape(x.shape[0], -1)
                cols.append(x * matcher.w[key] if weighted else x)
            return torch.cat(cols, 1)

        expected = side(ref, True) @ side(cand, False).T
        got = matcher.neuron_scores(m, cand)
        assert torch.allclose(got, expected, rtol=1e-12, atol=1e-12 * float(expected.abs().max()))


def test_one_thread_runs_single_threaded_and_restores_the_count():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with one_thread(torch.device("cpu")):
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
        with pytest.raises(RuntimeError), one_thread(torch.device("cpu")):
            raise RuntimeError("inside")
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_procrustes_value_is_the_attained_maximum():
    """O = U Vᵀ is orthogonal and tr(Oᵀ M) equals the returned ‖M‖_* (batched, single-threaded)."""
    m = torch.randn(5, 7, 7, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    o, value = procrustes(m, value=True)
    eye = torch.eye(7, dtype=torch.float64)
    assert torch.allclose(o.mT @ o, eye.expand(5, 7, 7), atol=1e-12)
    assert torch.allclose((o * m).sum((-2, -1)), value, rtol=1e-12)
    assert torch.allclose(value, torch.linalg.svdvals(m).sum(-1), rtol=1e-12)


def test_layer_steps_in_worker_threads_equal_the_sequential_loop(monkeypatch):
    """With 2 threads the head and MLP steps of the layers run in worker threads; the iterates,
    the objective record and the group element are those of the sequential loop."""
    config = dict(WIDE, activation="gelu")
    spec = spec_of("gpt", config)
    a, b = _pair(config, torch.float32)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        where = []
        original = _Matcher.neuron_step

        def spy(self, m, state):
            where.append(threading.current_thread() is threading.main_thread())
            return original(self, m, state)

        delta_where = []
        original_delta = _Matcher.neuron_delta

        def delta_spy(self, m, before, perm):
            delta_where.append(threading.current_thread() is threading.main_thread())
            return original_delta(self, m, before, perm)

        monkeypatch.setattr(_Matcher, "neuron_step", spy)
        monkeypatch.setattr(_Matcher, "neuron_delta", delta_spy)
        parallel = weight_match(spec, a, b, iterations=4, tol=0)
        assert where and not any(where), "the MLP steps did not run in worker threads"
        assert delta_where and not any(delta_where), "the MLP covariance updates did not run in worker threads"
        where.clear()
        monkeypatch.setattr(matching, "per_layer", lambda step, layers, device: [step(x) for x in layers])
        sequential = weight_match(spec, a, b, iterations=4, tol=0)
        assert where and all(where)
    finally:
        torch.set_num_threads(before)
    assert parallel.objective == pytest.approx(sequential.objective, rel=1e-6)
    assert parallel.objective[-1] > parallel.objective[0]
    for x, y in zip(parallel.transform.neurons, sequential.transform.neurons):
        assert torch.equal(x.perm, y.perm)
    for x, y in zip(parallel.transform.heads, sequential.transform.heads):
        assert torch.equal(x.perm, y.perm)
        assert torch.allclose(x.qk, y.qk, atol=1e-5) and torch.allclose(x.ov, y.ov, atol=1e-5)
    for k in parallel.state:
        assert torch.allclose(parallel.state[k], sequential.state[k], atol=1e-5), k


def test_layers_sharing_a_tensor_are_not_stepped_in_parallel():
    """Per-layer steps commute only when the layers own disjoint tensors; a shared MLP (or
    attention) makes the matcher fall back to the sequential loop."""
    spec = spec_of("gpt", WIDE)
    assert _layers_disjoint(spec)
    assert not _layers_disjoint(dataclasses.replace(spec, mlp=(spec.mlp[0], spec.mlp[0])))
    assert not _layers_disjoint(dataclasses.replace(spec, attention=(spec.attention[1],) * 2))


@pytest.mark.parametrize("activation,signed", [("gelu", False), ("swiglu", False), ("swiglu", True)])
def test_unrotated_mlp_weights_give_the_iterates_of_rotating_them(monkeypatch, activation, signed):
    """The MLP weights stay unrotated during matching, their C kept up to date from the rows each
    neuron permutation (and, with signed gated units, each sign flip) moves: objective record, group
    element and aligned state are those of the reference computation (rotate them at every residual
    step, recompute their C), float64."""
    monkeypatch.setattr(matching, "SIGNED_GATED_UNITS", signed)
    config = dict(WIDE, activation=activation)
    spec = spec_of("gpt", config)
    a, b = _pair(config)
    deltas = []
    original = _Matcher.neuron_delta

    def spy(self, m, before, perm):
        delta = original(self, m, before, perm)
        deltas.append(float(delta.abs().max()))
        return delta

    monkeypatch.setattr(_Matcher, "neuron_delta", spy)
    kept = weight_match(spec, a, b, iterations=5, tol=0)
    assert deltas and max(deltas) > 0, "no neuron permutation was exercised"
    monkeypatch.setattr(matching, "UNROTATED_MLP", False)
    deltas.clear()
    rotated = weight_match(spec, a, b, iterations=5, tol=0)
    assert not deltas
    assert kept.objective == pytest.approx(rotated.objective, rel=1e-10)
    assert kept.objective[-1] > kept.objective[1]
    assert torch.allclose(kept.transform.residual, rotated.transform.residual, atol=1e-9)
    for x, y in zip(kept.transform.neurons, rotated.transform.neurons):
        assert torch.equal(x.perm, y.perm) and (x.scale is None) == (y.scale is None)
        assert x.scale is None or torch.equal(x.scale, y.scale)
    if signed:
        assert any(n.scale is not None and bool((n.scale < 0).any()) for n in kept.transform.neurons)
    for k in kept.state:
        assert torch.allclose(kept.state[k], rotated.state[k], atol=1e-9), k


def _heads_in_place(spec, state, mode, seed=3):
    """``state`` moved by random within-head maps (every head kept in place), plus a little noise."""
    from fedbasin.alignment import random_group_element
    from fedbasin.alignment.group import HeadMap, apply_group

    g = random_group_element(spec, seed, mode=mode)
    g.residual, g.neurons = None, [None] * len(spec.mlp)
    g.heads = [HeadMap(torch.arange(a.num_heads), h.qk, h.ov) for a, h in zip(spec.attention, g.heads)]
    moved = apply_group(spec, state, g)
    noise = torch.Generator().manual_seed(seed)
    return {k: v + 0.01 * v.std() * torch.randn(v.shape, generator=noise, dtype=v.dtype) if v.dim() == 2 else v
            for k, v in moved.items()}


def _llama_gqa():
    from fedbasin.alignment.hf import hf_adapter

    from .causal_lm import hf_model

    model = hf_model("llama", num_key_value_heads=2)
    adapter = hf_adapter(model)
    return adapter.spec, adapter.to_standard(model.state_dict())


@pytest.mark.parametrize("case", ["learned", "rope", "permutation", "llama-gqa"])
def test_head_maps_are_the_head_steps_maps_when_heads_stay(case):
    """The maps-only head step (diagonal pairs, no values, no assignment) returns what the full
    head step returns when its assignment keeps every head in place: same maps, identity
    permutation (orthogonal, RoPE plane rotations, within-head permutations, grouped queries)."""
    mode = "permutation" if case == "permutation" else "orthogonal"
    if case == "llama-gqa":
        spec, raw = _llama_gqa()
    else:
        config = dict(WIDE, position="rope" if case == "rope" else "learned")
        spec, raw = spec_of("gpt", config), _pair(config)[0]
    ref = canonicalize(spec, raw, "reference").state
    cand = _heads_in_place(spec, ref, mode)
    matcher = _Matcher(spec, ref, _Objective(spec, ref, cand, "rms"), mode)
    for a in spec.attention:
        full, maps = matcher.head_step(a, cand), matcher.head_maps(a, cand)
        assert torch.equal(full.perm, torch.arange(a.num_heads)) and torch.equal(maps.perm, full.perm)
        assert maps.qk.shape[0] == a.kv_heads
        assert torch.allclose(maps.qk, full.qk, atol=1e-9) and torch.allclose(maps.ov, full.ov, atol=1e-9)


@pytest.mark.parametrize("d", [3, 40, POLAR_SIZE])
def test_residual_procrustes_fixing_ones_equals_the_dense_complement_basis(d):
    """LayerNorm's residual map (O·1 = 1) from the Householder reflection equals
    ``11ᵀ/d + Q R Qᵀ`` with the dense QR basis Q of the complement of 1, and attains the maximum
    of tr(Oᵀ C) over that group (``‖QᵀCQ‖_* + 1ᵀC1/d``)."""
    from fedbasin.alignment.group import ones_complement
    from fedbasin.alignment.matching import residual_procrustes

    c = torch.randn(d, d, generator=torch.Generator().manual_seed(d), dtype=torch.float64)
    q = ones_complement(d)
    expected = torch.full((d, d), 1.0 / d, dtype=torch.float64) + q @ procrustes(q.T @ c @ q) @ q.T
    o = residual_procrustes(c, fix_ones=True)
    ones = torch.ones(d, dtype=torch.float64)
    assert torch.allclose(o, expected, atol=1e-10)
    assert torch.allclose(o @ ones, ones, atol=1e-12)
    assert torch.allclose(o.T @ o, torch.eye(d, dtype=torch.float64), atol=1e-12)
    best = torch.linalg.svdvals(q.T @ c @ q).sum() + ones @ c @ ones / d
    assert torch.trace(o.T @ c) == pytest.approx(float(best), rel=1e-12)


@pytest.mark.parametrize("conditioning", [1.0, 1e3, 1e-6])
def test_large_procrustes_by_eigh_equals_the_svd_polar_factor(conditioning):
    """The residual map's Procrustes (d ≥ POLAR_BY_EIGH_FROM) through eigh of MᵀM gives U Vᵀ of
    the SVD to round-off and is orthogonal; with σ_min/σ_max below 1e-4 (last case) the SVD runs."""
    from fedbasin.alignment.matching import POLAR_BY_EIGH_FROM, _polar_by_eigh

    d = POLAR_BY_EIGH_FROM + 44
    g = torch.Generator().manual_seed(1)
    q1, _ = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))
    q2, _ = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))
    sigma = torch.logspace(0, math.log10(conditioning), d, dtype=torch.float64)  # σ_max/σ_min ≈ conditioning
    sigma = sigma * torch.rand(d, generator=g, dtype=torch.float64).add(1)
    m = q1 @ torch.diag(sigma) @ q2.T
    u, _, vh = torch.linalg.svd(m)
    o = procrustes(m)
    assert torch.allclose(o, u @ vh, atol=1e-9)
    assert torch.allclose(o.T @ o, torch.eye(d, dtype=torch.float64), atol=1e-12)
    assert (_polar_by_eigh(m) is None) == (conditioning < 1e-4)


@pytest.mark.parametrize("scales", [False, True])
def test_unrotated_mlp_weights_from_a_given_start(monkeypatch, scales):
    """A given start with neuron maps (permutations; ReLU scalings too) starts the kept MLP
    covariance from its own state: same iterates as the reference computation."""
    from fedbasin.alignment.group import GroupElement, NeuronMap, apply_group

    config = dict(WIDE, activation="relu")
    spec = spec_of("gpt", config)
    ref = canonicalize(spec, _pair(config)[0], "reference").state
    g = torch.Generator().manual_seed(4)
    planted, undo = GroupElement.identity(spec), GroupElement.identity(spec)
    for i, m in enumerate(spec.mlp):
        n = ref[m.up.weight].shape[0]
        perm = torch.randperm(n, generator=g)
        scale = torch.rand(n, generator=g, dtype=torch.float64).add(0.5) if scales else None
        planted.neurons[i] = NeuronMap(perm, scale)
        back = torch.argsort(perm)
        undo.neurons[i] = NeuronMap(back, None if scale is None else 1.0 / scale[back])
    cand = apply_group(spec, ref, planted)
    cand = {k: v + 0.05 * v.std() * torch.randn(v.shape, generator=g, dtype=v.dtype) if v.dim() == 2 else v
            for k, v in cand.items()}
    kept = weight_match(spec, ref, cand, iterations=3, tol=0, init=undo)
    assert kept.start == "given"
    monkeypatch.setattr(matching, "UNROTATED_MLP", False)
    rotated = weight_match(spec, ref, cand, iterations=3, tol=0, init=undo)
    assert kept.objective == pytest.approx(rotated.objective, rel=1e-10)
    for k in kept.state:  # near the optimum J is flat: the maps agree to ~√ε, not ε
        assert torch.allclose(kept.state[k], rotated.state[k], atol=1e-6), k
