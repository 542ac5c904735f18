"""What the ServerApp writes after every round, each file atomically, and reads back to resume.

Layout of ``out-dir``::

    round-0000/ ... round-NNNN/   fedbasin checkpoints (config.json + model.safetensors) of the
                                  global model after each round (0: the initial model)
    results.json                  {"run_config", "model", "rounds": [{"round", "test_loss",
                                  "test_accuracy", ...train/eval/strategy metrics}]}
    curves.png                    test accuracy and loss against the round
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import asdict
from pathlib import Path

import torch

from fedbasin.atomic import atomic_write
from fedbasin.checkpoint import load_checkpoint, save_checkpoint
from fedbasin.plots import save_figure

RESULTS_FILE = "results.json"
CURVES_FILE = "curves.png"
_ROUND_DIR = re.compile(r"^round-(\d{4,})$")


def write_json_atomic(path: Path, data) -> None:
    """Write JSON to a temporary file in the same directory, then ``os.replace`` it."""
    atomic_write(path, lambda tmp: tmp.write_text(json.dumps(data, indent=2)))


class RunOutputs:
    """Checkpoints, ``results.json`` and ``curves.png`` of one federated run in ``out_dir``."""

    def __init__(self, out_dir: str | os.PathLike, family: str, model_config, run_config: dict):
        self.dir = Path(out_dir)
        self.family, self.model_config = family, model_config
        self.results = {
            "run_config": dict(run_config),
            "model": {"family": family, **asdict(model_config)},
            "rounds": [],
        }

    def saved_rounds(self) -> list[int]:
        if not self.dir.is_dir():
            return []
        return sorted(
            int(m[1]) for p in self.dir.iterdir() if p.is_dir() and (m := _ROUND_DIR.match(p.name))
        )

    def checkpoint_dir(self, server_round: int) -> Path:
        return self.dir / f"round-{server_round:04d}"

    def start_fresh(self) -> list[int]:
        """Remove a previous run's checkpoints, results and curves; return the removed rounds."""
        stale = self.saved_rounds()
        for server_round in stale:
            shutil.rmtree(self.checkpoint_dir(server_round))
        for name in (RESULTS_FILE, CURVES_FILE):
            (self.dir / name).unlink(missing_ok=True)
        return stale

    def resume(self) -> tuple[int, dict[str, torch.Tensor]] | None:
        """``(k, state)`` of the last checkpoint (None if there is none), keeping the results of
        rounds ``0..k``. A checkpoint of a different model raises ``ValueError``."""
        rounds = self.saved_rounds()
        if not rounds:
            return None
        last = rounds[-1]
        checkpoint = load_checkpoint(self.checkpoint_dir(last))
        if checkpoint.family != self.family or checkpoint.config != self.model_config:
            raise ValueError(
                f"cannot resume from {checkpoint.path}: it holds a {checkpoint.family} model with "
                f"{checkpoint.config}, but this run builds a {self.family} model with "
                f"{self.model_config}"
            )
        results_path = self.dir / RESULTS_FILE
        if results_path.is_file():
            previous = json.loads(results_path.read_text())["rounds"]
            self.results["rounds"] = [r for r in previous if r["round"] <= last]
        return last, checkpoint.state

    def record(self, server_round: int, state: dict[str, torch.Tensor], metrics: dict) -> None:
        """Checkpoint the global model of ``server_round``, then add its metrics to the results."""
        self.dir.mkdir(parents=True, exist_ok=True)
        save_checkpoint(self.checkpoint_dir(server_round), self.family, self.model_config, state)
        rounds = [r for r in self.results["rounds"] if r["round"] != server_round]
        self.results["rounds"] = rounds + [{"round": server_round, **metrics}]
        write_json_atomic(self.dir / RESULTS_FILE, self.results)
        self.plot()

    def plot(self) -> None:
        """Test accuracy and loss against the round, as ``curves.png``."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        rounds = self.results["rounds"]
        x = [r["round"] for r in rounds]
        fig, (acc, loss) = plt.subplots(1, 2, figsize=(8, 3.2))
        acc.plot(x, [r["test_accuracy"] for r in rounds], marker="o")
        loss.plot(x, [r["test_loss"] for r in rounds], marker="o", color="tab:red")
        for ax, label in ((acc, "test accuracy"), (loss, "test loss")):
            ax.set_xlabel("round")
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
        fig.suptitle(f"{self.results['run_config'].get('data', '')}: {self.family}", fontsize=9)
        save_figure(fig, self.dir / CURVES_FILE)
        plt.close(fig)
