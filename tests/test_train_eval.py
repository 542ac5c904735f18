"""`fedbasin train` and `fedbasin eval`: two independent checkpoints a user can align, their scores."""

from __future__ import annotations

import re

from tests.helpers import cli_error

import json

import pytest
import torch

from fedbasin import cli
from fedbasin.checkpoint import build_torch_model, load_checkpoint
from fedbasin.cli import main
from fedbasin.data import load_task

TINY = ["--epochs", "8", "--dim", "16", "--depth", "1", "--heads", "2", "--mlp-dim", "32"]


def _run(capsys, *argv) -> dict:
    assert main([str(a) for a in argv]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.fixture(scope="module")
def digits_pair(tmp_path_factory):
    """Two tiny digits ViTs trained with seeds 0 and 1 through the CLI, and their summaries."""
    root = tmp_path_factory.mktemp("trained")
    summaries = []
    for seed in (0, 1):
        assert main(["train", "--data", "digits", "--seed", str(seed), "--out", str(root / f"s{seed}"), *TINY]) == 0
        summaries.append(json.loads((root / f"s{seed}" / "train.json").read_text()))
    return root, summaries


def test_train_writes_independent_checkpoints_that_eval_scores(digits_pair, capsys):
    root, summaries = digits_pair
    a, b = load_checkpoint(root / "s0"), load_checkpoint(root / "s1")
    assert (a.kind, a.family, a.config.dim, a.config.depth) == ("fedbasin", "vit", 16, 1)
    assert not torch.allclose(a.state["head.weight"], b.state["head.weight"])  # different seeds
    task = load_task("digits")
    for seed, ckpt, summary in ((0, a, summaries[0]), (1, b, summaries[1])):
        assert summary["seed"] == seed and summary["steps"] == 8 * -(-len(task.train) // 64)
        reported = _run(capsys, "eval", root / f"s{seed}", "--data", "digits")
        direct = task.evaluate(build_torch_model(ckpt))
        assert reported["examples"] == len(task.test) == 359
        assert reported["loss"] == pytest.approx(direct["loss"], abs=1e-6)
        assert reported["accuracy"] == pytest.approx(direct["accuracy"]) == pytest.approx(summary["test_accuracy"])
        assert reported["loss"] < 2.0 and reported["accuracy"] > 0.3  # trained: chance is ln 10 = 2.30, 0.1
    train = _run(capsys, "eval", root / "s0", "--data", "digits", "--split", "train", "--max-examples", "100")
    assert train["split"] == "train" and train["examples"] == 100


def test_trained_pair_goes_through_align_and_barrier(digits_pair, capsys, monkeypatch):
    root, _ = digits_pair
    _run(capsys, "align", root / "s0", root / "s1", "--out", root / "s1_aligned", "--iterations", "5")
    x = torch.rand(4, 1, 8, 8)
    with torch.no_grad():
        before = build_torch_model(load_checkpoint(root / "s1"))(x)
        after = build_torch_model(load_checkpoint(root / "s1_aligned"))(x)
    assert torch.allclose(before, after, atol=1e-4)
    plotted = {}
    monkeypatch.setattr("fedbasin.plots.plot_curves", lambda curves, path, title: plotted.update(curves, title=title))
    barrier = _run(capsys, "barrier", root / "s0", root / "s1", "--data", "digits", "--points", "3", "--align",
                   "--iterations", "5", "--plot", root / "curve.png")
    assert barrier["examples"] == 359 and len(barrier["losses"]) == 3
    # the plot shows the vanilla curve beside the aligned one, and the JSON carries both
    assert plotted["vanilla"].losses == barrier["vanilla"]["losses"]
    assert plotted["aligned"].losses == barrier["losses"] != barrier["vanilla"]["losses"]
    assert "A = s0 (λ=1)" in plotted["title"] and "B = s1 (λ=0)" in plotted["title"]


def test_curve_labels_tell_checkpoints_apart(tmp_path):
    from fedbasin.plots import distinct_names, plot_curves

    assert distinct_names(["runs/a/model", "runs/b/model"]) == ["a/model", "b/model"]
    assert distinct_names(["x/a", "y/b"]) == ["a", "b"]
    assert distinct_names(["/p/q/m", "/r/q/m"]) == ["p/q/m", "r/q/m"]
    from fedbasin.alignment import interpolation_curve

    curves = {name: interpolation_curve({"w": torch.zeros(1)}, {"w": torch.ones(1)}, lambda s, k=k: float(s["w"]) * k,
                                        points=3) for k, name in ((1, "vanilla"), (2, "aligned"))}
    plot_curves(curves, tmp_path / "c.png", title="t")
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"


def test_same_seed_reproduces_the_same_weights(digits_pair, tmp_path, capsys):
    root, _ = digits_pair
    _run(capsys, "train", "--data", "digits", "--seed", "1", "--out", tmp_path / "again", *TINY)
    first, again = load_checkpoint(root / "s1").state, load_checkpoint(tmp_path / "again").state
    assert all(torch.equal(first[k], again[k]) for k in first)


def test_train_gpt_on_text_and_eval_with_its_context(tmp_path, capsys):
    text = "".join(f"line {i}: to be or not to be\n" for i in range(300))
    (tmp_path / "t.txt").write_text(text)
    data = f"text:{tmp_path / 't.txt'}"
    summary = _run(capsys, "train", "--data", data, "--out", tmp_path / "gpt", "--block-size", "16",
                   "--position", "rope", *TINY)
    ckpt = load_checkpoint(tmp_path / "gpt")
    assert (ckpt.family, ckpt.config.position, ckpt.config.block_size) == ("gpt", "rope", 16)
    assert ckpt.config.vocab_size == len(set(text))
    scored = _run(capsys, "eval", tmp_path / "gpt", "--data", data)
    assert scored["loss"] == pytest.approx(summary["test_loss"], abs=1e-6) and scored["accuracy"] > 0.2


def test_a_character_model_reads_other_text_with_its_own_ids(tmp_path, capsys):
    """train saves the characters (characters.json); another text is read with the model's ids: a
    text of fewer characters scores as the same characters would, a text whose character set has
    the same size but other members (ids that would shift) is refused naming the stranger, and
    align's output keeps the vocabulary."""
    text = "".join(f"line {i}: to be or not to be\n" for i in range(300))
    (tmp_path / "t.txt").write_text(text)
    _run(capsys, "train", "--data", f"text:{tmp_path / 't.txt'}", "--out", tmp_path / "gpt", "--block-size", "16", *TINY)
    assert json.loads((tmp_path / "gpt" / "characters.json").read_text())["characters"] == "".join(sorted(set(text)))
    fewer = text.replace("b", "t")  # one character less: ids of 'e', 'i', ... unchanged only if read with the model's set
    (tmp_path / "fewer.txt").write_text(fewer)
    scored = _run(capsys, "eval", tmp_path / "gpt", "--data", f"text:{tmp_path / 'fewer.txt'}")
    model = build_torch_model(load_checkpoint(tmp_path / "gpt")).eval()
    task = load_task(f"text:{tmp_path / 'fewer.txt'}", block_size=16, characters="".join(sorted(set(text))))
    assert scored["loss"] == pytest.approx(task.evaluate(model, "test")["loss"], abs=1e-6)
    (tmp_path / "other.txt").write_text(text.replace("b", "Z"))  # as many characters, one of them new
    error = cli_error(capsys, ["eval", str(tmp_path / "gpt"), "--data", f"text:{tmp_path / 'other.txt'}"])
    assert "outside the" in error and "'Z'" in error
    (tmp_path / "gpt" / "characters.json").write_text('{"characters": "ba"}')  # ids are ranks: order matters
    assert "sorted order" in cli_error(capsys, ["eval", str(tmp_path / "gpt"), "--data", f"text:{tmp_path / 't.txt'}"])
    (tmp_path / "gpt" / "characters.json").write_text(json.dumps({"characters": "".join(sorted(set(text)))}))
    _run(capsys, "train", "--data", f"text:{tmp_path / 't.txt'}", "--out", tmp_path / "gpt1", "--block-size", "16",
         "--seed", "1", *TINY)
    _run(capsys, "align", tmp_path / "gpt", tmp_path / "gpt1", "--out", tmp_path / "aligned", "--iterations", "2")
    assert (tmp_path / "aligned" / "characters.json").read_bytes() == (tmp_path / "gpt" / "characters.json").read_bytes()
    # a model of another character table of the same size reads other ids: not aligned, merged or compared with it
    (tmp_path / "other.txt").write_text(text.replace("b", "Z"))
    _run(capsys, "train", "--data", f"text:{tmp_path / 'other.txt'}", "--out", tmp_path / "gptZ", "--block-size",
         "16", *TINY)
    for argv in (["align", tmp_path / "gpt", tmp_path / "gptZ", "--out", tmp_path / "az"],
                 ["merge", tmp_path / "gpt", tmp_path / "gptZ", "--out", tmp_path / "mz"]):
        error = cli_error(capsys, [str(a) for a in argv])
        assert f"{tmp_path / 'gptZ'}: its characters.json differs from {tmp_path / 'gpt'}'s (token 13 is 'Z' there, 'b' here)" in error
    assert not (tmp_path / "az").exists() and not (tmp_path / "mz").exists()


def test_train_hf_vit_writes_a_hugging_face_checkpoint(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    summary = _run(capsys, "train", "--data", "digits", "--model", "hf-vit", "--out", tmp_path / "hf", *TINY)
    model = transformers.ViTForImageClassification.from_pretrained(tmp_path / "hf").eval()
    assert model.config.hidden_size == 16 and model.config.num_labels == 10
    scored = _run(capsys, "eval", tmp_path / "hf", "--data", "digits")
    assert scored["kind"] == "hf" and scored["accuracy"] == pytest.approx(summary["test_accuracy"])
    assert scored["accuracy"] > 0.2


def test_train_refuses_bad_requests_before_training(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("fedbasin.training.train", lambda *a, **k: pytest.fail("trained despite a bad request"))
    (tmp_path / "kept").mkdir()
    (tmp_path / "kept" / "notes.txt").write_text("mine")
    cases = [
        (["--data", "digits", "--out", tmp_path / "kept"], "--out .*kept is a non-empty directory without config.json"),
        (["--data", "digits", "--model", "gpt", "--out", tmp_path / "x"], "--model gpt needs text data"),
        (["--data", "digits", "--position", "rope", "--out", tmp_path / "x"], "--position applies to gpt"),
        (["--data", "digits", "--heads", "5", "--out", tmp_path / "x"], "not divisible by 5 heads"),
        (["--data", "mnist", "--out", tmp_path / "x"], "--data mnist: unknown data source"),
        (["--data", "digits", "--tokenizer", tmp_path / "kept", "--out", tmp_path / "x"], "--tokenizer applies to text"),
    ]
    for argv, message in cases:
        assert re.search(message, cli_error(capsys, ["train", *map(str, argv)]))
    (tmp_path / "t.txt").write_text("abc " * 200)
    assert re.search("hf-gpt2 on text needs --tokenizer", cli_error(capsys, ["train", "--data", f"text:{tmp_path / 't.txt'}", "--model", "hf-gpt2", "--out", str(tmp_path / "x")]))
    assert (tmp_path / "kept" / "notes.txt").read_text() == "mine" and not (tmp_path / "x").exists()


def test_interrupted_training_writes_nothing(tmp_path, monkeypatch, capsys):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("fedbasin.training.train", interrupted)
    assert re.search("interrupted", cli_error(capsys, ["train", "--data", "digits", "--out", str(tmp_path / "x"), *TINY]))
    assert not (tmp_path / "x").exists()


def test_diverged_training_writes_nothing(tmp_path, capsys):
    """Weights that diverged (NaN) are not saved as a checkpoint: exit 1, one line naming the tensor."""
    assert main(["train", "--data", "digits", "--out", str(tmp_path / "x"), *TINY, "--lr", "1e30"]) == 1
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert re.search(r"training diverged \(\S+ holds NaN or infinite values, .*nothing was written", line)
    assert not (tmp_path / "x").exists()


def test_eval_names_mismatched_data(digits_pair, tmp_path, capsys):
    root, _ = digits_pair
    (tmp_path / "t.txt").write_text("abc " * 200)
    assert re.search("is a vit model but --data text", cli_error(capsys, ["eval", str(root / "s0"), "--data", f"text:{tmp_path / 't.txt'}"]))
    assert re.search("nowhere", cli_error(capsys, ["eval", str(tmp_path / "nowhere"), "--data", "digits"]))
    assert cli.HelpFormatter  # the train/eval parsers share the CLI's help formatter


def test_every_cli_argument_is_documented():
    import argparse

    from fedbasin.config import DEFAULT_RUN_CONFIG

    parser = cli.build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    assert {"train", "eval", "align", "merge", "barrier", "simulate"} <= set(commands)
    for name, command in commands.items():
        for action in command._actions:
            assert action.help, f"fedbasin {name} {action.option_strings or action.dest} has no help text"
    align_help = " ".join(commands["align"].format_help().split())
    assert "passes (default: 20)" in align_help and "(default: 0.0001)" in align_help  # defaults shown
    assert "cifar10:DIR" in commands["barrier"].format_help()
    simulate_help = commands["simulate"].format_help()
    assert all(f"\n  {key}=" in simulate_help for key in DEFAULT_RUN_CONFIG)


def test_shape_options_override_the_recipe_and_the_data_defaults(tmp_path, capsys):
    summary = _run(capsys, "train", "--data", "digits", "--out", tmp_path / "p4", "--epochs", "1", "--patch-size", "4",
                   "--dim", "8", "--depth", "1", "--heads", "2", "--mlp-dim", "16", "--norm", "rmsnorm",
                   "--activation", "swiglu", "--lr", "0.01", "--batch-size", "128")
    config = load_checkpoint(tmp_path / "p4").config
    assert (config.patch_size, config.dim, config.norm, config.activation) == (4, 8, "rmsnorm", "swiglu")
    assert (summary["lr"], summary["batch_size"], summary["steps"]) == (0.01, 128, -(-1438 // 128))
