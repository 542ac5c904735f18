"""The one-shot grid (fedbasin.benchmarks.oneshot_grid): its gaps' arithmetic, a tiny grid end to
end with every merge measured, reuse of finished runs, and bad input refused before any training."""

from __future__ import annotations

import json

import pytest

from fedbasin.benchmarks import oneshot_grid
from tests.test_tokenizer_data import NEEDS_SHARED_TEXT

TINY = ["--clients", "2", "--partitions", "iid", "--seeds", "0,1", "--jobs", "1",
        "--run-config", "proxy-size=60 refine-steps=4 distill-steps=6 local-epochs=1"]


def test_the_gaps_are_paired_differences_and_the_goals_are_counted_per_cell():
    rows = {f"r{seed}": {"best_client": 0.8, "fedavg": 0.1, "aligned_orthogonal": 0.4, "aligned_learned": "0.7",
                         "aligned_distilled": str(0.85 + 0.02 * seed), "fedavg_distilled": "0.81", "proxy_only": 0.5, "fresh_distilled": 0.84,
                         "ensemble": 0.86}
            for seed in (0, 1)}
    jobs = {name: {"cell": ("digits", 4, "iid")} for name in rows}
    (line,) = oneshot_grid.summarise(rows, jobs)
    assert line["distilled − ensemble"] == pytest.approx([-0.01, 0.01])
    assert line["aligned − FedAvg (distilled)"] == pytest.approx([0.04, 0.06])
    table = oneshot_grid.markdown([line])
    assert "| digits | 4 | iid | 0.800 ± 0.000 | 0.100 ± 0.000 |" in table
    assert "aligned − FedAvg (distilled), all 2 runs: 0.050 ± 0.014; cells with a mean ≥ +0.03: 1/1" in table
    assert "distilled − ensemble, all 2 runs: 0.000 ± 0.014; cells with a mean ≥ -0.01: 1/1" in table
    assert "proxy only" in table
    for row in rows.values():  # a row of an earlier version without a merge: its columns are left out
        del row["proxy_only"]
    table = oneshot_grid.markdown(oneshot_grid.summarise(rows, jobs))
    assert "proxy only" not in table and "fresh + distilled" in table


def test_a_tiny_grid_end_to_end_and_rerun_from_its_finished_runs(tmp_path, capsys):
    assert oneshot_grid.main([*TINY, "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "oneshot_grid.json").read_text())
    assert set(report["rows"]) == {"digits-k2-iid-s0", "digits-k2-iid-s1"}
    for row in report["rows"].values():  # every merge was computed, on two independently trained clients
        assert len(row["client_accuracy"]) == 2 and not row["clients_from_cache"]
        assert all(0 <= float(row[key]) <= 1 for key, _ in oneshot_grid.MERGES if not key.startswith("synthetic"))
        assert "synthetic_distilled" not in row  # the data-free server only with --synthetic
        assert row["aligned_distilled_from"] == "aligned + learned"
    assert report["rows"]["digits-k2-iid-s0"]["client_accuracy"] != report["rows"]["digits-k2-iid-s1"]["client_accuracy"]
    (cell,) = report["cells"]
    assert cell["seeds"] == 2 and len(cell["ensemble"]) == 2
    assert "| digits | 2 | iid |" in (tmp_path / "oneshot_grid.md").read_text()
    capsys.readouterr()
    assert oneshot_grid.main([*TINY, "--out", str(tmp_path)]) == 0  # nothing left to run
    assert "0 runs in" in capsys.readouterr().out
    assert json.loads((tmp_path / "oneshot_grid.json").read_text())["cells"] == report["cells"]
    # another server-side setting reruns the merges on the cached clients
    other = [*TINY[:-1], TINY[-1].replace("distill-steps=6", "distill-steps=7")]
    assert oneshot_grid.main([*other, "--out", str(tmp_path)]) == 0
    rerun = json.loads((tmp_path / "oneshot_grid.json").read_text())["rows"]
    assert all(row["clients_from_cache"] for row in rerun.values())
    # the server without data: synthesised inputs stand in for the proxy split, on the same clients
    capsys.readouterr()
    assert oneshot_grid.main([*other, "--out", str(tmp_path), "--synthetic", "20"]) == 0
    assert "2 runs in" in capsys.readouterr().out  # rows without the data-free arm do not answer for it
    for row in json.loads((tmp_path / "oneshot_grid.json").read_text())["rows"].values():
        assert row["synthetic"] == 20 and row["synthetic_examples"] == 20 and row["clients_from_cache"]
        assert all(0 <= row[key] <= 1 for key in ("synthetic_learned", "synthetic_distilled",
                                                  "synthetic_fedavg_distilled", "synthetic_agreement"))
    assert "data-free: + learned + distilled" in (tmp_path / "oneshot_grid.md").read_text()


@pytest.mark.parametrize("argv, message", [
    (["--clients", "1"], "--clients must be >= 2"),
    (["--run-config", "proxy-size=0"], "the grid compares distilled merges"),
    (["--partitions", "dirichlet:-1"], "expected iid or dirichlet:ALPHA"),
    (["--run-config", "proxy-size=60 distill-steps=5 distill-teacher=median"], "distill-teacher='median'"),
    (["--synthetic", "-1"], "--synthetic >= 0"),
    pytest.param(["--synthetic", "20", "--data", "text:../shared/data/tinyshakespeare/input.txt"],
                 "--synthetic 20: synthesised inputs are images", marks=NEEDS_SHARED_TEXT),
])
def test_bad_input_is_refused_in_one_line_before_any_training(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as exit_:
        oneshot_grid.main([*argv, "--out", str(tmp_path)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not (tmp_path / "runs").exists()


def _state_seen_by_a_worker(name: str) -> bool:
    from fedbasin.benchmarks import grid

    return hasattr(grid, name)


def test_grid_workers_start_from_a_fresh_interpreter_not_a_fork_of_the_caller(monkeypatch):
    """A fork copies the caller's state, threads' locks included: forked from a process that had run Ray's
    simulation, a grid worker died of a segfault in Ray's library (the test suite, once; reproduced
    every time by a simulation then a grid in one process). Spawned workers see none of the caller's
    state: a mark set on a module here is absent there."""
    from fedbasin.benchmarks import grid

    monkeypatch.setattr(grid, "caller_state_mark", True, raising=False)
    assert grid.run_in_workers(_state_seen_by_a_worker, [("caller_state_mark",)], 1, 0, "workers") == [False]
