"""The larger exact groups (invertible per-head QK/OV maps, ReLU neuron scalings) and the options of
learned refinement: every group element keeps the function, and every refinement option keeps the
function and never returns something worse than its start on the selection split."""

from __future__ import annotations

import pytest
import torch

from fedbasin.alignment import apply_group, canonicalize, learned_refine, random_group_element, to_gauge
from fedbasin.alignment.parametrize import _Delta
from fedbasin.alignment.proxy import proxy_streams
from fedbasin.data import load_task
from fedbasin.models import build_model
from fedbasin.training import cross_entropy

from .helpers import DIGITS_VIT, GPT, VIT, cli_error, inputs, rel_err, run, spec_of, trained_digits_vit, trained_like

CONFIGS = {
    "vit-ln-gelu": ("vit", dict(VIT)),
    "vit-rms-relu": ("vit", dict(VIT, norm="rmsnorm", activation="relu")),
    "gpt-rope-relu": ("gpt", dict(GPT, position="rope", norm="rmsnorm", activation="relu")),
    "gpt-ln-swiglu": ("gpt", dict(GPT, activation="swiglu")),
}


def _far_from_orthogonal(m: torch.Tensor) -> float:
    eye = torch.eye(m.shape[-1], dtype=m.dtype)
    return float((m @ m.transpose(-1, -2) - eye).abs().max())


@pytest.mark.parametrize("name", CONFIGS)
def test_random_invertible_group_element_keeps_outputs_float64(name):
    """``random_group_element(mode="invertible")``: invertible (not orthogonal) QK/OV maps, scaled
    RoPE planes and ReLU / gated (SwiGLU: ``up`` only) neuron scalings act exactly (relative output
    error < 1e-10)."""
    family, config = CONFIGS[name]
    spec = spec_of(family, config)
    state = trained_like(family, config, seed=1).state_dict()
    c = canonicalize(spec, state)
    g = random_group_element(spec, 5, mode="invertible", state=state)
    for hm in g.heads:  # the maps really leave the orthogonal group
        assert _far_from_orthogonal(hm.ov) > 0.1 and _far_from_orthogonal(hm.qk) > 0.1
    scaled = config.get("activation") in ("relu", "swiglu")
    assert all((nm.scale is not None) == scaled for nm in g.neurons)
    moved = to_gauge(spec, apply_group(spec, c.state, g), c.gains)
    assert max(float((moved[k] - state[k]).abs().max()) for k in state) > 0.1
    x, _ = inputs(family, config)
    assert rel_err(run(family, config, moved, x), run(family, config, state, x)) < 1e-10


@pytest.mark.parametrize("name", CONFIGS)
def test_learned_invertible_maps_are_exact_and_match_the_group_action(name):
    """Random parameters of the invertible refinement group: the differentiable transform equals
    the exact group action of ``hard_element`` and keeps the function (float64 < 1e-10)."""
    family, config = CONFIGS[name]
    spec = spec_of(family, config)
    state = trained_like(family, config, seed=2).state_dict()
    canon = canonicalize(spec, state)
    delta = _Delta(spec, canon.state, "ste", init_scale=1.0, group="invertible")
    scaled = config.get("activation") in ("relu", "swiglu")
    assert bool(delta.neuron_log_scale) == scaled  # scalings where exact: ReLU (homogeneous), gated (up)
    with torch.no_grad():
        for p in delta.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel()), dtype=p.dtype))
    g = delta.hard_element()
    for hm in g.heads:
        assert _far_from_orthogonal(hm.ov) > 0.05 and _far_from_orthogonal(hm.qk) > 0.05
    with torch.no_grad():
        soft_path = delta.transform(canon.state, tau=0.1, hard=True)
    exact = apply_group(spec, canon.state, g)
    assert max(float((soft_path[k] - exact[k]).abs().max()) for k in exact) < 1e-10
    x, _ = inputs(family, config)
    moved = to_gauge(spec, soft_path, canon.gains)
    assert rel_err(run(family, config, moved, x), run(family, config, state, x)) < 1e-10


def test_neuron_scaling_is_refused_for_gelu():
    from fedbasin.alignment.group import NeuronMap, apply_neuron_map

    spec = spec_of("vit", VIT)
    state = trained_like("vit", VIT, seed=1).state_dict()
    n = state[spec.mlp[0].up.weight].shape[0]
    with pytest.raises(ValueError, match="only exact for ReLU"):
        apply_neuron_map(spec.mlp[0], dict(state), NeuronMap(torch.arange(n), torch.full((n,), 2.0)))


OPTIONS = {
    "invertible": dict(group="invertible"),
    "fixed-permutations": dict(permutations="fixed", group="invertible"),
    "best-start-cosine-wide-lambda": dict(mode="best", schedule="cosine", lambda_range=(0.25, 0.75),
                                          selection_lambdas=(0.25, 0.5, 0.75)),
    "dual": dict(dual=True, group="invertible", lambda_range=(0.3, 0.7)),
}


@pytest.mark.parametrize("option", OPTIONS)
def test_refinement_option_keeps_function_and_never_raises_the_selection_loss(option):
    """On a really trained digits pair (float32): the refined candidate (and, with ``dual``, the
    moved reference) computes its input's function within 1e-5, the returned selection loss is the
    history's minimum and never above the start, and the merge of the returned pair has that loss."""
    spec = spec_of("vit", DIGITS_VIT)
    a, b = trained_digits_vit(1), trained_digits_vit(2)
    data = proxy_streams(load_task("digits", seed=0).train.subset(torch.arange(400)), 64, seed=0)
    result = learned_refine(spec, build_model("vit", DIGITS_VIT), a, [b], cross_entropy, data.batches,
                            data.selection, data.evaluation, steps=20, lr=0.05, eval_every=5, **OPTIONS[option])
    assert result.best_loss <= result.initial_loss
    assert result.best_loss == min(loss for _, loss in result.history)
    assert result.best_step > 0  # each option's gradients reach its maps on this pair
    x = load_task("digits", seed=0).test.inputs[:32]
    out = lambda s: run("vit", DIGITS_VIT, s, x, torch.float32)  # noqa: E731
    assert rel_err(out(result.states[0]), out(b)) < 1e-5
    reference = to_gauge(spec, result.reference_canonical, canonicalize(spec, a).gains)
    assert rel_err(out(reference), out(a)) < 1e-5
    if option == "dual":
        assert max(float((reference[k] - a[k]).abs().max()) for k in a) > 1e-4  # the reference moved
    # the returned pair's score on the selection split, recomputed: mean loss at the scored λ
    model, scores = build_model("vit", DIGITS_VIT), []
    for lam in OPTIONS[option].get("selection_lambdas", (0.5,)):
        model.load_state_dict({k: lam * reference[k] + (1 - lam) * result.states[0][k] for k in a})
        with torch.no_grad():
            total = sum(float(cross_entropy(model(x), y)) * len(y) for x, y in data.selection)
        scores.append(total / sum(len(y) for _, y in data.selection))
    assert sum(scores) / len(scores) == pytest.approx(result.best_loss, rel=1e-5)


def test_best_start_picks_the_lower_selection_loss():
    spec = spec_of("vit", DIGITS_VIT)
    a, b = trained_digits_vit(1), trained_digits_vit(2)
    data = proxy_streams(load_task("digits", seed=0).train.subset(torch.arange(400)), 64, seed=0)
    losses = {}
    for mode in ("permutation", "orthogonal", "best"):
        r = learned_refine(spec, build_model("vit", DIGITS_VIT), a, [b], cross_entropy, data.batches,
                           data.selection, steps=0, mode=mode)
        losses[mode] = (r.initial_loss, r.start_mode)
    assert losses["best"][0] == min(losses["permutation"][0], losses["orthogonal"][0])
    assert losses["best"][1] == min(("permutation", "orthogonal"), key=lambda m: losses[m][0])


@pytest.mark.parametrize("bad, message", [
    (dict(group="affine"), "group must be"),
    (dict(lambda_range=(0.7, 0.2)), "lambda_range"),
    (dict(schedule="linear"), "schedule"),
    (dict(dual=True, include_reference=False), "include_reference"),
    (dict(mode="whatever"), "symmetry mode must be one of"),
])
def test_bad_options_are_refused_before_any_work(bad, message):
    spec = spec_of("vit", VIT)
    a = trained_like("vit", VIT, seed=1).state_dict()
    with pytest.raises(ValueError, match=message):
        learned_refine(spec, build_model("vit", VIT).double(), a, [a], cross_entropy, iter(()), [(None, None)],
                       **bad)


def test_cli_merge_with_the_invertible_group(tmp_path, capsys):
    import json

    from fedbasin.checkpoint import save_checkpoint
    from fedbasin.cli import main

    config = dict(image_size=8, patch_size=2, channels=1, num_classes=10, dim=16, depth=1, heads=2, mlp_dim=32,
                  activation="relu")
    for seed in (1, 2):
        m = trained_like("vit", config, seed=seed, dtype=torch.float32)
        save_checkpoint(tmp_path / f"m{seed}", "vit", m.config, m.state_dict())
    models = [str(tmp_path / "m1"), str(tmp_path / "m2")]
    assert "--refine-lambda 0.8,0.2" in cli_error(capsys, ["merge", *models, "--out", str(tmp_path / "bad"),
                                                           "--refine-data", "digits", "--refine-lambda", "0.8", "0.2"])
    assert not (tmp_path / "bad").exists()
    assert main(["merge", *models, "--out", str(tmp_path / "out"), "--refine-data", "digits", "--refine-steps", "6",
                 "--refine-examples", "80", "--refine-group", "invertible", "--refine-schedule", "cosine",
                 "--refine-lambda", "0", "1", "--distill-steps", "0"]) == 0
    info = json.loads(capsys.readouterr().out)["refinement"]
    assert info["selection_loss_best"] < info["selection_loss_start"]
    assert (tmp_path / "out" / "model.safetensors").exists()
