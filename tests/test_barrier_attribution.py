"""scripts/barrier_attribution.py: the midpoint barrier of an aligned pair split over parameter groups by the
path integral of ∇L · Δ; the shares add up to the barrier measured directly."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

from fedbasin.cli import main  # noqa: E402
from tests.helpers import load_script  # noqa: E402
from tests.test_causal_lm_cli import _save  # noqa: E402
from tests.test_tokenizer_data import NEEDS_SHARED_TEXT, shakespeare_excerpt  # noqa: E402

pytestmark = NEEDS_SHARED_TEXT


def test_group_shares_add_up_to_the_midpoint_barrier(tmp_path, capsys):
    script = load_script("barrier_attribution")
    text = shakespeare_excerpt(tmp_path, 12_000)
    a, b = _save(tmp_path / "a", "llama", 1), _save(tmp_path / "b", "llama", 2)
    assert main(["align", str(a), str(b), "--out", str(tmp_path / "c"), "--refine-budget", "0"]) == 0
    capsys.readouterr()
    summary = script.attribute(str(a), str(tmp_path / "c"), f"text:{text}", max_examples=8, intervals=16, batch=4,
                               progress=lambda line: None)
    shares = summary["shares"]
    assert {"output head (seen rows)", "output head (unseen rows)", "token embedding (seen rows)", "MLP gate",
            "MLP up", "MLP down", "attention Q/K", "attention V/O", "norms"} <= set(shares)
    assert abs(summary["barrier_mid"]) > 1e-3  # a barrier to split
    assert summary["sum_of_shares"] == pytest.approx(summary["barrier_mid"], rel=0.02, abs=2e-4)
    from fedbasin.data import load_task

    train = load_task(f"text:{text}", tokenizer=str(a), block_size=16).train
    assert summary["seen_rows"] == len(train.token_ids().unique())  # the rows the training split uses
    json.dumps(summary)  # the script prints it
    with pytest.raises(ValueError, match="even"):
        script.attribute(str(a), str(tmp_path / "c"), f"text:{text}", intervals=3)
