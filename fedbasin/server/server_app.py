"""ServerApp: reads the run config, builds the model and the aligned strategy, runs the rounds.

Each round the global model is evaluated on the server's test split, checkpointed, and its
metrics are added to ``results.json`` and ``curves.png`` in ``out-dir`` (see ``outputs.py``).
``resume = true`` continues from the last checkpoint in ``out-dir``.
"""

from __future__ import annotations

import functools
import time
from logging import INFO

import torch

from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.common.logger import log
from flwr.serverapp import Grid, ServerApp

from fedbasin.alignment import fedbasin_adapter, learned_refine
from fedbasin.config import model_from_config, resolve_run_config, task_from_config
from fedbasin.server.outputs import RunOutputs
from fedbasin.strategies import AlignedFedAvg
from fedbasin.training import resolve_device

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Entry point for ``flwr run``: the run config is ``[tool.flwr.app.config]`` + overrides."""
    run_server(grid, resolve_run_config(context.run_config))


def make_refiner(spec, model, task, config: dict):
    """``refine(reference, clients)``: learned refinement on the proxy split (20% held out)."""
    train_split, held = task.proxy.split(0.2, seed=config["seed"])
    heldout = next(held.batches(len(held)))

    def batches():
        generator = torch.Generator().manual_seed(config["seed"])
        while True:
            yield from train_split.batches(config["batch-size"], generator=generator)

    return functools.partial(
        learned_refine, spec, model, loss_fn=task.loss_fn, batches=batches(), heldout=heldout,
        steps=config["refine-steps"], lr=config["refine-lr"], mode=config["symmetry"],
        permutations=config["refine-permutations"], match_iterations=config["align-iterations"],
    )


def time_exchanges(grid: Grid) -> dict:
    """Wrap ``grid.send_and_receive`` to time each exchange: message type (``train``,
    ``evaluate``) → seconds from pushing the messages to holding every reply (the round-time
    breakdown in docs/round_time.md)."""
    seconds: dict = {}
    send_and_receive = grid.send_and_receive

    def timed(messages, *args, **kwargs):
        messages = list(messages)
        kind = messages[0].metadata.message_type.split(".")[0] if messages else "none"
        started = time.perf_counter()
        try:
            return send_and_receive(messages, *args, **kwargs)
        finally:
            seconds[kind] = time.perf_counter() - started

    grid.send_and_receive = timed
    return seconds


def run_server(grid: Grid, config: dict) -> dict:
    """Run ``num-server-rounds`` rounds with a resolved run config; returns the results dict."""
    task = task_from_config(config)
    model = model_from_config(task, config, seed=config["seed"])
    outputs = RunOutputs(config["out-dir"], task.family, model.config, config)
    num_rounds = config["num-server-rounds"]
    first_round = 1
    resumed = outputs.resume() if config["resume"] else None
    if resumed is not None:
        last, state = resumed
        model.load_state_dict(state)
        first_round = last + 1
        log(INFO, "resuming after round %d from %s", last, outputs.checkpoint_dir(last))
        if last >= num_rounds:
            log(INFO, "all %d rounds are already done", num_rounds)
            return outputs.results
    elif stale := outputs.start_fresh():
        log(INFO, "fresh run: removed checkpoints of rounds %s from %s", stale, outputs.dir)

    spec = fedbasin_adapter(task.family, model.config).spec
    strategy = AlignedFedAvg(
        spec,
        alignment=config["alignment"],
        mode=config["symmetry"],
        iterations=config["align-iterations"],
        independent_init=config["init"] == "client",
        universe_iterations=config["universe-iterations"],
        refine=make_refiner(spec, model, task, config) if config["refine-steps"] > 0 else None,
        fraction_train=config["fraction-train"],
        fraction_evaluate=config["fraction-evaluate"],
        min_train_nodes=config["min-nodes"],
        min_evaluate_nodes=config["min-nodes"],
        min_available_nodes=config["min-nodes"],
    )
    device = resolve_device(config["device"])
    exchanges = time_exchanges(grid)
    round_started = time.perf_counter()

    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        """Test-split metrics of the global model; records every round not recorded yet."""
        nonlocal round_started
        seconds, round_started = time.perf_counter() - round_started, time.perf_counter()
        eval_started = time.perf_counter()
        model.load_state_dict(arrays.to_torch_state_dict())
        test = task.evaluate(model, "test", device)
        metrics = {"test_loss": test["loss"], "test_accuracy": test["accuracy"]}
        timing = {f"{kind}_exchange_seconds": s for kind, s in exchanges.items()}
        timing["server_eval_seconds"] = time.perf_counter() - eval_started
        exchanges.clear()
        if server_round >= first_round or resumed is None:
            extra = {"round_seconds": seconds, **timing} if server_round else {}
            for record in (strategy.train_metrics, strategy.evaluate_metrics):
                extra.update(record.get(server_round, {}))
            outputs.record(server_round, model.state_dict(), {**metrics, **extra})
            log(
                INFO,
                "round %d: test accuracy %.4f, test loss %.4f",
                server_round,
                test["accuracy"],
                test["loss"],
            )
        return MetricRecord(metrics)

    strategy.start(
        grid,
        initial_arrays=ArrayRecord(model.state_dict()),
        num_rounds=num_rounds,
        train_config=ConfigRecord(config),
        evaluate_config=ConfigRecord(config),
        evaluate_fn=evaluate,
        first_round=first_round,
    )
    return outputs.results
