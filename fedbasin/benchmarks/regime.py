"""When does alignment pay in multi-round federated learning? A regime map.

Runs the fedbasin ServerApp with ``alignment=true`` (AlignedFedAvg) and ``alignment=false``
(FedAvg) over local epochs × heterogeneity × initialisation × seeds, each run the ServerApp's
own round loop in this process (:mod:`fedbasin.benchmarks.inprocess`: the figures of
``fedbasin simulate`` bit for bit, without Flower's transport), and writes

* ``OUT/regime.md``: per cell, final test accuracy of each arm (mean ± sample std over seeds),
  the paired difference AlignedFedAvg − FedAvg, and rounds to ``--target`` accuracy (mean over
  the seeds that reach it, and how many do);
* ``OUT/regime.png``: the paired difference per cell, one panel per initialisation;
* ``OUT/regime.json``: every run's per-round test accuracy and seconds;
* ``OUT/runs/<cell>/``: each run's results.json (a finished run is not run again: the command
  can be interrupted and rerun).

Initialisation ``server``: every node starts round 1 from the broadcast model (shared init);
``client``: round 1 from each node's own seed (independent inits, the one-shot setting)::

    python -m fedbasin.benchmarks.regime --out runs/regime
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import time
from pathlib import Path

from fedbasin.benchmarks.grid import run_in_workers, write_report

ARMS = {"FedAvg": False, "AlignedFedAvg": True}  # arm -> run-config alignment
DEFAULTS = dict(data="digits", epochs="1,5,20", partitions="iid,dirichlet:0.5,dirichlet:0.1",
                inits="server,client", seeds="0,1,2", rounds=10, nodes=4, target=0.8)


def parse_partition(text: str) -> dict:
    """``iid`` or ``dirichlet:ALPHA`` → run-config keys."""
    name, _, alpha = text.partition(":")
    if name == "iid" and not alpha:
        return {"partitioner": "iid"}
    if name == "dirichlet":
        try:
            if float(alpha) > 0:
                return {"partitioner": "dirichlet", "dirichlet-alpha": float(alpha)}
        except ValueError:
            pass
    raise ValueError(f"--partitions {text!r}: expected iid or dirichlet:ALPHA with ALPHA > 0")


def cell_name(epochs: int, partition: str, init: str, seed: int, arm: str) -> str:
    return f"e{epochs}-{partition.replace(':', '')}-{init}-s{seed}-{arm}"


def run_one(name: str, overrides: dict, nodes: int, out: str) -> dict:
    """One ServerApp run in a worker process; returns its per-round figures."""
    import torch

    from fedbasin.benchmarks.inprocess import run_in_process
    from fedbasin.config import resolve_run_config

    torch.set_num_threads(1)
    logging.getLogger("flwr").setLevel(logging.WARNING)
    run_dir = Path(out) / "runs" / name
    config = resolve_run_config({**overrides, "out-dir": str(run_dir), "overwrite": True})
    started = time.perf_counter()
    results = run_in_process(config, nodes)
    rounds = results["rounds"]
    return {"name": name, "accuracy": [r["test_accuracy"] for r in rounds],
            "aggregate_seconds": sum(r.get("aggregate_seconds", 0.0) for r in rounds),
            "seconds": time.perf_counter() - started}


def finished(out: Path, name: str, rounds: int) -> dict | None:
    """The figures of an earlier complete run of ``name`` (same number of rounds), else None."""
    path = out / "runs" / name / "results.json"
    try:
        results = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    accuracy = [r["test_accuracy"] for r in results.get("rounds", [])]
    if len(accuracy) != rounds + 1 or not results.get("final", {}).get("usable"):
        return None
    return {"name": name, "accuracy": accuracy, "seconds": None,
            "aggregate_seconds": sum(r.get("aggregate_seconds", 0.0) for r in results["rounds"])}


def rounds_to(accuracy: list[float], target: float) -> int | None:
    """The first round whose global model reaches ``target`` test accuracy (None: never)."""
    return next((r for r, a in enumerate(accuracy) if a >= target), None)


def mean_spread(values: list[float]) -> str:
    """``mean ± sample std`` (± 0.000 for one value; :func:`fedbasin.benchmarks.suite.mean_spread`)."""
    from fedbasin.benchmarks.suite import mean_spread as mean_and_spread

    mean, spread = mean_and_spread(values)
    return f"{mean:.3f} ± {spread or 0.0:.3f}"


def summarise(runs: dict, grid: dict, target: float) -> list[dict]:
    """One row per (epochs, partition, init): both arms over the seeds."""
    rows = []
    for epochs in grid["epochs"]:
        for partition in grid["partitions"]:
            for init in grid["inits"]:
                row = {"epochs": epochs, "partition": partition, "init": init}
                finals, reach = {}, {}
                for arm in ARMS:
                    curves = [runs[cell_name(epochs, partition, init, s, arm)]["accuracy"] for s in grid["seeds"]]
                    finals[arm] = [c[-1] for c in curves]
                    reach[arm] = [rounds_to(c, target) for c in curves]
                    row[arm] = finals[arm]
                    row[f"{arm}_rounds_to_target"] = reach[arm]
                row["difference"] = [a - f for a, f in zip(finals["AlignedFedAvg"], finals["FedAvg"])]
                rows.append(row)
    return rows


def reach_text(rounds: list[int | None]) -> str:
    reached = [r for r in rounds if r is not None]
    if not reached:
        return f"— (0/{len(rounds)})"
    return f"{statistics.fmean(reached):.1f} ({len(reached)}/{len(rounds)})"


def markdown(rows: list[dict], target: float) -> str:
    lines = [f"| local epochs | partition | init | FedAvg | AlignedFedAvg | aligned − FedAvg | "
             f"rounds to {target:.2f}: FedAvg | AlignedFedAvg |", "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['epochs']} | {row['partition']} | {row['init']} | {mean_spread(row['FedAvg'])} | "
                     f"{mean_spread(row['AlignedFedAvg'])} | {mean_spread(row['difference'])} | "
                     f"{reach_text(row['FedAvg_rounds_to_target'])} | "
                     f"{reach_text(row['AlignedFedAvg_rounds_to_target'])} |")
    return "\n".join(lines)


def plot(rows: list[dict], grid: dict, path: Path) -> None:
    """Heat maps of the mean paired difference (AlignedFedAvg − FedAvg final accuracy)."""
    from fedbasin.plots import _figure, save_figure

    plt = _figure()
    fig, axes = plt.subplots(1, len(grid["inits"]), figsize=(4.2 * len(grid["inits"]), 3.4), squeeze=False)
    bound = max(0.02, max(abs(statistics.fmean(r["difference"])) for r in rows))
    for ax, init in zip(axes[0], grid["inits"]):
        values = [[statistics.fmean(next(r["difference"] for r in rows if (r["epochs"], r["partition"], r["init"])
                                         == (e, p, init))) for p in grid["partitions"]] for e in grid["epochs"]]
        image = ax.imshow(values, cmap="RdBu", vmin=-bound, vmax=bound)
        for i, line in enumerate(values):
            for j, value in enumerate(line):
                ax.text(j, i, f"{value:+.3f}", ha="center", va="center", fontsize=8)
        ax.set_xticks(range(len(grid["partitions"])), grid["partitions"], fontsize=8)
        ax.set_yticks(range(len(grid["epochs"])), [str(e) for e in grid["epochs"]])
        ax.set_xlabel("partition")
        if ax is axes[0][0]:
            ax.set_ylabel("local epochs")
        ax.set_title(f"init={init} ({'shared' if init == 'server' else 'independent'})", fontsize=9)
    fig.colorbar(image, ax=list(axes[0]), label="AlignedFedAvg − FedAvg, final accuracy")
    save_figure(fig, path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fedbasin.benchmarks.regime", description=__doc__.splitlines()[0])
    p.add_argument("--data", default=DEFAULTS["data"], help="data source (default: digits)")
    p.add_argument("--epochs", default=DEFAULTS["epochs"], help="local epochs, comma-separated (default 1,5,20)")
    p.add_argument("--partitions", default=DEFAULTS["partitions"],
                   help="iid and/or dirichlet:ALPHA, comma-separated (default iid,dirichlet:0.5,dirichlet:0.1)")
    p.add_argument("--inits", default=DEFAULTS["inits"], help="server (shared) and/or client (independent)")
    p.add_argument("--seeds", default=DEFAULTS["seeds"], help="run seeds, comma-separated (default 0,1,2)")
    p.add_argument("--rounds", type=int, default=DEFAULTS["rounds"], help="server rounds per run (default 10)")
    p.add_argument("--nodes", type=int, default=DEFAULTS["nodes"], help="nodes, one partition each (default 4)")
    p.add_argument("--target", type=float, default=DEFAULTS["target"], help="target test accuracy (default 0.8)")
    p.add_argument("--run-config", default="", help="further run-config overrides for every run")
    p.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="runs in parallel (default 2)")
    p.add_argument("--out", default="runs/regime", help="output directory (default runs/regime)")
    args = p.parse_args(argv)
    from fedbasin.config import resolve_run_config
    from fedbasin.simulate import parse_run_config

    try:  # every bad value is refused before any training
        grid = {"epochs": [int(e) for e in args.epochs.split(",")], "partitions": args.partitions.split(","),
                "inits": args.inits.split(","), "seeds": [int(s) for s in args.seeds.split(",")]}
        extra = parse_run_config(args.run_config)
        if min(grid["epochs"]) < 1 or args.rounds < 1 or args.nodes < 2 or args.jobs < 1:
            raise ValueError("--epochs, --rounds and --jobs must be >= 1 and --nodes >= 2")
        if not set(grid["inits"]) <= {"server", "client"}:
            raise ValueError(f"--inits {args.inits!r}: expected server, client or both")
        jobs = {}
        for epochs in grid["epochs"]:
            for partition in grid["partitions"]:
                for init in grid["inits"]:
                    for seed in grid["seeds"]:
                        for arm, alignment in ARMS.items():
                            overrides = {**extra, "data": args.data, **parse_partition(partition), "init": init,
                                         "seed": seed, "local-epochs": epochs, "num-server-rounds": args.rounds,
                                         "min-nodes": args.nodes, "alignment": alignment}
                            resolve_run_config(overrides)
                            jobs[cell_name(epochs, partition, init, seed, arm)] = overrides
    except ValueError as error:
        p.error(str(error))
    out = Path(args.out)
    started = time.perf_counter()
    runs = {name: done for name in jobs if (done := finished(out, name, args.rounds))}
    todo = [name for name in jobs if name not in runs]
    for result in run_in_workers(run_one, [(name, jobs[name], args.nodes, str(out)) for name in todo], args.jobs,
                                 len(runs), "regime runs"):
        runs[result["name"]] = result
    rows = summarise(runs, grid, args.target)
    table = markdown(rows, args.target)
    seconds = time.perf_counter() - started
    write_report(out, "regime", {"args": vars(args), "rows": rows, "runs": runs, "seconds": seconds}, table)
    plot(rows, grid, out / "regime.png")
    print(table)
    print(f"\n{len(todo)} runs in {seconds:.0f} s ({len(runs) - len(todo)} from earlier runs); "
          f"wrote {out / 'regime.md'}, regime.png, regime.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
