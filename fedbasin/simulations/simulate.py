"""``fedbasin simulate``: the fedbasin Flower apps in a local simulation (Ray backend).

The same run-config keys as ``flwr run .`` (``fedbasin.config.DEFAULT_RUN_CONFIG``, mirrored in
``[tool.flwr.app.config]``); ``flwr.simulation.run_simulation`` does not read pyproject.toml, so
the resolved config is handed to the ServerApp directly and reaches the clients inside every
train/evaluate message. Each virtual SuperNode gets 1 CPU. Writes ``OUT/results.json`` (plus
checkpoints and ``curves.png``) and prints a per-round table.

Stopping: SIGINT (Ctrl-C) or SIGTERM stops the ServerApp at its next message exchange (finished
checkpoints stay, writes are atomic), shuts Ray down (its GCS, raylet, agents and the ClientApp
worker processes) and exits 130 (SIGINT) or 143 (SIGTERM). A SIGKILLed process cannot clean
up: README.md (Command line) says what remains and how to stop it.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import sys
import threading
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
    # Ray's C++ failure-signal handler turns SIGTERM into an abort that skips all clean-up; without
    # it Ray's own Python handler raises SystemExit(SIGTERM) in the main thread (read at import).
    os.environ.setdefault("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", "1")
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
    stop = threading.Event()

    @server_app.main()
    def main(grid, context) -> None:
        _stop_at_next_exchange(grid, stop)
        run_server(grid, config)

    children_before = _children()
    threads_before = set(threading.enumerate())
    adopting = _set_subreaper(True)
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
    except BaseException:
        stop.set()
        raise
    finally:
        torch.set_num_threads(threads)
        _stop_ray(exclude=children_before)
        if adopting:
            _set_subreaper(False)
        if stop.is_set():  # the ServerApp thread leaves at its next grid call; bounded wait
            for thread in set(threading.enumerate()) - threads_before:
                thread.join(STOP_GRACE_SECONDS)
    return json.loads((Path(config["out-dir"]) / RESULTS_FILE).read_text())


STOP_GRACE_SECONDS = 30.0  # after an interrupt: how long the ServerApp may take to reach its next exchange


class SimulationStopped(Exception):
    """Raised in the ServerApp thread at its next grid call once the simulation is stopping."""


def _stop_at_next_exchange(grid, stop: threading.Event) -> None:
    """Make every grid call of the ServerApp thread raise once ``stop`` is set. That thread is not
    a daemon and cannot be interrupted, so without this the process would wait for it forever
    (Flower's in-memory grid keeps polling for replies that will never come)."""
    for name in ("push_messages", "pull_messages", "send_and_receive", "get_node_ids"):
        method = getattr(grid, name)

        def checked(*args, _method=method, **kwargs):
            if stop.is_set():
                raise SimulationStopped("simulation stopped")
            return _method(*args, **kwargs)

        setattr(grid, name, checked)


def _set_subreaper(on: bool) -> bool:
    """Linux: make this process the subreaper of its descendants (or stop being one), so that
    processes Ray leaves behind after ``ray.shutdown()`` (its dashboard and runtime-env agents
    outlive the raylet) stay our children and can be stopped. Returns whether it worked."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    PR_SET_CHILD_SUBREAPER = 36
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0) == 0


def _children() -> set:
    import psutil

    return {(p.pid, p.create_time()) for p in psutil.Process().children(recursive=True)}


def _stop_ray(exclude: set, grace: float = 5.0) -> None:
    """Shut down the Ray instance this process started (GCS, raylet, agents, workers), then
    stop every descendant started since (not in ``exclude``, ``(pid, create_time)`` pairs) that
    is still running: SIGTERM, ``grace`` seconds, SIGKILL."""
    import psutil

    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()
    left = []
    for process in psutil.Process().children(recursive=True):
        try:
            if (process.pid, process.create_time()) not in exclude:
                process.terminate()
                left.append(process)
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(left, timeout=grace)
    for process in alive:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=grace)


EXIT_INTERRUPTED, EXIT_TERMINATED = 130, 143


class _Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread like Ctrl-C so that the same clean-up runs."""


def _raise_terminated(signum, frame) -> None:
    raise _Terminated()


def _exit_if_stuck(code: int) -> None:
    """CLI only: if the ServerApp thread did not leave within the grace period, exit now rather
    than let the interpreter wait for it at shutdown."""
    if any(t.is_alive() and not t.daemon for t in threading.enumerate() if t is not threading.main_thread()):
        print(f"fedbasin simulate: the ServerApp did not stop within {STOP_GRACE_SECONDS:.0f}s; exiting",
              file=sys.stderr)
        sys.stderr.flush()
        os._exit(code)


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
        previous = signal.signal(signal.SIGTERM, _raise_terminated)
        try:
            results = simulate(config, args.num_supernodes, args.verbose)
        finally:
            signal.signal(signal.SIGTERM, previous)
    except (ValueError, FileNotFoundError) as error:
        print(f"fedbasin simulate: {error}", file=sys.stderr)
        return 2
    except UnusableModelError as error:
        print(f"fedbasin simulate: {error}", file=sys.stderr)
        return 1
    except (KeyboardInterrupt, SystemExit) as stopped:
        if isinstance(stopped, SystemExit) and stopped.code != signal.SIGTERM:
            raise
        # ray.init replaces our SIGTERM handler with one that raises SystemExit(SIGTERM)
        terminated = isinstance(stopped, (_Terminated, SystemExit))
        name, code = ("SIGTERM", EXIT_TERMINATED) if terminated else ("SIGINT", EXIT_INTERRUPTED)
        where = args.out or "the run config's out-dir"
        print(f"fedbasin simulate: stopped by {name}; Ray shut down; finished rounds are in {where}",
              file=sys.stderr)
        _exit_if_stuck(code)
        return code
    print_table(results["rounds"])
    print(f"results: {Path(config['out-dir']) / RESULTS_FILE}")
    return 0
