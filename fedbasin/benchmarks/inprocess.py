"""The fedbasin ServerApp and ClientApp in one process, without Flower's transport.

:func:`run_in_process` runs :func:`fedbasin.server.server_app.run_server` (the ServerApp's whole
round loop: ``AlignedFedAvg``, refinement, distillation, outputs) against an
:class:`InProcessGrid` whose K virtual nodes answer every message at once by calling the
ClientApp with the node config a simulation gives them (``partition-id``, ``num-partitions``).
No SuperLink, no Ray, no subprocesses: a round costs the clients' training and the merge, so
benchmarks that need hundreds of runs (``fedbasin.benchmarks.regime``) can afford them.

It is the same computation as ``fedbasin simulate``: the aggregate is a function of the set of
replies (``AlignedFedAvg`` orders them by content) and clients seed from the run seed, their
partition id and the round, and each client trains on one thread as a simulated one does (one CPU
each: floats summed in the same order), so a seeded run gives ``fedbasin simulate``'s per-round
figures bit for bit (``tests/test_simulation.py`` checks it). What it does not exercise: message
serialisation, timeouts, node failures, parallel clients (``round_seconds`` here is the sum of
the clients' times, not the slowest's).
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterable

import torch
from flwr.app import Context, Message, RecordDict
from flwr.serverapp import Grid
from flwr.supercore.task_identity import TaskIdentity

from fedbasin.alignment.matching import one_thread

RUN_ID = 1


class InProcessGrid(Grid):
    """Flower's ``Grid`` over ``num_nodes`` virtual nodes living in this process. Node ids are
    drawn from ``node_seed`` (like Flower, at random; the run's figures do not depend on them);
    node ``i`` holds partition ``i`` of ``num_nodes``. A message is handled by ``client_app`` when
    it is pushed; its reply waits to be pulled."""

    def __init__(self, num_nodes: int, client_app=None, node_seed: int = 0):
        if client_app is None:
            from fedbasin.client.client_app import app as client_app
        self.client_app = client_app
        draw = random.Random(node_seed)
        self.contexts: dict[int, Context] = {}
        for index in range(num_nodes):
            node_id = draw.getrandbits(63) or 1
            self.contexts[node_id] = Context(
                run_id=RUN_ID, node_id=node_id, state=RecordDict(), run_config={},
                node_config={"partition-id": index, "num-partitions": num_nodes})
        self._replies: dict[str, Message] = {}
        self._run = None

    def set_run(self, run) -> None:
        self._run = run

    @property
    def run(self):
        return self._run

    def create_message(self, content: RecordDict, message_type: str, dst_node_id: int, group_id: str,
                       ttl: float | None = None) -> Message:
        return Message(content, dst_node_id=dst_node_id, message_type=message_type, group_id=group_id,
                       ttl=ttl)

    def get_node_ids(self) -> Iterable[int]:
        return list(self.contexts)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        ids = []
        for number, message in enumerate(messages):
            message_id = message.metadata.message_id or f"{message.metadata.dst_node_id}-{number}-{id(message)}"
            with one_thread(torch.device("cpu")):  # as a simulated client (client-resources-num-cpus=1)
                self._replies[message_id] = self.client_app(message, self.contexts[message.metadata.dst_node_id])
            ids.append(message_id)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return [self._replies.pop(message_id) for message_id in message_ids if message_id in self._replies]

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        return self.pull_messages(self.push_messages(messages))


@contextlib.contextmanager
def serverapp_identity():
    """Flower creates messages only inside a run: set ``TaskIdentity`` as a ServerApp process
    does (run, task, node ids), and restore what was there."""
    names = ("_run_id", "_task_id", "_node_id")
    saved = {name: getattr(TaskIdentity, name, None) for name in names}
    for name, value in zip(names, (RUN_ID, 1, 0)):
        setattr(TaskIdentity, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(TaskIdentity, name, value)


def run_in_process(config: dict, num_nodes: int, node_seed: int = 0) -> dict:
    """``fedbasin simulate`` with ``num_nodes`` SuperNodes, in this process: the ServerApp's
    round loop on a resolved run ``config`` (:func:`fedbasin.config.resolve_run_config`; its
    ``out-dir`` receives results.json and the checkpoints). Returns the results dict."""
    from fedbasin.server.server_app import run_server

    with serverapp_identity():
        return run_server(InProcessGrid(num_nodes, node_seed=node_seed), config)
