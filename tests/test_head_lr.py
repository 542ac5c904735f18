"""A learning rate of its own for the per-head maps (``learned_refine(head_lr=...)``,
``--refine-head-lr``, run config ``refine-head-lr``): the QK/OV maps train at ``head_lr``, the
residual map and everything else at ``lr``."""

from __future__ import annotations

import json

import pytest
import torch

from fedbasin.alignment import learned_refine, proxy_streams
from fedbasin.config import RunConfigError, resolve_run_config
from fedbasin.training import cross_entropy
from tests.helpers import DIGITS_VIT, cli_error, expanded, spy_on_cli_refine, trained_digits_vit
from tests.test_soft_labels import assert_same_function, digits_pair


def refine(monkeypatch=None, steps: int = 12, permutations_learned: bool = False, **options):
    """Learned refinement of the digits pair; with ``monkeypatch``, also Adam's parameter groups."""
    groups = []
    if monkeypatch is not None:
        adam = torch.optim.Adam

        def recording(params, lr):
            params = list(params)
            groups.extend((group.get("lr", lr), list(group["params"])) for group in params)
            return adam(params, lr=lr)

        monkeypatch.setattr(torch.optim, "Adam", recording)
    model, spec, task, a, b = digits_pair()
    data = proxy_streams(task.proxy, 32, seed=0)
    result = learned_refine(spec, model, a, [b], cross_entropy, data.batches, data.selection, data.evaluation,
                            steps=steps, lr=1e-2, eval_every=3, group="invertible",
                            permutations="ste" if permutations_learned else "fixed",
                            batch_workers=1, **options)
    return model, spec, b, result, groups


def test_head_maps_get_their_own_learning_rate(monkeypatch):
    """With ``head_lr`` Adam has two groups: the QK and OV maps of every layer at ``head_lr`` and
    every other parameter (the residual map) at ``lr``, each parameter in exactly one group."""
    _, spec, _, _, groups = refine(monkeypatch, steps=1, head_lr=0.08)
    (rest_lr, rest), (head_lr, heads) = groups
    assert (rest_lr, head_lr) == (1e-2, 0.08)
    layers, dh = len(spec.attention), spec.attention[0].head_dim
    assert len(heads) == 2 * layers  # one QK and one OV map per layer
    assert all(p.shape == (spec.attention[0].num_heads, dh, dh) for p in heads)
    assert [p.shape for p in rest] == [(spec.width - 1, spec.width - 1)]  # the residual map (LayerNorm: fixes 1)
    assert not {id(p) for p in rest} & {id(p) for p in heads}


def test_head_lr_equal_to_lr_changes_nothing_and_another_value_keeps_the_function():
    """``head_lr = lr`` follows the one-group run exactly; a larger ``head_lr`` takes another path,
    keeps the candidate's function and never ends above its start on the selection split."""
    model, _, b, plain, _ = refine()
    _, _, _, same, _ = refine(head_lr=1e-2)
    assert same.history == plain.history
    _, _, _, faster, _ = refine(head_lr=0.08)
    assert faster.history[0] == plain.history[0] and faster.history != plain.history
    assert faster.best_loss <= faster.initial_loss
    assert_same_function(model, b, faster.states[0])


@pytest.mark.parametrize("value", [0, -1e-3, float("nan"), "0.1"])
def test_head_lr_refusal(value):
    model, spec, task, a, b = digits_pair()
    data = proxy_streams(task.proxy, 32, seed=0)
    with pytest.raises(ValueError, match=r"head_lr must be a finite number > 0, got"):
        learned_refine(spec, model, a, [b], cross_entropy, data.batches, data.selection, steps=2, head_lr=value)


def test_a_diverging_refinement_stops_and_returns_its_best_alignment():
    """A learning rate so large that the invertible head maps overflow: training stops at the first
    non-finite step instead of raising (the next step's Hungarian would get NaN scores), and the
    alignment kept before it is returned with the candidate's function; the summary says so."""
    model, _, b, result, _ = refine(steps=12, head_lr=1e4, permutations_learned=True)
    assert 0 < result.diverged_step <= 12 and len(result.history) < 12 // 3 + 1
    assert result.best_loss <= result.initial_loss
    assert_same_function(model, b, result.states[0])
    summary = result.summary()
    assert summary["diverged_step"] == result.diverged_step
    assert f"refinement diverged at step {result.diverged_step}" in summary["note"]
    _, _, _, sane, _ = refine(steps=3)
    assert sane.diverged_step == 0 and "diverged_step" not in sane.summary()


def test_cli_refine_head_lr(tmp_path, capsys, monkeypatch):
    """``--refine-head-lr`` reaches ``learned_refine`` and the summary; refused at 0 and without
    ``--refine-data``."""
    from fedbasin import cli
    from fedbasin.checkpoint import save_checkpoint

    seen = []
    spy_on_cli_refine(monkeypatch, lambda k: seen.append((k["lr"], k["head_lr"])))
    for seed in (0, 1):
        save_checkpoint(tmp_path / f"m{seed}", "vit", DIGITS_VIT, trained_digits_vit(seed))
    m0, m1, out = (str(tmp_path / n) for n in ("m0", "m1", "out"))
    base = ["align", m0, m1, "--refine-data", "digits", "--refine-steps", "3", "--refine-examples", "120"]
    assert cli.main([*base, "--out", out, "--refine-lr", "0.005", "--refine-head-lr", "0.04"]) == 0
    info = json.loads(capsys.readouterr().out)["refinement"]
    assert (info["lr"], info["head_lr"]) == (0.005, 0.04)
    assert cli.main([*base, "--out", out + "d"]) == 0
    assert json.loads(capsys.readouterr().out)["refinement"]["head_lr"] == 0.005  # an image classifier's auto lr
    assert seen == [(0.005, 0.04), (0.005, None)]  # its auto head lr is 0: the same as lr
    assert "must be at least 0, got -1" in cli_error(capsys, [*base, "--out", out + "2", "--refine-head-lr", "-1"])
    assert cli_error(capsys, ["align", m0, m1, "--out", out + "2", "--refine-head-lr", "0.04"]).endswith(
        "--refine-head-lr has no effect without --refine-data")


def test_the_server_refiner_passes_refine_head_lr(monkeypatch):
    """Run config ``refine-head-lr`` > 0 reaches ``learned_refine`` (0: None, i.e. ``refine-lr``)."""
    from fedbasin.server import server_app

    seen = []
    original = server_app.learned_refine
    monkeypatch.setattr(server_app, "learned_refine", lambda *a, **k: seen.append(expanded(k)["head_lr"]) or original(*a, **k))
    model, spec, task, a, b = digits_pair()
    for value in (0.05, 0.0):
        config = resolve_run_config({"proxy-size": 300, "refine-steps": 2, "refine-head-lr": value})
        result = server_app.make_refiner(spec, model, task, config)(a, [b])
        assert result.best_loss <= result.initial_loss
    assert seen == [0.05, None]
    with pytest.raises(RunConfigError, match=r"run-config refine-head-lr=-1.0 must be at least 0"):
        resolve_run_config({"refine-head-lr": -1})
