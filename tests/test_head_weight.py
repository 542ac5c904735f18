"""The output head's objective weight (``weight_match(head_weight=h)``): exact, planted-recovering, not a no-op."""

from __future__ import annotations

import pytest
import torch

from fedbasin.alignment import (
    apply_group,
    canonicalize,
    random_group_element,
    to_gauge,
    weight_match,
)
from fedbasin.alignment.matching import _Objective

from .helpers import GPT, VIT, inputs, rel_err, run, spec_of, trained_like

CONFIG = dict(GPT, vocab_size=400)


def _planted(family: str, config: dict):
    spec = spec_of(family, config)
    ref = trained_like(family, config, seed=1).state_dict()
    canon = canonicalize(spec, ref)
    moved = to_gauge(spec, apply_group(spec, canon.state, random_group_element(spec, 3, state=canon.state)), canon.gains)
    return spec, ref, moved


@pytest.mark.parametrize("token_rows", [None, torch.arange(0, 400, 3)])
def test_head_weight_keeps_the_function_and_recovers_the_planted_map(token_rows):
    spec, ref, moved = _planted("gpt", CONFIG)
    match = weight_match(spec, ref, moved, iterations=30, tol=0.0, head_weight=3.0, token_rows=token_rows)
    probe, _ = inputs("gpt", CONFIG)
    assert rel_err(run("gpt", CONFIG, match.state, probe), run("gpt", CONFIG, moved, probe)) < 1e-9
    assert max(float((match.state[k] - ref[k]).abs().max()) for k in ref) < 1e-8
    # the objective stays normalised: a perfect match scores 1 whatever the head's weight
    assert abs(match.objective[-1] - 1.0) < 1e-9


def test_head_weight_scales_only_the_output_head_and_changes_the_match():
    spec = spec_of("gpt", CONFIG)
    ref = trained_like("gpt", CONFIG, seed=1).state_dict()
    cand = trained_like("gpt", CONFIG, seed=2).state_dict()
    plain, heavy = _Objective(spec, ref, cand, "rms"), _Objective(spec, ref, cand, "rms", head_weight=4.0)
    assert {k for k in plain.w if heavy.w[k] != plain.w[k]} == {"head.weight"}
    assert heavy.w["head.weight"] == pytest.approx(4.0 * plain.w["head.weight"])
    default = weight_match(spec, ref, cand, iterations=5, tol=0.0)
    one = weight_match(spec, ref, cand, iterations=5, tol=0.0, head_weight=1.0)
    four = weight_match(spec, ref, cand, iterations=5, tol=0.0, head_weight=4.0)
    assert max(float((default.state[k] - one.state[k]).abs().max()) for k in ref) == 0.0
    assert max(float((four.state[k] - one.state[k]).abs().max()) for k in ref) > 1e-4
    probe, _ = inputs("gpt", CONFIG)
    assert rel_err(run("gpt", CONFIG, four.state, probe), run("gpt", CONFIG, cand, probe)) < 1e-9


@pytest.mark.parametrize("vocab, expected", [(400, 1.0), (2000, 2.0)])
def test_auto_head_weight_is_the_measured_best_for_the_model_kind(vocab, expected):
    """``head_weight="auto"`` (the schema's default) is options.HEAD_WEIGHT of what the model is: a
    character-sized vocabulary 1, a subword one (> 1,024 tokens) 2; the same match as the value given."""
    from fedbasin.alignment.matching import auto_head_weight

    config = dict(GPT, vocab_size=vocab)
    spec = spec_of("gpt", config)
    ref, cand = (trained_like("gpt", config, seed=s).state_dict() for s in (1, 2))
    assert auto_head_weight(spec, ref) == expected and auto_head_weight(*_planted("vit", VIT)[:2]) == 1.0
    auto = weight_match(spec, ref, cand, iterations=3, tol=0.0, head_weight="auto")
    given = weight_match(spec, ref, cand, iterations=3, tol=0.0, head_weight=expected)
    assert auto.objective == given.objective


def test_head_weight_without_a_token_embedding_changes_nothing_and_bad_values_are_refused():
    spec, ref, moved = _planted("vit", VIT)
    a = weight_match(spec, ref, moved, iterations=3, tol=0.0)
    b = weight_match(spec, ref, moved, iterations=3, tol=0.0, head_weight=5.0)
    assert a.objective == b.objective
    for bad in (0.0, -1.0, float("nan"), float("inf"), "heavy"):
        with pytest.raises(ValueError, match="head_weight"):
            weight_match(spec, ref, moved, iterations=1, head_weight=bad)


def test_cli_head_weight_is_honoured_and_refused_with_stream(tmp_path, capsys):
    from fedbasin.checkpoint import load_checkpoint
    from fedbasin.cli import main

    from .helpers import cli_error
    from .test_tokenizer_data import _gpt2

    ref, cand = _gpt2(tmp_path / "ref", 1, vocab=300, with_tokenizer=False), _gpt2(tmp_path / "cand", 2, vocab=300,
                                                                                    with_tokenizer=False)
    a, b = load_checkpoint(ref), load_checkpoint(cand)
    standard = lambda c: c.adapter.to_standard(c.state)
    distance = lambda x, y: max(float((x[k] - y[k]).abs().max()) for k in y)
    for h in (1.0, 3.0):
        out = tmp_path / f"aligned{h}"
        assert main(["align", str(ref), str(cand), "--out", str(out), "--iterations", "3",
                     "--head-weight", str(h)]) == 0
        capsys.readouterr()
        expected = weight_match(a.spec, standard(a), standard(b), iterations=3, head_weight=h).state
        assert distance(standard(load_checkpoint(out)), expected) < 1e-6
    assert distance(standard(load_checkpoint(tmp_path / "aligned1.0")),
                    standard(load_checkpoint(tmp_path / "aligned3.0"))) > 1e-4
    assert "--head-weight is not supported with --stream" in cli_error(
        capsys, ["align", str(ref), str(cand), "--out", str(tmp_path / "s"), "--stream", "--head-weight", "2"])
    assert "--head-weight" in cli_error(capsys, ["align", str(ref), str(cand), "--out", str(tmp_path / "s"),
                                                 "--head-weight", "0"])
