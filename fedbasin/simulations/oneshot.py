"""One-shot federated merging: K clients from independent inits, one long round, then merge.

For every data source and partitioner (IID, Dirichlet(alpha)) this trains K clients from their
own seeds on their partitions (the ClientApp's ``init = "client"`` round 1, run in-process one
client after the other), then reports test accuracy of

* the best single client,
* FedAvg (plain example-weighted average),
* aligned merges (permutation, orthogonal): every client aligned to the largest client, then
  averaged -- what ``AlignedFedAvg`` does in round 1 with ``independent_init``,
* the logit ensemble (mean of the K models' logits; K times the inference cost),

and the time of the alignment step against the round total (slowest client's training, as
clients train in parallel, plus the merge). Writes a markdown table to stdout and JSON to
``--out``::

    python -m fedbasin.simulations.oneshot --data digits \
        --data cifar10:../shared/data/cifar10 --run-config "max-train-examples=4000"
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from torch import nn

from fedbasin.alignment import average_states, fedbasin_adapter, merge, refined_merge
from fedbasin.config import model_from_config, resolve_run_config, task_from_config
from fedbasin.server.outputs import write_json_atomic
from fedbasin.server.server_app import make_refiner
from fedbasin.simulations.simulate import parse_run_config
from fedbasin.training import evaluate, resolve_device, train

ONESHOT_DEFAULTS = {"local-epochs": 30, "init": "client"}
MODES = ("permutation", "orthogonal")
COLUMNS = (  # row key, header, format
    ("data", "data", "{}"),
    ("partitioner", "partition", "{}"),
    ("best_client", "best client", "{:.4f}"),
    ("fedavg", "FedAvg", "{:.4f}"),
    ("aligned_permutation", "aligned (perm)", "{:.4f}"),
    ("aligned_orthogonal", "aligned (orth)", "{:.4f}"),
    ("aligned_learned", "aligned + learned", "{}"),
    ("ensemble", "logit ensemble", "{:.4f}"),
    ("align_seconds_permutation", "align s (perm)", "{:.2f}"),
    ("align_seconds_orthogonal", "align s (orth)", "{:.2f}"),
    ("round_seconds_orthogonal", "round s (orth)", "{:.1f}"),
)


class LogitEnsemble(nn.Module):
    """``logits(x) = mean_k model_k(x)``."""

    def __init__(self, models: list[nn.Module]):
        super().__init__()
        self.members = nn.ModuleList(models)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([m(x) for m in self.members]).mean(0)


def one_shot(config: dict, num_clients: int, progress: bool = True) -> dict:
    """Train ``num_clients`` independent clients on one run config and compare the merges."""
    task = task_from_config(config)
    device = resolve_device(config["device"])
    states, weights, seconds, singles = [], [], [], []
    model = None
    for k in range(num_clients):
        data = task.partition(
            num_clients, k, config["partitioner"], config["dirichlet-alpha"], config["seed"]
        )
        model = model_from_config(task, config, seed=config["seed"] + 1 + k)
        started = time.perf_counter()
        train(
            model,
            data,
            epochs=config["local-epochs"],
            lr=config["lr"],
            batch_size=config["batch-size"],
            device=device,
            seed=config["seed"] + 1000 + k,
            weight_decay=config["weight-decay"],
            progress=progress,
        )
        seconds.append(time.perf_counter() - started)
        singles.append(task.evaluate(model, "test", device)["accuracy"])
        states.append({key: value.detach().cpu() for key, value in model.state_dict().items()})
        weights.append(float(len(data)))

    def accuracy(state: dict) -> float:
        model.load_state_dict(state)
        return task.evaluate(model, "test", device)["accuracy"]

    spec = fedbasin_adapter(task.family, model.config).spec
    reference = max(range(num_clients), key=weights.__getitem__)
    row = {
        "data": config["data"],
        "partitioner": config["partitioner"]
        if config["partitioner"] == "iid"
        else f"dirichlet({config['dirichlet-alpha']})",
        "clients": num_clients,
        "examples": weights,
        "client_accuracy": singles,
        "best_client": max(singles),
        "fedavg": accuracy(average_states(states, weights)),
        "train_seconds": seconds,
    }
    for mode in MODES:
        result = merge(spec, states, weights, reference, mode, config["align-iterations"])
        row[f"aligned_{mode}"] = accuracy(result.state)
        row[f"align_seconds_{mode}"] = result.seconds
        row[f"round_seconds_{mode}"] = max(seconds) + result.seconds
    row["aligned_learned"] = "—"
    if config["refine-steps"] > 0:  # server-side learned refinement on the proxy split
        refine = make_refiner(spec, model_from_config(task, config, seed=0), task, config)
        merged, refined = refined_merge(spec, states, weights, reference, refine)
        row["aligned_learned"] = f"{accuracy(merged):.4f}"
        row["align_seconds_learned"] = refined.seconds
    members = []
    for state in states:
        member = model_from_config(task, config, seed=0)
        member.load_state_dict(state)
        members.append(member)
    row["ensemble"] = evaluate(LogitEnsemble(members), task.test, device)["accuracy"]
    return row


def markdown(rows: list[dict]) -> str:
    lines = [
        "| " + " | ".join(title for _, title, _ in COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS),
    ]
    lines += ["| " + " | ".join(fmt.format(r[key]) for key, _, fmt in COLUMNS) + " |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m fedbasin.simulations.oneshot", description=__doc__.splitlines()[0]
    )
    p.add_argument("--data", action="append", help="data source (repeatable; default: digits)")
    p.add_argument("--clients", type=int, default=4, help="K clients (default 4)")
    p.add_argument("--alpha", type=float, default=0.5, help="Dirichlet concentration (default 0.5)")
    p.add_argument(
        "--run-config",
        default="",
        help=f"run-config overrides (defaults: DEFAULT_RUN_CONFIG with {ONESHOT_DEFAULTS})",
    )
    p.add_argument("--out", default="runs/oneshot/results.json", help="JSON output")
    args = p.parse_args(argv)
    torch.set_num_threads(1)  # small models: one thread is fastest on a shared machine
    overrides = {**ONESHOT_DEFAULTS, **parse_run_config(args.run_config)}
    rows = []
    for data in args.data or ["digits"]:
        for partitioner in ("iid", "dirichlet"):
            config = resolve_run_config(
                {
                    **overrides,
                    "data": data,
                    "partitioner": partitioner,
                    "dirichlet-alpha": args.alpha,
                }
            )
            started = time.perf_counter()
            row = one_shot(config, args.clients)
            row["seconds"] = time.perf_counter() - started
            rows.append(row)
            print(markdown(rows[-1:]).splitlines()[-1], flush=True)
    print()
    print(markdown(rows))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out, {"args": vars(args), "rows": rows})
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
