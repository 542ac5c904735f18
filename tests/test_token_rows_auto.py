"""Data-free token-row inference (``token_rows="auto"``): planted trained rows are found from the weights
alone, all-trained models keep every row, models without token rows give None, and weight matching on the
inferred rows recovers a planted symmetry as well as on the true rows."""

from __future__ import annotations

import pytest
import torch

from fedbasin.alignment import (
    apply_group,
    canonicalize,
    merge,
    random_group_element,
    to_gauge,
    weight_match,
)
from fedbasin.alignment.token_rows import infer_token_rows, infer_token_weights

from .helpers import GPT, VIT, spec_of, trained_like

V, D, TRAINED = 3000, 48, 600
CONFIG = {**GPT, "vocab_size": V, "dim": D}
SIGMA = 0.02  # the init scale of the token rows


def _structure(n: int, seed: int = 99) -> tuple[torch.Tensor, torch.Tensor]:
    """What training writes into the rows of n seen tokens, shared by every model trained on the data
    (in its own basis): Zipf-like magnitudes, the most frequent token first."""
    g = torch.Generator().manual_seed(seed)
    size = 3 * SIGMA * torch.arange(1, n + 1, dtype=torch.float64).pow(-0.3)[:, None]
    return size * torch.randn(n, D, generator=g, dtype=torch.float64), size * torch.randn(n, D, generator=g, dtype=torch.float64)


def _rows(seen: torch.Tensor, seed: int, all_trained: bool = False) -> dict:
    """Token rows of one model: init noise, the shared structure on the seen rows, and in the head the
    push every unseen row shares (their logits pushed down together)."""
    g = torch.Generator().manual_seed(seed)
    emb = SIGMA * torch.randn(V, D, generator=g, dtype=torch.float64)
    head = SIGMA * torch.randn(V, D, generator=g, dtype=torch.float64)
    unseen = torch.ones(V, dtype=torch.bool)
    unseen[seen] = False
    if all_trained:  # every token frequent enough to move well away from its init
        size = SIGMA * torch.exp(2.5 * torch.rand(V, 1, generator=g, dtype=torch.float64))
        e, h = _structure(V)
        return {"tok_emb.weight": emb + size * e / e.norm(dim=1, keepdim=True) * D ** 0.5,
                "head.weight": head + size * h / h.norm(dim=1, keepdim=True) * D ** 0.5}
    e, h = _structure(len(seen))
    emb[seen] += e
    head[seen] += h
    push = torch.randn(D, generator=g, dtype=torch.float64)
    push = 2 * SIGMA * D ** 0.5 * push / push.norm()  # twice the init norm (as on the GPT-2 pair)
    head[unseen] += push
    # a seen token's logit along the push undone grows with its log-frequency (seen[0] the most frequent)
    log_rank = torch.arange(1, len(seen) + 1, dtype=torch.float64).log()[:, None]
    if len(seen):
        head[seen] -= push * (1 - log_rank / max(float(log_rank[-1]), 1.0))
    return {"tok_emb.weight": emb, "head.weight": head}


def _seen(seed: int = 5) -> torch.Tensor:
    return torch.randperm(V, generator=torch.Generator().manual_seed(seed))[:TRAINED]


def _model(seen, seed, **kw) -> dict:
    state = trained_like("gpt", CONFIG, seed=1).state_dict()
    state.update(_rows(seen, seed, **kw))
    # the head's rows are judged as stored; a planted candidate moved in the canonical form (gains
    # folded into the head's columns) and returned to the gauge of gains ≠ 1 would make its init noise
    # anisotropic, which a trained model's is not: unit gains before the head keep the plant honest
    state["norm_f.weight"] = torch.ones_like(state["norm_f.weight"])
    return state


def _recovery(found: torch.Tensor, seen: torch.Tensor) -> tuple[float, float]:
    truth = torch.zeros(V, dtype=torch.bool)
    truth[seen] = True
    hit = float((found & truth).sum())
    return hit / max(int(found.sum()), 1), hit / int(truth.sum())  # precision, recall


def test_planted_trained_rows_are_recovered_from_the_weights():
    spec = spec_of("gpt", CONFIG)
    seen = _seen()
    found = infer_token_rows(spec, _model(seen, 10), _model(seen, 11))
    precision, recall = _recovery(found.probability > 0.5, seen)
    assert precision >= 0.99 and recall >= 0.99, (precision, recall)
    assert found.summary() == {"source": "weights", "trained": found.trained, "of": V, "clusters": 4}
    assert abs(found.trained - TRAINED) <= 0.02 * TRAINED
    # the weights: zero (or nearly) on unseen rows, mean 1 on the rows judged trained
    w = infer_token_weights(spec, _model(seen, 10), _model(seen, 11))
    unseen = torch.ones(V, dtype=torch.bool)
    unseen[seen] = False
    assert float(w[unseen].sum()) < 0.01 * float(w[seen].sum())
    for weighting in ("mask", "signal", "zipf"):
        other = infer_token_rows(spec, _model(seen, 10), _model(seen, 11), weighting=weighting)
        assert abs(float(other.weights[found.probability > 0.5].mean()) - 1) < 1e-9
        assert float(other.weights[unseen].sum()) < 0.01 * float(other.weights[seen].sum())


def test_the_same_weights_are_judged_once_and_again_after_an_in_place_change(monkeypatch):
    """A plain ``align`` asks three times about the same tensors: each is judged once; a tensor changed in
    place since (or another tensor with equal values) is judged anew, with the answer its values give."""
    from fedbasin.alignment import token_rows

    judged = []
    compute = token_rows._tensor_evidence
    monkeypatch.setattr(token_rows, "_tensor_evidence", lambda key, rows: judged.append(key) or compute(key, rows))
    spec = spec_of("gpt", CONFIG)
    seen = _seen()
    ref, cand = _model(seen, 10), _model(seen, 11)
    first = infer_token_rows(spec, ref, cand)
    assert len(judged) == 4  # two token tensors per model
    again = infer_token_rows(spec, ref, cand)
    assert len(judged) == 4 and torch.equal(again.weights, first.weights)
    untrained = _model(torch.arange(0), 12)["head.weight"]  # one push on every row: no trained head rows
    ref["head.weight"].copy_(untrained)  # in place: the same tensor object, a new version
    changed = infer_token_rows(spec, ref, cand)
    assert len(judged) == 5
    fresh = {**ref, "head.weight": ref["head.weight"].clone()}  # equal values, another tensor
    assert torch.equal(infer_token_rows(spec, fresh, cand).weights, changed.weights)
    assert len(judged) == 6  # the clone alone is judged anew
    assert not torch.equal(changed.weights, first.weights)


def test_zipf_weights_rank_the_rows_by_their_logit_along_the_push_undone():
    spec = spec_of("gpt", CONFIG)
    seen = _seen()
    found = infer_token_rows(spec, _model(seen, 10), _model(seen, 11), weighting="zipf")
    w = found.weights[seen]  # seen[k] has frequency rank k + 1
    rank = torch.arange(1, len(seen) + 1, dtype=torch.float64)

    def ranks(x):
        return torch.argsort(torch.argsort(x)).double()

    spearman = float(torch.corrcoef(torch.stack([ranks(w), ranks(-rank)]))[0, 1])
    assert spearman > 0.8, spearman  # 0.85 here: the init noise blurs neighbouring ranks
    assert float(w[:10].mean()) > 3 * float(w[-100:].mean())  # rank^(-1/2): the head outweighs the tail


@pytest.mark.parametrize("projection", [True, False])
def test_rarely_seen_rows_are_found_by_their_projection_along_the_push(monkeypatch, projection):
    """A token seen once or twice undoes part of the push only: its head row stays inside the distance
    cluster (the shift is spread over d directions) but stands out along the push itself."""
    from fedbasin.alignment import token_rows

    monkeypatch.setattr(token_rows, "PROJECTION", projection)
    spec = spec_of("gpt", CONFIG)
    seen = _seen()
    rare = torch.randperm(V, generator=torch.Generator().manual_seed(5))[TRAINED:TRAINED + 200]
    unseen = torch.ones(V, dtype=torch.bool)
    unseen[seen] = False
    unseen[rare] = False

    def model(seed):
        state = _model(seen, seed)
        head = state["head.weight"].clone()
        head[rare] -= 0.4 * head[unseen].mean(dim=0)  # 40 % of the push undone
        state["head.weight"] = head
        return state

    found = infer_token_rows(spec, model(10), model(11))
    judged = found.probability > 0.5
    assert bool(judged[seen].all()) and not bool(judged[unseen].any())
    recall = float(judged[rare].double().mean())
    assert recall >= 0.9 if projection else recall <= 0.1, recall


def test_a_row_counts_only_when_trained_in_both_models():
    spec = spec_of("gpt", CONFIG)
    seen = _seen()
    half = seen[: TRAINED // 2]
    found = infer_token_rows(spec, _model(seen, 10), _model(half, 11))
    precision, recall = _recovery(found.probability > 0.5, half)
    assert precision >= 0.99 and recall >= 0.99, (precision, recall)


def test_models_with_every_row_trained_keep_every_row():
    spec = spec_of("gpt", CONFIG)
    found = infer_token_rows(spec, _model(_seen(), 10, all_trained=True), _model(_seen(), 11, all_trained=True))
    assert found.trained >= 0.98 * V
    assert float(found.weights.min()) > 0


def test_untrained_models_fall_back_to_all_rows_and_no_token_rows_give_none():
    spec = spec_of("gpt", CONFIG)
    empty = torch.tensor([], dtype=torch.long)
    found = infer_token_rows(spec, _model(empty, 10), _model(empty, 11))
    assert found.trained == V and bool((found.weights == 1).all())
    vit = spec_of("vit", VIT)
    states = [trained_like("vit", VIT, seed=s).state_dict() for s in (1, 2)]
    assert infer_token_weights(vit, *states) is None
    a = weight_match(vit, *states, iterations=3, tol=0.0)
    b = weight_match(vit, *states, iterations=3, tol=0.0, token_rows="auto")
    assert max(float((a.state[k] - b.state[k]).abs().max()) for k in a.state) == 0.0


def _planted_pair():
    """Reference with planted trained rows; the candidate is the same model with fresh untrained rows
    (fresh init noise and push), moved by a random group element: the trained rows pin the element."""
    spec = spec_of("gpt", CONFIG)
    seen = _seen()
    ref = _model(seen, 10)
    other = _rows(seen, 11)
    unseen = torch.ones(V, dtype=torch.bool)
    unseen[seen] = False
    cand = dict(ref)
    for k, rows in other.items():
        cand[k] = torch.where(unseen[:, None], rows, ref[k])
    canon = canonicalize(spec, cand)
    g = random_group_element(spec, 3, state=canon.state)
    return spec, ref, to_gauge(spec, apply_group(spec, canon.state, g), canon.gains), seen


def _saved_planted_pair(tmp_path):
    """:func:`_planted_pair` saved as checkpoints ``ref`` and ``cand`` in ``tmp_path``: (the seen rows, the config)."""
    from fedbasin.checkpoint import save_checkpoint
    from fedbasin.models import make_config

    _, ref, cand, seen = _planted_pair()
    config = make_config("gpt", CONFIG)
    for name, state in (("ref", ref), ("cand", cand)):
        save_checkpoint(tmp_path / name, "gpt", config, {k: v.float() for k, v in state.items()})
    return seen, config


def _error(match, ref) -> float:
    """Largest distance of the aligned candidate from the reference outside the token rows."""
    state = match if isinstance(match, dict) else match.state
    keys = [k for k in ref if k not in ("tok_emb.weight", "head.weight")]
    return max(float((state[k] - ref[k]).abs().max()) for k in keys)


def test_auto_recovers_a_planted_symmetry_as_well_as_the_true_rows():
    spec, ref, cand, seen = _planted_pair()
    truth = torch.zeros(V, dtype=torch.float64)
    truth[seen] = 1.0
    options = {"iterations": 20, "tol": 0.0}
    true_rows = weight_match(spec, ref, cand, token_rows=truth, **options)
    auto = weight_match(spec, ref, cand, token_rows="auto", **options)
    every = weight_match(spec, ref, cand, **options)
    assert _error(true_rows, ref) < 1e-6
    # soft weights (P ≈ 1 on trained rows, small but not 0 on a few untrained ones) move the optimum by
    # 3e-4 here; the untrained noise moves the all-rows match by 1.5 (the test can fail)
    assert _error(auto, ref) < 1e-3
    assert _error(every, ref) > 0.1
    assert auto.token_rows == {"source": "weights", "trained": pytest.approx(TRAINED, abs=12), "of": V, "clusters": 4}
    merged = merge(spec, [ref, cand], token_rows="auto", iterations=20, tol=0.0)
    assert _error(merged.state, ref) < 1e-3  # the mean of the reference and its exact copy
    assert merged.token_rows[0] is None and merged.token_rows[1]["trained"] == auto.token_rows["trained"]


def test_bad_token_rows_string_is_refused():
    spec, ref, cand, _ = _planted_pair()
    with pytest.raises(ValueError, match="auto"):
        weight_match(spec, ref, cand, token_rows="data")


def test_cli_seen_tokens_auto_records_the_rows_judged_trained(tmp_path, capsys):
    import json

    from fedbasin.checkpoint import load_checkpoint
    from fedbasin.cli import main

    from .helpers import cli_error

    _saved_planted_pair(tmp_path)
    a, b = (load_checkpoint(tmp_path / n) for n in ("ref", "cand"))
    assert main(["align", str(tmp_path / "ref"), str(tmp_path / "cand"), "--out", str(tmp_path / "out"),
                 "--seen-tokens", "auto", "--iterations", "5", "--head-weight", "1", "--refine-budget", "0"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["data_free"] == "weight matching"  # budget 0: no data-free refinement
    assert summary["token_rows"]["source"] == "weights" and summary["token_rows"]["of"] == V
    assert abs(summary["token_rows"]["trained"] - TRAINED) <= 12
    expected = weight_match(a.spec, a.adapter.to_standard(a.state), b.adapter.to_standard(b.state),
                            iterations=5, token_rows="auto").state
    written = load_checkpoint(tmp_path / "out")
    written = written.adapter.to_standard(written.state)
    assert max(float((written[k] - expected[k]).abs().max()) for k in expected) < 1e-6
    assert main(["merge", str(tmp_path / "ref"), str(tmp_path / "cand"), "--out", str(tmp_path / "merged"),
                 "--iterations", "5", "--head-weight", "1", "--refine-budget", "0"]) == 0  # auto is the default
    merged = json.loads(capsys.readouterr().out)
    assert merged["token_rows"][0] is None and abs(merged["token_rows"][1]["trained"] - TRAINED) <= 12
    assert "--token-weighting has no effect without --seen-tokens text:FILE" in cli_error(
        capsys, ["align", str(tmp_path / "ref"), str(tmp_path / "cand"), "--out", str(tmp_path / "x"),
                 "--seen-tokens", "auto", "--token-weighting", "count"])


def test_cli_unigram_proxy_draws_the_rows_judged_trained_by_their_learned_frequency(tmp_path, capsys, monkeypatch):
    """``--refine-data unigram`` (no data): the synthetic proxy is drawn from the rows judged trained in both
    models (the planted 600), the most frequent by the head's learned order drawn most (Zipf, f ∝ 1/rank),
    labelled by the models; models whose rows show no untrained cluster are refused in one line."""
    import json

    from fedbasin.checkpoint import save_checkpoint
    from fedbasin.cli import main
    from fedbasin.options import SYNTHETIC_EXAMPLES

    from .helpers import cli_error, spy_on_cli_refine

    seen, config = _saved_planted_pair(tmp_path)
    recorded = {}
    spy_on_cli_refine(monkeypatch, recorded.update)
    argv = ["align", str(tmp_path / "ref"), str(tmp_path / "cand"), "--out", str(tmp_path / "out"), "--refine-data",
            "unigram", "--refine-steps", "2", "--refine-examples", "400", "--iterations", "2"]
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out)["refinement"]
    assert (summary["proxy"], summary["labels"], summary["frequencies"]) == ("unigram", "models", "weights")
    assert recorded["model_labels"] is True
    drawn = recorded["batches"].split
    tokens = torch.cat([drawn.inputs.reshape(-1), drawn.targets.reshape(-1)])
    assert drawn.inputs.shape[1] == CONFIG["block_size"]
    assert set(tokens.tolist()) <= set(seen.tolist())  # only rows trained in both models
    counts = torch.bincount(tokens, minlength=V)[seen]  # seen[0] the most frequent
    top, rest = counts[:60].double().mean(), counts[300:].double().mean()
    assert float(top / rest) > 10  # f ∝ 1/rank: ~34 between ranks 1-60 and 301-600 (√ of it, ~4.6, fails)
    untrained = {k: v.float() for k, v in trained_like("gpt", CONFIG, seed=4).state_dict().items()}
    save_checkpoint(tmp_path / "fresh", "gpt", config, untrained)
    fresh = [a if a != str(tmp_path / "cand") else str(tmp_path / "fresh") for a in argv] + ["--overwrite"]
    assert "shows no untrained token rows to tell them from: give unigram:FILE" in cli_error(capsys, fresh)
    # plain align / merge of such models: this refinement by default, within --refine-budget
    for command in ("align", "merge"):
        recorded.clear()
        plain = [command, str(tmp_path / "ref"), str(tmp_path / "cand"), "--out", str(tmp_path / f"plain-{command}"),
                 "--refine-budget", "2"]
        assert main(plain) == 0
        summary = json.loads(capsys.readouterr().out)
        assert summary["data_free"] == "weight matching refined on --refine-data bigram"
        assert summary["refinement"]["proxy"] == "bigram" and recorded["model_labels"] is True
        # each synthetic proxy draws its own number of blocks (bigram 1,024, unigram 512)
        assert summary["refinement"]["proxy_examples"] == SYNTHETIC_EXAMPLES["bigram"] != SYNTHETIC_EXAMPLES["unigram"]
    not_refined = [a if a != str(tmp_path / "cand") else str(tmp_path / "fresh") for a in plain[:-2]] + [
        "--overwrite", "--refine-budget", "2"]  # over plain-merge, just written
    assert "--refine-budget has no effect without --refine-data here" in cli_error(capsys, not_refined)
    assert main(not_refined[:-2]) == 0 and json.loads(capsys.readouterr().out)["data_free"] == "weight matching"


def test_cli_bigram_proxy_chains_the_models_one_token_predictions_over_the_rows_judged_trained(tmp_path, capsys,
                                                                                                 monkeypatch):
    """``--refine-data bigram``: the first token as ``unigram`` draws it, each next one from the models' mean
    prediction after the previous token alone, over the rows judged trained; the models label the blocks."""
    import json

    from fedbasin.alignment.token_rows import infer_token_rows
    from fedbasin.checkpoint import build_torch_model, load_checkpoint
    from fedbasin.cli import _one_token_transitions, main
    from fedbasin.data import chain_blocks

    from .helpers import spy_on_cli_refine

    seen, config = _saved_planted_pair(tmp_path)
    recorded = {}
    spy_on_cli_refine(monkeypatch, recorded.update)
    assert main(["align", str(tmp_path / "ref"), str(tmp_path / "cand"), "--out", str(tmp_path / "out"),
                 "--refine-data", "bigram", "--refine-steps", "2", "--refine-examples", "60", "--iterations", "2"]) == 0
    summary = json.loads(capsys.readouterr().out)["refinement"]
    assert (summary["proxy"], summary["labels"], summary["frequencies"]) == ("bigram", "models", "weights")
    assert recorded["model_labels"] is True
    a, b = (load_checkpoint(tmp_path / n) for n in ("ref", "cand"))
    states = [m.adapter.to_standard(m.state) for m in (a, b)]
    found = infer_token_rows(a.spec, *states)
    rows = torch.nonzero(found.probability > 0.5)[:, 0]
    assert set(rows.tolist()) <= set(seen.tolist())
    transitions = _one_token_transitions(a, build_torch_model(a), states, rows)
    chain = chain_blocks(rows, found.weights.square()[rows], transitions, 60, CONFIG["block_size"], seed=0)
    drawn = recorded["batches"].split.inputs
    assert {tuple(r) for r in drawn.tolist()} <= {tuple(r) for r in chain.inputs.tolist()}
