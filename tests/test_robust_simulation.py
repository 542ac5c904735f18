"""End to end: a Flower simulation with one hostile node still trains a good global model."""

from __future__ import annotations

import pytest

from fedbasin.config import resolve_run_config


def run_in_process(config: dict, num_supernodes: int, client_app) -> dict:
    """The fedbasin ServerApp against ``client_app`` in Flower's in-process simulation (the only way
    to put a custom, hostile ClientApp beside it; ``fedbasin simulate`` runs the packaged apps)."""
    import json
    from pathlib import Path

    from flwr.serverapp import ServerApp
    from flwr.simulation import run_simulation

    from fedbasin.server.outputs import RESULTS_FILE
    from fedbasin.server.server_app import run_server

    server_app = ServerApp()

    @server_app.main()
    def main(grid, context) -> None:
        run_server(grid, config)

    run_simulation(server_app=server_app, client_app=client_app, num_supernodes=num_supernodes,
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}})
    return json.loads((Path(config["out-dir"]) / RESULTS_FILE).read_text())


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
    results = run_in_process(config, 3, hostile_client_app(2, 1e6))
    rounds = results["rounds"]
    assert [r["round"] for r in rounds] == [0, 1, 2]
    excluded = [r.get("excluded", []) for r in rounds[1:]]
    assert all(len(e) == 1 for e in excluded), excluded
    assert excluded[0][0]["node"] == excluded[1][0]["node"]  # the same node, every round
    assert all("max_abs_weight" in e[0]["reason"] for e in excluded)
    assert all(r["round_failed"] == 0 and r["num_excluded"] == 1 for r in rounds[1:])
    assert rounds[-1]["test_accuracy"] > rounds[0]["test_accuracy"] + 0.2
    assert results["final"]["usable"] is True
