"""Learned refinement of Hugging Face causal LMs with grouped-query attention (Llama/Qwen2 with
fewer key/value heads) and partial rotary (GPT-NeoX ``rotary_pct`` < 1): the refinement's
parametrisation is an exact group element for both groups, and refinement on proxy data keeps the
function and never returns something worse than its start on the selection split."""

from __future__ import annotations

import pytest
import torch

from fedbasin.alignment import (
    apply_group,
    canonicalize,
    learned_refine,
    random_group_element,
    to_gauge,
)
from fedbasin.alignment.group import check_group_perm
from fedbasin.alignment.hf import hf_adapter
from fedbasin.alignment.parametrize import _Delta
from fedbasin.alignment.proxy import proxy_streams
from fedbasin.data.task import Split
from fedbasin.training import cross_entropy

from .causal_lm import float64_rmsnorm, hf_model, load_state, logits, rel_err  # noqa: F401  (autouse fixture)

VARIANTS = {
    "llama-gqa2": ("llama", {"num_key_value_heads": 2}),  # 2 query heads per key/value head
    "llama-mqa-bias": ("llama", {"num_key_value_heads": 1, "attention_bias": True}),  # 4 per key/value head
    "qwen2-gqa2": ("qwen2", {"num_key_value_heads": 2}),  # q/k/v biases
    "neox-rotary-half": ("gpt_neox", {"rotary_pct": 0.5}),  # 4 of 8 head dims rotate
    "neox-rotary-quarter-relu": ("gpt_neox", {"rotary_pct": 0.25, "hidden_act": "relu"}),
}


def _far_from_orthogonal(m: torch.Tensor) -> float:
    eye = torch.eye(m.shape[-1], dtype=m.dtype)
    return float((m @ m.transpose(-1, -2) - eye).abs().max())


def _moved_logits(model_type, model, adapter, canonical, state) -> torch.Tensor:
    """Logits of a model of ``model``'s config carrying the canonical ``state`` in the model's gauge."""
    moved = adapter.from_standard(to_gauge(adapter.spec, state, canonical.gains))
    return logits(load_state(model_type, model.config, moved))


@pytest.mark.parametrize("group", ["orthogonal", "invertible"])
@pytest.mark.parametrize("name", VARIANTS)
def test_random_refinement_parameters_are_exact_group_elements(name, group):
    """Random parameters of the refinement module (scores, per-group maps, plane angles/scales,
    position-free blocks): the differentiable transform equals the exact group action of its hard
    element, the element respects key/value groups, and the logits are unchanged (float64 < 1e-10)."""
    model_type, overrides = VARIANTS[name]
    model = hf_model(model_type, seed=3, **overrides)
    adapter = hf_adapter(model)
    spec = adapter.spec
    canonical = canonicalize(spec, adapter.to_standard(model.state_dict()))
    delta = _Delta(spec, canonical.state, "ste", init_scale=1.0, group=group)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in delta.parameters():
            p.add_(0.5 * torch.randn(p.shape, generator=generator, dtype=p.dtype))
        for i, a in enumerate(spec.attention):  # groups in reverse order; group 0 reverses its query heads
            delta.head_scores[i].add_(4 * torch.eye(a.kv_heads, dtype=torch.float64).flip(0))
            if a.group_size > 1:
                delta.within_scores[str(i)][0].add_(4 * torch.eye(a.group_size, dtype=torch.float64).flip(0))
    g = delta.hard_element()
    for a, hm in zip(spec.attention, g.heads):
        G, r = a.kv_heads, a.group_size
        assert hm.qk.shape == hm.ov.shape == (G, a.head_dim, a.head_dim)  # one map per key/value group
        blocks = hm.perm.reshape(G, r) // r
        assert bool((blocks == blocks[:, :1]).all())  # query heads move only with their group
        free = hm.qk[:, a.rotated:, a.rotated:]  # partial rotary: the position-free block is learned too
        if free.numel():
            assert float((free - torch.eye(free.shape[-1], dtype=free.dtype)).abs().max()) > 0.1
        if group == "invertible":
            assert _far_from_orthogonal(hm.qk) > 0.05 and _far_from_orthogonal(hm.ov) > 0.05
            if free.numel():  # ... and leaves the orthogonal group
                assert _far_from_orthogonal(free) > 0.05
        H = a.num_heads
        if G > 1:
            assert bool((hm.perm // r != torch.arange(H) // r).any())  # whole groups moved
        if r > 1:
            assert bool((hm.perm % r != torch.arange(H) % r).any())  # query heads moved inside a group
    with torch.no_grad():
        soft_path = delta.transform(canonical.state, tau=0.1, hard=True)
    exact = apply_group(spec, canonical.state, g)
    assert max(float((soft_path[k] - exact[k]).abs().max()) for k in exact) < 1e-10
    assert max(float((exact[k] - canonical.state[k]).abs().max()) for k in exact) > 0.1  # it moved
    assert rel_err(_moved_logits(model_type, model, adapter, canonical, exact), logits(model)) < 1e-10


def test_random_invertible_element_with_partial_rotary_keeps_logits():
    """``random_group_element(mode="invertible")`` on partial rotary: scaled plane rotations and an
    invertible (not orthogonal) block on the position-free dims act exactly."""
    model_type, overrides = VARIANTS["neox-rotary-half"]
    model = hf_model(model_type, seed=4, **overrides)
    adapter = hf_adapter(model)
    canonical = canonicalize(adapter.spec, adapter.to_standard(model.state_dict()))
    g = random_group_element(adapter.spec, 5, mode="invertible")
    rd = adapter.spec.attention[0].rotated
    for hm in g.heads:
        assert _far_from_orthogonal(hm.qk[:, rd:, rd:]) > 0.1 and _far_from_orthogonal(hm.qk[:, :rd, :rd]) > 0.1
    moved = apply_group(adapter.spec, canonical.state, g)
    assert rel_err(_moved_logits(model_type, model, adapter, canonical, moved), logits(model)) < 1e-10


def _proxy(model_type, overrides, n=96, seq=12):
    """Random token sequences labelled with a third model's next-token choices (float32)."""
    ids = torch.randint(0, 40, (n, seq), generator=torch.Generator().manual_seed(0))
    teacher = hf_model(model_type, seed=99, dtype=torch.float32, **overrides)
    with torch.no_grad():
        targets = teacher(ids).logits.argmax(-1)
    return proxy_streams(Split(ids, targets), 16, seed=0)


@pytest.mark.parametrize("name, group, permutations", [
    ("llama-gqa2", "orthogonal", "ste"), ("llama-gqa2", "invertible", "ste"),
    ("neox-rotary-half", "orthogonal", "ste"), ("neox-rotary-half", "invertible", "ste"),
    ("llama-mqa-bias", "orthogonal", "sinkhorn"), ("qwen2-gqa2", "invertible", "fixed"),
])
def test_learned_refinement_keeps_function_and_never_raises_the_selection_loss(name, group, permutations):
    """On a float32 pair: the refined candidate computes its input's function (relative error
    < 1e-5), the returned selection loss is the history's minimum and not above the start, and
    the refinement found something better than its start (its gradients reach the maps)."""
    model_type, overrides = VARIANTS[name]
    a = hf_model(model_type, seed=1, dtype=torch.float32, **overrides)
    b = hf_model(model_type, seed=2, dtype=torch.float32, **overrides)
    adapter = hf_adapter(a)
    data = _proxy(model_type, overrides)
    result = learned_refine(adapter.spec, a, adapter.to_standard(a.state_dict()),
                            [adapter.to_standard(b.state_dict())], cross_entropy, data.batches, data.selection,
                            data.evaluation, steps=20, lr=0.05, eval_every=5, group=group, permutations=permutations,
                            to_module_state=adapter.from_standard)
    assert result.best_loss <= result.initial_loss
    assert result.best_loss == min(loss for _, loss in result.history)
    assert result.best_step > 0
    refined = load_state(model_type, b.config, adapter.from_standard(result.states[0])).float()
    assert rel_err(logits(refined), logits(b)) < 1e-5
    for attention, hm in zip(adapter.spec.attention, result.transforms[0].heads):  # start ∘ refinement
        assert hm.qk.shape[0] == hm.ov.shape[0] == attention.kv_heads  # one map per key/value group
        check_group_perm(attention, hm.perm)


def _rope_attention(a, state: dict, x: torch.Tensor) -> torch.Tensor:
    """Causal attention of one sequence x (T, d) with grouped-query heads and rotate-half RoPE on the
    first r_d dims of every head (GPT-NeoX's layout); no registered HF family has both."""
    T, H, G, dh, rd = x.shape[0], a.num_heads, a.kv_heads, a.head_dim, a.rotated
    proj = lambda lin, n: (x @ state[lin.weight].T + state[lin.bias]).reshape(T, n, dh)
    q, k, v = proj(a.q, H), proj(a.k, G), proj(a.v, G)
    angle = torch.arange(T, dtype=x.dtype)[:, None] * 10000.0 ** (-torch.arange(rd // 2, dtype=x.dtype) / (rd // 2))
    cos, sin = torch.cos(angle).repeat(1, 2)[:, None], torch.sin(angle).repeat(1, 2)[:, None]

    def rope(t):
        rot, rest = t[..., :rd], t[..., rd:]
        half = torch.cat([-rot[..., rd // 2:], rot[..., :rd // 2]], -1)
        return torch.cat([rot * cos + half * sin, rest], -1)

    q, k = rope(q), rope(k).repeat_interleave(a.group_size, 1)
    scores = torch.einsum("thd,shd->hts", q, k) / dh**0.5
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    out = torch.einsum("hts,shd->thd", scores.softmax(-1), v.repeat_interleave(a.group_size, 1))
    return out.reshape(T, H * dh) @ state[a.o.weight].T


@pytest.mark.parametrize("group", ["orthogonal", "invertible"])
def test_grouped_query_attention_with_partial_rotary_is_exact(group):
    """Both at once (6 query heads in 2 key/value groups, 4 of 8 head dims rotating), on a reference
    attention: random refinement parameters keep the attention output (moved by the residual map)."""
    from .helpers import gqa_attention

    generator = torch.Generator().manual_seed(0)
    a, spec, state = gqa_attention(generator)
    d = spec.width
    delta = _Delta(spec, state, "ste", init_scale=1.0, group=group)
    with torch.no_grad():
        for p in delta.parameters():
            p.add_(0.5 * torch.randn(p.shape, generator=generator, dtype=p.dtype))
        delta.head_scores[0].add_(4 * torch.eye(2, dtype=torch.float64).flip(0))
        delta.within_scores["0"][1].add_(4 * torch.eye(3, dtype=torch.float64).flip(0))
        moved = delta.transform(state, tau=0.1, hard=True)
    g = delta.hard_element()
    assert g.heads[0].perm.tolist() == [5, 4, 3, 0, 1, 2]  # groups swapped; old group 1 reversed inside
    exact = apply_group(spec, state, g)
    assert max(float((moved[k] - exact[k]).abs().max()) for k in exact) < 1e-10
    x = torch.randn(7, d, generator=generator, dtype=torch.float64)
    want = _rope_attention(a, state, x) @ g.residual
    assert rel_err(_rope_attention(a, moved, x @ g.residual), want) < 1e-10
