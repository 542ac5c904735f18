"""End to end: a Flower simulation with one hostile node still trains a good global model."""

from __future__ import annotations

import pytest

from fedbasin.config import resolve_run_config
from fedbasin.simulations import simulate


def hostile_client_app(hostile_partition: int, factor: float):
    """fedbasin's ClientApp, except that one partition's node scales its trained weights.
    Built inside a function so that Ray ships it by value to its workers."""
    from flwr.app import ArrayRecord, Message, RecordDict
    from flwr.clientapp import ClientApp

    from fedbasin.client.client_app import evaluate as honest_evaluate
    from fedbasin.client.client_app import train as honest_train

    app = ClientApp()

    @app.train()
    def train(msg, context):
        reply = honest_train(msg, context)
        if context.node_config.get("partition-id") != hostile_partition:
            return reply
        state = reply.content["arrays"].to_torch_state_dict()
        content = RecordDict({"arrays": ArrayRecord({k: v * factor for k, v in state.items()}),
                              "metrics": reply.content["metrics"]})
        return Message(content, reply_to=msg)

    app.evaluate()(honest_evaluate)
    return app


@pytest.mark.slow
def test_a_hostile_node_is_excluded_every_round_and_the_federation_learns(tmp_path):
    config = resolve_run_config({"num-server-rounds": 2, "min-nodes": 3, "out-dir": str(tmp_path / "run")})
    results = simulate.simulate(config, num_supernodes=3, client_app=hostile_client_app(2, 1e6))
    rounds = results["rounds"]
    assert [r["round"] for r in rounds] == [0, 1, 2]
    excluded = [r.get("excluded", []) for r in rounds[1:]]
    assert all(len(e) == 1 for e in excluded), excluded
    assert excluded[0][0]["node"] == excluded[1][0]["node"]  # the same node, every round
    assert all("max_abs_weight" in e[0]["reason"] for e in excluded)
    assert all(r["round_failed"] == 0 and r["num_excluded"] == 1 for r in rounds[1:])
    assert rounds[-1]["test_accuracy"] > rounds[0]["test_accuracy"] + 0.2
    assert results["final"]["usable"] is True
