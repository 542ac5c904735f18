"""Learned refinement: exact group members, function kept, held-out proxy loss never worse."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from fedbasin.alignment import weight_match
from fedbasin.alignment.group import apply_group
from fedbasin.alignment.parametrize import _Delta, cayley, sinkhorn
from fedbasin.alignment.refine import learned_refine
from fedbasin.models import build_model, make_config

from .helpers import (
    DIGITS_VIT,
    VIT,
    inputs,
    rel_err,
    run,
    spec_of,
    trained_digits_vit,
    trained_like,
)


def test_cayley_is_orthogonal_and_sinkhorn_doubly_stochastic():
    a = torch.randn(3, 7, 7, dtype=torch.float64)
    o = cayley(a)
    assert torch.allclose(o @ o.transpose(-1, -2), torch.eye(7, dtype=torch.float64).expand(3, 7, 7), atol=1e-12)
    p = sinkhorn(torch.randn(6, 6), iterations=200)
    assert torch.allclose(p.sum(0), torch.ones(6), atol=1e-4) and torch.allclose(p.sum(1), torch.ones(6), atol=1e-4)


@pytest.mark.parametrize("config", [dict(VIT), dict(VIT, norm="rmsnorm", activation="swiglu")])
def test_projected_parameters_are_exact_group_members(config):
    spec = spec_of("vit", config)
    state = trained_like("vit", config, seed=1).state_dict()
    delta = _Delta(spec, state, "ste", init_scale=1.0)
    with torch.no_grad():
        for p in delta.parameters():
            p.add_(0.3 * torch.randn_like(p))
    g = delta.hard_element()
    o = g.residual
    assert torch.allclose(o @ o.T, torch.eye(o.shape[0], dtype=o.dtype), atol=1e-10)
    if config.get("norm", "layernorm") == "layernorm":
        assert torch.allclose(o.sum(1), torch.ones(o.shape[0], dtype=o.dtype), atol=1e-10)
    for hm in g.heads:
        assert sorted(hm.perm.tolist()) == list(range(len(hm.perm)))
    for nm in g.neurons:
        assert sorted(nm.perm.tolist()) == list(range(len(nm.perm)))
    # the differentiable hard transform equals the exact group action
    from fedbasin.alignment import canonicalize

    canon = canonicalize(spec, state).state
    with torch.no_grad():
        soft_path = delta.transform(canon, tau=0.1, hard=True)
    exact = apply_group(spec, canon, g)
    assert max(float((soft_path[k] - exact[k]).abs().max()) for k in exact) < 1e-10


def _proxy(config, n=96, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, config["channels"], config["image_size"], config["image_size"], generator=g, dtype=torch.float64)
    teacher = trained_like("vit", config, seed=99)
    with torch.no_grad():
        y = teacher(x).argmax(-1)
    return x, y


@pytest.mark.parametrize("permutations", ["ste", "sinkhorn"])
def test_refinement_keeps_functions_and_never_worsens_selection_or_evaluation_loss(permutations):
    config = dict(VIT)
    spec = spec_of("vit", config)
    ref = trained_like("vit", config, seed=1).state_dict()
    cand = trained_like("vit", config, seed=2).state_dict()
    x, y = _proxy(config, n=128)
    train_x, train_y = x[:64], y[:64]
    selection, evaluation = (x[64:96], y[64:96]), (x[96:], y[96:])

    def batches():
        while True:
            for i in range(0, 64, 16):
                yield train_x[i:i + 16], train_y[i:i + 16]

    model = build_model("vit", config).double()
    result = learned_refine(spec, model, ref, [cand], F.cross_entropy, batches(), selection, evaluation, steps=30,
                            lr=0.05, permutations=permutations, eval_every=5)
    assert result.best_loss < result.initial_loss and result.best_step > 0  # gradients reach the maps
    assert result.improved and "note" not in result.summary()
    assert len(result.history) == 1 + 30 // 5
    probe, _ = inputs("vit", config)
    assert rel_err(run("vit", config, result.states[0], probe), run("vit", config, cand, probe)) < 1e-9
    # recompute both losses at the midpoint independently: keep-best chose on the selection split,
    # and the evaluation split (never used for a decision) is reported for the start and the result
    start = weight_match(spec, ref, cand).state

    def mid_loss(state, split):
        mid = {k: (ref[k] + state[k]) / 2 for k in ref}
        return float(F.cross_entropy(run("vit", config, mid, split[0]), split[1]))

    assert mid_loss(result.states[0], selection) == pytest.approx(result.best_loss, abs=1e-9)
    assert mid_loss(start, selection) == pytest.approx(result.initial_loss, abs=1e-9)
    assert mid_loss(result.states[0], evaluation) == pytest.approx(result.evaluation_loss, abs=1e-9)
    assert mid_loss(start, evaluation) == pytest.approx(result.evaluation_initial_loss, abs=1e-9)
    # in this seeded setting the improvement carries over to data selection never saw
    assert result.evaluation_loss < result.evaluation_initial_loss


def _three_models(n: int):
    """Three RMSNorm ViTs, a proxy set of n examples and an endless stream of its first 32."""
    config = dict(VIT, norm="rmsnorm")
    states = [trained_like("vit", config, seed=s).state_dict() for s in (1, 2, 3)]
    x, y = _proxy(config, n=n)

    def batches():
        while True:
            yield x[:32], y[:32]

    return config, spec_of("vit", config), states, x, y, batches


def test_three_models_dirichlet_refinement_runs_and_keeps_functions():
    config, spec, states, x, y, batches = _three_models(48)
    result = learned_refine(spec, build_model("vit", config).double(), states[0], states[1:], F.cross_entropy,
                            batches(), (x[32:], y[32:]), steps=10, alpha=1.0, eval_every=5)
    assert len(result.states) == 2 and result.history[0] == (0, result.initial_loss)
    assert result.best_loss == min(loss for _, loss in result.history)  # keep-best kept the best step
    probe, _ = inputs("vit", config)
    for refined, original in zip(result.states, states[1:]):
        assert rel_err(run("vit", config, refined, probe), run("vit", config, original, probe)) < 1e-9


def save_trained_digits_vits(folder, seeds) -> None:
    """Checkpoints ``folder/m{seed}`` of the tiny digits ViTs trained from each seed."""
    from fedbasin.checkpoint import save_checkpoint

    for seed in seeds:
        save_checkpoint(folder / f"m{seed}", "vit", make_config("vit", DIGITS_VIT), trained_digits_vit(seed))


def test_cli_merge_with_refinement(tmp_path, capsys):
    from fedbasin.cli import main

    save_trained_digits_vits(tmp_path, (1, 2))  # really trained: refinement has a barrier to lower
    assert main(["merge", str(tmp_path / "m1"), str(tmp_path / "m2"), "--out", str(tmp_path / "out"),
                 "--refine-data", "digits", "--refine-steps", "6", "--refine-examples", "80", "--distill-steps", "0"]) == 0
    info = json.loads(capsys.readouterr().out)["refinement"]
    assert info["selection_loss_best"] < info["selection_loss_start"]
    assert (tmp_path / "out" / "model.safetensors").exists()


def test_refinement_of_rotary_gpt_keeps_function_and_improves():
    from .helpers import GPT

    config = dict(GPT, position="rope", norm="rmsnorm")
    spec = spec_of("gpt", config)
    ref = trained_like("gpt", config, seed=1).state_dict()
    cand = trained_like("gpt", config, seed=2).state_dict()
    ids = torch.randint(0, config["vocab_size"], (24, config["block_size"]), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # a teacher's next-token choices give the proxy task something to learn
        targets = run("gpt", config, trained_like("gpt", config, seed=99).state_dict(), ids).argmax(-1)

    def token_loss(logits, y):
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    def batches():
        while True:
            yield ids[:16], targets[:16]

    result = learned_refine(spec, build_model("gpt", config).double(), ref, [cand], token_loss, batches(),
                            (ids[16:], targets[16:]), steps=30, lr=0.05, eval_every=5)
    assert result.best_loss < result.initial_loss
    probe, _ = inputs("gpt", config)
    assert rel_err(run("gpt", config, result.states[0], probe), run("gpt", config, cand, probe)) < 1e-9


def test_reference_left_out_of_the_mixture():
    """include_reference=False: one candidate alone has nothing to refine; the start comes back."""
    config = dict(VIT)
    spec = spec_of("vit", config)
    ref = trained_like("vit", config, seed=1).state_dict()
    cand = trained_like("vit", config, seed=2).state_dict()
    x, y = _proxy(config, n=40)

    def batches():
        while True:
            yield x[:32], y[:32]

    result = learned_refine(spec, build_model("vit", config).double(), ref, [cand], F.cross_entropy, batches(),
                            (x[32:], y[32:]), steps=10, include_reference=False)
    assert result.best_step == 0 and len(result.history) == 1 and not result.improved
    assert "could not improve" in result.summary()["note"]
    start = weight_match(spec, ref, cand).state
    assert all(torch.equal(result.states[0][k], start[k]) for k in start)


def test_universe_matching_then_refinement_keeps_every_function():
    """universe_iterations > 1: the start is universe matching (the reference re-aligned too); every
    returned model — the moved reference included — keeps its function, and the merge uses them."""
    from fedbasin.alignment import canonicalize, merge, refined_merge, to_gauge

    config, spec, states, x, y, batches = _three_models(64)

    def refine(reference, others, include_reference=True):
        return learned_refine(spec, build_model("vit", config).double(), reference, others, F.cross_entropy,
                              batches(), (x[32:48], y[32:48]), (x[48:], y[48:]), steps=10, eval_every=5,
                              universe_iterations=4, match_tol=0.0, include_reference=include_reference)

    merged, result = refined_merge(spec, states, [1.0, 1.0, 1.0], 0, refine)
    universe = merge(spec, states, universe_iterations=4, universe_tol=1e-4, tol=0.0)
    assert len(universe.universe_change) > 1  # the reference was re-aligned, so it moved
    gains = canonicalize(spec, states[0]).gains
    moved_reference = to_gauge(spec, result.reference_canonical, gains)
    assert max(float((moved_reference[k] - states[0][k]).abs().max()) for k in states[0]) > 1e-3
    probe, _ = inputs("vit", config)
    assert rel_err(run("vit", config, moved_reference, probe), run("vit", config, states[0], probe)) < 1e-9
    for refined, original in zip(result.states, states[1:]):
        assert rel_err(run("vit", config, refined, probe), run("vit", config, original, probe)) < 1e-9
    assert result.best_loss < result.initial_loss
    # the merge is the plain average of the returned members (reference gauge)
    members = [moved_reference, *result.states]
    average = {k: sum(m[k] for m in members) / 3 for k in merged}
    assert max(float((merged[k] - average[k]).abs().max()) for k in merged) < 1e-9


def test_cli_merge_universe_with_refinement(tmp_path, capsys):
    from fedbasin.cli import main

    save_trained_digits_vits(tmp_path, (1, 2, 3))
    assert main(["merge", *(str(tmp_path / f"m{s}") for s in (1, 2, 3)), "--out", str(tmp_path / "out"),
                 "--universe-iterations", "3", "--refine-data", "digits", "--refine-steps", "8",
                 "--refine-examples", "300", "--distill-steps", "0"]) == 0
    info = json.loads(capsys.readouterr().out)["refinement"]
    assert info["selection_loss_best"] < info["selection_loss_start"] and "evaluation_loss" in info


def test_a_run_that_blows_up_resumes_from_its_best_maps_at_half_the_learning_rate():
    """At lr 0.3 the digits pair's refinement blows up (checks far above the start) and, left alone, never
    beats its start in 120 steps; a check more than RELAPSE worse than the start sends training back to the
    best maps with half the learning rate, and the run ends well below its start."""
    from fedbasin.alignment import proxy_streams
    from fedbasin.alignment.refine import RELAPSE
    from fedbasin.training import cross_entropy

    from .test_soft_labels import digits_pair

    model, spec, task, a, b = digits_pair()
    data = proxy_streams(task.proxy, 32, seed=0)
    result = learned_refine(spec, model, a, [b], cross_entropy, data.batches, data.selection, steps=120,
                            eval_every=10, lr=0.3, batch_workers=1)
    checks = dict(result.history)
    assert result.relapses and all(checks[s] > (1 + RELAPSE) * result.initial_loss for s in result.relapses)
    assert result.summary()["relapses"] == result.relapses
    assert result.best_step > max(result.relapses) and result.best_loss < 0.7 * result.initial_loss
