"""`glmc_compare --aligned NAME=DIR`: the plain path from A to an endpoint already in A's basis is
evaluated with the same loss code as every other row (GLMC itself is not needed here)."""

from __future__ import annotations

import pytest
import torch

from tests.test_tokenizer_data import SHAKESPEARE, TOKENIZER, _gpt2

pytestmark = pytest.mark.skipif(not TOKENIZER.is_dir() or not SHAKESPEARE.is_file(),
                                reason="needs ../shared/data (gpt2_tokenizer, tinyshakespeare)")


def test_aligned_endpoint_rows(tmp_path):
    from fedbasin.benchmarks.glmc_compare import main

    text = tmp_path / "excerpt.txt"
    text.write_text(SHAKESPEARE.read_text(encoding="utf-8")[:60_000], encoding="utf-8")
    a, b = _gpt2(tmp_path / "a", 0), _gpt2(tmp_path / "b", 1)
    rows = main([str(a), str(b), "--text", str(text), "--max-blocks", "4", "--points", "3", "--variants", "",
                 "--circuit-variant", "", "--aligned", f"b={b}", "--aligned", f"a={a}"])["rows"]
    assert rows["aligned b"]["losses"] == rows["vanilla"]["losses"]  # B itself: the vanilla curve
    end_a = rows["vanilla"]["losses"][-1]
    # A as the endpoint: its own loss at λ = 0 (not B's), a flat path, no barrier
    assert rows["aligned a"]["losses"] == pytest.approx([end_a] * 3, abs=1e-6)
    assert rows["aligned a"]["barrier"] == pytest.approx(0.0, abs=1e-6)


def test_split_option_measures_on_the_validation_slice(tmp_path):
    """`--split validation` evaluates every row on the validation blocks (where settings are
    chosen), not on the test slice the reported figures use."""
    from fedbasin.checkpoint import build_torch_model, load_checkpoint
    from fedbasin.benchmarks.glmc_compare import main
    from fedbasin.benchmarks.gpt2_pair import mean_loss, pair_data

    text = tmp_path / "excerpt.txt"
    text.write_text(SHAKESPEARE.read_text(encoding="utf-8")[:60_000], encoding="utf-8")
    a, b = _gpt2(tmp_path / "a", 0), _gpt2(tmp_path / "b", 1)
    common = [str(a), str(b), "--text", str(text), "--max-blocks", "3", "--points", "2", "--variants", "",
              "--circuit-variant", ""]
    checkpoint = load_checkpoint(a)
    _, splits = pair_data(str(text), str(a), checkpoint.config.n_positions)
    for split in ("test", "validation"):
        out = main([*common, "--split", split])
        own = mean_loss(build_torch_model(checkpoint, checkpoint.state), splits[split].subset(torch.arange(3)))
        assert out["split"] == split and out["rows"]["vanilla"]["losses"][-1] == pytest.approx(own, abs=1e-6)


def test_aligned_endpoints_on_glmcs_merged_architecture(tmp_path):
    """`--aligned-on-glmc`: every aligned endpoint also goes to GLMC's driver as its model 1 with 0
    matching iterations (its path only); refused without `--glmc-path`. GLMC itself is stood in
    for by a script that records its arguments and returns a fixed curve."""
    from fedbasin.benchmarks.glmc_compare import main

    text = tmp_path / "excerpt.txt"
    text.write_text(SHAKESPEARE.read_text(encoding="utf-8")[:60_000], encoding="utf-8")
    a, b = _gpt2(tmp_path / "a", 0), _gpt2(tmp_path / "b", 1)
    common = [str(a), str(b), "--text", str(text), "--max-blocks", "2", "--points", "3", "--variants", "",
              "--circuit-variant", "", "--skip-vanilla", "--glmc-rows", "", "--aligned", f"b={b}", "--aligned-on-glmc"]
    with pytest.raises(SystemExit, match="--aligned-on-glmc needs --aligned NAME=DIR and --glmc-path"):
        main(common)
    calls = tmp_path / "calls.txt"
    fake = tmp_path / "fake_python"
    fake.write_text(f'#!/bin/sh\necho "$@" >> {calls}\necho \'{{"lambdas": [0, 0.5, 1], "losses": [1.0, 1.5, 1.0]}}\'\n')
    fake.chmod(0o755)
    rows = main([*common, "--glmc-path", str(tmp_path), "--glmc-python", str(fake)])["rows"]
    assert rows["aligned b on GLMC's merged architecture"]["barrier"] == pytest.approx(0.5)
    call = calls.read_text().split()
    assert call[call.index("--model1") + 1] == str(b) and call[call.index("--iterations") + 1] == "0"
