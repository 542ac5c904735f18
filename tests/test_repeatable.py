"""AlignedFedAvg's aggregate is a function of the set of replies: neither Flower's node ids (drawn
at random per run) nor the replies' arrival order change a bit of it (docs/flower.md,
"Repeatability"). The end-to-end check, two seeded ``fedbasin simulate`` runs, is in
tests/test_simulation.py."""

from __future__ import annotations

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict

from fedbasin.strategies import AlignedFedAvg
from tests.helpers import VIT, spec_of, trained_like
from tests.test_strategy import StubGrid, base_state, serverapp_identity  # noqa: F401  (autouse)

COUNTS = (100, 130, 120, 100)  # capped at the lower median (100): three clients tie for round 1's reference
LOSSES = (0.1, 0.7, 0.2, 0.3)  # sums whose float rounding depends on the order


def client_states() -> list[dict]:
    """Four independently initialised models (round 1 of init='client')."""
    return [{k: v.detach().clone() for k, v in trained_like("vit", VIT, seed=s, dtype=torch.float32)
             .state_dict().items()} for s in range(1, 5)]


def train_reply(node_id: int, state: dict, count: int, loss: float) -> Message:
    instruction = Message(RecordDict({"config": ConfigRecord()}), dst_node_id=node_id,
                          message_type=MessageType.TRAIN)
    metrics = MetricRecord({"train_loss": loss, "num-examples": count})
    return Message(RecordDict({"arrays": ArrayRecord(state), "metrics": metrics}), reply_to=instruction)


def eval_reply(node_id: int, count: int, loss: float) -> Message:
    instruction = Message(RecordDict(), dst_node_id=node_id, message_type=MessageType.EVALUATE)
    return Message(RecordDict({"m": MetricRecord({"eval_loss": loss, "num-examples": count})}),
                   reply_to=instruction)


def one_round(options: dict, server_round: int, node_ids: list[int], delivery: list[int]):
    """Client ``k`` answers from node ``node_ids[k]``; replies arrive in the order ``delivery``.
    Returns the aggregate's bytes per key, the train metrics and the evaluation metrics."""
    strategy = AlignedFedAvg(spec_of("vit", VIT), min_train_nodes=4, min_available_nodes=4, **options)
    list(strategy.configure_train(server_round, ArrayRecord(base_state()), ConfigRecord(),
                                  StubGrid(node_ids)))
    states = client_states()
    arrays, metrics = strategy.aggregate_train(
        server_round, [train_reply(node_ids[k], states[k], COUNTS[k], LOSSES[k]) for k in delivery])
    evaluated = strategy.aggregate_evaluate(
        server_round, [eval_reply(node_ids[k], COUNTS[k], LOSSES[k] + 1) for k in delivery])
    assert metrics["num_excluded"] == 0 and metrics["round_failed"] == 0
    return ({k: a.numpy().tobytes() for k, a in arrays.items()}, metrics["train_loss"],
            metrics["align_gain"], evaluated["eval_loss"])


@pytest.mark.parametrize("options, server_round", [
    ({"alignment": False}, 2),
    ({"independent_init": True}, 1),  # the reference: one of the three tied clients
    ({"mode": "permutation"}, 2),
], ids=["fedavg", "align-round1-client-init", "align-round2"])
def test_the_aggregate_depends_on_neither_node_ids_nor_arrival_order(options, server_round):
    first = one_round(options, server_round, [11, 22, 33, 44], [0, 1, 2, 3])
    # the same clients behind other node ids (a rerun: Flower draws them anew) and another arrival order
    for node_ids, delivery in (([44, 33, 22, 11], [0, 1, 2, 3]), ([22, 44, 11, 33], [3, 1, 0, 2]),
                               ([11, 22, 33, 44], [2, 3, 1, 0])):
        again = one_round(options, server_round, node_ids, delivery)
        assert again[0] == first[0]  # every array, bit for bit
        assert again[1:] == first[1:]  # train loss, alignment gain, evaluation loss: to the last digit
