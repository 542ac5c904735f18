"""Learned-refinement ablation on a trained pair of the barrier table: one JSON line per variant.

    python -m fedbasin.benchmarks.refine_ablation --task digits --seeds 0 1 --out runs/barriers \
        --variant '{"settings": "old"}' --variant '{}' --variant '{"group": "orthogonal"}'

The pair is trained (or reused) exactly as ``fedbasin.benchmarks.barriers`` does (cached under
``OUT/TASK/seedN``). Each variant is a JSON object of :func:`fedbasin.alignment.learned_refine`
options applied over ``barriers.REFINE_DEFAULTS`` (``"settings": "old"`` starts from
``barriers.REFINE_OLD`` instead), plus ``"proxy"`` (training examples used as proxy data, split
60/20/20; default the settings' own). Each line reports the test barrier (11 λ), the midpoint accuracy, the selection and
evaluation losses at the start and of the returned alignment, and wall and CPU seconds.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from fedbasin.benchmarks import barriers
from fedbasin.data import load_task


def run_variant(checkpoints, task, eval_split, variant: dict, default_proxy: int) -> dict:
    """Barrier and timing of one refinement variant (no data-free rows)."""
    options = dict(variant)
    proxy = options.pop("proxy", default_proxy)
    options = barriers.refine_settings("", options.pop("settings", "new"), proxy_examples=proxy, **options)
    proxy, steps = options.pop("proxy_examples"), options.pop("steps")
    row = barriers.evaluate_pair(checkpoints, task, eval_split, modes=(), refine_steps=steps, proxy_examples=proxy,
                                 refine_options=options)
    return {"variant": variant, "barrier": round(row["barrier"]["learned"], 4),
            "midpoint_accuracy": row["midpoint_accuracy"]["learned"], "start": row["learned_start"],
            "selection_loss": row["learned_proxy_loss"], "evaluation_loss": row["learned_evaluation_loss"],
            "best_step": row["learned_best_step"], "wall_seconds": row["learned_seconds"],
            "cpu_seconds": row["learned_cpu_seconds"], "losses": [round(x, 4) for x in row["curves"]["learned"]["losses"]]}


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="digits", choices=sorted(barriers.TASKS))
    parser.add_argument("--seeds", type=int, nargs=2, default=(0, 1))
    parser.add_argument("--variant", action="append", default=[], help="JSON object of options (repeatable)")
    parser.add_argument("--proxy-examples", type=int, help="default: the settings' (1438 new, 512 old); a "
                        "variant's \"proxy\" wins")
    parser.add_argument("--cifar", default="../shared/data/cifar10")
    parser.add_argument("--text", default="../shared/data/tinyshakespeare/input.txt")
    parser.add_argument("--out", default="runs/barriers")
    parser.add_argument("--log", help="append each JSON line to this file too")
    parser.add_argument("--previous-matcher", action="store_true",
                        help="weight matching as its previous iteration (no maps-only sweeps, MLP weights rotated "
                        "with every residual step: matching.INNER_SWEEPS = 0, UNROTATED_MLP = False), to compare "
                        "with results computed before that change")
    args = parser.parse_args(argv)
    if args.previous_matcher:
        from fedbasin.alignment import matching

        matching.INNER_SWEEPS, matching.UNROTATED_MLP = 0, False
    try:
        variants = [json.loads(v) for v in args.variant or ["{}"]]
    except json.JSONDecodeError as exc:
        parser.error(f"--variant is not a JSON object: {exc}")
    spec = barriers.TASKS[args.task]
    task = load_task(spec["source"].format(cifar=args.cifar, text=args.text), max_train_examples=spec["max_train"])
    eval_split = task.test
    if spec["eval_examples"] and len(eval_split) > spec["eval_examples"]:
        eval_split = eval_split.subset(torch.arange(spec["eval_examples"]))
    checkpoints, _ = barriers.trained_pair(args.task, spec, task, Path(args.out), False, seeds=tuple(args.seeds))
    rows = []
    for variant in variants:
        row = {"task": args.task, "seeds": list(args.seeds), **({"matcher": "previous"} if args.previous_matcher else {}),
               **run_variant(checkpoints, task, eval_split, variant, args.proxy_examples)}
        line = json.dumps(row)
        print(line, flush=True)
        if args.log:
            with open(args.log, "a") as f:
                f.write(line + "\n")
        rows.append(row)
    return rows


if __name__ == "__main__":
    main()
