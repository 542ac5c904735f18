"""One-shot federated merging: K clients from independent inits, one long round, then merge.

For every data source and partitioner (IID, Dirichlet(alpha)) this trains K clients from their
own seeds on their partitions (the ClientApp's ``init = "client"`` round 1, run in-process one
client after the other), then reports test accuracy of

* the best single client,
* FedAvg (plain example-weighted average),
* aligned merges (permutation, orthogonal): every client aligned to the largest client, then
  averaged -- what ``AlignedFedAvg`` does in round 1 with ``independent_init``,
* with a proxy split (and ``refine-steps`` not 0; auto: the run config's default, docs/options.md): the
  aligned merge after server-side learned refinement on the proxy
  split (``aligned + learned``),
* with ``distill-steps > 0`` (or ``auto``): that merge (or the aligned one) after server-side ensemble
  distillation on the proxy split (``aligned + distilled``), and, as a control, FedAvg distilled
  the same way (``FedAvg + distilled``) -- the ServerApp's ``make_refiner`` / ``make_distiller``,
* the server alone (``proxy_only``, with distillation): a fresh model trained by the same recipe on the
  proxy labels only (label weight 1): what the federation adds over the server's own data, and
  the same fresh model distilled like the merges (``fresh_distilled``): what a merge's start adds,
* the logit ensemble (mean of the K models' logits; K times the inference cost), and in the JSON
  (``ensemble_probabilities``) the ensemble of the mean of their probabilities,
* with ``synthetic`` > 0 (the grid's ``--synthetic N``): the server without data, N inputs synthesised
  from the clients' models standing in for the proxy split (:func:`data_free`, ``synthetic_*``),

and the time of the alignment step against the round total (slowest client's training, as
clients train in parallel, plus the merge). ``--further-rounds R`` then runs R FedAvg rounds
from every merge against FedAvg from one shared initialisation with the same total local
epochs (``--further-from`` picks which merges to continue: each costs R rounds of K clients).
Writes markdown tables to stdout and JSON to ``--out``::

    python -m fedbasin.benchmarks.oneshot --data digits --further-rounds 3 \
        --run-config "proxy-size=300 refine-steps=200 distill-steps=500"
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import pickle
import time
from pathlib import Path

import torch

from fedbasin.alignment import average_states, fedbasin_adapter, merge, refined_merge
from fedbasin.atomic import atomic_write
from fedbasin.config import model_from_config, resolve_run_config, task_from_config
from fedbasin.server.distill import LogitEnsemble, StateEnsemble
from fedbasin.server.outputs import write_json_atomic
from fedbasin.server.server_app import (
    distill_augment,
    distils,
    make_distiller,
    make_refiner,
    refines,
)
from fedbasin.simulate import parse_run_config
from fedbasin.training import evaluate, resolve_device, train

ONESHOT_DEFAULTS = {"local-epochs": 30, "init": "client"}
MODES = ("permutation", "orthogonal")
COLUMNS = (  # row key, header, format
    ("data", "data", "{}"),
    ("partitioner", "partition", "{}"),
    ("best_client", "best client", "{:.4f}"),
    ("fedavg", "FedAvg", "{:.4f}"),
    ("aligned_permutation", "aligned (perm)", "{:.4f}"),
    ("aligned_orthogonal", "aligned (orth)", "{:.4f}"),
    ("aligned_learned", "aligned + learned", "{}"),
    ("aligned_distilled", "aligned + distilled", "{}"),
    ("fedavg_distilled", "FedAvg + distilled", "{}"),
    ("ensemble", "logit ensemble", "{:.4f}"),
    ("align_seconds_orthogonal", "align s (orth)", "{:.2f}"),
    ("round_seconds_orthogonal", "round s (orth)", "{:.1f}"),
)
FURTHER_FROM = {  # --further-from name (a one-shot merge to continue) -> run-config key it needs > 0
    "fedavg": None,  # the plain example-weighted average
    "aligned": None,  # the aligned merge (run-config symmetry)
    "learned": "refine-steps",  # the aligned merge after learned refinement
    "distilled": "distill-steps",  # the aligned (or learned) merge after ensemble distillation
    "fedavg-distilled": "distill-steps",  # the plain average after ensemble distillation
}
COMPUTED_WHEN = {"refine-steps": refines, "distill-steps": distils}  # (config, task) -> whether that merge is made


def train_clients(task, config: dict, num_clients: int, starts: list[dict] | None, epochs: int,
                  seed: int, device, progress: bool) -> tuple[list[dict], list[float], list[float]]:
    """Every client k trains ``epochs`` on its partition, from ``starts[k]`` (None: its own
    initialisation, seed ``config.seed + 1 + k``); batch order from ``seed + k``. Returns the
    trained states (copies), the example counts and the training seconds."""
    states, weights, seconds = [], [], []
    for k in range(num_clients):
        data = task.partition(
            num_clients, k, config["partitioner"], config["dirichlet-alpha"], config["seed"]
        )
        model = model_from_config(task, config, seed=config["seed"] + 1 + k)
        if starts is not None:
            model.load_state_dict(starts[k])
        started = time.perf_counter()
        train(model, data, epochs=epochs, lr=config["lr"], batch_size=config["batch-size"],
              device=device, seed=seed + k, weight_decay=config["weight-decay"], progress=progress)
        seconds.append(time.perf_counter() - started)
        states.append({key: value.detach().cpu().clone() for key, value in model.state_dict().items()})
        weights.append(float(len(data)))
    return states, weights, seconds


SERVER_ONLY_KEYS = ("num-server-rounds", "alignment", "symmetry", "align-iterations", "universe-iterations",
                    "fraction-train", "fraction-evaluate", "min-nodes", "max-abs-weight", "max-num-examples",
                    "max-examples-ratio", "outlier-threshold", "clip-ratio", "aggregator", "trim-fraction",
                    "out-dir", "resume", "overwrite", "rebuild-results")


def client_cache_key(config: dict, num_clients: int) -> dict:
    """Everything that decides the trained clients: the run config without the server's keys
    (``refine-*``, ``distill-*`` and :data:`SERVER_ONLY_KEYS`), K and the torch version."""
    key = {k: v for k, v in config.items()
           if k not in SERVER_ONLY_KEYS and not k.startswith(("refine-", "distill-"))}
    return {**key, "clients": num_clients, "torch": str(torch.__version__)}


def cached_clients(cache: str | Path | None, task, config: dict, num_clients: int, device,
                   progress: bool) -> tuple[list[dict], list[float], list[float], bool]:
    """:func:`train_clients` for round 1, or its earlier result from ``cache`` (a directory; one
    file per :func:`client_cache_key`, written atomically; a file whose stored key differs is
    retrained, never trusted; an unreadable one is retrained and replaced). Returns states, example counts, training seconds, and whether
    they came from the cache. Server-side options can so be compared on the same clients."""
    if cache is None:
        return (*train_clients(task, config, num_clients, None, config["local-epochs"],
                               config["seed"] + 1000, device, progress), False)
    key = client_cache_key(config, num_clients)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    path = Path(cache) / f"clients-{digest}.pt"
    try:
        stored = torch.load(path, weights_only=True)
        if stored["key"] == key:
            return stored["states"], stored["weights"], stored["seconds"], True
    except FileNotFoundError:
        pass
    except (pickle.UnpicklingError, EOFError, RuntimeError, KeyError, TypeError) as error:  # damaged: retrain
        print(f"[oneshot] clients cache {path} unreadable ({type(error).__name__}); training the clients again")
    states, weights, seconds = train_clients(task, config, num_clients, None, config["local-epochs"],
                                             config["seed"] + 1000, device, progress)
    record = {"key": key, "states": states, "weights": weights, "seconds": seconds}
    atomic_write(path, lambda tmp: torch.save(record, tmp))
    return states, weights, seconds, False


def shared_init_epochs(local_epochs: int, rounds: int, epochs: int) -> int:
    """Local epochs per round of FedAvg from a shared init over ``rounds + 1`` rounds with the
    same total as one-shot + further rounds: ``(local_epochs + rounds · epochs) / (rounds + 1)``."""
    total = local_epochs + rounds * epochs
    if total % (rounds + 1):
        raise ValueError(f"same total compute: local-epochs + {rounds} × {epochs} = {total} local epochs "
                         f"cannot be split evenly over {rounds + 1} FedAvg rounds from a shared init")
    return total // (rounds + 1)


def further_rounds(task, config: dict, num_clients: int, starts: dict[str, dict], rounds: int,
                   epochs: int, device, accuracy, progress: bool) -> dict:
    """``rounds`` more FedAvg rounds (every client trains ``epochs`` from the global model, the
    server takes the example-weighted mean) from each one-shot merge in ``starts``, and plain
    FedAvg from one shared initialisation over ``rounds + 1`` rounds with the same local epochs
    in all (``local-epochs + rounds · epochs``, split evenly). Returns ``{arm: {"epochs": per
    round, "accuracy": test accuracy after every round}}``."""
    shared = model_from_config(task, config, seed=config["seed"]).state_dict()
    arms = {name: ([state], [config["local-epochs"]] + [epochs] * rounds) for name, state in starts.items()}
    per_round = shared_init_epochs(config["local-epochs"], rounds, epochs)
    arms["FedAvg, shared init"] = ([shared], [per_round] * (rounds + 1))
    out = {}
    for name, (history, schedule) in arms.items():
        first = 1 if name in starts else 0  # one-shot arms already hold their round-1 merge
        for r, round_epochs in enumerate(schedule[first:], start=first):
            states, weights, _ = train_clients(task, config, num_clients, [history[-1]] * num_clients,
                                               round_epochs, config["seed"] + 1000 * (r + 1), device, progress)
            history.append(average_states(states, weights))
        out[name] = {"epochs": schedule, "accuracy": [accuracy(s) for s in history[1 - first:]]}
    return out


def check_further_from(names: tuple[str, ...], config: dict, task=None) -> tuple[str, ...]:
    """``names`` (of :data:`FURTHER_FROM`), refused with one line when empty, unknown or (given the
    ``task``) naming a merge that ``config`` does not compute there — by the ServerApp's own rules,
    :func:`~fedbasin.server.server_app.refines` and :func:`~fedbasin.server.server_app.distils`."""
    if not names:
        raise ValueError("--further-from is empty: name at least one of " + ", ".join(FURTHER_FROM))
    for name in names:
        if name not in FURTHER_FROM:
            raise ValueError(f"--further-from {name!r}: expected one of {', '.join(FURTHER_FROM)}")
        needs = FURTHER_FROM[name]
        if needs is not None and task is not None and not COMPUTED_WHEN[needs](config, task):
            raise ValueError(f"--further-from {name}: that merge needs run-config {needs} > 0, or auto with a "
                             "budget and a proxy split (proxy-size >= 10)")
    return names


def data_free(task, config: dict, spec, states: list[dict], weights: list[int], reference: int, aligned: dict,
              fedavg: dict, accuracy, count: int) -> dict:
    """The server without data: ``count`` inputs synthesised from the clients' models
    (:func:`~fedbasin.server.synthesis.synthesize_inputs`, labelled by the classes drawn) stand in for
    the proxy split, and the same refinement and distillation run on them — the ``aligned`` merge
    (+ learned) + distilled, and ``fedavg`` + distilled. Row keys ``synthetic_*``; ``synthetic_agreement``: how often
    the ensemble gives a synthetic input its drawn class."""
    from fedbasin.server.synthesis import synthesize_inputs

    started = time.perf_counter()
    device = resolve_device(config["device"])
    model = model_from_config(task, config, seed=0).to(device)
    shape = (model.config.channels, model.config.image_size, model.config.image_size)
    proxy = synthesize_inputs(model, states, count, shape, model.config.num_classes, seed=config["seed"])
    synthetic = dataclasses.replace(task, proxy=proxy)
    ensemble = StateEnsemble(model, states)
    with torch.no_grad():
        agreement = sum(int((ensemble(x).argmax(-1) == y).sum()) for x, y in proxy.batches(256, device)) / count
    row = {"synthetic_examples": count, "synthetic_agreement": agreement,
           "synthetic_seconds_inputs": time.perf_counter() - started}
    start = aligned
    if refines(config, synthetic):
        refine = make_refiner(spec, model_from_config(task, config, seed=0), synthetic, config)
        start, _ = refined_merge(spec, states, weights, reference, refine)
        row["synthetic_learned"] = accuracy(start)
    if distils(config, synthetic):
        distill = make_distiller(model_from_config(task, config, seed=0), synthetic, config)
        row["synthetic_distilled"] = accuracy(distill(start, states).state)
        row["synthetic_fedavg_distilled"] = accuracy(distill(fedavg, states).state)
    row["synthetic_seconds"] = time.perf_counter() - started
    return row


def one_shot(config: dict, num_clients: int, progress: bool = True, rounds: int = 0,
             further_epochs: int = 10, cache: str | Path | None = None,
             further_from: tuple[str, ...] | None = None, synthetic: int = 0) -> dict:
    """Train ``num_clients`` independent clients on one run config (or take them from ``cache``,
    see :func:`cached_clients`) and compare the merges (and, with ``rounds > 0``, continue from
    them, from every merge or only those named in ``further_from`` (:data:`FURTHER_FROM`), see
    :func:`further_rounds`; with ``synthetic`` > 0 also the data-free server, :func:`data_free`)."""
    task = task_from_config(config)
    if further_from is not None:
        check_further_from(further_from, config, task)
    device = resolve_device(config["device"])
    states, weights, seconds, from_cache = cached_clients(cache, task, config, num_clients, device, progress)
    model = model_from_config(task, config, seed=0)

    def accuracy(state: dict) -> float:
        model.load_state_dict(state)
        return task.evaluate(model, "test", device)["accuracy"]

    singles = [accuracy(s) for s in states]
    spec = fedbasin_adapter(task.family, model.config).spec
    reference = max(range(num_clients), key=weights.__getitem__)
    fedavg = average_states(states, weights)
    row = {
        "data": config["data"],
        "partitioner": config["partitioner"]
        if config["partitioner"] == "iid"
        else f"dirichlet({config['dirichlet-alpha']})",
        "clients": num_clients,
        "examples": weights,
        "client_accuracy": singles,
        "best_client": max(singles),
        "fedavg": accuracy(fedavg),
        "train_seconds": seconds,
        "clients_from_cache": from_cache,
    }
    merges = {"FedAvg": fedavg}
    arms = {"fedavg": "FedAvg"}  # FURTHER_FROM name -> key in merges
    for mode in MODES:
        result = merge(spec, states, weights, reference, mode, config["align-iterations"])
        row[f"aligned_{mode}"] = accuracy(result.state)
        row[f"align_seconds_{mode}"] = result.seconds
        row[f"round_seconds_{mode}"] = max(seconds) + result.seconds
        if mode == config["symmetry"]:
            arms["aligned"] = f"aligned ({mode[:4]})"
            merges[arms["aligned"]] = result.state
    row["aligned_learned"] = row["aligned_distilled"] = row["fedavg_distilled"] = "—"
    if refines(config, task):  # server-side learned refinement on the proxy split
        refine = make_refiner(spec, model_from_config(task, config, seed=0), task, config)
        merges["aligned + learned"], refined = refined_merge(spec, states, weights, reference, refine)
        arms["learned"] = "aligned + learned"
        row["aligned_learned"] = f"{accuracy(merges['aligned + learned']):.4f}"
        row["align_seconds_learned"] = refined.seconds
        row["refine"] = refined.summary()
    if distils(config, task):  # server-side ensemble distillation, from the best aligned merge
        distill = make_distiller(model_from_config(task, config, seed=0), task, config)
        start = "aligned + learned" if "aligned + learned" in merges else list(merges)[1]
        for key, name in (("aligned_distilled", start), ("fedavg_distilled", "FedAvg")):
            distilled = distill(merges[name], states)
            row[key] = f"{accuracy(distilled.state):.4f}"
            row[f"{key}_from"] = name
            row[f"{key}_summary"] = distilled.summary()
            arms["distilled" if key == "aligned_distilled" else "fedavg-distilled"] = f"{name} + distilled"
            merges[f"{name} + distilled"] = distilled.state
        # the server alone: a fresh model trained on the proxy labels by the same recipe (weight 1 on the labels);
        # and the same fresh model distilled as the merges are: what the merge's start adds to the distillation
        fresh = model_from_config(task, config, seed=config["seed"] + 999).state_dict()
        alone = make_distiller(model_from_config(task, config, seed=0), task, {**config, "distill-label-weight": 1.0})
        row["proxy_only"] = accuracy(alone(fresh, states).state)
        row["fresh_distilled"] = accuracy(distill(fresh, states).state)
    if synthetic:
        row.update(data_free(task, config, spec, states, weights, reference, merges[arms["aligned"]], fedavg,
                             accuracy, synthetic))
    members = []
    for state in states:
        member = model_from_config(task, config, seed=0)
        member.load_state_dict(state)
        members.append(member)
    row["ensemble"] = evaluate(LogitEnsemble(members), task.test, device)["accuracy"]
    row["ensemble_probabilities"] = evaluate(LogitEnsemble(members, "probabilities"), task.test, device)["accuracy"]
    if rounds > 0:
        starts = merges if further_from is None else {arms[name]: merges[arms[name]] for name in further_from}
        row["further"] = further_rounds(task, config, num_clients, starts, rounds, further_epochs,
                                        device, accuracy, progress)
    return row


def source_name(data: str) -> str:
    """``cifar10:/some/dir`` → ``cifar10`` (tables name the data, not where it lies)."""
    return data.split(":", 1)[0]


def markdown(rows: list[dict]) -> str:
    lines = [
        "| " + " | ".join(title for _, title, _ in COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS),
    ]
    lines += ["| " + " | ".join(fmt.format(source_name(r[key]) if key == "data" else r[key])
                                for key, _, fmt in COLUMNS) + " |" for r in rows]
    return "\n".join(lines)


def further_markdown(rows: list[dict]) -> str:
    """Test accuracy after every round of :func:`further_rounds`, one line per row and arm."""
    rows = [r for r in rows if "further" in r]
    if not rows:
        return ""
    rounds = len(next(iter(rows[0]["further"].values()))["epochs"])
    lines = ["| data | partition | start | local epochs per round | "
             + " | ".join(f"round {r}" for r in range(1, rounds + 1)) + " |",
             "|" + "---|" * (4 + rounds)]
    for r in rows:
        for arm, result in r["further"].items():
            epochs = " + ".join(str(e) for e in result["epochs"])
            accs = " | ".join(f"{a:.4f}" for a in result["accuracy"])
            lines.append(f"| {source_name(r['data'])} | {r['partitioner']} | {arm} | {epochs} | {accs} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m fedbasin.benchmarks.oneshot", description=__doc__.splitlines()[0]
    )
    p.add_argument("--data", action="append", help="data source (repeatable; default: digits)")
    p.add_argument("--clients", type=int, default=4, help="K clients (default 4)")
    p.add_argument("--alpha", type=float, default=0.5, help="Dirichlet concentration (default 0.5)")
    p.add_argument("--partitioners", default="iid,dirichlet",
                   help="comma-separated, from iid and dirichlet (default: both, one row each)")
    p.add_argument(
        "--run-config",
        default="",
        help=f"run-config overrides (defaults: DEFAULT_RUN_CONFIG with {ONESHOT_DEFAULTS})",
    )
    p.add_argument("--further-rounds", type=int, default=0,
                   help="then this many FedAvg rounds from every one-shot merge, against FedAvg from a "
                   "shared initialisation with the same total local epochs (default 0: none)")
    p.add_argument("--further-epochs", type=int, default=10, help="local epochs per further round (default 10)")
    p.add_argument("--further-from", metavar="NAMES",
                   help="continue only from these one-shot merges, comma-separated, from "
                   + ", ".join(FURTHER_FROM) + " (default: every merge computed; FedAvg from a shared "
                   "initialisation always runs)")
    p.add_argument("--out", default="runs/oneshot/results.json", help="JSON output")
    p.add_argument("--clients-cache", metavar="DIR",
                   help="keep the trained round-1 clients here and reuse them when every client-side "
                   "setting matches (compare server-side options on the same clients)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)  # small models: one thread is fastest on a shared machine
    try:  # bad input is refused before any training
        overrides = {**ONESHOT_DEFAULTS, **parse_run_config(args.run_config)}
        resolve_run_config(overrides)
        partitioners = args.partitioners.split(",")
        if not partitioners or not set(partitioners) <= {"iid", "dirichlet"}:
            raise ValueError(f"--partitioners {args.partitioners!r}: expected iid, dirichlet or both, comma-separated")
        if args.clients < 1 or args.further_rounds < 0 or args.further_epochs < 1:
            raise ValueError("--clients and --further-epochs must be >= 1, --further-rounds >= 0")
        further_from = None
        if args.further_rounds:
            shared_init_epochs(resolve_run_config(overrides)["local-epochs"], args.further_rounds,
                               args.further_epochs)
            if args.further_from is not None:
                further_from = check_further_from(tuple(n.strip() for n in args.further_from.split(",") if n.strip()),
                                                  resolve_run_config(overrides))
        elif args.further_from is not None:
            raise ValueError("--further-from needs --further-rounds >= 1")
        for data in args.data or ["digits"]:  # loads (and caches) every data source up front
            config = resolve_run_config({**overrides, "data": data})
            task = task_from_config(config)
            if config["distill-steps"] != 0:  # > 0 or auto
                distill_augment(task, config)
            if further_from is not None:
                check_further_from(further_from, config, task)
    except (ValueError, FileNotFoundError) as error:
        p.error(str(error))
    rows = []
    for data in args.data or ["digits"]:
        for partitioner in partitioners:
            config = resolve_run_config(
                {
                    **overrides,
                    "data": data,
                    "partitioner": partitioner,
                    "dirichlet-alpha": args.alpha,
                }
            )
            started = time.perf_counter()
            row = one_shot(config, args.clients, rounds=args.further_rounds, further_epochs=args.further_epochs,
                           cache=args.clients_cache, further_from=further_from)
            row["seconds"] = time.perf_counter() - started
            rows.append(row)
            print(markdown(rows[-1:]).splitlines()[-1], flush=True)
    print()
    print(markdown(rows))
    if args.further_rounds:
        print()
        print(further_markdown(rows))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out, {"args": vars(args), "rows": rows})
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
