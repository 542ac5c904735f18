"""Barrier table on independently trained pairs: vanilla vs permutation vs orthogonal matching.

    python -m fedbasin.benchmarks.barriers --tasks digits,cifar10,shakespeare \
        --cifar ../shared/data/cifar10 --text ../shared/data/tinyshakespeare/input.txt --out runs/barriers

For each task two models are trained from different seeds (init and data order) on the same
data; checkpoints are cached under ``OUT/TASK/seedN`` so reruns only evaluate. The loss barrier
``max_λ [L(λθ_A + (1−λ)θ_B) − (λL_A + (1−λ)L_B)]`` is measured on (a slice of) the test split
on an 11-point λ grid. Writes ``OUT/results.json``, ``OUT/barriers.md`` and ``OUT/curves.png``.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from fedbasin.alignment import (
    canonicalize,
    fedbasin_adapter,
    interpolation_curve,
    learned_refine,
    proxy_streams,
    to_gauge,
    weight_match,
)
from fedbasin.checkpoint import load_checkpoint, save_checkpoint
from fedbasin.data import load_task
from fedbasin.models import build_model, make_config
from fedbasin.training import RECIPES, cross_entropy, train


def _bench(source: str, eval_examples: int, recipe: dict) -> dict:
    return dict(source=source, eval_examples=eval_examples, max_train=recipe["max_train_examples"],
                epochs=recipe["epochs"], lr=recipe["lr"], batch=recipe["batch_size"], model=recipe["model"])


# model shapes and training budgets (epochs over the task's training split): `fedbasin train`'s defaults
TASKS = {
    "digits": _bench("digits", 0, RECIPES["digits"]),
    "cifar10": _bench("cifar10:{cifar}", 2000, RECIPES["cifar10"]),
    "shakespeare": _bench("text:{text}", 1000, RECIPES["text"]),
}


def trained_pair(name: str, spec: dict, task, out: Path, progress: bool, seeds=(0, 1)) -> tuple[list, dict]:
    """Two checkpoints trained from ``seeds`` (cached); returns (checkpoints, training info).

    Same recipe as ``fedbasin train --data ... --seed N``, which writes the same weights."""
    config = make_config(task.family, {**spec["model"], **task.model_overrides})
    checkpoints, info = [], {"train_seconds": []}
    for seed in seeds:
        path = out / name / f"seed{seed}"
        if not (path / "config.json").exists():
            t0 = time.perf_counter()
            torch.manual_seed(seed)
            model = build_model(task.family, config, seed=seed)
            stats = train(model, task.train, epochs=spec["epochs"], lr=spec["lr"], batch_size=spec["batch"],
                          seed=seed, progress=progress)
            save_checkpoint(path, task.family, config, model.state_dict())
            (path / "train.json").write_text(json.dumps({**stats, "seconds": time.perf_counter() - t0}))
        info["train_seconds"].append(round(json.loads((path / "train.json").read_text())["seconds"], 1))
        checkpoints.append(load_checkpoint(path))
    info["steps"] = json.loads((out / name / f"seed{seeds[0]}" / "train.json").read_text())["steps"]
    info["config"] = {k: v for k, v in vars(config).items()}
    return checkpoints, info


# learned-refinement settings of the barrier table (``learned_refine`` options, plus the steps and the
# number of training examples used as proxy data); measured in docs/journal/merging-notes.md §7
REFINE_DEFAULTS = dict(steps=1000, proxy_examples=1438, lr=1e-2, group="invertible", mode="best",
                       lambda_range=(0.0, 1.0), schedule="constant", permutations="ste", dual=False,
                       selection_lambdas=(0.5,), batch_size=64, eval_every=10, soft_labels=0.0)
REFINE_OLD = dict(steps=200, proxy_examples=512, lr=1e-2, group="orthogonal", mode="orthogonal",
                  lambda_range=(0.4, 0.6), schedule="constant", permutations="ste", dual=False,
                  selection_lambdas=(0.5,), batch_size=64, eval_every=10, soft_labels=0.0)
# The recorded recipes behind the barrier table's learned rows (docs/benchmarks.md §1): what was run for
# each of the table's pairs, kept so that the table reproduces. A record, keyed by the table's task; nothing
# in the product reads it: fedbasin's defaults are chosen by what the model is (fedbasin.options.KIND_SETTINGS,
# which took the CIFAR-10 recipe for image classifiers and the character GPT's for character LMs) and are
# measured on the suite of pairs (fedbasin.benchmarks.suite). Each was sized to 2 minutes of wall time on 2 CPU
# cores; batch_workers 2 (each batch in two slices on two threads) gives the same figures on any thread count.
# Digits: the new settings with 4,000 steps at lr 3e-3, soft labels (half labels, half the two models' mean
# probabilities) and selection every 100 steps: 0.000 on the three AMD EPYC pairs in 71-79 s (selection every 20
# steps: 0.044 on the pair 0, 1; labels alone: 0.036 on the pair 4, 5). CIFAR-10 and the character GPT: the old
# settings (λ ~ U(0, 1) and the best start measured worse) with a cosine schedule and soft labels; CIFAR-10 960
# steps at lr 5e-3 on 12,000 proxy examples, the midpoint every 160 steps: 0.017 ± 0.001 over refinement seeds 0-2
# in 104-109 s (560 steps on 8,000 examples, one thread: 0.022 ± 0.001); the character GPT 680 steps of 32 blocks,
# the invertible group and λ ~ U(0.2, 0.6), where its curves peak, on 4,000 proxy blocks with selection every 170
# steps, lr 5e-3 and the head maps at 4e-2: 0.0547 / 0.0586 over refinement seeds 0 / 1 in 112 s (lr 1e-2 for
# every map: 0.0643 / 0.0674; docs/journal/merging-notes.md §13)
RECORDED_RECIPES = {"digits": dict(REFINE_DEFAULTS, steps=4000, lr=3e-3, eval_every=100, soft_labels=0.5,
                                  batch_workers=2),
                  "cifar10": dict(REFINE_OLD, steps=960, proxy_examples=12000, lr=5e-3, schedule="cosine",
                                  eval_every=160, soft_labels=0.5, batch_workers=2),
                  "shakespeare": dict(REFINE_OLD, steps=680, batch_size=32, proxy_examples=4000, schedule="cosine",
                                      eval_every=170, group="invertible", lambda_range=(0.2, 0.6), soft_labels=0.5,
                                      lr=5e-3, head_lr=4e-2, batch_workers=2)}


def refine_settings(task: str, choice: str = "recorded", **overrides) -> dict:
    """The refinement settings of the table's ``task``: ``choice`` "new", "old" or "recorded"
    (:data:`RECORDED_RECIPES`, "new" for other tasks; "task" is its older name), then every override that
    is not None."""
    if choice in ("recorded", "task"):
        settings = dict(RECORDED_RECIPES.get(task, REFINE_DEFAULTS))
    else:
        settings = dict(REFINE_DEFAULTS if choice == "new" else REFINE_OLD)
    settings.update({k: tuple(v) if isinstance(v, list) else v for k, v in overrides.items() if v is not None})
    return settings


def refine_pair(a, b, task, proxy_examples: int, weighting: str, **options):
    """Learned refinement of B onto A on the first ``proxy_examples`` training examples (60% train
    the transforms in batches of ``batch_size``, 20% selection, 20% evaluation); ``options`` override
    :data:`REFINE_DEFAULTS` (without its ``proxy_examples``)."""
    options = {**{k: v for k, v in REFINE_DEFAULTS.items() if k != "proxy_examples"}, **options}
    proxy = task.train.subset(torch.arange(min(proxy_examples, len(task.train))))
    data = proxy_streams(proxy, options.pop("batch_size"), seed=0)
    return learned_refine(a.spec, build_model(a.family, a.config), a.state, [b.state], cross_entropy,
                          data.batches, data.selection, data.evaluation, weighting=weighting, **options)


def evaluate_pair(checkpoints, task, eval_split, modes=("permutation", "orthogonal"), weighting="rms",
                  ablation=(), refine_steps=0, proxy_examples=512, refine_options=None) -> dict:
    a, b = checkpoints
    family = a.family

    def metrics(state):
        model = build_model(family, a.config)
        model.load_state_dict(state)
        return task.evaluate(model, eval_split)

    def loss(state):
        return metrics(state)["loss"]

    spec = fedbasin_adapter(family, a.config).spec
    row = {"accuracy_a": metrics(a.state)["accuracy"], "accuracy_b": metrics(b.state)["accuracy"]}
    curves = {"vanilla": interpolation_curve(a.state, b.state, loss)}
    row["midpoint_accuracy"] = {"vanilla": metrics({k: (a.state[k] + b.state[k]) / 2 for k in a.state})["accuracy"]}
    for mode in modes:
        result = weight_match(spec, a.state, b.state, mode=mode, iterations=30, tol=1e-6, weighting=weighting)
        curves[mode] = interpolation_curve(a.state, result.state, loss)
        row[f"{mode}_seconds"] = round(result.seconds, 2)
        row[f"{mode}_iterations"] = result.iterations
        row[f"{mode}_objective"] = [round(result.initial_objective, 4), round(result.objective[-1], 4)]
        mid = {k: (a.state[k] + result.state[k]) / 2 for k in a.state}
        row["midpoint_accuracy"][mode] = metrics(mid)["accuracy"]
    if refine_steps:
        cpu = time.process_time()
        options = {**(refine_options or {}), "steps": refine_steps}
        refined = refine_pair(a, b, task, proxy_examples, weighting, **options)
        row["learned_cpu_seconds"] = round(time.process_time() - cpu, 1)
        # the reference moves too with dual=True: interpolate the two returned endpoints
        ref = to_gauge(spec, refined.reference_canonical, canonicalize(spec, a.state).gains)
        curves["learned"] = interpolation_curve(ref, refined.states[0], loss)
        row["learned_seconds"] = round(refined.seconds, 1)
        row["learned_proxy_loss"] = [round(refined.initial_loss, 4), round(refined.best_loss, 4)]
        row["learned_best_step"] = refined.best_step
        row["learned_start"] = refined.start_mode
        row["learned_evaluation_loss"] = [round(refined.evaluation_initial_loss, 4), round(refined.evaluation_loss, 4)]
        mid = {k: (ref[k] + refined.states[0][k]) / 2 for k in a.state}
        row["midpoint_accuracy"]["learned"] = metrics(mid)["accuracy"]
    row["ablation"] = {}
    for mode in modes:
        for w in ablation:
            result = weight_match(spec, a.state, b.state, mode=mode, iterations=30, tol=1e-6, weighting=w)
            row["ablation"][f"{mode}/{w}"] = interpolation_curve(a.state, result.state, loss, points=5).barrier
    row["barrier"] = {name: c.barrier for name, c in curves.items()}
    row["curves"] = {name: c.to_dict() for name, c in curves.items()}
    return row


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", default="digits,cifar10,shakespeare")
    parser.add_argument("--cifar", default="../shared/data/cifar10")
    parser.add_argument("--text", default="../shared/data/tinyshakespeare/input.txt")
    parser.add_argument("--out", default="runs/barriers")
    parser.add_argument("--progress", action="store_true")
    parser.add_argument("--weighting", default="rms", choices=["cosine", "rms", "uniform"])
    parser.add_argument("--ablation", default="cosine,rms,uniform",
                        help="weightings compared in the ablation table ('' to skip)")
    parser.add_argument("--refine-steps", type=int, help="learned-refinement steps (0: skip; default: "
                        f"{REFINE_DEFAULTS['steps']} with the new settings, {REFINE_OLD['steps']} with the old)")
    parser.add_argument("--proxy-examples", type=int,
                        help="training examples used as proxy data, split 60/20/20 train/selection/evaluation "
                        f"(default: {REFINE_DEFAULTS['proxy_examples']} new, {REFINE_OLD['proxy_examples']} old)")
    parser.add_argument("--refine-settings", choices=["recorded", "task", "new", "old"], default="recorded",
                        help="learned-refinement defaults: 'new' (1000 steps, invertible group, best start, "
                        "λ ~ U(0, 1)), 'old' (200 steps, orthogonal group and start, λ ~ U(0.4, 0.6)) or 'recorded' ('task'): "
                        "the recipes recorded per table row (barriers.RECORDED_RECIPES); the product's "
                        "defaults are measured by fedbasin.benchmarks.suite")
    parser.add_argument("--refine-group", choices=["orthogonal", "invertible"])
    parser.add_argument("--refine-start", choices=["permutation", "orthogonal", "best"])
    parser.add_argument("--refine-lambda", type=float, nargs=2, metavar=("LO", "HI"), help="λ ~ U(LO, HI)")
    parser.add_argument("--refine-schedule", choices=["constant", "cosine"])
    parser.add_argument("--refine-permutations", choices=["ste", "sinkhorn", "fixed"])
    parser.add_argument("--refine-lr", type=float)
    parser.add_argument("--refine-dual", action="store_true", help="both endpoints carry a learned transform")
    parser.add_argument("--from-results", nargs="+", metavar="RESULTS_JSON",
                        help="only combine earlier results.json files into OUT's table and figure")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.from_results:
        return report(combine(args.from_results), out)
    overrides = dict(steps=args.refine_steps, proxy_examples=args.proxy_examples, group=args.refine_group,
                     mode=args.refine_start, lambda_range=args.refine_lambda, schedule=args.refine_schedule,
                     permutations=args.refine_permutations, lr=args.refine_lr, dual=args.refine_dual or None)
    results = {"machine": f"{platform.machine()} {torch.get_num_threads()} threads, torch {torch.__version__}",
               "weighting": args.weighting, "refine_settings": args.refine_settings, "tasks": {}}
    t_start = time.perf_counter()
    for name in args.tasks.split(","):
        spec = TASKS[name]
        t0 = time.perf_counter()
        task = load_task(spec["source"].format(cifar=args.cifar, text=args.text),
                         max_train_examples=spec["max_train"])
        eval_split = task.test
        if spec["eval_examples"] and len(eval_split) > spec["eval_examples"]:
            eval_split = eval_split.subset(torch.arange(spec["eval_examples"]))
        checkpoints, info = trained_pair(name, spec, task, out, args.progress)
        options = refine_settings(name, args.refine_settings, **overrides)
        steps, proxy_examples = options.pop("steps"), options.pop("proxy_examples")
        row = evaluate_pair(checkpoints, task, eval_split, weighting=args.weighting,
                            ablation=[w for w in args.ablation.split(",") if w], refine_steps=steps,
                            proxy_examples=proxy_examples, refine_options=options)
        row["refine"] = {"steps": steps, "proxy_examples": proxy_examples, **options}
        row.update(info, train_examples=len(task.train), eval_examples=len(eval_split), epochs=spec["epochs"],
                   total_seconds=round(time.perf_counter() - t0, 1))
        results["tasks"][name] = row
        print(json.dumps({name: {k: v for k, v in row.items() if k != "curves"}}, indent=1), flush=True)
        (out / "results.json").write_text(json.dumps(results, indent=1))
    results["seconds"] = round(time.perf_counter() - t_start, 1)
    return report(results, out)


def combine(paths: list[str]) -> dict:
    """One results dict from several results.json files (later files win per task)."""
    combined: dict = {"tasks": {}, "sources": paths}
    for path in paths:
        results = json.loads(Path(path).read_text())
        combined["tasks"].update(results["tasks"])
        combined.setdefault("machine", results.get("machine"))
    return combined


def report(results: dict, out: Path) -> dict:
    """Write OUT/results.json, OUT/barriers.md and OUT/curves.png; print the table."""
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "barriers.md").write_text(markdown_table(results))
    plot(results, out / "curves.png")
    print(markdown_table(results))
    return results


def markdown_table(results: dict) -> str:
    lines = [
        "| task | acc A / B | vanilla | permutation | orthogonal | learned | kept orth / learned "
        "| align s (perm / orth / learned) | learned CPU s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results["tasks"].items():
        b = r["barrier"]
        kept = lambda x: f"{x / b['vanilla']:.0%}" if b["vanilla"] > 0 else "n/a"  # noqa: E731
        learned = b.get("learned")
        lines.append(
            f"| {name} | {r['accuracy_a']:.3f} / {r['accuracy_b']:.3f} | {b['vanilla']:.3f} | {b['permutation']:.3f} "
            f"| {b['orthogonal']:.3f} | {'—' if learned is None else f'{learned:.3f}'} "
            f"| {kept(b['orthogonal'])} / {'—' if learned is None else kept(learned)} "
            f"| {r['permutation_seconds']} / {r['orthogonal_seconds']} / {r.get('learned_seconds', '—')} "
            f"| {r.get('learned_cpu_seconds', '—')} |"
        )
    ablation = {name: r["ablation"] for name, r in results["tasks"].items() if r.get("ablation")}
    if ablation:
        keys = sorted({k for a in ablation.values() for k in a})
        lines += ["", "Weighting ablation (barrier, 5-point grid):", "", "| task | " + " | ".join(keys) + " |",
                  "|---|" + "---|" * len(keys)]
        for name, a in ablation.items():
            lines.append(f"| {name} | " + " | ".join(f"{a[k]:.3f}" for k in keys) + " |")
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path) -> None:
    from fedbasin.plots import CURVE_STYLE, _figure, save_figure

    plt = _figure()
    names = list(results["tasks"])
    fig, axes = plt.subplots(1, len(names), figsize=(4.2 * len(names), 3.4), squeeze=False)
    for ax, name in zip(axes[0], names):
        for curve_name, c in results["tasks"][name]["curves"].items():
            ax.plot(c["lambdas"], c["losses"], marker="o", ms=3, label=f"{curve_name} ({c['barrier']:.3f})",
                    **CURVE_STYLE.get(curve_name, {}))
        ax.set_title(name)
        ax.set_xlabel("λ (λ·A + (1−λ)·B)")
        ax.set_ylabel("test loss")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    save_figure(fig, path)
    plt.close(fig)


if __name__ == "__main__":
    main()
