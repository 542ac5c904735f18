"""Data-free learned alignment: synthetic token blocks drawn by a text's token counts
(``unigram_blocks``, CLI ``--refine-data unigram:FILE``), labelled by the models' own mean
predictions for training, keep-best and the report (``learned_refine(model_labels=True)``)."""

from __future__ import annotations

import json

import pytest
import torch

from fedbasin.alignment import learned_refine, proxy_streams
from fedbasin.data import chain_blocks, unigram_blocks
from fedbasin.models import build_model
from fedbasin.training import cross_entropy
from tests.helpers import (
    GPT,
    cli_error,
    inputs,
    rel_err,
    run,
    spec_of,
    spy_on_cli_refine,
    trained_like,
)
from tests.test_tokenizer_data import NEEDS_SHARED_TEXT, _gpt2, shakespeare_excerpt


def test_unigram_blocks_follow_the_counts():
    ids = torch.tensor([0, 0, 0, 3] * 50)  # token 0 three times as often as token 3; the others never
    blocks = unigram_blocks(ids, 8, 400, 16, seed=0)
    assert blocks.inputs.shape == blocks.targets.shape == (400, 16)
    assert torch.equal(blocks.inputs[:, 1:], blocks.targets[:, :-1])  # next-token targets of one drawn row
    tokens = torch.cat([blocks.inputs.reshape(-1), blocks.targets[:, -1]])
    assert set(tokens.unique().tolist()) == {0, 3}
    assert float((tokens == 0).double().mean()) == pytest.approx(0.75, abs=0.01)  # 6,800 draws: σ = 0.005
    again = unigram_blocks(ids, 8, 400, 16, seed=0)
    assert torch.equal(again.inputs, blocks.inputs) and not torch.equal(unigram_blocks(ids, 8, 400, 16, seed=1).inputs,
                                                                        blocks.inputs)
    for bad in (torch.tensor([], dtype=torch.long), torch.tensor([0, 8])):
        with pytest.raises(ValueError, match=r"token ids in \[0, 8\)"):
            unigram_blocks(bad, 8, 4, 16)


def test_chain_blocks_walk_the_transitions_from_the_first_weights():
    """A Markov chain over token ids: the first token by its weight, each next one by the previous one's row of
    transition probabilities (a planted cycle is walked exactly; a random matrix is reproduced in frequency)."""
    tokens = torch.tensor([7, 3, 9, 5])
    cycle = torch.eye(4).roll(1, dims=1)  # row i puts all its mass on i + 1 (mod 4)
    blocks = chain_blocks(tokens, torch.tensor([0.0, 1.0, 0.0, 0.0]), cycle, 6, 9, seed=0)
    assert blocks.inputs.shape == blocks.targets.shape == (6, 9)
    assert torch.equal(blocks.inputs[:, 1:], blocks.targets[:, :-1])
    assert blocks.inputs[:, :5].tolist() == [[3, 9, 5, 7, 3]] * 6  # starts at token 3 (weight 1), then the cycle
    p = torch.rand(4, 4, generator=torch.Generator().manual_seed(0))
    p[2, 1] = 0.0  # never 9 → 3
    walk = chain_blocks(tokens, torch.ones(4), p * 5, 500, 40, seed=1)  # rows need not be normalised
    pairs = torch.stack([walk.inputs.reshape(-1), walk.targets.reshape(-1)], 1)
    index = {int(t): i for i, t in enumerate(tokens)}
    counts = torch.zeros(4, 4)
    for a, b in pairs.tolist():
        counts[index[a], index[b]] += 1
    assert counts[2, 1] == 0
    empirical = counts / counts.sum(1, keepdim=True)
    assert float((empirical - p / p.sum(1, keepdim=True)).abs().max()) < 0.03  # ≥ 3,000 draws per row: σ < 0.01
    again = chain_blocks(tokens, torch.ones(4), p, 500, 40, seed=1)
    assert torch.equal(again.inputs, walk.inputs)
    for first, transitions in ((torch.ones(3), p), (torch.ones(4), p[:3]), (torch.zeros(4), p),
                               (torch.ones(4), p - 1), (torch.ones(4), torch.zeros(4, 4))):
        with pytest.raises(ValueError, match="chain"):
            chain_blocks(tokens, first, transitions, 2, 4)


def test_one_token_transitions_are_the_models_mean_prediction_over_the_rows(tmp_path):
    """The bigram proxy's P[i, k]: the mean over the models of softmax(model(rows[i]))[rows[k]], renormalised over
    ``rows`` (computed on the models cut to those rows, equal to the full models' prediction restricted)."""
    from fedbasin.checkpoint import build_torch_model, load_checkpoint, save_checkpoint
    from fedbasin.cli import _one_token_transitions
    from fedbasin.models import make_config

    a, b = _pair()
    save_checkpoint(tmp_path / "a", "gpt", make_config("gpt", GPT), a)
    ref = load_checkpoint(tmp_path / "a")
    states = [ref.adapter.to_standard(s) for s in (a, b)]
    rows = torch.tensor([1, 4, 5, 11, 20, 22])
    found = _one_token_transitions(ref, build_torch_model(ref), states, rows)
    model = build_model("gpt", GPT)
    with torch.no_grad():
        full = [torch.func.functional_call(model, s, (rows[:, None],))[:, -1] for s in (a, b)]
    expected = sum(logits[:, rows].softmax(-1) for logits in full) / 2
    assert float((found - expected).abs().max()) < 1e-6
    assert float((found - _mean_prediction(a, b, rows[:, None])[:, -1][:, rows]).abs().max()) > 1e-3  # not renormalised


def _pair():
    return [trained_like("gpt", GPT, seed=s, dtype=torch.float32).state_dict() for s in (1, 2)]


def _refine(a, b, data, steps=8, **options):
    return learned_refine(spec_of("gpt", GPT), build_model("gpt", GPT), a, [b], cross_entropy, data.batches,
                          data.selection, data.evaluation, steps=steps, lr=0.05, eval_every=2, **options)


def _mean_prediction(a, b, x):
    model = build_model("gpt", GPT)
    with torch.no_grad():
        return sum(torch.func.functional_call(model, s, (x,)).softmax(-1) for s in (a, b)) / 2


def test_model_labels_score_every_split_on_the_models_mean_prediction():
    """With model_labels the selection and report losses are the cross-entropy against p̄, the two
    models' mean prediction (the same figures as splits labelled with p̄ by hand); refinement keeps the
    candidate's function and never raises the selection loss."""
    a, b = _pair()
    blocks = unigram_blocks(torch.arange(0, GPT["vocab_size"], 3), GPT["vocab_size"], 100, GPT["block_size"])
    data = proxy_streams(blocks, 8, seed=0)
    result = _refine(a, b, data, model_labels=True)
    by_hand = proxy_streams(blocks, 8, seed=0)
    by_hand.selection = [(x, _mean_prediction(a, b, x)) for x, _ in by_hand.selection]
    by_hand.evaluation = [(x, _mean_prediction(a, b, x)) for x, _ in by_hand.evaluation]
    reference = _refine(a, b, by_hand, steps=1)  # no training needed: the start's scores only
    assert result.initial_loss == pytest.approx(reference.initial_loss, rel=1e-6)
    assert result.evaluation_initial_loss == pytest.approx(reference.evaluation_initial_loss, rel=1e-6)
    labels = _refine(a, b, proxy_streams(blocks, 8, seed=0), steps=1)  # the drawn next tokens: another score
    assert abs(labels.initial_loss - result.initial_loss) > 0.1
    assert result.best_loss <= result.initial_loss and result.best_loss == min(v for _, v in result.history)
    x = inputs("gpt", GPT, torch.float32)[0]
    assert rel_err(run("gpt", GPT, result.states[0], x, torch.float32), run("gpt", GPT, b, x, torch.float32)) < 1e-5


def test_model_labels_refuse_a_soft_label_weight():
    a, b = _pair()
    blocks = unigram_blocks(torch.arange(GPT["vocab_size"]), GPT["vocab_size"], 20, GPT["block_size"])
    with pytest.raises(ValueError, match="leave soft_labels at 0"):
        _refine(a, b, proxy_streams(blocks, 8, seed=0), model_labels=True, soft_labels=0.5)


@NEEDS_SHARED_TEXT
def test_unigram_proxy_from_the_cli(tmp_path, monkeypatch, capsys):
    """``--refine-data unigram:FILE``: the proxy holds only tokens of FILE's training split, drawn
    (not its text), refinement is told to label every split with the models' predictions (sparse
    top-k, through a vocabulary), the summary says so, and the aligned candidate keeps its function; options that cannot apply are
    refused in one line."""
    from fedbasin.checkpoint import build_torch_model, load_checkpoint
    from fedbasin.cli import main
    from fedbasin.data import load_task

    text = shakespeare_excerpt(tmp_path, 20_000)
    ref, cand = _gpt2(tmp_path / "ref", 1), _gpt2(tmp_path / "cand", 2)
    seen = {}
    spy_on_cli_refine(monkeypatch, lambda k: seen.update(k))
    argv = ["align", ref, cand, "--out", tmp_path / "out", "--refine-data", f"unigram:{text}", "--refine-steps", "2",
            "--refine-examples", "60", "--iterations", "1"]
    assert main([str(a) for a in argv + ["--refine-vocabulary", "seen", "--refine-soft-label-top-k", "4"]]) == 0
    summary = json.loads(capsys.readouterr().out)["refinement"]
    assert summary["proxy"] == "unigram" and summary["labels"] == "models" and summary["proxy_examples"] == 60
    assert seen["model_labels"] is True and seen["soft_labels"] == 0.0 and seen["soft_label_top_k"] == 4
    train_tokens = set(load_task(f"text:{text}", tokenizer=str(ref), block_size=32).train.token_ids().tolist())
    drawn = seen["batches"].split
    assert set(torch.cat([drawn.inputs.reshape(-1), drawn.targets.reshape(-1)]).tolist()) <= train_tokens
    original, aligned = load_checkpoint(str(cand)), load_checkpoint(str(tmp_path / "out"))
    tokens = torch.tensor([[5, 17, 260, 11, 464]])
    with torch.no_grad():
        before = build_torch_model(original)(tokens).logits
        after = build_torch_model(aligned)(tokens).logits
    assert float((after - before).norm() / before.norm()) < 1e-5
    argv = [*argv, "--overwrite"]  # the refusals below name their options, not the --out just written
    assert "labelled by the models' predictions alone" in cli_error(capsys, argv + ["--refine-soft-labels", "0.5"])
    missing = [a if a != f"unigram:{text}" else f"unigram:{tmp_path / 'missing.txt'}" for a in argv]
    assert f"--refine-data unigram:{tmp_path / 'missing.txt'}: text file" in cli_error(capsys, missing)
    assert "needs the text file" in cli_error(capsys, [a if a != f"unigram:{text}" else "unigram:" for a in argv])
    small = {ref: _gpt2(tmp_path / "small_ref", 3, vocab=1000), cand: _gpt2(tmp_path / "small_cand", 4, vocab=1000)}
    # the GPT-2 tokenizer saved beside them has more ids than they embed
    assert f"--refine-data unigram:{text}: tokenizer" in cli_error(capsys, [small.get(a, a) for a in argv])
    assert "give K > 0" in cli_error(capsys, argv + ["--refine-vocabulary", "seen", "--refine-soft-label-top-k", "0"])
    assert "have no effect without soft labels" in cli_error(
        capsys, [a if a != f"unigram:{text}" else f"text:{text}" for a in argv] + ["--refine-soft-label-top-k", "4"])

