"""The merge's weights chosen on proxy data (``--distill-mixture best``): the line from the given weights to the
best model alone, scored on the selection split; :func:`fedbasin.alignment.merge.best_mixture` and the CLI."""

from __future__ import annotations

import json
import math

import pytest

from fedbasin.alignment.merge import best_mixture, mixture_toward
from fedbasin.checkpoint import load_checkpoint, save_checkpoint
from fedbasin.cli import main
from fedbasin.models import build_model
from tests.helpers import DIGITS_VIT, cli_error, digits_loss, trained_digits_vit


def test_the_line_runs_from_the_normalised_weights_to_one_model():
    assert mixture_toward([1.0, 3.0], 1, 0.0) == [0.25, 0.75]
    assert mixture_toward([1.0, 3.0], 0, 1.0) == [1.0, 0.0]
    assert mixture_toward([2.0, 2.0, 0.0], 0, 0.5) == pytest.approx([0.75, 0.25, 0.0])


def _quadratic(target: list[float]):
    """A loss of the weights with its minimum at ``target``; records every call."""
    seen = []

    def loss_of(w):
        seen.append(list(w))
        return sum((a - b) ** 2 for a, b in zip(w, target))

    return loss_of, seen


def test_the_lowest_loss_on_the_line_wins():
    loss_of, seen = _quadratic([0.75, 0.25])  # half way from (½, ½) to model 0 alone
    found = best_mixture([1.0, 1.0], loss_of)
    assert (found.model, found.share) == (0, 0.5) and found.weights == pytest.approx([0.75, 0.25])
    assert [a for a, _ in found.losses] == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert len(seen) == 2 + 4  # each model alone, then α = 0, ¼, ½, ¾ (α = 1 is the best model's own score)


def test_the_best_model_alone_can_win_and_the_given_weights_win_ties():
    loss_of, _ = _quadratic([0.0, 1.0])
    assert best_mixture([1.0, 1.0], loss_of).weights == [0.0, 1.0]
    flat = best_mixture([1.0, 1.0], lambda w: 1.0)
    assert (flat.share, flat.weights) == (0.0, [0.5, 0.5])


def test_a_model_of_weight_zero_is_never_scored_alone_nor_chosen():
    loss_of, seen = _quadratic([0.0, 0.0, 1.0])  # the weight-0 model would be best alone
    found = best_mixture([1.0, 1.0, 0.0], loss_of)
    assert found.model in (0, 1) and found.weights[2] == 0.0
    assert [0.0, 0.0, 1.0] not in seen


def test_non_finite_losses_never_win():
    found = best_mixture([1.0, 1.0], lambda w: math.nan if 0.6 < w[0] < 0.9 else 1 - w[0])
    assert (found.model, found.share) == (0, 1.0)  # α = ¼, ½, ¾ are NaN
    assert best_mixture([1.0, 1.0], lambda w: math.nan if w[0] < 0.9 else 1.0).share == 1.0  # nan for model 1
    assert best_mixture([1.0, 1.0], lambda w: math.inf).share == 0.0


@pytest.fixture(scope="module")
def trained_and_untrained(tmp_path_factory) -> list[str]:
    root = tmp_path_factory.mktemp("pair")
    save_checkpoint(root / "trained", "vit", DIGITS_VIT, trained_digits_vit(0))
    untrained = {k: v.float() for k, v in build_model("vit", DIGITS_VIT, seed=5).state_dict().items()}
    save_checkpoint(root / "untrained", "vit", DIGITS_VIT, untrained)
    return [str(root / "trained"), str(root / "untrained")]


def _merge(capsys, models, out, *options) -> dict:
    argv = ["merge", *models, "--out", str(out), "--refine-data", "digits", "--refine-steps", "2",
            "--refine-examples", "200", "--distill-steps", "0", *options]
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_merge_chooses_its_weights_on_the_selection_split(trained_and_untrained, capsys, tmp_path):
    """A trained model merged with an untrained one: every share of the untrained one costs selection loss, so
    ``best`` writes the trained model itself (its own gauge, the reference's) where ``given`` writes their mean."""
    trained = load_checkpoint(trained_and_untrained[0]).state
    summary = _merge(capsys, trained_and_untrained, tmp_path / "best", "--distill-mixture", "best")
    mixture = summary["refinement"]["mixture"]
    losses = mixture["losses"]
    assert list(losses) == ["0", "0.25", "0.5", "0.75", "1"]
    assert losses["1"] == min(losses.values()) < losses["0"]
    assert (mixture["best_model"], mixture["share"], mixture["weights"]) == (0, 1.0, [1.0, 0.0])
    written = load_checkpoint(tmp_path / "best").state
    assert max((written[k] - trained[k]).abs().max().item() for k in trained) < 1e-5

    given = _merge(capsys, trained_and_untrained, tmp_path / "given", "--distill-mixture", "given")
    assert "mixture" not in given["refinement"]
    assert digits_loss(load_checkpoint(tmp_path / "given").state) > digits_loss(trained) + 0.5


def test_merges_keep_the_given_weights_by_default(trained_and_untrained, capsys, tmp_path):
    summary = _merge(capsys, trained_and_untrained, tmp_path / "m")
    assert "mixture" not in summary["refinement"]


def test_the_mixture_needs_proxy_data(trained_and_untrained, capsys, tmp_path):
    line = cli_error(capsys, ["merge", *trained_and_untrained, "--out", tmp_path / "o", "--distill-mixture", "best"])
    assert "--distill-mixture has no effect without --refine-data" in line
    assert not (tmp_path / "o").exists()
