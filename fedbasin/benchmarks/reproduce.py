"""Regenerate the tables of docs/benchmarks.md from the benchmark drivers.

    python -m fedbasin.benchmarks.reproduce                  # every section (see --help for times)
    python -m fedbasin.benchmarks.reproduce --sections barriers --tasks digits

Each section runs its driver into ``OUT/SECTION/`` and replaces the text between the markers
``<!-- reproduce:SECTION -->`` and ``<!-- /reproduce:SECTION -->`` in the document. Results
already in ``OUT`` are reused (trained checkpoints and results files), so a second call only
rewrites the document; ``--rerun`` recomputes them. Loss and accuracy figures are deterministic
for a given machine, torch version and ``OMP_NUM_THREADS=1``; wall times are not.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path

import torch

from fedbasin.atomic import atomic_write
from fedbasin.benchmarks import barriers
from fedbasin.data import load_task

SECTIONS = ("barriers", "barrier-seeds", "many", "many4", "width", "oneshot", "oneshot-seeds", "oneshot-cifar10",
            "oneshot-cifar10-seeds", "oneshot-cifar10-long")
# the clients (refine-steps=0: these tables distil only, as measured before refinement became the default with a
# proxy split); the server's options:
# distillation as measured before mixup and labels became the image default (docs/options.md): pinned off; and
# at Adam 0.002, the image rate before it was sized by the run's steps (500 steps now read 0.00086)
DISTILL_BEFORE_AUTO = "distill-augment=none distill-label-weight=0.0 distill-lr=0.002"
ONESHOT_CIFAR10 = f"max-train-examples=12000 proxy-size=500 local-epochs=10 refine-steps=0 {DISTILL_BEFORE_AUTO}"
ONESHOT_CIFAR10_VARIANTS = (  # (file name, table label, distillation run config), every one on the same cached clients
    ("kl", "KL, 500 steps", "distill-steps=500"),
    ("label", "KL + labels (w 0.5)", "distill-steps=500 distill-label-weight=0.5"),
    ("labelaug", "KL + labels (w 0.5) + crop/flip", "distill-steps=500 distill-label-weight=0.5 distill-augment=crop-flip"),
    ("label02aug", "KL + labels (w 0.2) + crop/flip", "distill-steps=500 distill-label-weight=0.2 distill-augment=crop-flip"),
)
ONESHOT_CIFAR10_SEEDS_DISTILL = ONESHOT_CIFAR10_VARIANTS[-1][2]  # the setting repeated over seeds
ONESHOT_CIFAR10_PROBABILITY_SEEDS = (0, 1, 2)  # runs with distill-teacher=probabilities, both partitions
# the seeds' setting distilled six times longer with the probability teacher (500 steps stop short: docs/journal/merging-notes.md §8)
ONESHOT_CIFAR10_LONG = ("distill-steps=3000 distill-label-weight=0.2 distill-augment=crop-flip "
                        "distill-teacher=probabilities")
# the refinement settings the one-shot tables were measured with (the run config's defaults before the options
# schema chose them by model kind, docs/options.md), pinned so that the sections reproduce those figures
REFINE_BEFORE_AUTO = ("refine-lr=0.01 refine-head-lr=0.0 refine-permutations='ste' refine-group='orthogonal' "
                      "refine-start='symmetry' refine-lambda='0.4,0.6' refine-schedule='constant' refine-soft-labels=0.0 "
                      "refine-soft-label-top-k=0 refine-workers=0 refine-batch-size=16 refine-vocabulary='full' "
                      "refine-vocabulary-samples=0 refine-vocabulary-batch-samples=0 refine-eval-every=10 head-weight=1.0")
ONESHOT_PROXY = f"proxy-size=300 refine-steps=200 distill-steps=500 {REFINE_BEFORE_AUTO} {DISTILL_BEFORE_AUTO}"  # the server's proxy levers, §4
ONESHOT_SEEDS = (0, 1, 2)
SEED_PAIRS = ((0, 1), (2, 3), (4, 5))


def replace_block(text: str, section: str, body: str) -> str:
    """``text`` with the block between the section's markers replaced by ``body``."""
    start, end = f"<!-- reproduce:{section} -->\n", f"<!-- /reproduce:{section} -->"
    pattern = re.compile(rf"{re.escape(start)}.*?{re.escape(end)}", re.DOTALL)
    if not pattern.search(text):
        raise ValueError(f"no '<!-- reproduce:{section} -->' ... '<!-- /reproduce:{section} -->' block in the document")
    return pattern.sub(lambda m: start + body.strip("\n") + "\n" + end, text, count=1)


def _cached(path: Path, rerun: bool, compute) -> dict:
    if rerun or not path.is_file():
        compute()
    return json.loads(path.read_text())


def section_barriers(args, out: Path) -> str:
    """Vanilla / permutation / orthogonal / learned barriers of one trained pair per task."""
    files = []
    for task in args.tasks.split(","):
        where = out / task
        argv = ["--tasks", task, "--out", str(where), "--cifar", args.cifar, "--text", args.text,
                "--ablation", args.ablation] + ([] if args.refine_steps is None else ["--refine-steps", str(args.refine_steps)])
        _cached(where / "results.json", args.rerun, lambda argv=argv: barriers.main(argv))
        files.append(str(where / "results.json"))
    combined = barriers.combine(files)
    if args.figures:
        barriers.report(combined, Path(args.figures))
    return barriers.markdown_table(combined)


def section_barrier_seeds(args, out: Path) -> str:
    """Digits barriers over several independently trained pairs: mean and spread."""
    def compute():
        spec = barriers.TASKS["digits"]
        task = load_task(spec["source"], max_train_examples=spec["max_train"])
        rows = []
        for seeds in SEED_PAIRS:
            checkpoints, _ = barriers.trained_pair("digits", spec, task, out, False, seeds=seeds)
            options = barriers.refine_settings("digits")  # learned refinement with the barrier table's settings
            steps, proxy = options.pop("steps"), options.pop("proxy_examples")
            row = barriers.evaluate_pair(checkpoints, task, task.test, refine_steps=steps, proxy_examples=proxy,
                                         refine_options=options)
            rows.append({"seeds": list(seeds), "accuracy": [row["accuracy_a"], row["accuracy_b"]],
                         "barrier": row["barrier"], "learned_cpu_seconds": row["learned_cpu_seconds"],
                         "learned_seconds": row["learned_seconds"]})
        (out / "results.json").write_text(json.dumps({"pairs": rows}, indent=1))

    out.mkdir(parents=True, exist_ok=True)
    pairs = _cached(out / "results.json", args.rerun, compute)["pairs"]
    lines = ["| seeds | acc A / B | vanilla | permutation | orthogonal | learned | kept: perm / orth "
             "| learned s (wall / CPU) |", "|---|---|---|---|---|---|---|---|"]
    for p in pairs:
        b = p["barrier"]
        lines.append(f"| {p['seeds'][0]}, {p['seeds'][1]} | {p['accuracy'][0]:.3f} / {p['accuracy'][1]:.3f} "
                     f"| {b['vanilla']:.3f} | {b['permutation']:.3f} | {b['orthogonal']:.3f} | {b['learned']:.3f} "
                     f"| {b['permutation'] / b['vanilla']:.0%} / {b['orthogonal'] / b['vanilla']:.0%} "
                     f"| {p['learned_seconds']} / {p['learned_cpu_seconds']} |")

    def mean_sd(key):
        values = [p["barrier"][key] for p in pairs]
        return f"{statistics.mean(values):.3f} ± {statistics.stdev(values):.3f}" if len(values) > 1 else f"{values[0]:.3f}"

    lines.append(f"| mean ± sd ({len(pairs)} pairs) | | {mean_sd('vanilla')} | {mean_sd('permutation')} "
                 f"| {mean_sd('orthogonal')} | {mean_sd('learned')} | | |")
    return "\n".join(lines)


def section_many(args, out: Path) -> str:
    from fedbasin.benchmarks import many

    results = _cached(out / "digits_results.json", args.rerun,
                      lambda: many.main(["--task", "digits", "--models", "3", "--out", str(out)]))
    if args.figures:
        many.plot_simplex(results["simplex"], Path(args.figures).parent / "simplex_digits.png")
    change = ", ".join(f"{c:.1%}" for c in results["universe_change"])
    return many.markdown(results) + f"\nuniverse matching: the average changed by {change} over its passes\n"


def section_width(args, out: Path) -> str:
    from fedbasin.benchmarks import width

    _cached(out / "results.json", args.rerun, lambda: width.main(["--threads", "1", "--out", str(out)]))
    return (out / "width.md").read_text()


def section_many4(args, out: Path) -> str:
    """Four digits models (issue 7 item 5): the centroid against the best single model."""
    from fedbasin.benchmarks import many

    results = _cached(out / "digits_results.json", args.rerun,
                      lambda: many.main(["--task", "digits", "--models", "4", "--simplex-steps", "4",
                                         "--out", str(out)]))
    return many.markdown(results)


def section_oneshot(args, out: Path) -> str:
    from fedbasin.benchmarks import oneshot

    tables = []
    for name, run_config, extra, title in (
        ("digits", "", [], "Clients hold the whole training split (1,437 images):"),
        ("digits_proxy", ONESHOT_PROXY, ["--further-rounds", "3", "--further-epochs", "10"],
         "The server holds 300 training images as proxy data (clients share the other 1,137):"),
    ):
        path = out / f"{name}.json"
        argv = ["--data", "digits", "--out", str(path)] + (["--run-config", run_config] if run_config else []) + extra
        rows = _cached(path, args.rerun, lambda argv=argv: oneshot.main(argv))["rows"]
        tables.append(f"{title}\n\n{oneshot.markdown(rows)}")
        if extra:
            tables.append("Three further FedAvg rounds (10 local epochs each) from every one-shot merge, against "
                          "FedAvg from one shared initialisation with the same 60 local epochs per client "
                          f"(4 rounds × 15); test accuracy after each round:\n\n{oneshot.further_markdown(rows)}")
    return "\n\n".join(tables)


def section_oneshot_seeds(args, out: Path) -> str:
    """The digits one-shot rows with the server's proxy levers over three seeds: mean ± sd."""
    from fedbasin.benchmarks import oneshot

    rows = []
    for seed in ONESHOT_SEEDS:
        path = out / f"seed{seed}.json"
        argv = ["--data", "digits", "--out", str(path), "--run-config", f"{ONESHOT_PROXY} seed={seed}"]
        rows += _cached(path, args.rerun, lambda argv=argv: oneshot.main(argv))["rows"]
    return (seed_table(rows, ("best_client", "fedavg", "aligned_orthogonal", "aligned_learned", "aligned_distilled",
                              "fedavg_distilled", "ensemble"))
            + f"\n\nseeds {', '.join(map(str, ONESHOT_SEEDS))} (data split, partitions, inits, batch order)")


def seed_table(rows: list[dict], keys: tuple[str, ...]) -> str:
    """One line per partition of one-shot ``rows`` (one row per seed and partition): mean ± sd
    over the seeds of every column in ``keys`` (in the order of ``oneshot.COLUMNS``)."""
    from fedbasin.benchmarks import oneshot

    titles = [(k, title) for k, title, _ in oneshot.COLUMNS] + [("ensemble_probabilities", "probability ensemble")]
    keys = [(k, title) for k, title in titles if k in keys]
    lines = ["| partition | " + " | ".join(title for _, title in keys) + " |", "|" + "---|" * (len(keys) + 1)]
    for partition in dict.fromkeys(r["partitioner"] for r in rows):
        group = [r for r in rows if r["partitioner"] == partition]
        cells = []
        for key, _ in keys:
            values = [float(r[key]) for r in group]
            cells.append(f"{statistics.mean(values):.3f} ± {statistics.stdev(values):.3f}")
        lines.append(f"| {partition} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def section_oneshot_cifar10(args, out: Path) -> str:
    """One-shot rows on 12,000 CIFAR-10 training images (no further rounds: bounded CPU time):
    the clients are trained once (``out/clients``) and every distillation variant of
    :data:`ONESHOT_CIFAR10_VARIANTS` runs on the same clients."""
    from fedbasin.benchmarks import oneshot

    header = ("| partition | server distillation | best client | FedAvg | aligned (orth) | aligned + distilled "
              "| FedAvg + distilled | logit ensemble | distill s (aligned) |")
    lines = [header, "|" + "---|" * 9]
    rows = {}
    for name, label, run_config in ONESHOT_CIFAR10_VARIANTS:
        path = out / f"{name}.json"
        argv = ["--data", f"cifar10:{args.cifar}", "--out", str(path), "--clients-cache", str(out / "clients"),
                "--run-config", f"{ONESHOT_CIFAR10} {run_config}"]
        rows[label] = _cached(path, args.rerun, lambda argv=argv: oneshot.main(argv))["rows"]
    for partition in ("iid", "dirichlet(0.5)"):
        for label, variant in rows.items():
            r = next(row for row in variant if row["partitioner"] == partition)
            lines.append(f"| {partition} | {label} | {r['best_client']:.4f} | {r['fedavg']:.4f} "
                         f"| {r['aligned_orthogonal']:.4f} | {r['aligned_distilled']} | {r['fedavg_distilled']} "
                         f"| {r['ensemble']:.4f} | {r['aligned_distilled_summary']['seconds']:.0f} |")
    return "\n".join(lines)


def cifar10_oneshot_rows(args, cifar10: Path, path: Path, run_config: str,
                         partitions: str = "iid,dirichlet") -> list[dict]:
    """The rows of one CIFAR-10 one-shot run with the settings of :data:`ONESHOT_CIFAR10` and
    ``run_config``, on the clients cache of the oneshot-cifar10 section (``cifar10``: its
    directory), computed only when ``path`` is missing (or ``--rerun``)."""
    from fedbasin.benchmarks import oneshot

    argv = ["--data", f"cifar10:{args.cifar}", "--partitioners", partitions, "--out", str(path),
            "--clients-cache", str(cifar10 / "clients"), "--run-config", f"{ONESHOT_CIFAR10} {run_config}"]
    return _cached(path, args.rerun, lambda: oneshot.main(argv))["rows"]


def per_seed_lines(rows: list[dict], keys: tuple[str, ...], extra=lambda row: []) -> list[str]:
    """One table line per run, IID first, then by seed: the accuracies in ``keys``, then the cells
    ``extra(row)``."""
    return [f"| {r['partitioner']} | {r['seed']} | " + " | ".join([f"{float(r[k]):.4f}" for k in keys] + extra(r))
            + " |" for r in sorted(rows, key=lambda r: (r["partitioner"] != "iid", r["seed"]))]


def section_oneshot_cifar10_seeds(args, out: Path) -> str:
    """The CIFAR-10 one-shot rows of :data:`ONESHOT_CIFAR10_SEEDS_DISTILL` over seeds 0-2 (seed 0:
    the oneshot-cifar10 section's run of that setting; seeds 1 and 2: one run per seed and
    partition on the same clients cache): per-seed accuracies and mean ± sd; then the rows of
    :data:`ONESHOT_CIFAR10_PROBABILITY_SEEDS` again with the probability teacher
    (``distill-teacher=probabilities``), both partitions, with their mean ± sd."""
    from fedbasin.benchmarks import oneshot

    cifar10 = out.parent / "oneshot-cifar10"

    def run(path: Path, run_config: str, partitions: str = "iid,dirichlet") -> list[dict]:
        return cifar10_oneshot_rows(args, cifar10, path, run_config, partitions)

    setting = ONESHOT_CIFAR10_SEEDS_DISTILL
    rows = [{**r, "seed": 0} for r in run(cifar10 / f"{ONESHOT_CIFAR10_VARIANTS[-1][0]}.json", setting)]
    probability = []
    for seed in ONESHOT_SEEDS[1:]:
        for partition in ("iid", "dirichlet"):
            rows += [{**r, "seed": seed} for r in run(out / f"seed{seed}_{partition}.json",
                                                      f"{setting} seed={seed}", partition)]
    for partition in ("iid", "dirichlet"):
        for seed in ONESHOT_CIFAR10_PROBABILITY_SEEDS:
            probability += [{**r, "seed": seed} for r in run(out / f"prob_seed{seed}_{partition}.json",
                                                             f"{setting} distill-teacher=probabilities seed={seed}",
                                                             partition)]
    keys = ("best_client", "fedavg", "aligned_orthogonal", "aligned_distilled", "fedavg_distilled", "ensemble")
    titles = " | ".join(title for k, title, _ in oneshot.COLUMNS if k in keys)
    per_seed = [f"| partition | seed | {titles} |", "|" + "---|" * (len(keys) + 2)] + per_seed_lines(rows, keys)
    teacher = ["| partition | seed | best client | aligned + distilled (logit teacher) | aligned + distilled "
               "(probability teacher) | FedAvg + distilled (probability teacher) | logit ensemble | probability "
               "ensemble |", "|" + "---|" * 8]
    for r in probability:
        logit = next(x for x in rows if x["seed"] == r["seed"] and x["partitioner"] == r["partitioner"])
        teacher.append(f"| {r['partitioner']} | {r['seed']} | {r['best_client']:.4f} | {logit['aligned_distilled']} "
                       f"| {r['aligned_distilled']} | {r['fedavg_distilled']} | {r['ensemble']:.4f} "
                       f"| {r['ensemble_probabilities']:.4f} |")
    probability_keys = ("best_client", "aligned_distilled", "fedavg_distilled", "ensemble_probabilities")
    return ("\n".join(per_seed) + "\n\nMean ± sd over seeds " + ", ".join(map(str, ONESHOT_SEEDS)) + ":\n\n"
            + seed_table(rows, keys) + "\n\nWith the probability teacher (`distill-teacher=probabilities`, otherwise "
            "the same setting and clients):\n\n" + "\n".join(teacher) + "\n\nMean ± sd over seeds "
            + ", ".join(map(str, ONESHOT_CIFAR10_PROBABILITY_SEEDS)) + ", probability teacher:\n\n"
            + seed_table(probability, probability_keys))


def section_oneshot_cifar10_long(args, out: Path) -> str:
    """The CIFAR-10 one-shot rows of :data:`ONESHOT_CIFAR10_LONG` over seeds 0-2 and both
    partitions (one run per seed and partition; the clients cache is the oneshot-cifar10 section's,
    so the clients are those of the oneshot-cifar10-seeds rows on the same machine): per-seed
    accuracies and mean ± sd."""
    rows = []
    for seed in ONESHOT_SEEDS:
        for partition in ("iid", "dirichlet"):
            rows += [{**r, "seed": seed} for r in cifar10_oneshot_rows(
                args, out.parent / "oneshot-cifar10", out / f"seed{seed}_{partition}.json",
                f"{ONESHOT_CIFAR10_LONG} seed={seed}", partition)]
    keys = ("best_client", "fedavg", "aligned_orthogonal", "aligned_distilled", "fedavg_distilled",
            "ensemble_probabilities")
    lines = [("| partition | seed | best client | FedAvg | aligned (orth) | aligned + distilled | FedAvg + distilled "
              "| probability ensemble | distill s (aligned, wall) |"), "|" + "---|" * 9]
    lines += per_seed_lines(rows, keys, lambda r: [f"{r['aligned_distilled_summary']['seconds']:.0f}"])
    return ("\n".join(lines) + "\n\nMean ± sd over seeds " + ", ".join(map(str, ONESHOT_SEEDS)) + ":\n\n"
            + seed_table(rows, keys))


RUNNERS = {"barriers": section_barriers, "barrier-seeds": section_barrier_seeds, "many": section_many,
           "many4": section_many4, "width": section_width, "oneshot": section_oneshot,
           "oneshot-seeds": section_oneshot_seeds, "oneshot-cifar10": section_oneshot_cifar10,
           "oneshot-cifar10-seeds": section_oneshot_cifar10_seeds,
           "oneshot-cifar10-long": section_oneshot_cifar10_long}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--sections", default=",".join(s for s in SECTIONS if not s.startswith("oneshot-cifar10")),
                        help="comma-separated; times on 2 idle cores: barriers 2 min per digits pair (cifar10 "
                        "~12 min, shakespeare ~25 min), barrier-seeds 4 min plus ~1 CPU min of refinement per pair, width 2 min; at load average 6-11 (upper bounds): many "
                        "15 min, many4 5 min plus training, oneshot 24 min, oneshot-seeds 25 min; not by default: "
                        "oneshot-cifar10 (per row ~3 min CPU: 4 clients, merges, 500 distillation steps; each "
                        "further variant 1.5-5 min CPU; 10-30 min wall per variant at load 12), oneshot-cifar10-seeds (on the "
                        "oneshot-cifar10 section's clients: seeds 1-2 train their clients, ~2 min CPU per seed and "
                        "partition; then 7 distillation runs, 1.3-2.5 min CPU each), oneshot-cifar10-long (its own clients per "
                        "seed and partition, ~3 min CPU each, then two 3000-step distillations, ~5 min CPU each)")
    parser.add_argument("--tasks", default="digits", help="barriers section: tasks (digits, cifar10, shakespeare)")
    parser.add_argument("--cifar", default="../shared/data/cifar10", help="CIFAR-10 parquet directory")
    parser.add_argument("--text", default="../shared/data/tinyshakespeare/input.txt", help="Tiny Shakespeare file")
    parser.add_argument("--refine-steps", type=int, help="barriers: learned-refinement steps (default: the "
                        "barriers driver's, fedbasin.benchmarks.barriers.REFINE_DEFAULTS)")
    parser.add_argument("--ablation", default="cosine,rms,uniform", help="barriers: weightings compared")
    parser.add_argument("--doc", default="docs/benchmarks.md", help="document whose blocks are rewritten")
    parser.add_argument("--figures", default="docs/barriers",
                        help="where the barrier figure/results go ('' to skip figures)")
    parser.add_argument("--out", default="runs/reproduce", help="working directory (checkpoints, results)")
    parser.add_argument("--rerun", action="store_true", help="recompute results already in --out")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    doc = Path(args.doc)
    text = doc.read_text()
    tables = {}
    for section in args.sections.split(","):
        if section not in RUNNERS:
            raise SystemExit(f"reproduce: unknown section {section!r}; known: {', '.join(SECTIONS)}")
        replace_block(text, section, "")  # the document has the block: fail before the long work
    for section in args.sections.split(","):
        try:
            tables[section] = RUNNERS[section](args, Path(args.out) / section)
        except (ValueError, FileNotFoundError, RuntimeError, KeyError) as exc:
            raise SystemExit(f"reproduce: section {section}: {exc}") from None
        text = replace_block(text, section, tables[section])
        atomic_write(doc, lambda tmp, text=text: tmp.write_text(text))  # after every section: an interruption keeps the rest
        print(f"[reproduce] {section}: {doc} updated", flush=True)
    return tables


if __name__ == "__main__":
    main()
