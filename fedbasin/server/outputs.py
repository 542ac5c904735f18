"""What the ServerApp writes after every round, each file atomically, and reads back to resume.

Layout of ``out-dir``::

    round-0000/ ... round-NNNN/   fedbasin checkpoints (config.json + model.safetensors) of the
                                  global model after each round (0: the initial model); for a
                                  Hugging Face causal LM a from_pretrained directory with the
                                  run's tokenizer files beside the weights
    results.json                  {"run_config", "model", "rounds": [{"round", "test_loss",
                                  "test_accuracy", ...train/eval/strategy metrics, "excluded":
                                  [{"node", "stage", "reason"}], "capped", "failure"}],
                                  "final": {"round", "usable", "reason"}}
    curves.png                    test accuracy and loss against the round
    *.damaged-<time>              a checkpoint or results file that resume found unusable,
                                  kept aside (nothing is deleted except by ``overwrite``)
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from dataclasses import asdict
from logging import WARNING
from pathlib import Path

import torch
from flwr.common.logger import log

from fedbasin.atomic import atomic_write, write_problem
from fedbasin.checkpoint import load_checkpoint, save_checkpoint
from fedbasin.plots import save_figure

RESULTS_FILE = "results.json"
CURVES_FILE = "curves.png"
_ROUND_DIR = re.compile(r"^round-(\d{4,})$")


def write_json_atomic(path: Path, data) -> None:
    """Write JSON to a temporary file in the same directory, then ``os.replace`` it."""
    atomic_write(path, lambda tmp: tmp.write_text(json.dumps(data, indent=2)))


class OutDirError(ValueError):
    """``out-dir`` cannot be used (``fedbasin simulate`` exits 4; the ServerApp refuses the run)."""


def check_out_dir(out_dir: Path, fresh: bool, overwrite: bool) -> list[str]:
    """The names already in ``out_dir`` (none if it does not exist yet), after checking that the run
    can write there (:func:`fedbasin.atomic.write_problem`: a probe write) and, for a ``fresh`` run,
    that the directory is empty unless ``overwrite``: a fresh run never replaces earlier outputs.
    Raises :class:`OutDirError`."""
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise OutDirError(f"out-dir {out_dir} exists and is not a directory")
    entries = sorted(p.name for p in out_dir.iterdir()) if out_dir.is_dir() else []
    if fresh and entries and not overwrite:
        shown = ", ".join(entries[:4]) + (", ..." if len(entries) > 4 else "")
        raise OutDirError(
            f"out-dir {out_dir} is not empty ({shown}); a fresh run never replaces earlier "
            "outputs: set resume=true to continue that run, overwrite=true (fedbasin "
            "simulate --overwrite) to replace it, or choose another out-dir"
        )
    if problem := write_problem(out_dir, replaced=False):  # a run writes into out-dir
        raise OutDirError(f"out-dir {out_dir} is not writable: {problem}")
    return entries


class RunOutputs:
    """Checkpoints, ``results.json`` and ``curves.png`` of one federated run in ``out_dir``."""

    def __init__(self, out_dir: str | os.PathLike, family: str, model_config, run_config: dict,
                 extra_files=None):
        """``extra_files(directory)``: writes more files into every checkpoint (e.g. the
        tokenizer), inside its atomic write."""
        self.dir = Path(out_dir)
        self.family, self.model_config = family, model_config
        self.extra_files = extra_files
        described = model_config.to_diff_dict() if hasattr(model_config, "to_diff_dict") else asdict(model_config)
        self.results = {
            "run_config": dict(run_config),
            "model": {"family": family, **described},
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

    def prepare_fresh(self, overwrite: bool) -> list[str]:
        """Make ``out_dir`` ready for a fresh run. A non-empty directory is refused (a fresh run
        never deletes an earlier run's outputs) unless ``overwrite``; then this run's own kinds
        of files (round checkpoints, results, curves) are removed, and their names returned."""
        entries = check_out_dir(self.dir, fresh=True, overwrite=overwrite)
        self.dir.mkdir(parents=True, exist_ok=True)
        removed = []
        for name in entries:
            path = self.dir / name
            if _ROUND_DIR.match(name) and path.is_dir():
                shutil.rmtree(path)
            elif name in (RESULTS_FILE, CURVES_FILE) and path.is_file():
                path.unlink()
            else:
                continue
            removed.append(name)
        return removed

    def resume(self, rebuild_results: bool = False) -> tuple[int, dict[str, torch.Tensor]] | None:
        """``(k, state)`` of the newest usable checkpoint (None if there is no checkpoint),
        keeping the recorded results of rounds ``0..k``.

        A checkpoint that does not load or holds non-finite values is moved aside (renamed
        ``round-NNNN.damaged-<time>``, never deleted) with a log line, and the next older one is
        tried. A checkpoint of a different model raises ``ValueError``. ``results.json`` must
        be readable when checkpoints exist; if it is missing or damaged this raises
        ``ValueError`` naming it, unless ``rebuild_results`` (then a damaged file is kept aside
        and the history restarts; :meth:`unrecorded_rounds` lists what to re-evaluate).
        """
        check_out_dir(self.dir, fresh=False, overwrite=False)
        rounds = self.saved_rounds()
        if not rounds:
            if (self.dir / RESULTS_FILE).exists():
                raise ValueError(
                    f"cannot resume: {self.dir / RESULTS_FILE} exists but {self.dir} holds no "
                    "round-NNNN checkpoint; restore them, or start a fresh run elsewhere"
                )
            return None
        for last in reversed(rounds):
            path = self.checkpoint_dir(last)
            try:
                checkpoint = load_checkpoint(path)
                bad = [k for k, v in checkpoint.state.items()
                       if v.is_floating_point() and not torch.isfinite(v).all()]
                if bad:
                    raise ValueError(f"non-finite values in {bad[:3]}")
            except (OSError, ValueError) as error:
                aside = self._move_aside(path)
                log(WARNING, "resume: checkpoint %s is unusable (%s); moved it to %s and "
                    "falling back to the previous checkpoint", path, error, aside.name)
                continue
            if hasattr(self.model_config, "to_dict") and checkpoint.family == self.family:
                from fedbasin.causal_lm import config_differences  # a Hugging Face model

                if differences := config_differences(self.model_config, checkpoint.config):
                    raise ValueError(f"cannot resume from {checkpoint.path}: its {self.family} "
                                     f"model differs from this run's: {', '.join(differences[:4])}")
            elif checkpoint.family != self.family or checkpoint.config != self.model_config:
                raise ValueError(
                    f"cannot resume from {checkpoint.path}: it holds a {checkpoint.family} model "
                    f"with {checkpoint.config}, but this run builds a {self.family} model with "
                    f"{self.model_config}"
                )
            self.results["rounds"] = [
                r for r in self._read_history(rounds, rebuild_results) if r["round"] <= last
            ]
            return last, checkpoint.state
        raise ValueError(
            f"cannot resume: no usable checkpoint in {self.dir} (the damaged ones were moved "
            "aside); start a fresh run in another out-dir"
        )

    def _read_history(self, rounds: list[int], rebuild: bool) -> list[dict]:
        """The recorded rounds of ``results.json`` (see :meth:`resume`)."""
        path = self.dir / RESULTS_FILE
        try:
            history = json.loads(path.read_text())["rounds"]
            if not isinstance(history, list) or not all(
                isinstance(r, dict) and type(r.get("round")) is int for r in history
            ):
                raise ValueError("'rounds' is not a list of records with an integer 'round'")
            return history
        except FileNotFoundError:
            problem = "is missing"
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as error:
            problem = f"is damaged ({type(error).__name__}: {error})"
        if not rebuild:
            raise ValueError(
                f"cannot resume: {path} {problem}, but checkpoints of rounds {rounds} exist; "
                "restore it, or set rebuild-results=true to rebuild the test metrics of every "
                "round from its checkpoint (the damaged file is kept aside)"
            )
        if path.exists():
            log(WARNING, "resume: %s %s; kept as %s, rebuilding the history from checkpoints",
                path, problem, self._move_aside(path).name)
        return []

    def _move_aside(self, path: Path) -> Path:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        aside = path.with_name(f"{path.name}.damaged-{stamp}")
        n = 1
        while aside.exists():
            aside, n = path.with_name(f"{path.name}.damaged-{stamp}-{n}"), n + 1
        os.replace(path, aside)
        return aside

    def unrecorded_rounds(self, last: int) -> list[int]:
        """Saved rounds up to ``last`` without a record (e.g. after an interrupted write)."""
        recorded = {r["round"] for r in self.results["rounds"]}
        return [k for k in self.saved_rounds() if k <= last and k not in recorded]

    def record(self, server_round: int, state: dict[str, torch.Tensor] | None, metrics: dict) -> None:
        """Checkpoint the global model of ``server_round`` (unless ``state`` is None: already
        saved), then add its metrics to the results."""
        self.dir.mkdir(parents=True, exist_ok=True)
        if state is not None:
            save_checkpoint(self.checkpoint_dir(server_round), self.family, self.model_config, state,
                            extra_files=self.extra_files)
        rounds = [r for r in self.results["rounds"] if r["round"] != server_round]
        self.results["rounds"] = sorted(rounds + [{"round": server_round, **metrics}],
                                        key=lambda r: r["round"])
        self.save_results()

    def save_results(self) -> None:
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
