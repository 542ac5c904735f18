"""The CPU speed paths of weight matching give the results of the plain ones: the MLP score
accumulated in place, single-threaded SVDs, and per-layer steps run in worker threads."""

from __future__ import annotations

import dataclasses
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

        monkeypatch.setattr(_Matcher, "neuron_step", spy)
        parallel = weight_match(spec, a, b, iterations=4, tol=0)
        assert where and not any(where), "the MLP steps did not run in worker threads"
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
