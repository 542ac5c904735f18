"""``fedbasin simulate``: the fedbasin Flower apps in a local simulation (Ray backend).

The same run-config keys as ``flwr run .`` (``fedbasin.config.DEFAULT_RUN_CONFIG``, mirrored in
``[tool.flwr.app.config]``); ``flwr.simulation.run_simulation`` does not read pyproject.toml, so
the resolved config is handed to the ServerApp directly and reaches the clients inside every
train/evaluate message. Each virtual SuperNode gets 1 CPU. Writes ``OUT/results.json`` (plus
checkpoints and ``curves.png``) and prints a per-round table.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tomllib
from pathlib import Path

from fedbasin.config import resolve_run_config
from fedbasin.server.outputs import RESULTS_FILE
from fedbasin.server.server_app import UnusableModelError

DEFAULT_SUPERNODES = 3
TABLE_COLUMNS = (  # results key, header, format
    ("round", "round", "{}"),
    ("test_accuracy", "acc", "{:.4f}"),
    ("test_loss", "loss", "{:.3f}"),
    ("train_loss", "train", "{:.3f}"),
    ("eval_accuracy", "client", "{:.4f}"),
    ("align_gain", "gain", "{:.3f}"),
    ("aggregate_seconds", "agg s", "{:.2f}"),
    ("round_seconds", "round s", "{:.1f}"),
    ("num_excluded", "excl", "{}"),
    ("round_failed", "failed", "{}"),
)
TABLE_CAPTION = (
    "acc, loss: global model on the server's test split; train: clients' mean train loss; "
    "client: accuracy on the clients' held-out data; gain: alignment objective gain; "
    "agg s, round s: aggregation and round seconds; excl: excluded replies; failed: 1 if the "
    "round kept the previous global model"
)


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "simulate",
        help="run a federated simulation (Flower, Ray backend) and write results.json",
        description=__doc__.splitlines()[0].replace("``", ""),
        epilog="Run-config keys and defaults: fedbasin.config.DEFAULT_RUN_CONFIG "
        "(table in docs/flower.md).",
    )
    p.add_argument(
        "--run-config",
        default="",
        metavar='"KEY=VALUE ..."',
        help='run-config overrides, e.g. "num-server-rounds=5 symmetry=permutation"',
    )
    p.add_argument(
        "--num-supernodes",
        type=int,
        default=DEFAULT_SUPERNODES,
        help=f"virtual SuperNodes, one data partition each (default {DEFAULT_SUPERNODES})",
    )
    p.add_argument("--out", help="output directory (overrides the run config's out-dir)")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the outputs of an earlier run in the output directory (run config "
        "overwrite=true); without it a non-empty output directory is refused",
    )
    p.add_argument("--verbose", action="store_true", help="Flower debug logs")
    p.set_defaults(func=run)
    return p


def parse_run_config(text: str) -> dict:
    """``"k=v k=v"`` → dict. Values are TOML (``5``, ``0.1``, ``true``, ``'text'``), as with
    ``flwr run --run-config``; a value that is not valid TOML is taken as a bare string."""
    config = {}
    for item in shlex.split(text):
        key, sep, value = item.partition("=")
        if not (key and sep and value):
            raise ValueError(f"run-config item {item!r} is not KEY=VALUE")
        try:
            config[key] = tomllib.loads(f"value = {value}")["value"]
        except tomllib.TOMLDecodeError:
            config[key] = value
    return config


def simulate(
    config: dict, num_supernodes: int = DEFAULT_SUPERNODES, verbose: bool = False, client_app=None
) -> dict:
    """Run a resolved run config under ``flwr.simulation.run_simulation``; return results.json.
    ``client_app`` replaces fedbasin's ClientApp (e.g. to add a hostile node in a test)."""
    import torch
    from flwr.serverapp import ServerApp
    from flwr.simulation import run_simulation

    from fedbasin.client.client_app import app as fedbasin_client_app
    from fedbasin.server.server_app import run_server

    client_app = client_app or fedbasin_client_app

    if config["min-nodes"] > num_supernodes:
        raise ValueError(
            f"min-nodes={config['min-nodes']} exceeds --num-supernodes={num_supernodes}"
        )
    server_app = ServerApp()

    @server_app.main()
    def main(grid, context) -> None:
        run_server(grid, config)

    gpus = 1.0 / num_supernodes if torch.cuda.is_available() else 0.0
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # server-side evaluation must not compete with the 1-CPU clients
    try:
        run_simulation(
            server_app=server_app,
            client_app=client_app,
            num_supernodes=num_supernodes,
            backend_config={"client_resources": {"num_cpus": 1, "num_gpus": gpus}},
            verbose_logging=verbose,
        )
    finally:
        torch.set_num_threads(threads)
    return json.loads((Path(config["out-dir"]) / RESULTS_FILE).read_text())


def print_table(rounds: list[dict]) -> None:
    from rich import box
    from rich.console import Console
    from rich.table import Table

    table = Table(title="fedbasin simulate", caption=TABLE_CAPTION, box=box.SIMPLE_HEAD)
    columns = [c for c in TABLE_COLUMNS if any(c[0] in r for r in rounds)]
    for _, title, _ in columns:
        table.add_column(title, justify="right", no_wrap=True)
    for r in rounds:
        table.add_row(*(fmt.format(r[key]) if key in r else "" for key, _, fmt in columns))
    Console().print(table)


def run(args: argparse.Namespace) -> int:
    try:
        overrides = parse_run_config(args.run_config)
        if args.out:
            overrides["out-dir"] = args.out
        if args.overwrite:
            overrides["overwrite"] = True
        config = resolve_run_config(overrides)
        if args.num_supernodes < 1:
            raise ValueError(f"--num-supernodes must be at least 1, got {args.num_supernodes}")
        results = simulate(config, args.num_supernodes, args.verbose)
    except (ValueError, FileNotFoundError) as error:
        print(f"fedbasin simulate: {error}", file=sys.stderr)
        return 2
    except UnusableModelError as error:
        print(f"fedbasin simulate: {error}", file=sys.stderr)
        return 1
    print_table(results["rounds"])
    print(f"results: {Path(config['out-dir']) / RESULTS_FILE}")
    return 0
