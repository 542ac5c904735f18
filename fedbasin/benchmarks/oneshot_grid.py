"""One-shot federated merging against the clients' ensemble, over K × partitions × seeds.

Runs :func:`fedbasin.benchmarks.oneshot.one_shot` (K clients from independent initialisations, one
long local round, then the server's merges) for every number of clients, partition and seed, and
writes per cell (data, K, partition) the test accuracy, mean ± sample std over the seeds, of the
best client, FedAvg, the aligned merge, + learned refinement, + ensemble distillation, FedAvg +
the same distillation and the logit ensemble, with the paired differences the question turns on:

* ``distilled − ensemble``: is one merged model as good as the K clients together (goal: > −0.01)?
* ``aligned − FedAvg (distilled)``: does the alignment carry weight once both are distilled the
  same way from their own start (goal: +0.03 on average)?
* ``distilled − proxy only``: does the federation add anything over a model the server trains on
  its proxy labels alone by the same recipe?
* ``distilled − fresh + distilled``: does the merge's start (aligned + learned) add anything over
  distilling the same teachers into a freshly initialised model?

Outputs in ``--out``: ``oneshot_grid.md`` (the table), ``oneshot_grid.json`` (every run's row) and
``runs/<cell>.json`` (a finished run is not run again: interrupt and rerun freely). Trained clients
are cached in ``--out``/clients, so other server-side settings (``--run-config``) can be compared on
the same clients. The defaults (``GRID_RUN_CONFIG``) fix the step counts, so every figure repeats::

    python -m fedbasin.benchmarks.oneshot_grid --out runs/oneshot_grid
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from pathlib import Path

from fedbasin.benchmarks.grid import run_in_workers, write_report
from fedbasin.benchmarks.regime import mean_spread, parse_partition

# a proxy of 300 labelled examples (of digits' 1,138 training images; at most 1,000 for any data),
# refinement and distillation by step counts (the figures repeat; ~35 s and ~40 s on a 2-core CPU)
GRID_RUN_CONFIG = "proxy-size=300 refine-steps=1000 distill-steps=3000"
DEFAULTS = dict(data="digits", clients="4,5,8", partitions="iid,dirichlet:0.3,dirichlet:0.5", seeds="0,1,2")
MERGES = (  # row key of one_shot, column title
    ("best_client", "best client"),
    ("fedavg", "FedAvg"),
    ("aligned_orthogonal", "aligned"),
    ("aligned_learned", "+ learned"),
    ("aligned_distilled", "+ learned + distilled"),
    ("fedavg_distilled", "FedAvg + distilled"),
    ("proxy_only", "proxy only"),
    ("fresh_distilled", "fresh + distilled"),
    ("ensemble", "ensemble"),
    ("synthetic_learned", "data-free: + learned"),  # --synthetic N: the server holds no data (oneshot.data_free)
    ("synthetic_distilled", "data-free: + learned + distilled"),
    ("synthetic_fedavg_distilled", "data-free: FedAvg + distilled"),
)
GAPS = (  # title, merge a, merge b, the goal for a − b (mean over a cell's seeds)
    ("distilled − ensemble", "aligned_distilled", "ensemble", -0.01),
    ("aligned − FedAvg (distilled)", "aligned_distilled", "fedavg_distilled", 0.03),
    ("distilled − best client", "aligned_distilled", "best_client", 0.0),
    ("distilled − proxy only", "aligned_distilled", "proxy_only", 0.0),
    ("distilled − fresh + distilled", "aligned_distilled", "fresh_distilled", 0.0),
    ("data-free distilled − ensemble", "synthetic_distilled", "ensemble", -0.01),
    ("data-free: aligned − FedAvg (distilled)", "synthetic_distilled", "synthetic_fedavg_distilled", 0.03),
    ("data-free distilled − best client", "synthetic_distilled", "best_client", 0.0),
)


def cell_name(data: str, clients: int, partition: str, seed: int) -> str:
    return f"{data.split(':', 1)[0]}-k{clients}-{partition.replace(':', '')}-s{seed}"


def run_cell(name: str, overrides: dict, clients: int, out: str, synthetic: int = 0) -> dict:
    """One one-shot run in a worker process; its row is written to ``out/runs/<name>.json``."""
    import torch

    from fedbasin.benchmarks.oneshot import one_shot
    from fedbasin.config import resolve_run_config
    from fedbasin.server.outputs import write_json_atomic

    torch.set_num_threads(1)
    started = time.perf_counter()
    row = one_shot(resolve_run_config(overrides), clients, progress=False, cache=Path(out) / "clients",
                   synthetic=synthetic)
    row.update(name=name, overrides=overrides, synthetic=synthetic, seconds=time.perf_counter() - started)
    write_json_atomic(Path(out) / "runs" / f"{name}.json", row)
    return row


def finished(out: Path, name: str, overrides: dict, synthetic: int = 0) -> dict | None:
    """The row of an earlier run of ``name`` with the same run-config overrides (and data-free inputs), else None."""
    try:
        row = json.loads((out / "runs" / f"{name}.json").read_text())
    except (OSError, ValueError):
        return None
    return row if row.get("overrides") == overrides and row.get("synthetic", 0) == synthetic else None


def figure(row: dict, key: str) -> float:
    """A merge's test accuracy from a one_shot row (its optional merges are formatted strings; NaN:
    not in the row, measured by an earlier version)."""
    return float(row.get(key, "nan"))


def summarise(rows: dict, jobs: dict) -> list[dict]:
    """One line per (data, K, partition): every merge's and gap's values over the seeds."""
    cells: dict[tuple, list[dict]] = {}
    for name, job in jobs.items():
        cells.setdefault(job["cell"], []).append(rows[name])
    lines = []
    for (data, clients, partition), members in cells.items():
        line = {"data": data, "clients": clients, "partition": partition, "seeds": len(members)}
        for key, _ in MERGES:
            line[key] = [figure(r, key) for r in members]
        for title, a, b, _ in GAPS:
            line[title] = [figure(r, a) - figure(r, b) for r in members]
        lines.append(line)
    return lines


def markdown(lines: list[dict]) -> str:
    """The table (columns that no row measured are left out) and each gap over all runs, with the
    cells whose mean meets its goal."""
    measured = [key for key in [k for k, _ in MERGES] + [t for t, *_ in GAPS]
                if any(math.isfinite(v) for line in lines for v in line[key])]
    titles = dict(MERGES)
    header = ["data", "K", "partition"] + [titles.get(key, key) for key in measured]
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for line in lines:
        cells = [line["data"], str(line["clients"]), line["partition"]] + [mean_spread(line[k]) for k in measured]
        out.append("| " + " | ".join(cells) + " |")
    out.append("")
    for title, _, _, goal in GAPS:
        if title in measured:
            values = [v for line in lines for v in line[title]]
            met = sum(statistics.fmean(line[title]) >= goal for line in lines)
            out.append(f"- {title}, all {len(values)} runs: {mean_spread(values)}; cells with a mean ≥ {goal:+.2f}: "
                       f"{met}/{len(lines)}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fedbasin.benchmarks.oneshot_grid",
                                description=__doc__.splitlines()[0])
    p.add_argument("--data", default=DEFAULTS["data"], help="data source (default: digits; cifar10:DIR)")
    p.add_argument("--clients", default=DEFAULTS["clients"], help="numbers of clients K (default 4,5,8)")
    p.add_argument("--partitions", default=DEFAULTS["partitions"],
                   help="iid and/or dirichlet:ALPHA, comma-separated (default iid,dirichlet:0.3,dirichlet:0.5)")
    p.add_argument("--seeds", default=DEFAULTS["seeds"], help="run seeds, comma-separated (default 0,1,2)")
    p.add_argument("--run-config", default=GRID_RUN_CONFIG,
                   help=f"run-config overrides for every run (default {GRID_RUN_CONFIG!r}; the one-shot "
                   "defaults, local-epochs=30 init=client, apply first)")
    p.add_argument("--synthetic", type=int, default=0, metavar="N",
                   help="also the server without data: N inputs synthesised from the clients' models stand in "
                   "for the proxy split (columns 'data-free: …'; default 0: not run; rows without it are run "
                   "again whole, which with the grid's fixed step counts repeats their other columns)")
    p.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="runs in parallel (default 2)")
    p.add_argument("--out", default="runs/oneshot_grid", help="output directory (default runs/oneshot_grid)")
    args = p.parse_args(argv)
    from fedbasin.benchmarks.oneshot import ONESHOT_DEFAULTS
    from fedbasin.config import resolve_run_config, task_from_config
    from fedbasin.server.server_app import distill_augment, distils, refines
    from fedbasin.simulate import parse_run_config

    try:  # every bad value is refused before any training
        clients = [int(k) for k in args.clients.split(",")]
        seeds = [int(s) for s in args.seeds.split(",")]
        partitions = args.partitions.split(",")
        extra = {**ONESHOT_DEFAULTS, **parse_run_config(args.run_config), "data": args.data}
        if min(clients) < 2 or args.jobs < 1 or args.synthetic < 0:
            raise ValueError("--clients must be >= 2, --jobs >= 1 and --synthetic >= 0")
        config = resolve_run_config(extra)
        task = task_from_config(config)
        if args.synthetic and task.data != "images":
            raise ValueError(f"--synthetic {args.synthetic}: synthesised inputs are images; {args.data} holds {task.data}")
        if not (refines(config, task) and distils(config, task)):
            raise ValueError("the grid compares distilled merges: give a proxy-size >= 10 with refine-steps and "
                             "distill-steps > 0 (or auto)")
        distill_augment(task, config)
        jobs = {}
        for k in clients:
            for partition in partitions:
                for seed in seeds:
                    overrides = {**extra, **parse_partition(partition), "seed": seed}
                    resolve_run_config(overrides)
                    jobs[cell_name(args.data, k, partition, seed)] = {
                        "overrides": overrides, "clients": k, "cell": (args.data.split(":", 1)[0], k, partition)}
    except ValueError as error:
        p.error(str(error))
    out = Path(args.out)
    started = time.perf_counter()
    rows = {name: row for name, job in jobs.items() if (row := finished(out, name, job["overrides"], args.synthetic))}
    todo = [name for name in jobs if name not in rows]
    for row in run_in_workers(run_cell, [(name, jobs[name]["overrides"], jobs[name]["clients"], str(out),
                                          args.synthetic) for name in todo], args.jobs, len(rows), "one-shot runs"):
        rows[row["name"]] = row
    lines = summarise(rows, jobs)
    table = markdown(lines)
    seconds = time.perf_counter() - started
    write_report(out, "oneshot_grid", {"args": vars(args), "cells": lines, "rows": rows, "seconds": seconds}, table)
    print(table)
    print(f"\n{len(todo)} runs in {seconds:.0f} s ({len(rows) - len(todo)} from earlier runs); "
          f"wrote {out / 'oneshot_grid.md'}, oneshot_grid.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
