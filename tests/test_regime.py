"""The regime map (fedbasin.benchmarks.regime): its table's arithmetic, a tiny grid end to end,
reuse of finished runs, and bad input refused before any training."""

from __future__ import annotations

import json

import pytest

from fedbasin.benchmarks import regime


def test_rounds_to_target_and_the_paired_difference():
    assert regime.rounds_to([0.1, 0.5, 0.82, 0.79, 0.9], 0.8) == 2
    assert regime.rounds_to([0.1, 0.5], 0.8) is None
    grid = {"epochs": [5], "partitions": ["iid"], "inits": ["client"], "seeds": [0, 1]}
    curves = {("FedAvg", 0): [0.1, 0.7, 0.75], ("FedAvg", 1): [0.1, 0.8, 0.85],
              ("AlignedFedAvg", 0): [0.1, 0.81, 0.9], ("AlignedFedAvg", 1): [0.1, 0.6, 0.83]}
    runs = {regime.cell_name(5, "iid", "client", seed, arm): {"accuracy": curve}
            for (arm, seed), curve in curves.items()}
    (row,) = regime.summarise(runs, grid, target=0.8)
    assert row["FedAvg"] == [0.75, 0.85] and row["AlignedFedAvg"] == [0.9, 0.83]
    assert row["difference"] == pytest.approx([0.15, -0.02])
    assert row["FedAvg_rounds_to_target"] == [None, 1] and row["AlignedFedAvg_rounds_to_target"] == [1, 2]
    table = regime.markdown([row], 0.8)
    assert "| 5 | iid | client | 0.800 ± 0.071 | 0.865 ± 0.049 | 0.065 ± 0.120 | 1.0 (1/2) | 1.5 (2/2) |" in table


def test_a_tiny_regime_map_end_to_end_and_rerun_from_its_finished_runs(tmp_path, capsys):
    args = ["--epochs", "1", "--partitions", "dirichlet:0.5", "--inits", "server", "--seeds", "0",
            "--rounds", "1", "--nodes", "2", "--jobs", "1", "--out", str(tmp_path)]
    assert regime.main(args) == 0
    report = json.loads((tmp_path / "regime.json").read_text())
    assert set(report["runs"]) == {"e1-dirichlet0.5-server-s0-FedAvg", "e1-dirichlet0.5-server-s0-AlignedFedAvg"}
    for run in report["runs"].values():
        assert len(run["accuracy"]) == 2 and run["accuracy"][1] > run["accuracy"][0]
    (row,) = report["rows"]
    assert row["difference"] == [report["runs"]["e1-dirichlet0.5-server-s0-AlignedFedAvg"]["accuracy"][-1]
                                 - report["runs"]["e1-dirichlet0.5-server-s0-FedAvg"]["accuracy"][-1]]
    assert (tmp_path / "regime.png").stat().st_size > 0
    assert "| 1 | dirichlet:0.5 | server |" in (tmp_path / "regime.md").read_text()
    capsys.readouterr()
    assert regime.main(args) == 0  # every run is finished: nothing is trained again
    assert "0 runs in" in capsys.readouterr().out
    assert json.loads((tmp_path / "regime.json").read_text())["rows"] == report["rows"]


@pytest.mark.parametrize("flag, value, message", [
    ("--partitions", "dirichlet:0", "--partitions 'dirichlet:0': expected iid or dirichlet:ALPHA"),
    ("--inits", "shared", "--inits 'shared': expected server, client or both"),
    ("--run-config", "lr=-1", "lr"),
])
def test_bad_input_is_refused_before_any_run(tmp_path, capsys, flag, value, message):
    with pytest.raises(SystemExit) as exit_:
        regime.main([flag, value, "--out", str(tmp_path)])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err
    assert not any(tmp_path.iterdir())
