"""Selection and report batches of a large-vocabulary language model are cut so that one batch's
logits stay under 2^26 values (GPT-2's head product runs 2.7× faster per value at 10 blocks of 128
than at 32, and the peak memory falls with it); small vocabularies keep their batch sizes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tests.helpers import spy_on_cli_refine
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
                 "--refine-steps", "1", "--refine-examples", "120", "--iterations", "1"]) == 0
    for split in ("selection", "evaluation"):
        sizes = [len(y) for _, y in seen[split]]
        assert max(sizes) * context * vocab <= BUDGET and max(sizes) == BUDGET // (context * vocab)
        assert sum(sizes) == 24  # 20 % of the 120 proxy blocks: every block is scored


def test_server_proxy_batches(text_file):
    from fedbasin.data import load_task
    from fedbasin.server.server_app import server_proxy_streams

    task = load_task(f"text:{text_file}", tokenizer=str(TOKENIZER), block_size=64, proxy_size=120)
    config = {"batch-size": 16, "seed": 0}
    big = server_proxy_streams(task, SimpleNamespace(config=SimpleNamespace(vocab_size=50257)), config)
    assert [len(y) for _, y in big.selection] == [20, 4]  # 2^26 // (64 × 50257) = 20
    small = server_proxy_streams(task, SimpleNamespace(config=SimpleNamespace(vocab_size=65)), config)
    assert [len(y) for _, y in small.selection] == [24]  # 20 % of 120 blocks in one batch of at most 256
