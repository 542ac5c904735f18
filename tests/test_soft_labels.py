"""Learned refinement on soft labels: the maps train on (1 − w)·labels + w·the mixed models' mean
predicted probabilities (fedbasin.alignment.soft_labels)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fedbasin.alignment import fedbasin_adapter, learned_refine, proxy_streams
from fedbasin.alignment.proxy import TrainingStream
from fedbasin.alignment.soft_labels import _soft_labels
from fedbasin.alignment.vocabulary import TrainingVocabulary
from fedbasin.alignment.workers import _Workers
from fedbasin.config import RunConfigError, resolve_run_config
from fedbasin.data import load_task
from fedbasin.models import build_model
from fedbasin.training import cross_entropy
from tests.helpers import DIGITS_VIT, cli_error, trained_digits_vit


def test_cross_entropy_takes_probability_targets():
    """One-hot probabilities give the class-id loss; soft targets give −Σ t log softmax(z), for
    class logits (B, C) and next-token logits (B, T, V) alike."""
    g = torch.Generator().manual_seed(0)
    for shape in ((6, 5), (3, 4, 7)):
        logits = torch.randn(*shape, generator=g, dtype=torch.float64)
        ids = torch.randint(0, shape[-1], shape[:-1], generator=g)
        assert float(cross_entropy(logits, F.one_hot(ids, shape[-1]).float())) == pytest.approx(
            float(cross_entropy(logits, ids)), rel=1e-6)
        soft = torch.rand(*shape, generator=g).softmax(-1)
        expected = -(soft.double() * logits.log_softmax(-1)).sum(-1).mean()
        assert float(cross_entropy(logits, soft)) == pytest.approx(float(expected), rel=1e-6)


def digits_pair():
    model = build_model("vit", DIGITS_VIT)
    spec = fedbasin_adapter("vit", model.config).spec
    task = load_task("digits", seed=0, proxy_size=300)
    return model, spec, task, trained_digits_vit(0), trained_digits_vit(1)


def test_soft_labels_are_the_mixed_models_mean_probabilities_on_the_training_part():
    model, _, task, a, b = digits_pair()
    data = proxy_streams(task.proxy, 32, seed=0)
    forward = lambda state, x, module: torch.func.functional_call(module, state, (x,))
    labels = _soft_labels(data.batches.split, [a, b], _Workers(model, torch.device("cpu"), 2), 0.25, "cpu", forward)
    expected = 0
    for state in (a, b):
        model.load_state_dict(state)
        with torch.no_grad():
            expected = expected + model(data.batches.split.inputs).softmax(-1) / 2
    hard = F.one_hot(data.batches.split.targets, 10).float()
    torch.testing.assert_close(labels, 0.75 * hard + 0.25 * expected, rtol=1e-5, atol=1e-6)
    relabelled = data.batches.relabelled(labels)  # a fresh stream: the same batches, new targets
    fresh = TrainingStream(data.batches.split, 32, seed=0)
    for _ in range(12):  # past the first epoch (180 training examples)
        (x, t), (x0, y0) = next(relabelled), next(fresh)
        assert torch.equal(x, x0) and torch.equal(t.argmax(-1), y0)


def test_soft_labels_read_the_inputs_through_the_split_s_transform():
    """Stored inputs that only become model inputs through the split's transform (CIFAR-10 keeps
    uint8 images): the labels equal those of the transformed inputs stored as they are. (The
    classes were once counted on a raw stored input: uint8 images into the model raised.)"""
    from fedbasin.data.task import Split

    model, _, task, a, b = digits_pair()
    split = proxy_streams(task.proxy, 32, seed=0).batches.split
    lo, hi = float(split.inputs.min()), float(split.inputs.max())
    stored = ((split.inputs - lo) / (hi - lo) * 255).round().to(torch.uint8)
    transform = lambda q: q.float() / 255 * (hi - lo) + lo
    forward = lambda state, x, module: torch.func.functional_call(module, state, (x,))
    workers = _Workers(model, torch.device("cpu"), 1)
    labels = _soft_labels(Split(stored, split.targets, transform), [a, b], workers, 0.5, "cpu", forward)
    expected = _soft_labels(Split(transform(stored), split.targets), [a, b], workers, 0.5, "cpu", forward)
    torch.testing.assert_close(labels, expected, rtol=0, atol=0)


def refine(soft_labels: float, steps: int = 40):
    model, spec, task, a, b = digits_pair()
    data = proxy_streams(task.proxy, 32, seed=0)
    result = learned_refine(spec, model, a, [b], cross_entropy, data.batches, data.selection, data.evaluation,
                            steps=steps, lr=1e-2, eval_every=5, soft_labels=soft_labels)
    return model, b, result


def test_refinement_on_soft_labels_keeps_the_function_and_never_raises_the_selection_loss():
    model, b, soft = refine(0.5)
    _, _, hard = refine(0.0)
    assert soft.best_loss <= soft.initial_loss and soft.best_step > 0
    assert soft.initial_loss == hard.initial_loss  # the same start, scored on the labels
    assert [loss for _, loss in soft.history] != [loss for _, loss in hard.history]  # the targets changed
    assert_same_function(model, b, soft.states[0])


def assert_same_function(model, state: dict, refined: dict) -> None:
    """The digits model computes the same outputs with ``refined`` as with ``state`` (float32)."""
    x = torch.rand(8, 1, 8, 8)
    with torch.no_grad():
        model.load_state_dict(state)
        before = model(x)
        model.load_state_dict(refined)
        after = model(x)
    assert float((after - before).abs().max() / before.abs().max()) < 1e-5


def test_soft_label_refusals(monkeypatch):
    model, spec, task, a, b = digits_pair()
    data = proxy_streams(task.proxy, 32, seed=0)
    args = (spec, model, a, [b], cross_entropy)
    with pytest.raises(ValueError, match=r"soft_labels must be a number in \[0, 1\], got 1.5"):
        learned_refine(*args, data.batches, data.selection, steps=2, soft_labels=1.5)
    with pytest.raises(ValueError, match="soft_labels needs the training stream of proxy_streams"):
        learned_refine(*args, iter(list(data.selection)), data.selection, steps=2, soft_labels=0.5)
    with pytest.raises(ValueError, match="soft_labels over every class cannot be combined with a training vocabulary"):
        learned_refine(*args, data.batches, data.selection, steps=2, soft_labels=0.5, vocabulary=torch.arange(3))
    for bad in (-1, 2.0, True):
        with pytest.raises(ValueError, match=f"soft_label_top_k must be an integer >= 0 .*, got {bad!r}"):
            learned_refine(*args, data.batches, data.selection, steps=2, soft_labels=0.5, soft_label_top_k=bad)
    monkeypatch.setattr("fedbasin.alignment.soft_labels.SOFT_LABEL_BYTES", 1000)
    with pytest.raises(ValueError, match=r"the targets of 180 training examples would take 0.0 GiB .* or sparse top-k"):
        learned_refine(*args, data.batches, data.selection, steps=2, soft_labels=0.5)
    with pytest.raises(ValueError, match=r"the targets of 180 training examples .* a smaller top-k"):
        learned_refine(*args, data.batches, data.selection, steps=2, soft_labels=0.5, soft_label_top_k=3)
    with pytest.raises(RunConfigError, match="run-config refine-soft-labels=1.5 must be at most 1.0"):
        resolve_run_config({"refine-soft-labels": 1.5})


def test_cli_soft_labels(tmp_path, capsys, monkeypatch):
    """``--refine-soft-labels`` reaches the refinement and its summary; it is refused out of
    [0, 1], without ``--refine-data`` and with a restricted vocabulary."""
    import json

    import fedbasin.alignment.refine as refine_module
    from fedbasin.checkpoint import save_checkpoint
    from fedbasin.cli import main

    seen = []
    original = refine_module._soft_labels
    monkeypatch.setattr(refine_module, "_soft_labels", lambda *a: seen.append(a[3::3]) or original(*a))

    for seed in (0, 1):
        save_checkpoint(tmp_path / f"m{seed}", "vit", DIGITS_VIT, trained_digits_vit(seed))
    m0, m1, out = (str(tmp_path / n) for n in ("m0", "m1", "out"))
    assert main(["merge", m0, m1, "--out", out, "--refine-data", "digits", "--refine-steps", "6",
                 "--refine-examples", "120", "--refine-soft-labels", "0.5", "--distill-steps", "0"]) == 0
    info = json.loads(capsys.readouterr().out)["refinement"]
    assert info["soft_labels"] == 0.5 and info["selection_loss_best"] <= info["selection_loss_start"]
    assert main(["merge", m0, m1, "--out", out + "k", "--refine-data", "digits", "--refine-steps", "6",
                 "--refine-examples", "120", "--refine-soft-labels", "0.5", "--refine-soft-label-top-k", "3",
                 "--distill-steps", "0"]) == 0
    assert json.loads(capsys.readouterr().out)["refinement"]["soft_label_top_k"] == 3
    assert seen == [(0.5, 0), (0.5, 3)]
    assert "must be at most 1.0, got 2" in cli_error(capsys, ["merge", m0, m1, "--out", out + "2",
                                                                       "--refine-soft-labels", "2"])
    assert cli_error(capsys, ["merge", m0, m1, "--out", out + "2", "--refine-soft-labels", "0.5"]).endswith(
        "--refine-soft-labels has no effect without --refine-data")
    assert cli_error(capsys, ["merge", m0, m1, "--out", out + "2", "--refine-data", "digits", "--refine-soft-labels",
                              "0.5", "--refine-vocabulary", "proxy", "--refine-soft-label-top-k", "0"]).endswith(
        "--refine-vocabulary proxy --refine-soft-label-top-k 0: soft labels over every token cannot be combined "
        "with a restricted vocabulary: give K > 0")
    assert cli_error(capsys, ["merge", m0, m1, "--out", out + "2", "--refine-data", "digits",
                              "--refine-soft-labels", "0", "--refine-soft-label-top-k", "3"]).endswith(
        "--refine-soft-label-top-k 3 --refine-soft-labels 0.0: sparse soft labels have no effect without soft labels "
        "(> 0, or unigram: data)")
    assert "must be at least 0, got -1" in cli_error(capsys, ["merge", m0, m1, "--out", out + "2", "--refine-data",
                                                            "digits", "--refine-soft-labels", "0.5",
                                                            "--refine-soft-label-top-k", "-1"])


def test_the_server_refines_on_soft_labels(monkeypatch):
    """Run config ``refine-soft-labels``: the ServerApp's refiner labels the round's clients' proxy
    predictions and the round succeeds; the option reaches ``learned_refine``."""
    from flwr.supercore.task_identity import TaskIdentity

    import fedbasin.alignment.refine as refine_module
    from fedbasin.server.server_app import make_refiner
    from fedbasin.strategies import AlignedFedAvg
    from tests.test_distill import one_shot_round

    for name, value in (("_run_id", 7), ("_task_id", 1), ("_node_id", 0)):
        monkeypatch.setattr(TaskIdentity, name, value)
    seen = []
    original = refine_module._soft_labels
    monkeypatch.setattr(refine_module, "_soft_labels", lambda *a: seen.append(a[3::3]) or original(*a))
    config = resolve_run_config({"proxy-size": 300, "refine-steps": 6, "refine-soft-labels": 0.5,
                                 "refine-soft-label-top-k": 4, "model.dim": 16,
                                 "model.depth": 1, "model.heads": 2, "model.mlp-dim": 32})
    model, spec, task, _, _ = digits_pair()
    strategy = AlignedFedAvg(spec, refine=make_refiner(spec, model, task, config), independent_init=True,
                             min_train_nodes=3, min_available_nodes=3)
    arrays, metrics = one_shot_round(strategy, [trained_digits_vit(seed) for seed in range(3)])
    assert arrays is not None and metrics["round_failed"] == 0 and "refine_heldout_loss" in metrics
    assert seen == [(0.5, 4)]


def test_cross_entropy_takes_sparse_probability_targets():
    """k (class id, weight) pairs per target: with every class listed the dense loss; with fewer, the
    dense cross-entropy of the coarse distribution (the listed classes, and one bucket of the rest
    holding the weight they leave)."""
    g = torch.Generator().manual_seed(0)
    for shape in ((6, 5), (3, 4, 7)):
        logits = torch.randn(*shape, generator=g, dtype=torch.float64)
        soft = torch.rand(*shape, generator=g, dtype=torch.float64).softmax(-1)
        values, ids = soft.topk(shape[-1], dim=-1)
        assert float(cross_entropy(logits, torch.stack([ids.double(), values], -1))) == pytest.approx(
            float(cross_entropy(logits, soft)), rel=1e-12)
        for k in (1, 2):
            values, ids = soft.topk(k, dim=-1)
            p = logits.softmax(-1)
            listed = p.gather(-1, ids)
            coarse = -(values * listed.log()).sum(-1) - (1 - values.sum(-1)) * (1 - listed.sum(-1)).log()
            got = cross_entropy(logits, torch.stack([ids.double(), values], -1))
            assert float(got) == pytest.approx(float(coarse.mean()), rel=1e-10)


def test_truncated_targets_are_best_matched_by_the_target_itself():
    """The sparse loss of a truncated distribution is stationary at that distribution's own logits:
    it does not reward moving the unlisted classes' mass onto the listed ones."""
    g = torch.Generator().manual_seed(1)
    soft = torch.rand(4, 3, 50, generator=g, dtype=torch.float64).softmax(-1)  # flat: the top 5 hold ~15 %
    values, ids = soft.topk(5, dim=-1)
    logits = soft.log().requires_grad_(True)
    cross_entropy(logits, torch.stack([ids.double(), values], -1)).backward()
    assert float(logits.grad.abs().max()) < 1e-12
    sharper = (2 * soft.log()).detach()  # the same order, more mass on the top classes
    assert float(cross_entropy(sharper, torch.stack([ids.double(), values], -1))) > float(
        cross_entropy(soft.log(), torch.stack([ids.double(), values], -1)))


def test_sparse_targets_listing_no_class_give_no_gradient():
    logits = torch.randn(2, 6, dtype=torch.float64, requires_grad=True)
    nothing = torch.zeros(2, 3, 2, dtype=torch.float64)  # every weight 0: all mass in the bucket (p = 1)
    loss = cross_entropy(logits, nothing)
    loss.backward()
    assert loss.item() == 0.0 and bool(torch.isfinite(logits.grad).all()) and float(logits.grad.abs().max()) == 0.0


def test_top_k_soft_labels_are_the_largest_entries_of_the_dense_targets():
    model, _, task, a, b = digits_pair()
    split = proxy_streams(task.proxy, 32, seed=0).batches.split
    forward = lambda state, x, module: torch.func.functional_call(module, state, (x,))
    workers = _Workers(model, torch.device("cpu"), 2)
    dense = _soft_labels(split, [a, b], workers, 0.25, "cpu", forward)
    sparse = _soft_labels(split, [a, b], workers, 0.25, "cpu", forward, top_k=3)
    values, ids = dense.topk(3, dim=-1)
    assert sparse.shape == (len(split), 3, 2)
    assert torch.equal(sparse[..., 0].long(), ids)
    torch.testing.assert_close(sparse[..., 1], values)  # not renormalised: the rest is the bucket's
    every = _soft_labels(split, [a, b], workers, 0.25, "cpu", forward, top_k=50)  # k above the classes: all of them
    assert every.shape == (len(split), 10, 2)


def test_sparse_targets_keep_only_the_vocabulary_s_weight():
    """Through a training vocabulary, sparse targets are renumbered to its rows; weight on tokens
    outside it is dropped (it joins the unlisted bucket), the rest kept as it is."""
    from tests.helpers import GPT, spec_of, trained_like

    state = trained_like("gpt", GPT, seed=1, dtype=torch.float32).state_dict()
    vocab = TrainingVocabulary(spec_of("gpt", GPT), state, torch.tensor([2, 5, 9]))
    targets = torch.tensor([[[5.0, 0.5], [3.0, 0.3], [9.0, 0.2]]])  # token 3 is outside
    renumbered = vocab.renumber(targets)
    assert renumbered[..., 0].tolist() == [[1.0, 0.0, 2.0]]
    torch.testing.assert_close(renumbered[..., 1], torch.tensor([[0.5, 0.0, 0.2]]))


def lm_refinement(soft_labels: float = 0.0, top_k: int = 0, **options):
    """A tiny GPT pair refined on next-token blocks of the even tokens."""
    from fedbasin.data import Split
    from tests.helpers import GPT, spec_of, trained_like

    a, b = (trained_like("gpt", GPT, seed=s, dtype=torch.float32).state_dict() for s in (1, 2))
    kept = torch.arange(0, GPT["vocab_size"], 2)
    g = torch.Generator().manual_seed(0)
    blocks = kept[torch.randint(0, len(kept), (120, GPT["block_size"] + 1), generator=g)]
    data = proxy_streams(Split(blocks[:, :-1], blocks[:, 1:]), 8, seed=0)
    result = learned_refine(spec_of("gpt", GPT), build_model("gpt", GPT), a, [b], cross_entropy, data.batches,
                            data.selection, steps=12, lr=0.05, eval_every=3, soft_labels=soft_labels,
                            soft_label_top_k=top_k, **options)
    return b, result


def test_top_k_soft_labels_refine_a_language_model_through_a_vocabulary():
    """Sparse soft labels with every class equal the dense run; top-k targets through a sampled
    training vocabulary train the maps (another history than the labels'), keep the function and
    never raise the selection loss."""
    from tests.helpers import GPT, inputs, rel_err, run

    _, dense = lm_refinement(0.5)
    _, every = lm_refinement(0.5, top_k=GPT["vocab_size"])
    assert [v for _, v in every.history] == pytest.approx([v for _, v in dense.history], rel=1e-5)
    vocabulary = {"vocabulary": torch.arange(0, GPT["vocab_size"], 2), "vocabulary_samples": 3}
    _, hard = lm_refinement(0.0, **vocabulary)
    b, soft = lm_refinement(0.5, top_k=4, **vocabulary)
    assert soft.initial_loss == hard.initial_loss and [v for _, v in soft.history] != [v for _, v in hard.history]
    assert soft.best_loss <= soft.initial_loss and soft.best_loss == min(v for _, v in soft.history)
    x = inputs("gpt", GPT, torch.float32)[0]
    assert rel_err(run("gpt", GPT, soft.states[0], x, torch.float32), run("gpt", GPT, b, x, torch.float32)) < 1e-5


def test_top_k_soft_labels_over_a_vocabulary_are_its_probabilities():
    """With a training vocabulary, p̄ is the mean softmax over its tokens only; the sparse ids are
    the full model's token ids."""
    from fedbasin.data import Split
    from tests.helpers import GPT, spec_of, trained_like

    a, b = (trained_like("gpt", GPT, seed=s, dtype=torch.float32).state_dict() for s in (1, 2))
    kept = torch.arange(0, GPT["vocab_size"], 2)
    blocks = kept[torch.randint(0, len(kept), (5, GPT["block_size"] + 1), generator=torch.Generator().manual_seed(0))]
    split = Split(blocks[:, :-1], blocks[:, 1:])
    model = build_model("gpt", GPT)
    forward = lambda state, x, module: torch.func.functional_call(module, state, (x,))
    vocab = TrainingVocabulary(spec_of("gpt", GPT), a, kept)
    got = _soft_labels(split, [a, b], _Workers(model, torch.device("cpu"), 2), 0.5, "cpu", forward, 3, vocab)
    with torch.no_grad():
        p = sum(forward(s, split.inputs, model)[..., kept].softmax(-1) for s in (a, b)) / 2
    target = 0.5 * F.one_hot(vocab.renumber(split.targets), len(kept)).float() + 0.5 * p
    values, ids = target.topk(3, dim=-1)
    assert torch.equal(got[..., 0].long(), kept[ids])
    torch.testing.assert_close(got[..., 1], values)
