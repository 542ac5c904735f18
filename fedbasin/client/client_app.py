"""ClientApp: trains and evaluates on this node's partition of the run's data.

The node finds its partition in its node config (``partition-id``, ``num-partitions``; the
simulation sets them, a SuperNode gets them from ``--node-config``). The run config comes with
each message (the ServerApp sends it), falling back to the node's ``context.run_config`` and
:data:`fedbasin.config.DEFAULT_RUN_CONFIG`.
"""

from __future__ import annotations

import time

from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fedbasin.config import model_from_config, resolve_run_config, task_from_config
from fedbasin.training import evaluate as evaluate_model
from fedbasin.training import resolve_device
from fedbasin.training import train as train_model

VALIDATION_FRACTION = 0.1  # of each partition, held out for the evaluate message

app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Train the model for ``local-epochs`` on the local partition and reply with its weights.

    ``init = "client"`` starts round 1 from an independent, node-specific initialisation
    (seed + 1 + partition-id) instead of the broadcast weights (the one-shot setting).
    """
    config, server_round = _run_config(msg, context)
    partition_id, train_data, _ = _local_data(context, config)
    task = task_from_config(config)
    if config["init"] == "client" and server_round == 1:
        model = model_from_config(task, config, seed=config["seed"] + 1 + partition_id)
    else:
        model = model_from_config(task, config, seed=config["seed"])
        model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    started = time.perf_counter()
    result = train_model(
        model,
        train_data,
        epochs=config["local-epochs"],
        lr=config["lr"],
        batch_size=config["batch-size"],
        device=resolve_device(config["device"]),
        seed=config["seed"] + 1000 * server_round + partition_id,
        weight_decay=config["weight-decay"],
    )
    metrics = {
        "train_loss": result["train_loss"],
        "train_seconds": time.perf_counter() - started,
        "num-examples": len(train_data),
    }
    content = RecordDict({"arrays": ArrayRecord(model.state_dict()), "metrics": MetricRecord(metrics)})
    return Message(content=content, reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """Evaluate the broadcast model on the held-out part of the local partition."""
    config, _ = _run_config(msg, context)
    _, _, validation = _local_data(context, config)
    model = model_from_config(task_from_config(config), config, seed=config["seed"])
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    result = evaluate_model(model, validation, device=resolve_device(config["device"]))
    metrics = {"eval_loss": result["loss"], "eval_accuracy": result["accuracy"], "num-examples": len(validation)}
    return Message(content=RecordDict({"metrics": MetricRecord(metrics)}), reply_to=msg)


def _run_config(msg: Message, context: Context) -> tuple[dict, int]:
    """The resolved run config (message over node context over defaults) and the round."""
    sent = dict(msg.content["config"]) if "config" in msg.content.config_records else {}
    server_round = int(sent.pop("server-round", 1))
    return resolve_run_config({**context.run_config, **sent}), server_round


def _local_data(context: Context, config: dict):
    """``(partition_id, train, validation)`` of this node's partition."""
    missing = [k for k in ("partition-id", "num-partitions") if k not in context.node_config]
    if missing:
        raise ValueError(
            f"node {context.node_id}: node config lacks {missing}; start the SuperNode with "
            "--node-config 'partition-id=<i> num-partitions=<n>'"
        )
    partition_id, num_partitions = int(context.node_config["partition-id"]), int(context.node_config["num-partitions"])
    data = task_from_config(config).partition(
        num_partitions, partition_id, config["partitioner"], config["dirichlet-alpha"], config["seed"]
    )
    train_data, validation = data.split(VALIDATION_FRACTION, seed=config["seed"] + partition_id)
    return partition_id, train_data, validation
