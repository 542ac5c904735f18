"""The README's 2-minute GPT-2 learned alignment over refinement seeds, scored on every slice.

For each ``--seeds`` S it runs the README command (``fedbasin align … --refine-seed S``) on the recipe
pair PAIR/seed0, PAIR/seed1 and times it (wall clock of the whole process), then measures each refined
endpoint's barrier (11 λ, λ = 1 is seed 0) with ``glmc_compare --aligned`` on the first 32 test blocks,
on the 141 validation blocks and on all 140 test blocks. Prints one row per seed and the mean ± sample
standard deviation (and range) per slice; ``--out DIR`` keeps the endpoints, the JSON of every
evaluation and ``summary.json``.

    python scripts/gpt2_learned_seeds.py --pair runs/gpt2pair6 --text ../shared/data/tinyshakespeare/input.txt \\
        --out runs/seeds --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

README_OPTIONS = [  # README.md, "learned alignment" row: 800 steps of 8 blocks in about 115 s on 2 cores
    "--refine-group", "invertible", "--refine-lambda", "0.2", "0.6", "--refine-permutations", "fixed",
    "--refine-lr", "0.003", "--refine-head-lr", "0.04", "--refine-schedule", "cosine",
    "--refine-vocabulary", "seen", "--refine-vocabulary-samples", "512", "--refine-vocabulary-batch-samples", "512",
    "--head-weight", "2", "--refine-steps", "800", "--refine-batch-size", "8", "--refine-eval-every", "800",
    "--refine-examples", "2048", "--refine-workers", "2", "--refine-evaluation-fraction", "0",
]


def overridden(base: list[str], extra: list[str]) -> list[str]:
    """``base`` options without those ``extra`` names (flag and values), then ``extra``: the CLI refuses an
    option given twice, so a variant replaces the row's value instead of repeating the flag."""
    named, kept, dropping = {t.partition("=")[0] for t in extra if t.startswith("--")}, [], False
    for token in base:
        if token.startswith("--"):
            dropping = token.partition("=")[0] in named
        if not dropping:
            kept.append(token)
    return kept + extra


SLICES = {"test-32": ["--split", "test", "--max-blocks", "32"], "validation": ["--split", "validation"],
          "test": ["--split", "test"]}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pair", required=True, type=Path, help="folder with seed0/ and seed1/ (gpt2_pair)")
    parser.add_argument("--text", required=True, help="the Tiny Shakespeare text the pair was trained on")
    parser.add_argument("--out", required=True, type=Path, help="folder for the endpoints and results")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="refinement seeds")
    parser.add_argument("--slices", nargs="+", choices=sorted(SLICES), default=list(SLICES))
    parser.add_argument("--extra", default="", help="further align options, one string (a variant of the row)")
    args = parser.parse_args(argv)
    a, b = str(args.pair / "seed0"), str(args.pair / "seed1")
    for path in (a, b):
        if not (Path(path) / "config.json").is_file():
            raise SystemExit(f"gpt2_learned_seeds: {path}/config.json not found (train the pair with gpt2_pair)")
    taken = [str(args.out / f"seed{s}") for s in args.seeds if (args.out / f"seed{s}").exists()]
    if taken:
        raise SystemExit(f"gpt2_learned_seeds: {taken[0]} exists; choose another --out (nothing is overwritten)")
    args.out.mkdir(parents=True, exist_ok=True)
    rows = {}
    for seed in args.seeds:
        endpoint = args.out / f"seed{seed}"
        command = [sys.executable, "-m", "fedbasin.cli", "align", a, b, "--out", str(endpoint),
                   "--seen-tokens", f"text:{args.text}", "--refine-data", f"text:{args.text}",
                   *overridden([*README_OPTIONS, "--refine-seed", str(seed)], args.extra.split())]
        start = time.perf_counter()
        done = subprocess.run(command, stdout=subprocess.PIPE, text=True, check=False)  # progress on stderr
        wall = time.perf_counter() - start
        if done.returncode:
            raise SystemExit(f"gpt2_learned_seeds: align with --refine-seed {seed} exited {done.returncode}")
        refinement = json.loads(done.stdout)["refinement"]
        rows[seed] = {"wall_seconds": round(wall, 1), "best_step": refinement.get("best_step")}
        print(f"seed {seed}: aligned in {wall:.1f} s (best step {rows[seed]['best_step']})", file=sys.stderr, flush=True)
    evaluations = {  # one thread each, side by side: the barriers do not depend on it
        name: subprocess.Popen([sys.executable, "-m", "fedbasin.benchmarks.glmc_compare", a, b, "--text", args.text,
                                "--points", "11", "--skip-vanilla", "--variants", "", "--circuit-variant", "",
                                "--glmc-rows", "", *SLICES[name], "--out", str(args.out / f"{name}.json"),
                                *(f"--aligned=seed{s}={args.out / f'seed{s}'}" for s in args.seeds)],
                               stdout=subprocess.DEVNULL)
        for name in args.slices}
    for name, process in evaluations.items():
        if process.wait():
            raise SystemExit(f"gpt2_learned_seeds: the {name} evaluation exited {process.returncode}")
        measured = json.loads((args.out / f"{name}.json").read_text())["rows"]
        for seed in args.seeds:
            rows[seed][name] = round(measured[f"aligned seed{seed}"]["barrier"], 4)
    summary = {"options": overridden(README_OPTIONS, args.extra.split()), "seeds": rows, "slices": {}}
    for name in ["wall_seconds", *args.slices]:
        values = [rows[s][name] for s in args.seeds]
        spread = statistics.stdev(values) if len(values) > 1 else 0.0
        summary["slices"][name] = {"mean": round(statistics.mean(values), 4), "std": round(spread, 4),
                                   "min": min(values), "max": max(values)}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    print("| seed | " + " | ".join(args.slices) + " | wall s |")
    for seed in args.seeds:
        print(f"| {seed} | " + " | ".join(f"{rows[seed][n]:.4f}" for n in args.slices) + f" | {rows[seed]['wall_seconds']} |")
    digits = {name: 1 if name == "wall_seconds" else 4 for name in summary["slices"]}
    print("| mean ± sd | " + " | ".join(f"{summary['slices'][n]['mean']:.{digits[n]}f} ± {summary['slices'][n]['std']:.{digits[n]}f}"
                                       for n in [*args.slices, "wall_seconds"]) + " |")
    return summary


if __name__ == "__main__":
    main()
