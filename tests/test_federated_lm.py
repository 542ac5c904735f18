"""The federated language-model benchmark (fedbasin.benchmarks.federated_lm): clients' parts of the
text, and a tiny run end to end with the GPT-2 tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fedbasin.benchmarks import federated_lm
from fedbasin.data.task import Split

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"
TOKENIZER = SHARED / "gpt2_tokenizer"
TEXT = SHARED / "tinyshakespeare" / "input.txt"


class Blocks:
    """A task stand-in: blocks numbered in text order (block i holds i everywhere)."""

    def __init__(self, n_train: int, n_test: int):
        ids = torch.arange(n_train + n_test)[:, None].expand(-1, 4)
        self.train, self.test = Split(ids[:n_train], ids[:n_train]), Split(ids[n_train:], ids[n_train:])


def test_clients_get_contiguous_segments_with_their_own_test_tail_and_the_proxy_apart():
    trains, tests, proxy = federated_lm.client_parts(Blocks(90, 10), clients=4, own_test=0.2, proxy_size=8, seed=0)
    seen = []
    for k, (train, test) in enumerate(zip(trains, tests)):
        segment = set(range(k * 100 // 4, (k + 1) * 100 // 4))
        own, trained = test.inputs[:, 0].tolist(), train.inputs[:, 0].tolist()
        assert own == sorted(segment)[-5:]  # the segment's last 20 %
        assert set(trained) < segment and trained == sorted(trained)
        seen += own + trained
    assert len(proxy) == 8 and len(seen) + 8 == 100
    assert sorted(seen + proxy.inputs[:, 0].tolist()) == list(range(100))  # a partition of the text's blocks
    with pytest.raises(ValueError, match="client 0: 2 training blocks cannot give 5 to the proxy"):
        federated_lm.client_parts(Blocks(9, 3), clients=4, own_test=0.3, proxy_size=20, seed=0)


@pytest.mark.skipif(not (TOKENIZER.is_dir() and TEXT.is_file()), reason="needs ../shared/data")
def test_a_tiny_federation_of_gpt2_models_end_to_end(tmp_path, capsys):
    text = tmp_path / "plays.txt"
    text.write_text(TEXT.read_text(encoding="utf-8")[:12000], encoding="utf-8")
    out = tmp_path / "lm.json"
    run_config = ("local-epochs=1 block-size=16 model.dim=16 model.depth=1 model.heads=2 model.mlp-dim=32 "
                  "proxy-size=16 refine-budget=1.0 distill-steps=2")
    assert federated_lm.main(["--text", str(text), "--tokenizer", str(TOKENIZER), "--families", "gpt2",
                              "--run-config", run_config, "--out", str(out)]) == 0
    assert (tmp_path / "lm-gpt2-clients.pt").is_file()  # the trained clients, kept for a rerun
    (row,) = json.loads(out.read_text())["rows"]
    assert len(row["client"]) == 4 and all(len(c["own"]) == 4 for c in row["client"])
    assert row["best_client"]["union"] == min(c["union"] for c in row["client"])
    assert set(row["merges"]) == {"FedAvg", "aligned", "aligned + learned", "aligned + learned + distilled",
                                  "FedAvg + distilled"}
    # four independent inits: their plain average is worse than the aligned average
    assert row["merges"]["aligned"]["union"] < row["merges"]["FedAvg"]["union"]
    assert "| gpt2 |" in capsys.readouterr().out


def test_the_shared_init_arm_trains_as_many_epochs_as_the_one_shot_arm():
    """3 local epochs + 2 further rounds of 1 = 5 epochs over FedAvg's 3 rounds: 2, 2, 1."""
    assert federated_lm.even_split(5, 3) == [2, 2, 1] and federated_lm.even_split(6, 3) == [2, 2, 2]
    assert sum(federated_lm.even_split(7, 4)) == 7


def test_bad_input_is_refused_in_one_line_before_any_training(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        federated_lm.main(["--text", str(tmp_path / "missing.txt"), "--out", str(tmp_path / "x.json")])
    assert exit_.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert "missing.txt does not exist" in error
    with pytest.raises(SystemExit):
        federated_lm.main(["--clients", "1"])
    assert not (tmp_path / "x.json").exists()


def test_trained_clients_are_reused_only_for_the_same_settings(tmp_path):
    calls = []

    def compute():
        calls.append(1)
        return [{"w": torch.full((2,), float(len(calls)))}]

    path = tmp_path / "clients.pt"
    first = federated_lm.cached(path, compute, {"lr": 0.003})
    again = federated_lm.cached(path, compute, {"lr": 0.003})
    assert len(calls) == 1 and torch.equal(first[0]["w"], again[0]["w"])
    other = federated_lm.cached(path, compute, {"lr": 0.001})  # another setting: trained again
    assert len(calls) == 2 and other[0]["w"][0] == 2.0
    path.write_bytes(b"damaged")
    assert federated_lm.cached(path, compute, {"lr": 0.001})[0]["w"][0] == 3.0 and len(calls) == 3
