"""`fedbasin train --model hf-<model_type>` on every registered causal-LM family (Llama, Mistral,
Qwen2, GPT-NeoX, Phi): the family builds the config from fedbasin's shape options and the data's
fields, the checkpoint loads with ``from_pretrained``, and ``eval`` / ``barrier`` score it."""

from __future__ import annotations

import json
import math

import pytest

pytest.importorskip("transformers")

from fedbasin import cli  # noqa: E402
from fedbasin.alignment.hf import hf_model_class  # noqa: E402
from tests.helpers import cli_error  # noqa: E402
from tests.test_tokenizer_data import NEEDS_SHARED_TEXT, TOKENIZER, shakespeare_excerpt  # noqa: E402

pytestmark = NEEDS_SHARED_TEXT

FAMILIES = ("llama", "mistral", "qwen2", "gpt_neox", "phi")
SHAPE = dict(dim=32, depth=2, heads=4, mlp_dim=64)
CONTEXT = 16


def _run(capsys, argv) -> dict:
    code = cli.main([str(a) for a in argv])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return json.loads(captured.out)


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    return shakespeare_excerpt(tmp_path_factory.mktemp("text"), 6_000)


@pytest.fixture(scope="module", params=FAMILIES)
def trained(request, tmp_path_factory, text_file):
    """Two seeds of ``--model hf-<model_type>``, trained 2 steps each, and their train.json."""
    model_type = request.param
    assert f"hf-{model_type}" in cli._models(), "the family registers no way to build a new model"
    root = tmp_path_factory.mktemp(model_type)
    shape = [a for k, v in SHAPE.items() for a in (f"--{k.replace('_', '-')}", v)]
    summaries = []
    for seed in (0, 1):
        code = cli.main([str(a) for a in ("train", "--model", f"hf-{model_type}", "--data", f"text:{text_file}",
                                          "--tokenizer", TOKENIZER, "--out", root / f"s{seed}", "--seed", seed,
                                          "--epochs", 1, "--max-train-examples", 16, "--batch-size", 8,
                                          "--block-size", CONTEXT, *shape)])
        assert code == 0
        summaries.append(json.loads((root / f"s{seed}" / "train.json").read_text()))
    return model_type, root, summaries


def test_train_writes_a_checkpoint_from_pretrained_loads(trained):
    model_type, root, summaries = trained
    model = hf_model_class(model_type).from_pretrained(root / "s0")
    config = model.config
    assert (config.model_type, config.hidden_size, config.num_hidden_layers, config.num_attention_heads,
            config.intermediate_size) == (model_type, 32, 2, 4, 64)
    assert (config.vocab_size, config.max_position_embeddings) == (50257, CONTEXT)  # the data's fields
    assert getattr(config, "num_key_value_heads", None) in (None, 4)  # plain multi-head attention
    # the tokenizer's special ids (GPT-2's: bos = eos = 50256, no pad), not the family's defaults (Llama's 1/2)
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (50256, 50256, None)
    assert summaries[0]["family"] == model_type and summaries[0]["steps"] == 2
    assert all(math.isfinite(s["test_loss"]) for s in summaries)


def test_eval_and_barrier_score_the_trained_pair(trained, text_file, capsys):
    model_type, root, summaries = trained
    data = ["--data", f"text:{text_file}", "--tokenizer", TOKENIZER]
    # train saved its tokenizer beside the weights: eval needs no --tokenizer
    assert (root / "s0" / "tokenizer.json").is_file() or (root / "s0" / "vocab.json").is_file()
    scored = _run(capsys, ["eval", root / "s0", *data[:2], "--max-examples", 8])
    assert scored["family"] == model_type and scored["examples"] == 8
    assert math.isfinite(scored["loss"]) and 0 <= scored["accuracy"] <= 1
    barrier = _run(capsys, ["barrier", root / "s0", root / "s1", *data, "--points", 3, "--max-examples", 8,
                            "--align", "--iterations", 2, "--seen-tokens", f"text:{text_file}"])  # token rows from the text: faster
    for curve in (barrier, barrier["vanilla"]):
        assert len(curve["losses"]) == 3 and all(math.isfinite(x) for x in curve["losses"])
    assert barrier["losses"][-1] == pytest.approx(scored["loss"], rel=1e-4)  # λ = 1: model A itself


@pytest.mark.parametrize("model_type", FAMILIES)
def test_subword_families_need_a_tokenizer(model_type, text_file, tmp_path, capsys):
    message = cli_error(capsys, ["train", "--model", f"hf-{model_type}", "--data", f"text:{text_file}",
                                 "--out", tmp_path / "x"])
    assert f"--model hf-{model_type} on text needs --tokenizer" in message
    assert not (tmp_path / "x").exists()


def test_model_choices_are_the_registry(tmp_path, capsys):
    from fedbasin.alignment.families import family, trainable

    assert set(FAMILIES) | {"gpt2", "vit"} <= set(trainable())
    assert cli._models() == ("vit", "gpt", *(f"hf-{t}" for t in trainable()))
    assert all(family(t).data == "text" for t in FAMILIES)
    message = cli_error(capsys, ["train", "--model", "hf-phi", "--data", "digits", "--out", tmp_path / "x"])
    assert "--model hf-phi needs text data" in message
