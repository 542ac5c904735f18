"""A federated language-model benchmark: K causal LMs, each trained on its own part of a text.

The text (Tiny Shakespeare by default: plays one after the other) is tokenised once and cut into
K contiguous segments, one per client, so that clients see different plays and speakers (a real
shift). Each segment's last ``--own-test`` share is that client's own test split; the union of
the K own test splits is the union test split. The server holds ``proxy-size`` blocks drawn
evenly from the clients' training parts (removed from them) for learned refinement and
distillation. Every client starts from its own initialisation (seed ``100·seed + 1 + k``) and
trains ``local-epochs`` on its part. Reported, as mean next-token loss (nats) on the union test
split and on each client's own split:

* every client, the best client (lowest union loss),
* FedAvg (example-weighted mean), aligned (the ServerApp's data-free weight matching with the
  run config's options), aligned + learned (its learned refinement on the proxy split, sized by
  ``refine-budget``), aligned + learned + distilled and FedAvg + distilled (ensemble distillation on
  the proxy split, ``distill-steps``), the logit ensemble (K times the inference cost),
* with ``--rounds R``: R more rounds of local training (``--round-epochs``) and plain averaging from
  the best one-shot merge, against R + 1 FedAvg rounds from one shared initialisation with the same
  total local epochs (:func:`even_split`).

Models come from the run config's ``hf-config`` (a Hugging Face model type sized by ``model.*``),
one row per ``--families`` entry::

    python -m fedbasin.benchmarks.federated_lm --text ../shared/data/tinyshakespeare/input.txt \\
        --tokenizer ../shared/data/gpt2_tokenizer --families gpt2,llama --out runs/federated_lm
"""

from __future__ import annotations

import argparse
import json
import pickle
import time
from pathlib import Path

import torch

LM_DEFAULTS = {"block-size": 64, "model.dim": 64, "model.depth": 2, "model.heads": 4, "model.mlp-dim": 256,
               "local-epochs": 3, "lr": 0.003, "batch-size": 16, "proxy-size": 200, "distill-steps": 300,
               "refine-budget": 120.0}
FAMILY_DEFAULTS = {"llama": {"model.kv-heads": 2}, "mistral": {"model.kv-heads": 2}, "qwen2": {"model.kv-heads": 2}}


def concat(splits):
    from fedbasin.data.task import Split

    return Split(torch.cat([s.inputs for s in splits]), torch.cat([s.targets for s in splits]))


def client_parts(task, clients: int, own_test: float, proxy_size: int, seed: int):
    """``(train parts, own test parts, proxy)``: the text's blocks in order (train then test split)
    cut into ``clients`` contiguous segments; each segment's last ``own_test`` share is its own test
    part; ``proxy_size // clients`` random blocks of each remaining part go to the server's proxy."""
    blocks = concat([task.train, task.test])
    n, per_client = len(blocks), proxy_size // clients
    generator = torch.Generator().manual_seed(seed)
    trains, tests, proxies = [], [], []
    for k in range(clients):
        segment = blocks.subset(torch.arange(k * n // clients, (k + 1) * n // clients))
        cut = len(segment) - max(1, int(own_test * len(segment)))
        order = torch.randperm(cut, generator=generator)
        if cut - per_client < 1:
            raise ValueError(f"client {k}: {cut} training blocks cannot give {per_client} to the proxy")
        proxies.append(segment.subset(order[:per_client].sort().values))
        trains.append(segment.subset(order[per_client:].sort().values))
        tests.append(segment.subset(torch.arange(cut, len(segment))))
    return trains, tests, concat(proxies) if per_client else None


def even_split(total: int, parts: int) -> list[int]:
    """``total`` local epochs over ``parts`` rounds, as evenly as whole epochs allow (earlier rounds
    take the remainder): the FedAvg arm trains exactly as many epochs as the one-shot arm."""
    return [total // parts + (r < total % parts) for r in range(parts)]


def cached(path: Path | None, compute, key: dict):
    """``compute()``'s result, kept in ``path`` (written atomically) with ``key`` and reused while the
    stored key is the same (trained clients survive a later failure and a rerun; the key leaves out the
    server's options, :func:`~fedbasin.benchmarks.oneshot.client_cache_key`)."""
    from fedbasin.atomic import atomic_write

    key = json.loads(json.dumps(key, sort_keys=True, default=str))
    if path is not None:
        try:
            stored = torch.load(path, weights_only=True)
            if stored["key"] == key:
                return stored["value"]
        except (OSError, RuntimeError, KeyError, TypeError, EOFError, pickle.UnpicklingError):
            pass
    value = compute()
    if path is not None:
        atomic_write(path, lambda tmp: torch.save({"key": key, "value": value}, tmp))
    return value


def federated_lm(config: dict, clients: int, own_test: float = 0.1, rounds: int = 0, round_epochs: int = 1,
                 progress: bool = True, cache: Path | None = None) -> dict:
    """One benchmark row for one run config (``hf-config`` names the family); see the module docstring.
    ``cache``: a file keeping the trained clients for a rerun with the same settings."""
    from fedbasin.alignment import average_states, merge, refined_merge
    from fedbasin.benchmarks.oneshot import client_cache_key
    from fedbasin.config import eval_batch_size, model_adapter, model_from_config, task_from_config
    from fedbasin.data.task import Task
    from fedbasin.options import from_run_config, resolve_match
    from fedbasin.server.distill import LogitEnsemble
    from fedbasin.server.server_app import distils, kind_of, make_distiller, make_refiner, refines
    from fedbasin.training import evaluate, resolve_device, train

    started = time.perf_counter()
    device = resolve_device(config["device"])
    source = task_from_config({**config, "proxy-size": 0})
    trains, tests, proxy = client_parts(source, clients, own_test, config["proxy-size"], config["seed"])
    task = Task(source.name, source.family, source.model_overrides, concat(trains), concat(tests), proxy,
                tokenizer=source.tokenizer)
    module = model_from_config(task, config, seed=0)
    adapter = model_adapter(task, module)[1]
    spec = adapter.spec
    batch = eval_batch_size(task, module)  # one batch's logits stay small (50k-token vocabularies)

    def losses(model, batch_size: int = batch) -> dict:
        return {"union": evaluate(model, task.test, device, batch_size)["loss"],
                "own": [evaluate(model, test, device, batch_size)["loss"] for test in tests]}

    def of_state(state: dict) -> dict:
        module.load_state_dict(adapter.from_standard(state))
        return losses(module)

    def local_training(starts: list[dict] | None, epochs: int, seed: int) -> tuple[list[dict], list[float]]:
        states, seconds = [], []
        for k in range(clients):
            model = model_from_config(task, config, seed=100 * config["seed"] + 1 + k)
            if starts is not None:
                model.load_state_dict(adapter.from_standard(starts[k]))
            t0 = time.perf_counter()
            train(model, trains[k], epochs=epochs, lr=config["lr"], batch_size=config["batch-size"], device=device,
                  seed=seed + k, weight_decay=config["weight-decay"], progress=progress)
            seconds.append(time.perf_counter() - t0)
            states.append({key: v.detach().cpu().clone() for key, v in adapter.to_standard(model.state_dict()).items()})
        return states, seconds

    states, train_seconds = cached(cache, lambda: local_training(None, config["local-epochs"], 1000 * config["seed"]),
                                   {**client_cache_key(config, clients), "own_test": own_test})
    weights = [float(len(t)) for t in trains]
    row = {"family": config["hf-config"], "clients": clients, "blocks": [len(t) for t in trains],
           "union_test_blocks": len(task.test), "proxy_blocks": len(proxy) if proxy is not None else 0,
           "train_seconds": train_seconds}
    row["client"] = [of_state(s) for s in states]
    best = min(range(clients), key=lambda k: row["client"][k]["union"])
    row["best_client"] = {"index": best, **row["client"][best]}
    members = []
    for state in states:
        member = model_from_config(task, config, seed=0)
        member.load_state_dict(adapter.from_standard(state))
        members.append(member)
    row["ensemble"] = losses(LogitEnsemble(members), max(1, batch // clients))
    del members
    merges = {"FedAvg": average_states(states, weights)}
    reference = max(range(clients), key=weights.__getitem__)
    match = resolve_match(from_run_config(config)[0], kind_of(task, module))
    t0 = time.perf_counter()
    merges["aligned"] = merge(spec, [dict(s) for s in states], weights, reference, match=match).state
    row["align_seconds"] = time.perf_counter() - t0
    if refines(config, task):  # the ServerApp's rules: a proxy split and refine-steps > 0 or auto with a budget
        refine = make_refiner(spec, module, task, config, adapter.from_standard)
        t0 = time.perf_counter()
        merges["aligned + learned"], refined = refined_merge(spec, [dict(s) for s in states], weights, reference,
                                                             refine)
        row["refine_seconds"], row["refine"] = time.perf_counter() - t0, refined.summary()
    if distils(config, task):  # distill-steps > 0, or auto with a budget and a proxy split
        distill = make_distiller(module, task, config, adapter)
        for name in ("aligned + learned" if "aligned + learned" in merges else "aligned", "FedAvg"):
            t0 = time.perf_counter()
            result = distill(merges[name], states)
            merges[f"{name} + distilled"] = result.state
            row[f"distill_seconds_{name}"] = time.perf_counter() - t0
    row["merges"] = {name: of_state(state) for name, state in merges.items()}
    if rounds > 0:
        start = min(merges, key=lambda name: row["merges"][name]["union"])
        total = config["local-epochs"] + rounds * round_epochs
        shared = {k: v.detach().clone() for k, v in adapter.to_standard(
            model_from_config(task, config, seed=100 * config["seed"]).state_dict()).items()}
        arms = {f"from {start}": ([merges[start]], [round_epochs] * rounds),
                "FedAvg, shared init": ([shared], even_split(total, rounds + 1))}
        row["further"] = {"epochs_total": total}
        for name, (history, schedule) in arms.items():
            for r, epochs in enumerate(schedule, start=1):
                trained, _ = local_training([history[-1]] * clients, epochs, 1000 * (config["seed"] + r))
                history.append(average_states(trained, weights))
            row["further"][name] = {"epochs": schedule, "union": [of_state(s)["union"] for s in history[1:]]}
    row["seconds"] = time.perf_counter() - started
    return row


def markdown(rows: list[dict]) -> str:
    """Union-test loss of every model; each client also on its own split (in parentheses)."""
    names = list(dict.fromkeys(name for row in rows for name in row["merges"]))  # in the order computed
    lines = ["| family | clients: union (own) | best client | " + " | ".join(names) + " | ensemble |",
             "|---|---|---|" + "---|" * (len(names) + 1)]
    for row in rows:
        clients = ", ".join(f"{c['union']:.3f} ({c['own'][k]:.3f})" for k, c in enumerate(row["client"]))
        merged = [f"{row['merges'][n]['union']:.3f}" if n in row["merges"] else "—" for n in names]
        lines.append(f"| {row['family']} | {clients} | {row['best_client']['union']:.3f} | " + " | ".join(merged)
                     + f" | {row['ensemble']['union']:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fedbasin.benchmarks.federated_lm", description=__doc__.splitlines()[0])
    p.add_argument("--text", default="../shared/data/tinyshakespeare/input.txt", help="a UTF-8 text file")
    p.add_argument("--tokenizer", default="../shared/data/gpt2_tokenizer", help="a Hugging Face tokenizer directory")
    p.add_argument("--families", default="gpt2,llama", help="hf-config model types, comma-separated")
    p.add_argument("--clients", type=int, default=4, help="K clients (default 4)")
    p.add_argument("--own-test", type=float, default=0.1, help="each segment's share kept as its own test split")
    p.add_argument("--rounds", type=int, default=0, help="further rounds from the best one-shot merge (default 0)")
    p.add_argument("--round-epochs", type=int, default=1, help="local epochs per further round (default 1)")
    p.add_argument("--run-config", default="", help=f"run-config overrides (defaults: {LM_DEFAULTS})")
    p.add_argument("--out", default="runs/federated_lm/results.json", help="JSON output")
    args = p.parse_args(argv)
    from fedbasin.config import resolve_run_config, task_from_config
    from fedbasin.server.outputs import write_json_atomic
    from fedbasin.simulate import parse_run_config

    torch.set_num_threads(1)
    try:  # every bad value is refused before any training
        if args.clients < 2 or args.rounds < 0 or args.round_epochs < 1 or not 0 < args.own_test < 1:
            raise ValueError("--clients must be >= 2, --rounds >= 0, --round-epochs >= 1, 0 < --own-test < 1")
        overrides = parse_run_config(args.run_config)
        configs = []
        for family in [f.strip() for f in args.families.split(",") if f.strip()]:
            config = resolve_run_config({**LM_DEFAULTS, **FAMILY_DEFAULTS.get(family, {}), **overrides,
                                         "data": f"text:{args.text}", "tokenizer": args.tokenizer,
                                         "hf-config": family})
            configs.append(config)
        if not configs:
            raise ValueError("--families is empty")
        task_from_config({**configs[0], "proxy-size": 0})  # the text and the tokenizer load
    except (ValueError, FileNotFoundError, OSError) as error:
        p.error(str(error).splitlines()[0])
    rows = []
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    for config in configs:
        cache = Path(args.out).with_name(f"{Path(args.out).stem}-{config['hf-config']}-clients.pt")
        rows.append(federated_lm(config, args.clients, args.own_test, args.rounds, args.round_epochs, cache=cache))
        print(markdown(rows[-1:]).splitlines()[-1], flush=True)
    table = markdown(rows)
    print("\n" + table)
    out = Path(args.out)
    write_json_atomic(out, {"args": vars(args), "run_configs": configs, "rows": rows})
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
