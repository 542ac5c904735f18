"""Selection and report batches of a large-vocabulary language model are cut so that one batch's
logits stay under 2^26 values (GPT-2's head product runs 2.7× faster per value at 10 blocks of 128
than at 32, and the peak memory falls with it); small vocabularies keep their batch sizes. The shares
of the selection and report splits are the user's (each exact pass over them costs time)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from fedbasin.alignment import proxy_streams
from fedbasin.data.task import Split
from tests.helpers import cli_error, spy_on_cli_refine
from tests.test_tokenizer_data import NEEDS_SHARED_TEXT, TOKENIZER, _gpt2, shakespeare_excerpt

pytestmark = NEEDS_SHARED_TEXT
BUDGET = 2**26


@pytest.fixture
def text_file(tmp_path):
    return shakespeare_excerpt(tmp_path, 40_000)


def test_cli_refinement_scores_in_batches_whose_logits_fit_the_budget(tmp_path, text_file, monkeypatch):
    from fedbasin.cli import main

    vocab, context = 200_000, 32  # 6.4 M logit values per block: 10 blocks a batch
    ref, cand = _gpt2(tmp_path / "ref", 1, vocab=vocab), _gpt2(tmp_path / "cand", 2, vocab=vocab)
    seen = {}
    spy_on_cli_refine(monkeypatch, lambda k: seen.update(selection=k["selection"], evaluation=k["evaluation"]))
    assert main(["align", str(ref), str(cand), "--out", str(tmp_path / "out"), "--refine-data", f"text:{text_file}",
                 "--refine-steps", "1", "--refine-examples", "120", "--iterations", "1",
                 "--refine-evaluation-fraction", "0.2"]) == 0
    for split in ("selection", "evaluation"):
        sizes = [len(y) for _, y in seen[split]]
        assert max(sizes) * context * vocab <= BUDGET and max(sizes) == BUDGET // (context * vocab)
        assert sum(sizes) == 24  # 20 % of the 120 proxy blocks: every block is scored


def test_server_proxy_batches(text_file):
    from fedbasin.config import resolve_run_config
    from fedbasin.data import load_task
    from fedbasin.server.server_app import server_proxy_streams

    task = load_task(f"text:{text_file}", tokenizer=str(TOKENIZER), block_size=64, proxy_size=120)
    config = resolve_run_config({"batch-size": 16, "seed": 0})
    big = server_proxy_streams(task, SimpleNamespace(config=SimpleNamespace(vocab_size=50257)), config)
    assert [len(y) for _, y in big.selection] == [20, 4]  # 2^26 // (64 × 50257) = 20
    small = server_proxy_streams(task, SimpleNamespace(config=SimpleNamespace(vocab_size=65)), config)
    assert [len(y) for _, y in small.selection] == [24]  # 20 % of 120 blocks in one batch of at most 256


@pytest.mark.parametrize("selection, evaluation, sizes", [(0.2, 0.2, (60, 20, 20)), (0.1, 0.0, (90, 10, 0)),
                                                          (0.3, 0.1, (60, 30, 10))])
def test_proxy_split_shares_are_disjoint_and_cover_the_proxy(selection, evaluation, sizes):
    proxy = Split(torch.arange(100), torch.arange(100))  # each example's id is its input
    data = proxy_streams(proxy, 8, seed=0, selection_fraction=selection, evaluation_fraction=evaluation)
    parts = [data.batches.split.inputs, *(torch.cat([x for x, _ in split]) if split else torch.tensor([], dtype=torch.long)
                                          for split in (data.selection, data.evaluation))]
    assert tuple(len(p) for p in parts) == sizes and (data.evaluation is None) == (evaluation == 0)
    assert torch.equal(torch.cat(parts).sort().values, torch.arange(100))


@pytest.mark.parametrize("selection, evaluation", [(0.0, 0.2), (0.5, 0.5), (0.2, -0.1)])
def test_bad_proxy_split_shares_are_refused(selection, evaluation):
    with pytest.raises(ValueError, match="proxy split shares"):
        proxy_streams(Split(torch.arange(10), torch.arange(10)), 4, selection_fraction=selection,
                      evaluation_fraction=evaluation)


def test_cli_refinement_split_shares(tmp_path, text_file, monkeypatch, capsys):
    """--refine-selection-fraction / --refine-evaluation-fraction reach the splits and the summary; with
    no report split its examples train and no report loss is claimed; bad shares are one-line errors."""
    from fedbasin.cli import main

    ref, cand = _gpt2(tmp_path / "ref", 1), _gpt2(tmp_path / "cand", 2)
    seen = {}
    spy_on_cli_refine(monkeypatch, lambda k: seen.update(k))
    argv = ["align", str(ref), str(cand), "--out", str(tmp_path / "out"), "--refine-data", f"text:{text_file}",
            "--refine-steps", "2", "--refine-examples", "120", "--iterations", "1"]
    assert main(argv + ["--refine-selection-fraction", "0.1", "--refine-evaluation-fraction", "0"]) == 0
    summary = json.loads(capsys.readouterr().out)["refinement"]
    assert sum(len(y) for _, y in seen["selection"]) == 12 and seen["evaluation"] is None
    argv = [*argv, "--overwrite"]  # the refusals below name their options, not the --out just written
    assert len(seen["batches"].split) == 108
    assert summary["selection_fraction"] == 0.1 and summary["evaluation_fraction"] == 0
    assert "evaluation_loss" not in summary
    for bad in (["--refine-selection-fraction", "0"], ["--refine-selection-fraction", "0.6", "--refine-evaluation-fraction", "0.4"]):
        assert "needs a selection share > 0" in cli_error(capsys, argv + bad)
    no_data = [a for a in argv if a not in ("--refine-data", f"text:{text_file}")]
    assert "has no effect without --refine-data" in cli_error(capsys, no_data + ["--refine-evaluation-fraction", "0"])


def test_server_proxy_split_shares(text_file):
    """The ServerApp's proxy split follows proxy-selection-fraction / proxy-evaluation-fraction (refinement
    and distillation share it); bad shares are refused with the run config, one line naming both keys."""
    from fedbasin.config import RunConfigError, resolve_run_config
    from fedbasin.data import load_task
    from fedbasin.server.server_app import server_proxy_streams

    task = load_task(f"text:{text_file}", tokenizer=str(TOKENIZER), block_size=64, proxy_size=120)
    config = resolve_run_config({"proxy-size": 120, "batch-size": 16, "proxy-selection-fraction": 0.1,
                                 "proxy-evaluation-fraction": 0.0})
    data = server_proxy_streams(task, SimpleNamespace(config=SimpleNamespace(vocab_size=65)), config)
    assert sum(len(y) for _, y in data.selection) == 12 and data.evaluation is None
    assert len(data.batches.split) == 108
    for bad in ({"proxy-selection-fraction": 0.0}, {"proxy-selection-fraction": 0.6, "proxy-evaluation-fraction": 0.4},
                {"proxy-evaluation-fraction": -0.1}):
        with pytest.raises(RunConfigError, match="proxy-selection-fraction=.* proxy-evaluation-fraction=.*: needs"):
            resolve_run_config(bad)


def test_cli_refinement_seed(tmp_path, text_file, monkeypatch, capsys):
    """--refine-seed S seeds the proxy's split, the batch order and learned_refine's own draws, and the
    summary records it: the same seed writes the same candidate, another seed another one (0 is the default)."""
    from fedbasin.cli import main

    ref, cand = _gpt2(tmp_path / "ref", 1), _gpt2(tmp_path / "cand", 2)
    seen = []
    spy_on_cli_refine(monkeypatch, lambda k: seen.append((k["seed"], torch.cat([x for x, _ in k["selection"]]))))

    def refined(name, *seed):
        out = tmp_path / name
        assert main(["align", str(ref), str(cand), "--out", str(out), "--refine-data", f"text:{text_file}",
                     "--refine-steps", "3", "--refine-examples", "60", "--refine-batch-size", "8", "--iterations", "1",
                     "--refine-workers", "1", "--refine-lambda", "0.2", "0.8", *seed]) == 0
        summary = json.loads(capsys.readouterr().out)["refinement"]
        return summary["seed"], (out / "model.safetensors").read_bytes()

    default, again, other = refined("default"), refined("zero", "--refine-seed", "0"), refined("three", "--refine-seed", "3")
    assert [s for s, _ in seen] == [0, 0, 3] and (default[0], again[0], other[0]) == (0, 0, 3)
    assert torch.equal(seen[0][1], seen[1][1]) and not torch.equal(seen[0][1], seen[2][1])
    assert default[1] == again[1] and default[1] != other[1]
