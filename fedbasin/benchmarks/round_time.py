"""Where a deployed round's time goes: a SuperLink and SuperNodes on localhost, digits, small ViT.

    python -m fedbasin.benchmarks.round_time [--rounds 3] [--supernodes 2] [--out runs/round_time]

Starts the deployment (fedbasin.deployment.LocalFederation: throwaway FLWR_HOME, free ports,
every process stopped at the end), submits the app with ``flwr run``, waits for the rounds by
watching ``results.json`` (the ``flwr`` CLI is slow to start, so it is called only to submit and
to read the final status), and prints each round's breakdown from the server's and the
clients' timings (ServerApp: ``round_seconds``, ``*_exchange_seconds``, ``aggregate_seconds``;
ClientApp replies: ``train_*`` / ``eval_*`` wait, startup, decode, encode, handler seconds,
means over the clients). Writes ``OUT/round_time.json``.

Per exchange (train, evaluate): ``delivery`` = server creates the message → ClientApp process
starts (SuperLink, SuperNode polling, SuperExec launching the process); ``startup`` = ClientApp
process start → handler (interpreter, imports); ``handler`` = decode + data/model set-up +
training or evaluation + encode; ``return`` = the rest of the exchange (reply push, ServerApp
polling). ``other`` = the round minus both exchanges and the aggregation: the server-side test
evaluation and checkpoint of the previous round, configure_* and logging.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

from fedbasin.deployment import LocalFederation, wait_for

ROOT = Path(__file__).resolve().parents[2]
COLUMNS = ("round", "delivery", "startup", "decode", "train", "encode", "handler", "return", "aggregate",
           "eval exchange", "other", "round s", "strategy %")


def breakdown(record: dict) -> dict:
    """One round of results.json → named parts (seconds) that add up to ``round_seconds``."""
    train_ex = record["train_exchange_seconds"]
    wait, startup, handler = (record[f"train_{k}_seconds"] for k in ("wait", "startup", "handler"))
    aggregate = record["aggregate_seconds"]
    eval_ex = record.get("evaluate_exchange_seconds", 0.0)
    parts = {
        "round": record["round"],
        "delivery": wait - startup,
        "startup": startup,
        "decode": record["train_decode_seconds"],
        "train": record["train_seconds"],
        "encode": record["train_encode_seconds"],
        "handler": handler,
        "return": train_ex - wait - handler,
        "aggregate": aggregate,
        "align": record.get("align_seconds", 0.0),
        "eval exchange": eval_ex,
        "eval delivery": record.get("eval_wait_seconds", 0.0) - record.get("eval_startup_seconds", 0.0),
        "eval startup": record.get("eval_startup_seconds", 0.0),
        "eval handler": record.get("eval_handler_seconds", 0.0),
        "other": record["round_seconds"] - train_ex - aggregate - eval_ex,
        "round s": record["round_seconds"],
    }
    parts["strategy %"] = 100.0 * aggregate / record["round_seconds"]
    return parts


def print_breakdown(rows: list[dict]) -> None:
    print(" | ".join(f"{c:>9}" for c in COLUMNS))
    for row in rows:
        print(" | ".join(f"{row[c]:>9.2f}" if c != "round" else f"{row[c]:>9d}" for c in COLUMNS))
    if rows:
        mean = {c: sum(r[c] for r in rows) / len(rows) for c in rows[0] if c != "round"}
        print(" | ".join(["     mean"] + [f"{mean[c]:>9.2f}" for c in COLUMNS[1:]]))
        print(f"evaluate exchange (mean): delivery {mean['eval delivery']:.2f} s, startup "
              f"{mean['eval startup']:.2f} s, handler {mean['eval handler']:.2f} s")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--supernodes", type=int, default=2)
    parser.add_argument("--local-epochs", type=int, default=1)
    parser.add_argument("--out", default="runs/round_time")
    parser.add_argument("--timeout", type=float, default=900, help="seconds to wait for the run")
    args = parser.parse_args(argv)

    out = Path(args.out).absolute()
    run_dir = out / "run"
    if run_dir.exists() and any(run_dir.iterdir()):
        parser.error(f"{run_dir} is not empty; choose another --out")
    out.mkdir(parents=True, exist_ok=True)
    results = run_dir / "results.json"
    config = (f"num-server-rounds={args.rounds} local-epochs={args.local_epochs} min-nodes={args.supernodes} "
              f"out-dir='{run_dir}'")
    started = time.perf_counter()
    with LocalFederation(out / "deployment") as federation:
        federation.start_superlink()
        for i in range(args.supernodes):
            federation.start_supernode(f"supernode-{i}", f"partition-id={i} num-partitions={args.supernodes}")
        run_id = federation.submit(ROOT, config)

        def rounds_done() -> bool:
            try:
                return len(json.loads(results.read_text())["rounds"]) == args.rounds + 1
            except (OSError, ValueError, KeyError):
                return False

        wait_for(rounds_done, args.timeout, f"{args.rounds} rounds in {results}", interval=1.0)
        status = federation.wait_finished(run_id, 120)
    wall = time.perf_counter() - started
    rounds = json.loads(results.read_text())["rounds"][1:]
    rows = [breakdown(r) for r in rounds]
    print(f"run {run_id}: {status}; {args.supernodes} SuperNodes on localhost, {args.rounds} rounds, "
          f"local-epochs={args.local_epochs}; machine: {platform.machine()}, {os.cpu_count()} CPUs, "
          f"{platform.python_version()}; wall {wall:.0f} s. Seconds per round (client values: mean of "
          f"the nodes):")
    print_breakdown(rows)
    (out / "round_time.json").write_text(json.dumps({"status": status, "wall_seconds": wall, "rounds": rows},
                                                    indent=1))
    return 0 if status == "finished:completed" else 1


if __name__ == "__main__":
    raise SystemExit(main())
