"""``fedbasin merge --refine-data SPEC`` distils the models' ensemble into the refined merge by default (the
schema's DistillOptions, ``auto`` by model kind, sized by ``--distill-budget``), writes the distilled state,
and refuses distillation options that would do nothing."""

from __future__ import annotations

import json

import pytest
import torch

from fedbasin.checkpoint import load_checkpoint, save_checkpoint
from fedbasin.cli import main
from fedbasin.server.distill import named_augment
from tests.helpers import DIGITS_VIT, cli_error, trained_digits_vit

REFINE = ["--refine-data", "digits", "--refine-steps", "3", "--refine-examples", "200"]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> list[str]:
    root = tmp_path_factory.mktemp("pair")
    for seed in (0, 1):
        save_checkpoint(root / f"m{seed}", "vit", DIGITS_VIT, trained_digits_vit(seed))
    return [str(root / "m0"), str(root / "m1")]


def _merge(capsys, models, out, *options) -> dict:
    assert main(["merge", *models, "--out", str(out), *REFINE, *options]) == 0
    return json.loads(capsys.readouterr().out)


def _weights(path) -> dict:
    return load_checkpoint(path).state


def test_merge_with_data_distils_by_default_with_the_image_settings(models, calls, capsys, tmp_path):
    """No distillation option: the budget (120 s) sizes the run, with the image classifiers' auto settings; the
    written merge is the distilled student, not the refined merge it started from."""
    summary = _merge(capsys, models, tmp_path / "distilled")
    (call,) = calls
    assert (call["steps"], call["budget"]) == (None, 120.0)
    from fedbasin.options import IMAGE_DISTILL_RATE

    assert (call["lr"], call["temperature"], call["label_weight"], call["teacher"]) == (
        IMAGE_DISTILL_RATE, 3.0, 0.5, "logits")
    assert getattr(call["augment"], "mixes_labels", False) and call["teachers"] == 2
    record = summary["refinement"]["distillation"]
    assert (record["augment"], record["teachers"], record["budget_seconds"]) == ("mixup", 2, 120.0)
    assert record["lr"] == call["result"].lr == IMAGE_DISTILL_RATE(call["result"].steps)  # the rate its steps chose
    written = _weights(tmp_path / "distilled")
    kept = call["result"].state
    assert call["result"].improved  # (4 steps on this pair lower the selection loss)
    assert all(torch.equal(written[k], kept[k].to(written[k].dtype)) for k in written)

    plain = _merge(capsys, models, tmp_path / "plain", "--distill-steps", "0")
    assert "distillation" not in plain["refinement"] and len(calls) == 1
    undistilled = _weights(tmp_path / "plain")
    assert max((written[k] - undistilled[k]).abs().max().item() for k in written) > 0


def test_given_steps_and_weights(models, calls, capsys, tmp_path):
    """``--distill-steps N`` is a fixed run (no budget); a model of weight 0 is no teacher."""
    summary = _merge(capsys, models, tmp_path / "o", "--distill-steps", "7", "--distill-lr", "0.01",
                     "--weights", "1,0")
    (call,) = calls
    assert (call["steps"], call["budget"], call["lr"], call["teachers"]) == (7, None, 0.01, 1)
    assert summary["refinement"]["distillation"]["budget_seconds"] is None


@pytest.mark.parametrize("options, words", [
    (["--distill-steps", "3"], "--distill-steps has no effect without --refine-data"),
    (["--refine-data", "unigram", "--distill-lr", "0.1"], "--distill-lr has no effect with --refine-data unigram"),
    (["--distill-augment", "sideways"], "--distill-augment"),
])
def test_ineffective_or_bad_options_are_refused_in_one_line(models, capsys, tmp_path, options, words):
    line = cli_error(capsys, ["merge", *models, "--out", tmp_path / "o", *options])
    assert words in line
    assert not (tmp_path / "o").exists()


def test_align_has_no_distillation_options(models, capsys, tmp_path):
    assert "--distill-steps" in cli_error(capsys, ["align", *models, "--out", tmp_path / "o", "--refine-data",
                                                   "digits", "--distill-steps", "3"])


def test_named_views_need_images():
    assert named_augment("none", (128,)) is None
    assert getattr(named_augment("crop-flip-mixup", (3, 32, 32)), "mixes_labels", False)
    with pytest.raises(ValueError, match=r"distill-augment 'crop' needs image data .* shape \(128,\)"):
        named_augment("crop", (128,))


def test_one_translation_of_the_distillation_options():
    """``distill_call`` is what the CLI and the ServerApp pass to ``ensemble_distill``; ``auto`` must be resolved
    for the model's kind first."""
    from fedbasin.options import IMAGE, IMAGE_DISTILL_RATE, SUBWORD_LM, DistillOptions, distill_call, resolve_distill

    with pytest.raises(ValueError, match="resolve them for the model first"):
        distill_call(DistillOptions())
    assert distill_call(resolve_distill(DistillOptions(), IMAGE)) == dict(
        lr=IMAGE_DISTILL_RATE, temperature=3.0, label_weight=0.5, teacher="logits")
    assert distill_call(resolve_distill(DistillOptions(teacher="probabilities"), SUBWORD_LM)) == dict(
        lr=0.001, temperature=1.0, label_weight=0.0, teacher="probabilities")


def test_eval_scores_an_ensemble_of_checkpoints(models, capsys):
    """``fedbasin eval A B``: the mean-logit (or mean-probability) ensemble's loss and accuracy, which the merge
    is compared with; one checkpoint as before."""
    from fedbasin.data import load_task
    from fedbasin.models import build_model
    from fedbasin.server.distill import LogitEnsemble

    def run(*argv) -> dict:
        assert main(["eval", *argv, "--data", "digits"]) == 0
        return json.loads(capsys.readouterr().out)

    single = run(models[0])
    assert "checkpoints" not in single
    members = []
    for path in models:
        model = build_model("vit", DIGITS_VIT)
        model.load_state_dict(load_checkpoint(path).state)
        members.append(model)
    task = load_task("digits", seed=0)
    for combine in ("logits", "probabilities"):
        scored = run(*models, "--ensemble", combine)
        expected = task.evaluate(LogitEnsemble(members, combine), task.split("test"))
        assert scored["checkpoints"] == models and scored["ensemble"] == combine
        assert scored["loss"] == pytest.approx(expected["loss"], rel=1e-5)
        assert scored["accuracy"] == pytest.approx(expected["accuracy"])
    assert scored["loss"] != pytest.approx(single["loss"], rel=1e-3)


def test_an_ensemble_of_different_architectures_is_refused(models, capsys, tmp_path):
    other = dict(DIGITS_VIT, depth=DIGITS_VIT["depth"] + 1)
    from fedbasin.models import build_model

    save_checkpoint(tmp_path / "deeper", "vit", other, build_model("vit", other).state_dict())
    line = cli_error(capsys, ["eval", models[0], tmp_path / "deeper", "--data", "digits"])
    assert str(tmp_path / "deeper") in line
    line = cli_error(capsys, ["eval", models[0], "--data", "digits", "--ensemble", "probabilities"])
    assert line.endswith("--ensemble probabilities has no effect with one CHECKPOINT (it combines several)")


def test_the_merge_is_scored_beside_its_models_on_the_test_split(models, capsys, tmp_path, monkeypatch):
    """The summary's ``against_models``: the merge, each model and their ensemble on the test split of
    ``--refine-data`` (which the refinement and the distillation never read); with ``--weights 1,0`` the written
    merge is model 0, so their scores agree, and the stderr line names the best model and the gap."""
    from fedbasin.data import load_task
    from fedbasin.models import build_model
    from fedbasin.server.distill import mean_loss
    from fedbasin.training import cross_entropy

    assert main(["merge", *models, "--out", str(tmp_path / "m"), *REFINE, "--distill-steps", "0",
                 "--weights", "1,0"]) == 0
    captured = capsys.readouterr()
    found = json.loads(captured.out)["refinement"]["against_models"]
    test = load_task("digits").test
    assert found["split"] == "test" and found["examples"] == len(test)  # all of it (under the cap)
    assert len(found["models"]) == 2 and found["models"][0] != found["models"][1]
    assert found["merge"]["loss"] == pytest.approx(found["models"][0]["loss"], abs=1e-6)
    assert found["merge"]["accuracy"] == found["models"][0]["accuracy"]
    module = build_model("vit", load_checkpoint(models[1]).config).eval()
    module.load_state_dict(load_checkpoint(models[1]).state)
    assert found["models"][1]["loss"] == pytest.approx(
        mean_loss(module, cross_entropy, list(test.batches(64)), "cpu"), rel=1e-5)  # the test split, not the proxy's
    best = found["best_model"]
    assert found["merge_minus_best_model"]["loss"] == pytest.approx(
        found["merge"]["loss"] - found["models"][best]["loss"])
    (line,) = [x for x in captured.err.splitlines() if "of the best model" in x]
    assert models[best] in line and f"{found['ensemble']['loss']:.4f}" in line
    assert f"on {len(test)} examples of the test split of --refine-data" in line

    # a large test split: its first examples, up to the cap
    monkeypatch.setattr("fedbasin.cli.AGAINST_MODELS_EXAMPLES", 50)
    assert main(["merge", *models, "--out", str(tmp_path / "c"), *REFINE, "--distill-steps", "0"]) == 0
    assert json.loads(capsys.readouterr().out)["refinement"]["against_models"]["examples"] == 50


def test_merge_against_members_scores_each_state_and_the_mean_logit_ensemble():
    """Every figure is the plain mean loss / accuracy of that model over the batches (example-weighted), the
    ensemble's that of the mean logits, and the best model the one of lowest loss."""
    from fedbasin.models import build_model
    from fedbasin.server.distill import LogitEnsemble, mean_loss, merge_against_members
    from fedbasin.training import cross_entropy

    torch.manual_seed(0)
    module = build_model("vit", DIGITS_VIT).eval()
    states = [trained_digits_vit(seed) for seed in (0, 1)]
    merged = {k: (states[0][k] + states[1][k]) / 2 for k in states[0]}
    from fedbasin.data import load_task

    test = load_task("digits", seed=0).split("test")
    split = list(test.batches(64))[:3] + [next(test.batches(7))]  # unequal batches: weighted by size
    found = merge_against_members(module, merged, states, cross_entropy, split)

    def model_of(state):
        m = build_model("vit", DIGITS_VIT).eval()
        m.load_state_dict(state)
        return m

    def accuracy(m):
        with torch.no_grad():
            hits = sum(int((m(x).argmax(-1) == y).sum()) for x, y in split)
        return hits / sum(len(y) for _, y in split)

    members = [model_of(s) for s in states]
    for got, m in [(found["merge"], model_of(merged)), *zip(found["models"], members),
                   (found["ensemble"], LogitEnsemble(members))]:
        assert got["loss"] == pytest.approx(mean_loss(m, cross_entropy, split, "cpu"), rel=1e-5)
        assert got["accuracy"] == pytest.approx(accuracy(m))
    losses = [m["loss"] for m in found["models"]]
    assert found["best_model"] == losses.index(min(losses)) and found["examples"] == 3 * 64 + 7
    assert found["merge_minus_best_model"]["loss"] == pytest.approx(found["merge"]["loss"] - min(losses))
