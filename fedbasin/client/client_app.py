"""ClientApp: trains and evaluates on this node's partition of the run's data.

The node finds its partition in its node config (``partition-id``, ``num-partitions``; the
simulation sets them, a SuperNode gets them from ``--node-config``, which may also name a
node-local ``data`` source). The run config comes with each message (the ServerApp sends it),
falling back to the node's ``context.run_config`` and :data:`fedbasin.config.DEFAULT_RUN_CONFIG`.

Messages carry the model in its adapter's standard layout (``model_adapter``: the layout of the
strategy's symmetry spec; for fedbasin's models the state dict itself). Hugging Face causal LMs
(``hf-config`` / ``hf-pretrained``, :mod:`fedbasin.causal_lm`) are built from the config alone
here, untied when the run aligns (the server's model is untied the same way), and their
pretrained weights arrive with the broadcast.
"""

from __future__ import annotations

import time

from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fedbasin.config import (
    eval_batch_size,
    model_adapter,
    model_from_config,
    resolve_run_config,
    task_from_config,
)
from fedbasin.training import evaluate as evaluate_model
from fedbasin.training import resolve_device
from fedbasin.training import train as train_model

VALIDATION_FRACTION = 0.1  # of each partition, held out for the evaluate message

app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Train the model for ``local-epochs`` on the local partition and reply with its weights.

    ``init = "client"`` starts round 1 from an independent, node-specific initialisation
    (seed + 1 + node index) instead of the broadcast weights (the one-shot setting).
    """
    clock = _Clock(msg)
    config, server_round = _run_config(msg, context)
    node_index, task, train_data, _ = _local_data(context, config)
    if config["init"] == "client" and server_round == 1:
        model = model_from_config(task, config, seed=config["seed"] + 1 + node_index)
        adapter = model_adapter(task, model)[1]
    else:
        model = model_from_config(task, config, seed=config["seed"], load_weights=False)
        adapter = model_adapter(task, model)[1]
        model.load_state_dict(adapter.from_standard(clock.decode(msg.content["arrays"])))
    started = time.perf_counter()
    result = train_model(
        model,
        train_data,
        epochs=config["local-epochs"],
        lr=config["lr"],
        batch_size=config["batch-size"],
        device=resolve_device(config["device"]),
        seed=config["seed"] + 1000 * server_round + node_index,
        weight_decay=config["weight-decay"],
    )
    metrics = {
        "train_loss": result["train_loss"],
        "train_seconds": time.perf_counter() - started,
        "num-examples": len(train_data),
    }
    encode_started = time.perf_counter()
    arrays = ArrayRecord(adapter.to_standard(model.state_dict()))
    clock.encode_seconds = time.perf_counter() - encode_started
    metrics.update(clock.metrics("train_"))
    content = RecordDict({"arrays": arrays, "metrics": MetricRecord(metrics)})
    return Message(content=content, reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """Evaluate the broadcast model on the held-out part of the local partition."""
    clock = _Clock(msg)
    config, _ = _run_config(msg, context)
    _, task, _, validation = _local_data(context, config)
    model = model_from_config(task, config, seed=config["seed"], load_weights=False)
    model.load_state_dict(model_adapter(task, model)[1].from_standard(clock.decode(msg.content["arrays"])))
    result = evaluate_model(model, validation, device=resolve_device(config["device"]),
                            batch_size=eval_batch_size(task, model))
    metrics = {
        "eval_loss": result["loss"],
        "eval_accuracy": result["accuracy"],
        "num-examples": len(validation),
        **clock.metrics("eval_"),
    }
    return Message(content=RecordDict({"metrics": MetricRecord(metrics)}), reply_to=msg)


class _Clock:
    """Where a message's time goes on this node (``docs/round_time.md``), as reply metrics:

    ``wait_seconds``: from the server creating the message to this handler starting (push,
    SuperNode polling, ClientApp process start); ``startup_seconds``: from this ClientApp process
    starting to the handler (interpreter, imports); ``decode_seconds``: arrays → tensors;
    ``encode_seconds``: tensors → reply arrays; ``handler_seconds``: the whole handler.
    Wall-clock differences across processes: meaningful on one machine or with synced clocks.
    """

    def __init__(self, msg: Message):
        self.started = time.time()
        self.perf_started = time.perf_counter()
        self.created_at = msg.metadata.created_at
        self.decode_seconds = self.encode_seconds = 0.0

    def decode(self, arrays: ArrayRecord) -> dict:
        started = time.perf_counter()
        state = arrays.to_torch_state_dict()
        self.decode_seconds = time.perf_counter() - started
        return state

    def metrics(self, prefix: str) -> dict:
        import psutil

        values = {
            "wait_seconds": self.started - self.created_at,
            "startup_seconds": self.started - psutil.Process().create_time(),
            "decode_seconds": self.decode_seconds,
            "encode_seconds": self.encode_seconds,
            "handler_seconds": time.perf_counter() - self.perf_started,
        }
        return {prefix + key: float(value) for key, value in values.items()}


def _run_config(msg: Message, context: Context) -> tuple[dict, int]:
    """The resolved run config (message over node context over defaults) and the round."""
    sent = dict(msg.content["config"]) if "config" in msg.content.config_records else {}
    server_round = int(sent.pop("server-round", 1))
    return resolve_run_config({**context.run_config, **sent}), server_round


def _local_data(context: Context, config: dict):
    """``(node_index, task, train, validation)`` of this node's data.

    Node config: ``partition-id`` and ``num-partitions`` select a partition of the run's
    ``data`` (both or neither: neither means the whole training split, e.g. a node's own
    private data); an optional ``data`` key replaces the run's source with a node-local one.
    The node index (for seeds) is the partition id, else the node id.
    """
    node = context.node_config
    given = [k for k in ("partition-id", "num-partitions") if k in node]
    if len(given) == 1:
        raise ValueError(
            f"node {context.node_id}: node config has {given[0]} only; start the SuperNode with "
            "--node-config 'partition-id=<i> num-partitions=<n>'"
        )
    task = task_from_config({**config, "data": node.get("data", config["data"])})
    if given:
        node_index = int(node["partition-id"])
        data = task.partition(
            int(node["num-partitions"]),
            node_index,
            config["partitioner"],
            config["dirichlet-alpha"],
            config["seed"],
        )
    else:
        node_index, data = context.node_id % 2**31, task.train
    train_data, validation = data.split(VALIDATION_FRACTION, seed=config["seed"] + node_index)
    return node_index, task, train_data, validation
