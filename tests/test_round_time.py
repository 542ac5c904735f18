"""The round-time instrumentation (docs/round_time.md): the ClientApp's replies carry where a
message's time went, the ServerApp times each exchange, and the breakdown adds up to the round."""

from __future__ import annotations

import time

import pytest
from flwr.app import ArrayRecord, Message, MessageType, RecordDict

from fedbasin.config import model_from_config, resolve_run_config, task_from_config
from fedbasin.server.server_app import time_exchanges
from fedbasin.benchmarks.round_time import breakdown

from .test_simulation import ask, node

PARTS = ("wait", "startup", "decode", "encode", "handler")


@pytest.fixture(autouse=True)
def serverapp_identity(monkeypatch):
    """Messages are created inside a run in Flower 1.41 (see tests/test_strategy.py)."""
    from flwr.supercore.task_identity import TaskIdentity

    for name, value in (("_run_id", 7), ("_task_id", 1), ("_node_id", 0)):
        monkeypatch.setattr(TaskIdentity, name, value)


@pytest.mark.parametrize("message_type, prefix", [(MessageType.TRAIN, "train_"), (MessageType.EVALUATE, "eval_")])
def test_client_replies_carry_their_timings(message_type, prefix):
    config = resolve_run_config()
    model = model_from_config(task_from_config(config), config, seed=0)
    before = time.time()
    reply = ask(message_type, ArrayRecord(model.state_dict()), node({"partition-id": 0, "num-partitions": 3}),
                **{"local-epochs": 1, "server-round": 2})
    after = time.time()
    metrics = reply.content["metrics"]
    timings = {part: metrics[f"{prefix}{part}_seconds"] for part in PARTS}
    assert all(value >= 0 for value in timings.values()), timings
    assert timings["handler"] <= after - before  # the handler ran inside this call
    assert timings["wait"] <= after - before + 1e-3  # the message was created just before
    assert timings["startup"] >= timings["wait"]  # this process is older than the message
    assert timings["decode"] + timings["encode"] <= timings["handler"]
    if prefix == "train_":
        assert 0 < metrics["train_seconds"] <= timings["handler"]


class _Grid:
    def send_and_receive(self, messages, *, timeout=None):
        return [m.metadata.message_type for m in messages]


def test_server_times_each_exchange_by_message_type():
    grid = _Grid()
    seconds = time_exchanges(grid)
    messages = [Message(RecordDict(), dst_node_id=i, message_type=MessageType.EVALUATE) for i in (1, 2)]
    assert grid.send_and_receive(iter(messages), timeout=5) == [MessageType.EVALUATE] * 2  # replies pass through
    assert list(seconds) == ["evaluate"] and seconds["evaluate"] >= 0


def test_breakdown_adds_up_to_the_round():
    record = {"round": 2, "round_seconds": 60.0, "train_exchange_seconds": 30.0, "evaluate_exchange_seconds": 20.0,
              "aggregate_seconds": 0.5, "align_seconds": 0.4, "train_seconds": 6.0, "train_wait_seconds": 12.0,
              "train_startup_seconds": 10.0, "train_handler_seconds": 14.0, "train_decode_seconds": 0.01,
              "train_encode_seconds": 0.01}
    parts = breakdown(record)
    exchange = parts["delivery"] + parts["startup"] + parts["handler"] + parts["return"]
    assert exchange == pytest.approx(30.0)
    assert exchange + parts["aggregate"] + parts["eval exchange"] + parts["other"] == pytest.approx(60.0)
    assert parts["strategy %"] == pytest.approx(100 * 0.5 / 60)
