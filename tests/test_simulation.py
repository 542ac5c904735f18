"""The Flower apps end to end under ``fedbasin simulate`` (Ray backend), resume, run config."""

from __future__ import annotations

import argparse
import json
import tomllib
from pathlib import Path

import pytest
import torch
from flwr.common.config import flatten_dict

from fedbasin.checkpoint import load_checkpoint
from fedbasin.config import DEFAULT_RUN_CONFIG, model_config, resolve_run_config
from fedbasin.simulations import simulate
from fedbasin.strategies import AlignedFedAvg

ROOT = Path(__file__).resolve().parents[1]


def test_pyproject_run_config_matches_the_python_defaults():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    app = pyproject["tool"]["flwr"]["app"]
    assert flatten_dict(app["config"]) == DEFAULT_RUN_CONFIG
    assert app["components"] == {
        "serverapp": "fedbasin.server.server_app:app",
        "clientapp": "fedbasin.client.client_app:app",
    }


def test_run_config_errors_name_the_key():
    with pytest.raises(ValueError, match="unknown run-config key 'epochs'"):
        resolve_run_config({"epochs": 3})
    with pytest.raises(ValueError, match="lr='fast'"):
        resolve_run_config({"lr": "fast"})
    with pytest.raises(ValueError, match="symmetry='rotation'"):
        resolve_run_config({"symmetry": "rotation"})
    assert resolve_run_config({"lr": 1})["lr"] == 1.0
    with pytest.raises(ValueError, match="model.position='rope' does not apply to vit"):
        model_config("vit", {}, resolve_run_config({"model.position": "rope"}))
    assert model_config("gpt", {"vocab_size": 65}, resolve_run_config({"model.position": "rope"}))["position"] == "rope"


def cli(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    simulate.add_parser(parser.add_subparsers())
    args = parser.parse_args(["simulate", *argv])
    return args.func(args)


def test_simulate_rejects_bad_options(tmp_path, capsys):
    assert cli("--run-config", "min-nodes=3", "--num-supernodes", "2", "--out", str(tmp_path)) == 2
    assert "min-nodes=3 exceeds --num-supernodes=2" in capsys.readouterr().err
    assert cli("--run-config", "lr=", "--out", str(tmp_path)) == 2
    assert "'lr=' is not KEY=VALUE" in capsys.readouterr().err
    assert cli("--run-config", "lr=fast", "--out", str(tmp_path)) == 2
    assert "lr='fast' has type str" in capsys.readouterr().err
    assert simulate.parse_run_config("model.dim=32 symmetry=permutation data='text:a b.txt' resume=true") == {
        "model.dim": 32, "symmetry": "permutation", "data": "text:a b.txt", "resume": True}


@pytest.mark.slow
def test_simulation_trains_then_resumes_from_the_last_checkpoint(tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    assert cli("--num-supernodes", "2", "--out", str(out), "--run-config", "num-server-rounds=1") == 0
    assert "round s" in capsys.readouterr().out
    results = json.loads((out / "results.json").read_text())
    rounds = results["rounds"]
    assert [r["round"] for r in rounds] == [0, 1]
    assert rounds[1]["test_accuracy"] > rounds[0]["test_accuracy"] + 0.2
    assert rounds[1]["num_excluded"] == 0 and "align_gain" in rounds[1] and "eval_accuracy" in rounds[1]
    assert (out / "curves.png").stat().st_size > 0
    saved = load_checkpoint(out / "round-0001").state

    # resume: the strategy's first round is round 2 and starts from the round-1 checkpoint
    seen = []
    configure_train = AlignedFedAvg.configure_train

    def spy(self, server_round, arrays, config, grid):
        messages = list(configure_train(self, server_round, arrays, config, grid))
        seen.append((messages[0].content["config"]["server-round"], arrays.to_torch_state_dict()))
        return messages

    monkeypatch.setattr(AlignedFedAvg, "configure_train", spy)
    config = resolve_run_config({"num-server-rounds": 2, "out-dir": str(out), "resume": True})
    resumed = simulate.simulate(config, num_supernodes=2)
    assert [server_round for server_round, _ in seen] == [2]
    for key, value in saved.items():
        torch.testing.assert_close(seen[0][1][key], value)
    assert [r["round"] for r in resumed["rounds"]] == [0, 1, 2]
    assert resumed["rounds"][:2] == rounds
    assert (out / "round-0002" / "model.safetensors").is_file()
