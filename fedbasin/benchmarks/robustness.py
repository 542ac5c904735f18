"""Attack table: one hostile client among K, final test accuracy per aggregation setting.

Every round the server's ``AlignedFedAvg.configure_train`` builds the instructions, the real
ClientApp (``fedbasin.client.client_app``) trains each honest node on its partition, the
attacker rewrites its own reply, and ``AlignedFedAvg.aggregate_train`` aggregates the Flower
Messages: the same code path as a Flower run, without the Ray simulation around it. Attacks
(node K−1; the clean column has K honest nodes):

* ``scaled``: the attacker's trained weights × 1e6;
* ``random``: an untrained model of the same architecture (a new seed every round);
* ``sign-flip``: the update reversed, ``θ_g − (θ_k − θ_g)``;
* ``inflated``: trained on shuffled labels and claiming ``num-examples = 1e12``.

Settings (rows): plain FedAvg and AlignedFedAvg with no defence, then AlignedFedAvg with the
default screening (per-reply magnitude check, capped counts, MAD rule) and with each robust
option on its own. Also reports the screening overhead per round: aggregation seconds of the
default settings against no defence, on the clean replies.

    python -m fedbasin.benchmarks.robustness --out docs/robustness.json

``--colluders``: the colluder table instead, two hostile nodes (the last two) among K = 4 and
K = 5, 4 rounds of 3 local epochs at lr 0.005 (the server holds a proxy split of 100 examples in
every row, so that proxy screening, ``proxy-screening = 0.5``, can be compared), attacks:

* ``inflated``: label-flipped models (trained on ``y → C − 1 − y``) claiming 1e6 examples each
  (= ``max-num-examples``);
* ``other-model``: a model trained from its own seed on other data (the node's partition with
  transposed images), the same every round, with an honest count;
* ``label-flip``: label-flipped models with honest counts.

    python -m fedbasin.benchmarks.robustness --colluders --out docs/robustness_colluders.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.supercore.task_identity import TaskIdentity
from tqdm import tqdm

from fedbasin.alignment import fedbasin_adapter
from fedbasin.client.client_app import app as client_app
from fedbasin.config import model_from_config, resolve_run_config, task_from_config
from fedbasin.data.task import Split
from fedbasin.models import build_model
from fedbasin.server.server_app import proxy_screen_options, robust_options
from fedbasin.strategies import AlignedFedAvg

ATTACKS = ("clean", "scaled", "random", "sign-flip", "inflated")
OFF = {"max-abs-weight": 3e38, "max-num-examples": 0, "max-examples-ratio": 0.0,
       "outlier-threshold": 0.0}
SETTINGS = {  # name: (alignment, run-config overrides of the robust keys)
    "FedAvg, no defence": (False, OFF),
    "FedAvg, default screening": (False, {}),
    "AlignedFedAvg, no defence": (True, OFF),
    "AlignedFedAvg, default screening": (True, {}),
    "Aligned, MAD rule only": (True, {**OFF, "outlier-threshold": 3.5}),
    "Aligned, count caps only": (True, {**OFF, "max-num-examples": 1000000,
                                        "max-examples-ratio": 10.0}),
    "Aligned, clipping (ratio 1) only": (True, {**OFF, "clip-ratio": 1.0}),
    "Aligned, trimmed mean (0.25) only": (True, {**OFF, "aggregator": "trimmed-mean"}),
    "Aligned, coordinate median only": (True, {**OFF, "aggregator": "median"}),
}
RUN_CONFIG = {"local-epochs": 3, "num-server-rounds": 3}
COLLUDER_ATTACKS = ("clean", "inflated", "other-model", "label-flip")
COLLUDER_SETTINGS = {
    "AlignedFedAvg, no defence": (True, OFF),
    "AlignedFedAvg, default screening": (True, {}),
    "AlignedFedAvg, + proxy screening": (True, {"proxy-screening": 0.5}),
    "Aligned, coordinate median only": (True, {**OFF, "aggregator": "median"}),
}
# the proxy split is for proxy screening; distillation (on by default with a proxy split) stays off, as measured
COLLUDER_CONFIG = {**RUN_CONFIG, "num-server-rounds": 4, "lr": 0.005, "proxy-size": 100, "distill-steps": 0}
COLLUDER_COHORTS = ((4, 2), (5, 2))  # (K, colluders)


class Grid:
    """The part of ``flwr.serverapp.Grid`` that ``FedAvg.configure_train`` uses."""

    def __init__(self, node_ids):
        self.node_ids = list(node_ids)

    def get_node_ids(self):
        return self.node_ids


def _digest(arrays: ArrayRecord) -> str:
    h = hashlib.sha1()
    for key, array in arrays.items():
        h.update(key.encode())
        h.update(array.data)
    return h.hexdigest()


class Federation:
    """K nodes running the real ClientApp; honest replies are cached by (node, round, model),
    so every setting shares the identical first round."""

    def __init__(self, overrides: dict, clients: int, hostile: int = 1):
        self.overrides, self.clients = overrides, clients
        config = self.config = resolve_run_config(overrides)
        self.task = task_from_config(config)
        self.model = model_from_config(self.task, config, seed=config["seed"])
        self.spec = fedbasin_adapter(self.task.family, self.model.config).spec
        self.nodes = list(range(1, clients + 1))
        self.hostile = self.nodes[clients - hostile:]  # the attackers: the last ``hostile`` nodes
        self.cache: dict = {}

    def context(self, node: int, run_config: dict | None = None) -> Context:
        return Context(run_id=1, node_id=node, state=RecordDict(), run_config=run_config or {},
                       node_config={"partition-id": node - 1, "num-partitions": self.clients})

    def honest(self, instruction: Message, server_round: int) -> Message:
        node = instruction.metadata.dst_node_id
        key = (node, server_round, _digest(instruction.content["arrays"]))
        if key not in self.cache:
            self.cache[key] = client_app(instruction, self.context(node))
        return self.cache[key]

    def attack(self, kind: str, instruction: Message, server_round: int) -> Message:
        """The attacker's reply to ``instruction``."""
        broadcast = instruction.content["arrays"].to_torch_state_dict()
        trained = self.honest(instruction, server_round)
        state = trained.content["arrays"].to_torch_state_dict()
        n = trained.content["metrics"]["num-examples"]
        if kind == "scaled":
            state = {k: v * 1e6 for k, v in state.items()}
        elif kind == "random":
            seed = 10_000 + server_round
            state = build_model(self.task.family, self.model.config, seed=seed).state_dict()
        elif kind == "sign-flip":
            state = {k: 2 * broadcast[k] - v for k, v in state.items()}
        elif kind == "inflated" and len(self.hostile) > 1:  # colluders: flipped labels, 1e6 each
            state, n = self.relabelled(instruction, server_round, "flip"), 10**6
        elif kind == "inflated":
            state, n = self.relabelled(instruction, server_round, "shuffle"), 10**12
        elif kind == "label-flip":
            state = self.relabelled(instruction, server_round, "flip")
        elif kind == "other-model":
            state = self.other_model(instruction.metadata.dst_node_id)
        content = RecordDict({"arrays": ArrayRecord(state),
                              "metrics": MetricRecord({"train_loss": 1.0, "num-examples": n})})
        return Message(content, reply_to=instruction)

    def relabelled(self, instruction: Message, server_round: int, how: str) -> dict:
        """The attacker's model trained from the broadcast on its partition with shuffled labels
        (``how="shuffle"``) or flipped ones, ``y → C − 1 − y`` (``"flip"``)."""
        node = instruction.metadata.dst_node_id
        key = (how, node, server_round, _digest(instruction.content["arrays"]))
        if key not in self.cache:
            data = self.task.partition(self.clients, node - 1, seed=self.config["seed"])
            if how == "flip":
                targets = int(self.task.train.targets.max()) - data.targets
            else:
                g = torch.Generator().manual_seed(server_round)
                targets = data.targets[torch.randperm(len(data), generator=g)]
            self.cache[key] = self._trained(Split(data.inputs, targets, data.transform),
                                            instruction.content["arrays"].to_torch_state_dict(), server_round)
        return self.cache[key]

    def other_model(self, node: int) -> dict:
        """A model trained from its own seed on other data (the node's partition with transposed
        images) for ``local-epochs``; the same payload every round."""
        key = ("other", node)
        if key not in self.cache:
            data = self.task.partition(self.clients, node - 1, seed=self.config["seed"])
            data = Split(data.inputs.transpose(-1, -2).contiguous(), data.targets, data.transform)
            start = model_from_config(self.task, self.config, seed=7000 + node).state_dict()
            self.cache[key] = self._trained(data, start, 7000 + node)
        return self.cache[key]

    def _trained(self, data: Split, start: dict, seed: int) -> dict:
        from fedbasin.training import train

        model = model_from_config(self.task, self.config, seed=self.config["seed"])
        model.load_state_dict(start)
        train(model, data, epochs=self.config["local-epochs"], lr=self.config["lr"],
              batch_size=self.config["batch-size"], seed=seed, weight_decay=self.config["weight-decay"])
        return {k: v.detach().clone() for k, v in model.state_dict().items()}

    def strategy(self, alignment: bool, robust: dict) -> tuple[AlignedFedAvg, dict]:
        config = resolve_run_config({**self.overrides, **robust, "alignment": alignment})
        strategy = AlignedFedAvg(
            self.spec, alignment=alignment, iterations=config["align-iterations"],
            min_train_nodes=self.clients, min_available_nodes=self.clients,
            **robust_options(config), **proxy_screen_options(self.model, self.task, config),
        )
        return strategy, config

    def overhead(self, repeats: int) -> dict:
        """Median seconds of ``aggregate_train`` on the same clean round-1 replies, without
        defence and with the default screening (interleaved, ``repeats`` times each), and the
        median ``screen_seconds`` (cohort rule) of the screened runs."""
        arrays = ArrayRecord(self.model.state_dict())
        timings: dict = {}
        for _ in range(repeats):
            for name in ("FedAvg, no defence", "FedAvg, default screening",
                         "AlignedFedAvg, no defence", "AlignedFedAvg, default screening"):
                strategy, config = self.strategy(*SETTINGS[name])
                instructions = strategy.configure_train(1, arrays, ConfigRecord(config),
                                                        Grid(self.nodes))
                replies = [self.honest(m, 1) for m in instructions]
                _, metrics = strategy.aggregate_train(1, replies)
                timings.setdefault(name, []).append(
                    (metrics["aggregate_seconds"], metrics.get("screen_seconds", 0.0)))
        return {name: {"aggregate_seconds": statistics.median(t[0] for t in runs),
                       "screen_seconds": statistics.median(t[1] for t in runs)}
                for name, runs in timings.items()}

    def run(self, alignment: bool, robust: dict, attack: str) -> dict:
        """Rounds of configure_train → replies → aggregate_train; final test metrics."""
        strategy, config = self.strategy(alignment, robust)
        arrays = ArrayRecord(self.model.state_dict())
        seconds, excluded, failed, reasons = [], [], 0, []
        for server_round in range(1, config["num-server-rounds"] + 1):
            instructions = list(strategy.configure_train(server_round, arrays, ConfigRecord(config),
                                                         Grid(self.nodes)))
            replies = [
                self.attack(attack, m, server_round)
                if attack != "clean" and m.metadata.dst_node_id in self.hostile
                else self.honest(m, server_round)
                for m in instructions
            ]
            new, metrics = strategy.aggregate_train(server_round, replies)
            arrays = new if new is not None else arrays
            seconds.append(metrics["aggregate_seconds"])
            excluded.append(list(metrics["excluded_nodes"]))
            failed += metrics["round_failed"]
            reasons.append(strategy.screening[server_round]["failed"])
        model = model_from_config(self.task, self.config, seed=0)
        model.load_state_dict(arrays.to_torch_state_dict())
        test = self.task.evaluate(model, "test", "cpu")
        return {"accuracy": test["accuracy"], "loss": test["loss"],
                "aggregate_seconds": seconds, "excluded": excluded, "failed_rounds": failed,
                "failures": reasons}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("docs/robustness.json"))
    parser.add_argument("--repeats", type=int, default=7, help="timing repeats (overhead)")
    parser.add_argument("--overhead-only", action="store_true", help="skip the attack table")
    parser.add_argument("--colluders", action="store_true",
                        help="the colluder table (2 of 4, 2 of 5) instead of the one-attacker table")
    args = parser.parse_args(argv)
    for name, value in (("_run_id", 1), ("_task_id", 1), ("_node_id", 0)):
        setattr(TaskIdentity, name, value)  # a ServerApp process sets its run identity first
    torch.set_num_threads(1)
    started = time.perf_counter()
    if args.colluders:
        return colluders(args, argv, started)
    overrides = {**RUN_CONFIG, "seed": args.seed}
    federation = Federation(overrides, args.clients)
    table: dict = {}
    if not args.overhead_only:
        bar = tqdm(total=len(SETTINGS) * len(ATTACKS), desc="attack table")
        for name, (alignment, robust) in SETTINGS.items():
            table[name] = {}
            for attack in ATTACKS:
                table[name][attack] = federation.run(alignment, robust, attack)
                bar.update()
        bar.close()
    overhead = federation.overhead(args.repeats)
    result = {
        "command": "python -m fedbasin.benchmarks.robustness "
                   + " ".join(sys.argv[1:] if argv is None else argv),
        "seed": args.seed, "clients": args.clients, "run_config": overrides,
        "machine": f"{platform.machine()}, {platform.processor() or platform.system()}, "
                   f"torch {torch.__version__}, 1 thread",
        "wall_seconds": round(time.perf_counter() - started, 1),
        "overhead_per_round_clean": overhead,
        "table": table,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(markdown(result))
    return 0


def colluders(args, argv, started: float) -> int:
    """The colluder table: every setting of :data:`COLLUDER_SETTINGS` against every attack of
    :data:`COLLUDER_ATTACKS`, for each cohort of :data:`COLLUDER_COHORTS`."""
    overrides = {**COLLUDER_CONFIG, "seed": args.seed}
    table: dict = {}
    bar = tqdm(total=len(COLLUDER_COHORTS) * len(COLLUDER_SETTINGS) * len(COLLUDER_ATTACKS), desc="colluders")
    for clients, hostile in COLLUDER_COHORTS:
        federation = Federation(overrides, clients, hostile)
        for name, (alignment, robust) in COLLUDER_SETTINGS.items():
            row = table[f"{name} ({hostile} of {clients})"] = {}
            for attack in COLLUDER_ATTACKS:
                row[attack] = federation.run(alignment, robust, attack)
                row[attack]["hostile"] = federation.hostile
                bar.update()
    bar.close()
    result = {
        "command": "python -m fedbasin.benchmarks.robustness "
                   + " ".join(sys.argv[1:] if argv is None else argv),
        "seed": args.seed, "cohorts": COLLUDER_COHORTS, "run_config": overrides,
        "machine": f"{platform.machine()}, {platform.processor() or platform.system()}, "
                   f"torch {torch.__version__}, 1 thread",
        "wall_seconds": round(time.perf_counter() - started, 1),
        "table": table,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(markdown(result, COLLUDER_ATTACKS))
    return 0


def markdown(result: dict, attacks=ATTACKS) -> str:
    """The accuracy table and the overhead lines as Markdown."""
    lines = ["| setting | " + " | ".join(attacks) + " |", "|---" * (len(attacks) + 1) + "|"]
    for name, row in result["table"].items():
        cells = []
        for attack in attacks:
            run = row[attack]
            hostile = set(run.get("hostile", [result.get("clients")])) if attack != "clean" else set()
            caught = sum(len(hostile & set(e)) for e in run["excluded"])
            honest = sum(len([n for n in e if n not in hostile]) for e in run["excluded"])
            possible = len(hostile) * len(run["excluded"])
            notes = [f"{caught}/{possible} out"] if caught else []
            notes += [f"{honest} honest out"] if honest else []
            notes += [f"{run['failed_rounds']} failed"] if run["failed_rounds"] else []
            cells.append(f"{run['accuracy']:.3f}" + (f" ({', '.join(notes)})" if notes else ""))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines.append("")
    for name, t in result.get("overhead_per_round_clean", {}).items():
        lines.append(f"- {name}: aggregate_train {1000 * t['aggregate_seconds']:.1f} ms per round, "
                     f"of which cohort screening {1000 * t['screen_seconds']:.1f} ms")
    lines.append(f"- wall time {result['wall_seconds']} s")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
