"""Merging 3–4 independently trained models: loss at the centroid and over the simplex.

    python -m fedbasin.benchmarks.many --task digits --models 4 --out runs/many

Methods compared at the centroid (equal weights): vanilla averaging, alignment to one reference,
universe matching, and learned refinement on proxy data (λ ~ Dirichlet(1)); then the learned
centroid (and, as a control, the vanilla one) after ensemble distillation of the models' mean
logits on the same proxy data (:func:`fedbasin.server.distill.ensemble_distill`, keep-best on the
same selection split). The logit ensemble itself (K× the inference cost) is the ceiling. For the
first three models the test loss over the simplex ``Σ λ_k θ_k`` is drawn as heat maps (PNG).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from fedbasin.alignment import (
    average_states,
    canonicalize,
    learned_refine,
    merge,
    proxy_streams,
    to_gauge,
)
from fedbasin.benchmarks.barriers import TASKS
from fedbasin.checkpoint import load_checkpoint, save_checkpoint
from fedbasin.data import load_task
from fedbasin.models import build_model, make_config
from fedbasin.server.distill import LogitEnsemble, ensemble_distill
from fedbasin.training import cross_entropy, evaluate, train


def trained_models(name: str, count: int, task, out: Path) -> list:
    spec = TASKS[name]
    config = make_config(task.family, {**spec["model"], **task.model_overrides})
    checkpoints = []
    for seed in range(count):
        path = out / name / f"seed{seed}"
        if not (path / "config.json").exists():
            model = build_model(task.family, config, seed=seed)
            train(model, task.train, epochs=spec["epochs"], lr=spec["lr"], batch_size=spec["batch"], seed=seed)
            save_checkpoint(path, task.family, config, model.state_dict())
        checkpoints.append(load_checkpoint(path))
    return checkpoints


def simplex_points(steps: int) -> list[tuple[float, float, float]]:
    return [(i / steps, j / steps, (steps - i - j) / steps) for i in range(steps + 1) for j in range(steps + 1 - i)]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="digits", choices=sorted(TASKS))
    parser.add_argument("--models", type=int, default=4)
    parser.add_argument("--refine-steps", type=int, default=200)
    parser.add_argument("--distill-steps", type=int, default=1000, help="ensemble distillation steps (0: skip)")
    parser.add_argument("--distill-examples", type=int, default=0,
                        help="training examples distillation uses (60%% train / 20%% select / 20%% report; "
                        "0: the whole training split)")
    parser.add_argument("--simplex-steps", type=int, default=10)
    parser.add_argument("--cifar", default="../shared/data/cifar10")
    parser.add_argument("--text", default="../shared/data/tinyshakespeare/input.txt")
    parser.add_argument("--out", default="runs/many")
    args = parser.parse_args(argv)
    out = Path(args.out)
    t_start = time.perf_counter()
    spec_t = TASKS[args.task]
    task = load_task(spec_t["source"].format(cifar=args.cifar, text=args.text), max_train_examples=spec_t["max_train"])
    evaluation = task.test
    if spec_t["eval_examples"] and len(evaluation) > spec_t["eval_examples"]:
        evaluation = evaluation.subset(torch.arange(spec_t["eval_examples"]))
    checkpoints = trained_models(args.task, args.models, task, out)
    ref = checkpoints[0]
    spec, family, config = ref.spec, ref.family, ref.config
    states = [c.state for c in checkpoints]

    def metrics(state):
        model = build_model(family, config)
        model.load_state_dict(state)
        return task.evaluate(model, evaluation)

    results = {"task": args.task, "models": args.models, "individual": [metrics(s) for s in states], "centroid": {}}
    timings = {}
    t0 = time.perf_counter()
    canon_ref = canonicalize(spec, states[0])
    aligned_once = merge(spec, states, universe_iterations=1)
    timings["reference"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    universe = merge(spec, states, universe_iterations=5)
    timings["universe"] = time.perf_counter() - t0
    proxy = task.train.subset(torch.arange(min(512, len(task.train))))
    data = proxy_streams(proxy, 64, seed=0)
    refined = learned_refine(spec, build_model(family, config), states[0], states[1:], cross_entropy,
                             data.batches, data.selection, data.evaluation,
                             steps=args.refine_steps, lr=1e-2, eval_every=10, alpha=1.0)
    timings["learned"] = refined.seconds
    universe_refined = learned_refine(spec, build_model(family, config), states[0], states[1:], cross_entropy,
                                      proxy_streams(proxy, 64, seed=0).batches, data.selection, data.evaluation,
                                      steps=args.refine_steps, lr=1e-2, eval_every=10, alpha=1.0,
                                      universe_iterations=5)
    timings["universe+learned"] = universe_refined.seconds
    learned_canonical = [canon_ref.state, *refined.canonical]
    merged = {
        "vanilla": average_states(states, [1.0] * len(states)),
        "reference": aligned_once.state,
        "universe": universe.state,
        "learned": to_gauge(spec, average_states(learned_canonical, [1.0] * len(states)), canon_ref.gains),
        "universe+learned": to_gauge(spec, average_states([universe_refined.reference_canonical,
                                                           *universe_refined.canonical], [1.0] * len(states)),
                                     canon_ref.gains),
    }
    if args.distill_steps > 0:
        transfer = task.train.subset(torch.arange(min(args.distill_examples or len(task.train), len(task.train))))
        for name, start in (("learned + distilled", "learned"), ("vanilla + distilled", "vanilla")):
            split = proxy_streams(transfer, 64, seed=0)
            distilled = ensemble_distill(build_model(family, config), merged[start], states, cross_entropy,
                                         split.batches, split.selection, split.evaluation,
                                         steps=args.distill_steps, lr=1e-3, temperature=3.0)
            merged[name] = distilled.state
            timings[name] = timings.get(start, 0.0) + distilled.seconds
            results.setdefault("distill", {})[name] = distilled.summary()
    for name, state in merged.items():
        results["centroid"][name] = {**metrics(state), "seconds": round(timings.get(name, 0.0), 2)}
    members = []
    for state in states:
        members.append(build_model(family, config))
        members[-1].load_state_dict(state)
    results["ensemble"] = evaluate(LogitEnsemble(members), evaluation)
    results["universe_change"] = universe.universe_change

    # simplex over the first three models (reference gauge, so plain averages are canonical paths)
    universe_members = [m.canonical for m in universe.matches]
    if len(universe_members) < len(states):  # stopped after the first pass: the reference was not re-aligned
        universe_members = [canon_ref.state, *universe_members]
    members = {
        "vanilla": states[:3],
        "universe": [to_gauge(spec, s, canon_ref.gains) for s in universe_members[:3]],
        "learned": [to_gauge(spec, s, canon_ref.gains) for s in learned_canonical[:3]],
    }
    if args.models != 3:
        members.pop("learned")  # learned maps were optimised for all models' simplex, not the first three
    points = simplex_points(args.simplex_steps)
    results["simplex"] = {
        name: [[*p, metrics(average_states(trio, list(p)))["loss"]] for p in points if sum(p) > 0]
        for name, trio in members.items()
    }
    results["seconds"] = round(time.perf_counter() - t_start, 1)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.task}_results.json").write_text(json.dumps(results, indent=1))
    plot_simplex(results["simplex"], out / f"{args.task}_simplex.png")
    print(markdown(results))
    return results


def markdown(results: dict) -> str:
    lines = ["| method | centroid test loss | centroid test accuracy | time (s) |", "|---|---|---|---|"]
    for name, r in results["centroid"].items():
        lines.append(f"| {name} | {r['loss']:.3f} | {r['accuracy']:.3f} | {r['seconds']} |")
    accs = ", ".join(f"{r['accuracy']:.3f}" for r in results["individual"])
    ceiling = results.get("ensemble")
    ceiling = f"; logit ensemble (K× inference): accuracy {ceiling['accuracy']:.3f}" if ceiling else ""
    return "\n".join(lines) + f"\n\nindividual models: accuracy {accs}{ceiling}\n"


def plot_simplex(simplex: dict, path: Path) -> None:
    """One heat map per method of the test loss over the simplex, on a shared colour scale."""
    from fedbasin.plots import _figure, save_figure

    plt = _figure()
    fig, axes = plt.subplots(1, len(simplex), figsize=(4.2 * len(simplex), 4.2), squeeze=False)
    values = [p[3] for pts in simplex.values() for p in pts]
    levels = [min(values) + (max(values) - min(values)) * i / 20 for i in range(21)]
    for ax, (name, pts) in zip(axes[0], simplex.items()):
        x = [p[1] + p[2] / 2 for p in pts]  # barycentric → 2-D (model 0 at (0,0), 1 at (1,0), 2 at (½,√3/2))
        y = [p[2] * 3**0.5 / 2 for p in pts]
        filled = ax.tricontourf(x, y, [p[3] for p in pts], levels=levels, cmap="viridis")
        ax.set_title(f"{name}", fontsize=10, pad=16)
        ax.set_aspect("equal")
        ax.axis("off")
        for (tx, ty), label in zip(((0, 0), (1, 0), (0.5, 3**0.5 / 2)), ("θ₀", "θ₁", "θ₂")):
            ax.annotate(label, (tx, ty), ha="center", va="top" if ty == 0 else "bottom")
    fig.colorbar(filled, ax=axes[0].tolist(), shrink=0.8, label="test loss")
    save_figure(fig, path)
    plt.close(fig)


if __name__ == "__main__":
    main()
