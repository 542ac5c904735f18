"""The activation start of learned refinement (``activation_match``, ``start="activations"``) and the
restricted-vocabulary training loss (``vocabulary=``): exact transforms, a recovered planted
symmetry, the restricted loss equal to the full one on its tokens, and keep-best never above the
start."""

from __future__ import annotations

import json

import pytest
import torch

from fedbasin.alignment import apply_group, canonicalize, learned_refine, random_group_element, to_gauge
from fedbasin.alignment.activations import activation_match
from fedbasin.alignment.proxy import proxy_streams
from fedbasin.alignment.vocabulary import TrainingVocabulary
from fedbasin.data import load_task
from fedbasin.models import build_model
from fedbasin.training import cross_entropy

from .helpers import (DIGITS_VIT, GPT, VIT, cli_error, inputs, rel_err, run, spec_of, spy_on_cli_refine,
                      trained_digits_vit, trained_like)

PLANTED = {
    "vit-rms-relu": ("vit", dict(VIT, norm="rmsnorm", activation="relu")),
    "gpt-ln-gelu": ("gpt", dict(GPT)),
    "gpt-rope-swiglu": ("gpt", dict(GPT, position="rope", norm="rmsnorm", activation="swiglu")),
}


def _batches(family, config, n=8):
    return [inputs(family, config, seed=s) for s in range(n)]


@pytest.mark.parametrize("name", PLANTED)
def test_activation_start_recovers_a_planted_symmetry(name):
    """The candidate is the reference moved by a random element of the orthogonal group (residual
    rotation, head permutation with per-head QK/OV maps — RoPE: plane rotations — and neuron
    permutation); matching on activations maps it back onto the reference, weight for weight."""
    family, config = PLANTED[name]
    spec = spec_of(family, config)
    reference = trained_like(family, config, seed=1).state_dict()
    canon = canonicalize(spec, reference)
    g = random_group_element(spec, 3, mode="orthogonal", state=reference)
    candidate = to_gauge(spec, apply_group(spec, canon.state, g), canon.gains)
    assert max(float((candidate[k] - reference[k]).abs().max()) for k in reference) > 0.1
    found = activation_match(spec, build_model(family, config).double(), reference, candidate,
                             _batches(family, config))
    assert max(float((found.state[k] - reference[k]).abs().max()) for k in reference) < 1e-6
    assert found.start == "activations"


def _hf_gpt2(seed: int, vocab: int = 64):
    """A tiny untied HF GPT-2 (2 layers, width 16, 2 heads) with weights spread like a trained model's."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.GPT2Config(vocab_size=vocab, n_positions=16, n_embd=16, n_layer=2, n_head=2, n_inner=32,
                                     tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model


def test_activation_start_keeps_the_function_of_an_hf_gpt2_float32():
    """Hooks reach GPT-2's Conv1D modules through the adapter: the aligned candidate computes the
    candidate's logits (relative error < 1e-5, float32), and the alignment moved its weights."""
    from fedbasin.alignment.hf import hf_adapter

    ref_model, cand_model = _hf_gpt2(1), _hf_gpt2(2)
    adapter = hf_adapter(ref_model)
    ref, cand = (adapter.to_standard(m.state_dict()) for m in (ref_model, cand_model))
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 64, (4, 16), generator=g) for _ in range(4)]
    found = activation_match(adapter.spec, ref_model, ref, cand, batches, adapter.from_standard)
    assert any(float((found.state[k] - cand[k]).abs().max()) > 1e-2 for k in cand)
    moved = _hf_gpt2(3)
    moved.load_state_dict(adapter.from_standard(found.state), strict=False)
    x = torch.randint(0, 64, (3, 16), generator=g)
    with torch.no_grad():
        assert rel_err(moved(x).logits, cand_model(x).logits) < 1e-5
    assert found.objective[1] > found.objective[0]  # the residual map fits the activations better


def test_restricted_vocabulary_logits_are_the_full_logits_of_those_tokens():
    """With the token rows cut to a vocabulary and ids renumbered, the model's logits are exactly the
    full model's logits at those tokens; with every token the training loss is the full loss."""
    spec = spec_of("gpt", GPT)
    state = trained_like("gpt", GPT, seed=1, dtype=torch.float32).state_dict()
    kept = torch.tensor([0, 2, 3, 7, 11, 12, 19, 22])
    vocab = TrainingVocabulary(spec, state, kept)
    restrict, renumber = (lambda s: vocab.restrict(s, vocab.ids)), vocab.renumber
    x = kept[torch.randint(0, len(kept), (3, GPT["block_size"]), generator=torch.Generator().manual_seed(0))]
    full = run("gpt", GPT, state, x, torch.float32)
    small = run("gpt", dict(GPT, vocab_size=len(kept)), restrict(state), renumber(x), torch.float32)
    assert torch.equal(renumber(kept), torch.arange(len(kept)))
    assert float((small - full[..., kept]).abs().max()) < 1e-5
    every = torch.arange(GPT["vocab_size"])
    vocab = TrainingVocabulary(spec, state, every)
    restrict, renumber = (lambda s: vocab.restrict(s, vocab.ids)), vocab.renumber
    y = torch.randint(0, GPT["vocab_size"], x.shape, generator=torch.Generator().manual_seed(1))
    assert float(cross_entropy(run("gpt", GPT, restrict(state), renumber(y), torch.float32), renumber(y))) == \
        pytest.approx(float(cross_entropy(run("gpt", GPT, state, y, torch.float32), y)), rel=1e-6)
    with pytest.raises(ValueError, match="token 1, outside the refinement vocabulary"):
        TrainingVocabulary(spec, state, kept).renumber(torch.tensor([[0, 1]]))


def test_refinement_with_every_token_as_vocabulary_equals_the_full_refinement():
    spec = spec_of("gpt", GPT)
    a, b = (trained_like("gpt", GPT, seed=s, dtype=torch.float32).state_dict() for s in (1, 2))
    g = torch.Generator().manual_seed(0)
    data = [(x, x) for x in (torch.randint(0, 12, (4, GPT["block_size"]), generator=g) for _ in range(6))]
    results = [learned_refine(spec, build_model("gpt", GPT), a, [b], _lm_loss, iter(data * 3), data[:2], steps=8,
                              eval_every=2, vocabulary=v, vocabulary_samples=k)
               for v, k in ((None, 0), (torch.arange(GPT["vocab_size"]), 0), (torch.arange(12), 100))]
    results.append(learned_refine(spec, build_model("gpt", GPT), a, [b], _lm_loss, iter(data * 3), data[:2], steps=8,
                                  eval_every=2, vocabulary=torch.arange(12), vocabulary_samples=100,
                                  vocabulary_batch_samples=100))
    for other in results[1:]:  # every token kept, or every token outside the vocabulary (and the batch) drawn
        assert [loss for _, loss in results[0].history] == pytest.approx([loss for _, loss in other.history], rel=1e-5)
    assert results[0].best_step > 0


def test_sampled_outside_tokens_estimate_the_dropped_mass():
    """Each draw's corrected outside logits give an unbiased estimate of the outside tokens'
    partition sum; drawing every outside token is the full softmax again."""
    spec = spec_of("gpt", GPT)
    state = trained_like("gpt", GPT, seed=1, dtype=torch.float32).state_dict()
    kept = torch.tensor([0, 2, 3, 7, 11, 12, 19, 22])
    z = torch.randn(GPT["vocab_size"], generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    vocab = TrainingVocabulary(spec, state, kept, samples=5, seed=0)
    estimates = []
    for _ in range(4000):
        rows, correction, _, _ = vocab.draw(kept, kept)
        assert torch.equal(rows[:len(kept)], kept) and not bool(torch.isin(rows[len(kept):], kept).any())
        estimates.append(float((z[rows[len(kept):]] + correction[len(kept):]).exp().sum()))
    outside = torch.ones(GPT["vocab_size"], dtype=torch.bool)
    outside[kept] = False
    assert sum(estimates) / len(estimates) == pytest.approx(float(z[outside].exp().sum()), rel=0.02)
    rows, correction, _, _ = TrainingVocabulary(spec, state, kept, samples=100).draw(kept, kept)
    assert sorted(rows.tolist()) == list(range(GPT["vocab_size"])) and float(correction.abs().max()) == 0.0


def test_batch_sampled_vocabulary_keeps_the_step_s_tokens_and_estimates_the_rest():
    """``batch_samples``: a step's rows are its own tokens exactly (inputs and targets renumbered onto
    them), then k other vocabulary tokens whose corrected logits estimate the rest of the vocabulary's
    partition sum without bias, then the outside draws; drawing every token is the fixed vocabulary's
    loss again."""
    spec = spec_of("gpt", GPT)
    state = trained_like("gpt", GPT, seed=1, dtype=torch.float32).state_dict()
    kept = torch.tensor([0, 2, 3, 7, 11, 12, 19, 22])
    x, y = torch.tensor([[3, 7, 3]]), torch.tensor([[7, 3, 19]])
    z = torch.randn(GPT["vocab_size"], generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    vocab = TrainingVocabulary(spec, state, kept, samples=2, seed=0, batch_samples=2)
    estimates = []
    for _ in range(4000):
        rows, correction, xs, ys = vocab.draw(x, y)
        assert torch.equal(rows[:3], torch.tensor([3, 7, 19])) and torch.equal(rows[xs], x) and torch.equal(rows[ys], y)
        rest = rows[3:5]
        assert bool(torch.isin(rest, kept).all()) and not bool(torch.isin(rest, rows[:3]).any())
        assert not bool(torch.isin(rows[5:], kept).any()) and rows.numel() == 7
        estimates.append(float((z[rest] + correction[3:5]).exp().sum()))
    others = kept[~torch.isin(kept, torch.tensor([3, 7, 19]))]
    estimates = torch.tensor(estimates)  # unbiased: within 4 standard errors of the exact sum
    assert abs(float(estimates.mean() - z[others].exp().sum())) < 4 * float(estimates.std()) / len(estimates) ** 0.5
    every = TrainingVocabulary(spec, state, kept, batch_samples=100)
    rows, correction, xs, ys = every.draw(x, y)
    assert sorted(rows.tolist()) == kept.tolist() and float(correction.abs().max()) == 0.0
    fixed = TrainingVocabulary(spec, state, kept)
    blocks = kept[torch.randint(0, len(kept), (3, GPT["block_size"]), generator=torch.Generator().manual_seed(2))]
    rows, _, xs, _ = every.draw(blocks, blocks)
    sampled = run("gpt", dict(GPT, vocab_size=len(kept)), every.restrict(state, rows), xs, torch.float32)
    exact = run("gpt", dict(GPT, vocab_size=len(kept)), fixed.restrict(state, fixed.ids), fixed.renumber(blocks),
                torch.float32)
    assert float(_lm_loss(sampled, xs)) == pytest.approx(float(_lm_loss(exact, fixed.renumber(blocks))), rel=1e-6)
    with pytest.raises(ValueError, match="token 1, outside the refinement vocabulary"):
        vocab.draw(torch.tensor([[0, 1]]), torch.tensor([[0, 2]]))


def _lm_loss(logits, targets):
    return cross_entropy(logits[:, :-1], targets[:, 1:])


@pytest.mark.parametrize("options", [dict(start="activations"), dict(start="activations", mode="best"),
                                     dict(start="activations", vocabulary=True)],
                         ids=["activations", "activations-best", "activations-vocabulary"])
def test_refinement_from_activations_keeps_function_and_never_raises_the_selection_loss(options):
    """Trained digits pair (float32): the refined candidate keeps its function (< 1e-5); the kept
    alignment is the history's best selection loss, never above the start; ``mode="best"`` starts
    from the lowest of the three starts. A GPT pair covers ``vocabulary``."""
    if options.get("vocabulary"):
        return _lm_refinement_never_raises()
    spec = spec_of("vit", DIGITS_VIT)
    a, b = trained_digits_vit(1), trained_digits_vit(2)
    data = proxy_streams(load_task("digits", seed=0).train.subset(torch.arange(400)), 64, seed=0)
    result = learned_refine(spec, build_model("vit", DIGITS_VIT), a, [b], cross_entropy, data.batches,
                            data.selection, data.evaluation, steps=20, lr=0.05, eval_every=5, group="invertible",
                            **options)
    assert result.best_loss <= result.initial_loss == result.history[0][1]
    assert result.best_loss == min(loss for _, loss in result.history)
    x = load_task("digits", seed=0).test.inputs[:32]
    assert rel_err(run("vit", DIGITS_VIT, result.states[0], x, torch.float32),
                   run("vit", DIGITS_VIT, b, x, torch.float32)) < 1e-5
    starts = {}
    for start, mode in (("activations", "orthogonal"), ("weights", "permutation"), ("weights", "orthogonal")):
        r = learned_refine(spec, build_model("vit", DIGITS_VIT), a, [b], cross_entropy, data.batches,
                           data.selection, steps=0, start=start, mode=mode)
        starts[r.start_mode] = r.initial_loss
    expected = min(starts, key=starts.get) if options.get("mode") == "best" else "activations"
    assert result.start_mode == expected and result.initial_loss == pytest.approx(starts[expected], rel=1e-6)


def _lm_refinement_never_raises():
    spec = spec_of("gpt", GPT)
    a, b = (trained_like("gpt", GPT, seed=s, dtype=torch.float32).state_dict() for s in (1, 2))
    kept = torch.arange(0, GPT["vocab_size"], 2)
    g = torch.Generator().manual_seed(0)
    data = [(x, x) for x in (kept[torch.randint(0, len(kept), (4, GPT["block_size"]), generator=g)] for _ in range(8))]
    result = learned_refine(spec, build_model("gpt", GPT), a, [b], _lm_loss, iter(data[2:] * 4), data[:2], steps=12,
                            lr=0.05, eval_every=3, start="activations", vocabulary=kept)
    assert result.best_loss <= result.initial_loss and result.best_loss == min(v for _, v in result.history)
    x = inputs("gpt", GPT, torch.float32)[0]
    assert rel_err(run("gpt", GPT, result.states[0], x, torch.float32), run("gpt", GPT, b, x, torch.float32)) < 1e-5


@pytest.mark.parametrize("bad, message", [
    (dict(start="data"), "start must be"),
    (dict(start="activations", mode="permutation"), "orthogonal"),
    (dict(start_batches=0), "start_batches"),
])
def test_bad_start_options_are_refused(bad, message):
    spec = spec_of("vit", VIT)
    a = trained_like("vit", VIT, seed=1).state_dict()
    with pytest.raises(ValueError, match=message):
        learned_refine(spec, build_model("vit", VIT).double(), a, [a], cross_entropy, iter(()), [(None, None)], **bad)


def test_vocabulary_is_refused_without_token_embedding():
    spec = spec_of("vit", VIT)
    a = trained_like("vit", VIT, seed=1).state_dict()
    with pytest.raises(ValueError, match="no token embedding"):
        TrainingVocabulary(spec, a, torch.arange(3))


def test_batch_samples_need_a_vocabulary():
    spec = spec_of("gpt", GPT)
    a = trained_like("gpt", GPT, seed=1, dtype=torch.float32).state_dict()
    with pytest.raises(ValueError, match="vocabulary_batch_samples samples a training vocabulary"):
        learned_refine(spec, build_model("gpt", GPT), a, [a], _lm_loss, iter(()), [(None, None)],
                       vocabulary_batch_samples=4)


def test_batch_sampled_vocabulary_keeps_the_tokens_sparse_soft_targets_list():
    """Sparse (id, weight) soft targets: a step's exact rows are its inputs and every token its targets
    list with weight > 0 (weight-0 entries and tokens outside the vocabulary add no row); the targets
    renumbered onto the rows name the same tokens with the same weights; drawing every token gives the
    fixed vocabulary's soft-label loss again."""
    spec = spec_of("gpt", GPT)
    state = trained_like("gpt", GPT, seed=1, dtype=torch.float32).state_dict()
    kept = torch.tensor([0, 2, 3, 7, 11, 12, 19, 22])
    x = torch.tensor([[3, 7, 3]])
    # per position: (id, weight) pairs; 12 at weight 0 and 5 (outside the vocabulary) add no row
    y = torch.tensor([[[[7, .5], [22, .3], [12, 0.]], [[3, .6], [5, .2], [0, .1]], [[19, .9], [22, .05], [12, 0.]]]])
    vocab = TrainingVocabulary(spec, state, kept, seed=0, batch_samples=2)
    rows, correction, xs, ys = vocab.draw(x, y)
    assert sorted(rows[:5].tolist()) == [0, 3, 7, 19, 22] and rows.numel() == 7
    assert float(correction[:5].abs().max()) == 0.0 and torch.equal(rows[xs], x)
    listed = ys[..., 1] > 0
    assert int(listed.sum()) == 6 and torch.equal(rows[ys[..., 0].long()][listed], y[..., 0].long()[listed])
    assert torch.equal(ys[..., 1], y[..., 1] * torch.isin(y[..., 0].long(), kept))
    every, fixed = TrainingVocabulary(spec, state, kept, batch_samples=100), TrainingVocabulary(spec, state, kept)
    blocks = kept[torch.randint(0, len(kept), (3, GPT["block_size"]), generator=torch.Generator().manual_seed(2))]
    g = torch.Generator().manual_seed(3)
    targets = torch.stack([kept[torch.randint(0, len(kept), (3, GPT["block_size"], 4), generator=g)].float(),
                           torch.rand(3, GPT["block_size"], 4, generator=g) / 4], -1)
    rows, _, xs, ts = every.draw(blocks, targets)
    sampled = run("gpt", dict(GPT, vocab_size=len(kept)), every.restrict(state, rows), xs, torch.float32)
    exact = run("gpt", dict(GPT, vocab_size=len(kept)), fixed.restrict(state, fixed.ids), fixed.renumber(blocks),
                torch.float32)
    assert float(cross_entropy(sampled, ts)) == pytest.approx(float(cross_entropy(exact, fixed.renumber(targets))),
                                                              rel=1e-6)


def test_cli_align_from_activations_with_a_restricted_vocabulary(tmp_path, capsys, monkeypatch):
    """``fedbasin align --refine-start activations --refine-vocabulary proxy`` on a tiny HF GPT-2
    with text data: the summary reports the activation start, keep-best never above it, and the
    written endpoint computes the candidate's function (float32)."""
    from fedbasin.checkpoint import build_torch_model, load_checkpoint, save_checkpoint
    from fedbasin.cli import main

    seen = []
    spy_on_cli_refine(monkeypatch, lambda k: seen.append(k["vocabulary_batch_samples"]))
    text = tmp_path / "text.txt"
    letters = torch.randint(0, 26, (6000,), generator=torch.Generator().manual_seed(0)).tolist()
    text.write_text("".join(chr(97 + c) for c in letters), encoding="utf-8")
    paths = []
    for seed in (1, 2):
        model = _hf_gpt2(seed, vocab=26)
        save_checkpoint(tmp_path / f"m{seed}", "gpt2", model.config, model.state_dict(), kind="hf")
        paths.append(str(tmp_path / f"m{seed}"))
    out = tmp_path / "aligned"
    argv = ["align", *paths, "--out", str(out), "--refine-data", f"text:{text}", "--refine-steps", "6",
            "--refine-examples", "60", "--refine-batch-size", "8", "--refine-start", "activations",
            "--refine-vocabulary", "proxy", "--refine-eval-every", "2"]
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out)["refinement"]
    assert summary["start"] == "activations"
    assert summary["selection_loss_best"] < summary["selection_loss_start"]
    x = torch.randint(0, 26, (3, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = build_torch_model(load_checkpoint(out))(x).logits
        want = build_torch_model(load_checkpoint(paths[1]))(x).logits
    assert rel_err(got, want) < 1e-5
    assert "it needs symmetry orthogonal" in cli_error(capsys, argv + ["--overwrite", "--symmetry", "permutation"])
    # each step's own tokens plus 3 sampled ones: the option reaches the summary, the function is kept
    def writing(where):  # argv with another --out
        return [str(tmp_path / where) if a == str(out) else a for a in argv]

    assert main(writing("batch") + ["--refine-vocabulary-batch-samples", "3"]) == 0
    summary = json.loads(capsys.readouterr().out)["refinement"]
    assert summary["vocabulary_batch_samples"] == 3 and summary["vocabulary"] == "proxy" and seen[-1] == 3
    assert summary["selection_loss_best"] < summary["selection_loss_start"]
    with torch.no_grad():
        assert rel_err(build_torch_model(load_checkpoint(tmp_path / "batch"))(x).logits, want) < 1e-5
    full = [a for a in argv if a not in ("--refine-vocabulary", "proxy")]
    for option in ("--refine-vocabulary-samples", "--refine-vocabulary-batch-samples"):
        assert "needs vocabulary proxy|seen" in cli_error(capsys, full + ["--overwrite", option, "3"])
    # with sparse soft labels: the rows the targets list join each step's own tokens
    assert main(writing("soft") + ["--refine-vocabulary-batch-samples", "3", "--refine-soft-labels", "0.5",
                                   "--refine-soft-label-top-k", "4"]) == 0
    summary = json.loads(capsys.readouterr().out)["refinement"]
    assert summary["vocabulary_batch_samples"] == 3 and summary["soft_labels"] == 0.5 and seen[-1] == 3
    assert summary["selection_loss_best"] <= summary["selection_loss_start"]
    with torch.no_grad():
        assert rel_err(build_torch_model(load_checkpoint(tmp_path / "soft"))(x).logits, want) < 1e-5
