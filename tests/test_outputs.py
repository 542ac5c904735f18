"""Server outputs never lose data: fresh runs refuse to clobber, resume falls back, histories
are checked, checkpoint replacement has no gap, an unusable final model is an error."""

from __future__ import annotations

import re

import json
import math

import pytest
import torch

import fedbasin.checkpoint as checkpoint_module
from fedbasin.checkpoint import load_checkpoint, save_checkpoint
from fedbasin.config import model_from_config, resolve_run_config, task_from_config
from fedbasin.server.outputs import RESULTS_FILE, RunOutputs
from fedbasin.server.server_app import UnusableModelError, check_final_model, run_server

SMALL = {"model.dim": 16, "model.depth": 1, "model.heads": 2, "model.mlp-dim": 16}


def setup(out, **overrides):
    config = resolve_run_config({**SMALL, "out-dir": str(out), **overrides})
    task = task_from_config(config)
    model = model_from_config(task, config, seed=0)
    return config, model, RunOutputs(out, task.family, model.config, config)


def previous_run(out, rounds=3) -> dict:
    """An earlier run's outputs: checkpoints 0..rounds-1 and their records."""
    _, model, outputs = setup(out)
    states = {}
    for k in range(rounds):
        states[k] = {key: v + 0.01 * k for key, v in model.state_dict().items()}
        outputs.record(k, states[k], {"test_loss": 1.0 - 0.1 * k, "test_accuracy": 0.1 * k})
    return states


def test_a_fresh_run_refuses_a_non_empty_out_dir_before_touching_it(tmp_path):
    out = tmp_path / "run"
    previous_run(out)
    (out / "notes.txt").write_text("mine")
    before = sorted(p.name for p in out.iterdir())
    with pytest.raises(ValueError, match=r"out-dir .*run is not empty .* overwrite=true"):
        run_server(None, resolve_run_config({**SMALL, "out-dir": str(out)}))
    assert sorted(p.name for p in out.iterdir()) == before
    # invalid configurations fail before any output is looked at
    for bad in ({"num-server-rounds": 0}, {"lr": -1.0}, {"trim-fraction": 0.5}, {"fraction-train": 1.5},
                {"resume": True, "overwrite": True}, {"aggregator": "mode"}, {"max-abs-weight": math.inf}):
        with pytest.raises(ValueError, match="run-config"):
            resolve_run_config({"out-dir": str(out), **bad})
    # overwrite removes this kind of output only
    _, _, outputs = setup(out, overwrite=True)
    removed = outputs.prepare_fresh(overwrite=True)
    assert sorted(removed) == ["curves.png", "results.json", "round-0000", "round-0001", "round-0002"]
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="is not a directory"):
        setup(tmp_path / "file")[2].prepare_fresh(overwrite=True)


def test_resume_falls_back_to_the_newest_usable_checkpoint(tmp_path, caplog):
    out = tmp_path / "run"
    states = previous_run(out, rounds=4)
    weights = out / "round-0003" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # truncated
    nan_state = {k: v.clone() for k, v in states[2].items()}
    next(iter(nan_state.values()))[0] = float("nan")
    save_checkpoint(out / "round-0002", "vit", setup(out)[1].config, nan_state)

    _, _, outputs = setup(out, resume=True)
    with caplog.at_level("WARNING", logger="flwr"):
        last, state = outputs.resume()
    assert last == 1
    for key, value in states[1].items():
        torch.testing.assert_close(state[key], value)
    assert "round-0003 is unusable (" in caplog.text
    assert re.search(r"round-0002 is unusable \(.*(non-finite|NaN or infinite)", caplog.text)
    kept = sorted(p.name for p in out.iterdir() if ".damaged-" in p.name)
    assert [name.split(".")[0] for name in kept] == ["round-0002", "round-0003"]  # moved aside, not deleted
    assert [r["round"] for r in outputs.results["rounds"]] == [0, 1]

    # a checkpoint of another model is not "damaged": resume refuses it
    _, _, other = setup(out, **{"model.dim": 32, "resume": True})
    with pytest.raises(ValueError, match="cannot resume from .*round-0001"):
        other.resume()


@pytest.mark.parametrize("damage", ["missing", "not json", '{"rounds": [1, 2]}', '{"run": 1}', "[]"])
def test_a_missing_or_damaged_history_is_an_error_naming_it_or_an_explicit_rebuild(tmp_path, damage):
    out = tmp_path / "run"
    previous_run(out)
    path = out / RESULTS_FILE
    if damage == "missing":
        path.unlink()
    else:
        path.write_text(damage)
    with pytest.raises(ValueError, match=f"cannot resume: {path} is (missing|damaged).*rebuild-results=true"):
        setup(out, resume=True)[2].resume()

    # rebuild: the damaged file is kept aside; run_server re-evaluates every checkpoint (no rounds left)
    config = resolve_run_config({**SMALL, "out-dir": str(out), "resume": True, "rebuild-results": True,
                                 "num-server-rounds": 2})
    results = run_server(None, config)
    assert [(r["round"], r["rebuilt"]) for r in results["rounds"]] == [(0, True), (1, True), (2, True)]
    assert all(0 <= r["test_accuracy"] <= 1 and r["test_loss"] > 0 for r in results["rounds"])
    assert json.loads(path.read_text())["rounds"] == results["rounds"]
    aside = [p for p in out.iterdir() if p.name.startswith(f"{RESULTS_FILE}.damaged-")]
    assert [p.read_text() for p in aside] == ([] if damage == "missing" else [damage])


def test_a_round_checkpointed_but_not_recorded_is_rebuilt(tmp_path):
    out = tmp_path / "run"
    previous_run(out)
    history = json.loads((out / RESULTS_FILE).read_text())
    history["rounds"] = history["rounds"][:2]  # interrupted between checkpoint and results write
    (out / RESULTS_FILE).write_text(json.dumps(history))
    results = run_server(None, resolve_run_config({**SMALL, "out-dir": str(out), "resume": True,
                                                   "num-server-rounds": 2}))
    assert [r["round"] for r in results["rounds"]] == [0, 1, 2]
    assert results["rounds"][:2] == history["rounds"] and results["rounds"][2]["rebuilt"] is True


def test_checkpoint_replacement_never_leaves_the_name_empty(tmp_path, monkeypatch):
    _, model, _ = setup(tmp_path)
    path = tmp_path / "ckpt"
    save_checkpoint(path, "vit", model.config, model.state_dict())
    moves = []
    real_replace = checkpoint_module.os.replace

    def spy(src, dst):
        moves.append((str(src), str(dst)))
        return real_replace(src, dst)

    monkeypatch.setattr(checkpoint_module.os, "replace", spy)
    new = {k: v + 1 for k, v in model.state_dict().items()}
    save_checkpoint(path, "vit", model.config, new)
    assert not [m for m in moves if m[0] == str(path)], f"{path} was moved away: {moves}"
    torch.testing.assert_close(load_checkpoint(path).state["head.weight"], new["head.weight"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # the old one is gone, no leftovers


def test_an_unusable_final_model_is_recorded_and_raises(tmp_path):
    _, model, outputs = setup(tmp_path / "run")
    state = model.state_dict()
    outputs.record(1, state, {"test_loss": 0.5, "test_accuracy": 0.9, "round_failed": 1})
    check_final_model(outputs, state)
    assert outputs.results["final"] == {"round": 1, "usable": True, "reason": "", "failed_rounds": [1]}
    outputs.record(2, state, {"test_loss": math.nan, "test_accuracy": 0.1})
    with pytest.raises(UnusableModelError, match="round 2 .* unusable: test loss nan"):
        check_final_model(outputs, state)
    broken = {k: v * math.inf for k, v in state.items()}
    with pytest.raises(UnusableModelError, match="non-finite weights"):
        check_final_model(outputs, broken)
    final = json.loads((tmp_path / "run" / RESULTS_FILE).read_text())["final"]
    assert final["usable"] is False and "non-finite weights" in final["reason"]


def test_simulate_exits_1_when_the_final_model_is_unusable(tmp_path, monkeypatch, capsys):
    import argparse

    from fedbasin import simulate

    def unusable(config, *args, **kwargs):
        raise UnusableModelError(f"the final global model of round 3 in {config['out-dir']} is unusable: x")

    monkeypatch.setattr(simulate, "simulate", unusable)
    parser = argparse.ArgumentParser()
    simulate.add_parser(parser.add_subparsers())
    args = parser.parse_args(["simulate", "--out", str(tmp_path), "--overwrite"])
    assert args.func(args) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "round 3" in err and "unusable" in err
