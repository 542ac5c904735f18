"""The suite of independently trained pairs on which fedbasin's defaults are chosen and reported.

    python -m fedbasin.benchmarks.suite [--members NAME ...] [--cache runs/suite] [--out FILE.json]

Every member is two (the universe member: three) models of one recipe trained from different
seeds. The models are trained once and cached under ``--cache`` (image recipes with
:func:`fedbasin.benchmarks.barriers.trained_pair`, the text recipes with
:mod:`fedbasin.benchmarks.gpt2_pair` ``--model-type gpt2|llama``); ``--pair-dir MEMBER=DIR``
(``--gpt2-pair DIR`` for ``gpt2-s01``) takes a pair trained elsewhere (``DIR/seed{S}``).

Each member is then measured only through the command line, as a user runs it (``python -m
fedbasin.cli`` in a child process), so the table reflects the current defaults:

* endpoints: ``fedbasin eval A --data SPEC --max-examples N`` (loss, accuracy);
* vanilla: ``fedbasin barrier A B --data SPEC --max-examples N --points 11``;
* data-free: ``fedbasin align A B --out C`` (no other option), then ``fedbasin barrier A C``;
* learned: ``fedbasin align A B --out C --refine-data SPEC`` (no other option), then the barrier;
* ``--variant NAME="OPTIONS"`` (repeatable): one more learned endpoint with those options added, an
  ablation or a candidate default measured side by side (rows ``learned:NAME``, a table of their own);
* ``--refine-seeds S ...``: every learned endpoint (default and variants) again with ``--refine-seed S``
  (rows ``learned@sS``, ``learned:NAME@sS``), so a default is chosen on the spread over refinement seeds
  as well as over pairs (the variant table gives each one's mean ± spread over pairs and seeds);
* image pairs: the accuracy of the midpoint ``(A + X)/2`` (X = B, C) by ``fedbasin eval``;
* ``--merge``: what a user writes with data, ``fedbasin merge A B --out M --refine-data SPEC`` (no other
  option: the learned refinement, then the models' ensemble distilled into the merge), evaluated by
  ``fedbasin eval`` (again per ``--refine-seeds`` S); a table of its accuracy and loss against the better model;
  ``--merge-variant NAME="OPTIONS"`` (repeatable, implies ``--merge``): one more merge with those options added
  (columns ``merge:NAME``);
* GPT-2 pairs with ``--glmc-path``: GLMC's weight matching (permutation, orthogonal) through
  ``glmc_compare --glmc-only`` (on its own slice: the first N blocks of ``gpt2_pair``'s test split);
* the universe member (3 models): ``fedbasin merge M0 M1 M2 --out C`` (and ``--no-align``, and
  ``--refine-data SPEC``: refined and distilled), evaluated by ``fedbasin eval``; its "barrier" columns hold the merge gap
  ``L(merge) − mean_i L(M_i)``.

The align/merge commands are timed (wall clock of the child process, Python start-up included)
and their peak resident memory is the child's own high-water mark (``VmHWM`` at its exit). ``--jobs N``
runs up to N child commands side by side (the members' measurements, and a member's learned endpoints
and barriers), each with ``OMP_NUM_THREADS`` = cores / N unless it is set: on a many-core machine a
refinement-seed study takes the time of one run per wave. (A budgeted refinement buys the steps its
core gives it; each row records them.) Rows are written
atomically to ``--out`` after each member and reused by a rerun while the fedbasin code is the
same (git's tree hash of ``fedbasin/`` as it is on disk, :func:`code_version`) and the evaluation
settings match; ``--rerun`` measures again (the trained models are always reused).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

import fedbasin
from fedbasin.atomic import atomic_write

ROOT = Path(fedbasin.__file__).resolve().parent.parent  # the checkout whose code the children run
DEFAULT_TEXT = "../shared/data/tinyshakespeare/input.txt"
DEFAULT_TOKENIZER = "../shared/data/gpt2_tokenizer"
DEFAULT_CIFAR = "../shared/data/cifar10"
POINTS = 11
GROUPS = {"text": "GPT-style text", "image": "image", "universe": "universe (3 models)"}
# evaluation slice per data kind: the first N examples of the CLI's test split (0: all of it). digits: the
# whole 359-image split; CIFAR-10: 2,000 images (as docs/benchmarks.md §1); text: 200 blocks of 128 tokens
# (the CLI's test split is the last 10% of the tokens)
EVAL_EXAMPLES = {"digits": 0, "cifar10": 2000, "text": 200}


@dataclass(frozen=True)
class Recipe:
    """How the models of a member are trained: ``kind`` image (``barriers.TASKS[task]`` with ``model``
    overrides, or ``fedbasin train --data TASK`` with ``train`` options when given) or text
    (``gpt2_pair --model-type task``)."""

    kind: str
    task: str
    model: tuple = ()  # (field, value) overrides of the image recipe's model shape
    train: tuple = ()  # options of `fedbasin train` (e.g. a Hugging Face model); its seeds train on one thread


@dataclass(frozen=True)
class Member:
    name: str
    group: str  # text | image | universe
    recipe: str  # a key of RECIPES; also the models' folder under the cache
    seeds: tuple[int, ...]


RECIPES = {
    "gpt2": Recipe("text", "gpt2"),
    "llama": Recipe("text", "llama"),
    "digits": Recipe("image", "digits"),
    "cifar10-w96": Recipe("image", "cifar10"),  # fedbasin train's CIFAR-10 recipe: d=96, MLP 192
    "cifar10-w64": Recipe("image", "cifar10", (("dim", 64), ("mlp_dim", 128))),
    # a Hugging Face ViTForImageClassification, wider and longer trained (MLP 4×, 30,000 images, 6 epochs; ~860 s
    # per seed on one core of the Xeon, ~1,500 s on the EPYC): the kind of pair a user brings, and one whose
    # refinement is step-limited
    "cifar10-hfvit-w128": Recipe("image", "cifar10", train=(
        "--model", "hf-vit", "--dim", "128", "--depth", "4", "--heads", "4", "--mlp-dim", "512", "--epochs", "6",
        "--max-train-examples", "30000")),
}

MEMBERS = {m.name: m for m in [
    Member("gpt2-s01", "text", "gpt2", (0, 1)),
    Member("gpt2-s23", "text", "gpt2", (2, 3)),
    Member("llama-s01", "text", "llama", (0, 1)),
    Member("digits-s01", "image", "digits", (0, 1)),
    Member("digits-s23", "image", "digits", (2, 3)),
    Member("cifar10-w96-s01", "image", "cifar10-w96", (0, 1)),
    Member("cifar10-w64-s01", "image", "cifar10-w64", (0, 1)),
    Member("cifar10-hfvit-s01", "image", "cifar10-hfvit-w128", (0, 1)),
    Member("cifar10-hfvit-s23", "image", "cifar10-hfvit-w128", (2, 3)),
    Member("digits-u012", "universe", "digits", (0, 1, 2)),
]}


class SuiteError(Exception):
    """A failed step, in one line."""


# ------------------------------------------------------------------------------------------------
# inputs


def data_kind(member: Member) -> str:
    recipe = RECIPES[member.recipe]
    return "text" if recipe.kind == "text" else recipe.task


def data_spec(member: Member, args) -> str:
    """The ``--data`` / ``--refine-data`` value of the member's commands."""
    kind = data_kind(member)
    return {"text": f"text:{args.text}", "cifar10": f"cifar10:{args.cifar}", "digits": "digits"}[kind]


def model_dirs(member: Member, args) -> list[Path]:
    """Where the member's models are (or will be trained): ``DIR/seed{S}``."""
    base = args.pair_dirs.get(member.name) or Path(args.cache) / member.recipe
    return [Path(base) / f"seed{s}" for s in member.seeds]


def trained(path: Path) -> bool:
    return (path / "config.json").is_file() and (path / "model.safetensors").is_file()


def select_members(names: list[str] | None) -> list[Member]:
    """The members named (all by default, in table order), or a ValueError naming the unknown one."""
    if not names:
        return list(MEMBERS.values())
    unknown = [n for n in names if n not in MEMBERS]
    if unknown:
        raise ValueError(f"--members: unknown member {unknown[0]!r}; expected some of {', '.join(MEMBERS)}")
    return [MEMBERS[n] for n in dict.fromkeys(names)]


def parse_pair_dirs(items: list[str]) -> dict[str, Path]:
    dirs = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not (sep and path):
            raise ValueError(f"--pair-dir {item!r}: expected MEMBER=DIR")
        if name not in MEMBERS or MEMBERS[name].group == "universe":
            pairs = [m.name for m in MEMBERS.values() if m.group != "universe"]
            raise ValueError(f"--pair-dir {item!r}: {name!r} is not a pair member ({', '.join(pairs)})")
        dirs[name] = Path(path)
    return dirs


def check_inputs(members: list[Member], args) -> None:
    """Every file the selected members need exists (ValueError in one line otherwise); nothing is trained."""
    for member in members:
        kind = data_kind(member)
        given = args.pair_dirs.get(member.name)
        if given is not None:
            for path in model_dirs(member, args):
                if not trained(path):
                    raise ValueError(f"--pair-dir {member.name}={given}: {path} holds no trained model "
                                     "(config.json + model.safetensors); a given folder is never trained into")
        if kind == "text":
            if not Path(args.text).is_file():
                raise ValueError(f"--text {args.text}: no such file (member {member.name})")
            if not all(trained(p) for p in model_dirs(member, args)) and not Path(args.tokenizer).is_dir():
                raise ValueError(f"--tokenizer {args.tokenizer}: no such directory (needed to train {member.name})")
        elif kind == "cifar10":
            for split in ("train", "test"):
                if not (Path(args.cifar) / f"{split}.parquet").is_file():
                    raise ValueError(f"--cifar {args.cifar}: no {split}.parquet there (member {member.name})")
    pairs = [m for m in members if m.group != "universe"]
    for flag, command, variants in (("--variant", "align", args.variants), ("--merge-variant", "merge",
                                                                             args.merge_variants)):
        for name, options in variants.items():  # the CLI's own parser: a bad flag is refused before any work
            seeded = ["--refine-seed", "1"] if args.refine_seeds else []  # as the @sS runs add it
            if pairs and (why := cli_usage_error([command, "A", "B", "--out", "C", "--refine-data",
                                                  data_spec(pairs[0], args), *options, *seeded])):
                raise ValueError(f"{flag} {name}: {why}")
    if args.glmc_path is not None:
        if not Path(args.glmc_path).is_dir():
            raise ValueError(f"--glmc-path {args.glmc_path}: no such directory")
        if not Path(args.glmc_python).is_file():
            raise ValueError(f"--glmc-python {args.glmc_python}: no such file")


def cli_usage_error(argv: list[str]) -> str | None:
    """The usage error ``fedbasin`` would print for ``argv`` (argparse's own check: flags, types,
    ranges), or None when it parses."""
    import contextlib
    import io

    from fedbasin.cli import build_parser

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            build_parser().parse_args(argv)
    except SystemExit:
        line = (err.getvalue().strip().splitlines() or ["bad options"])[-1]  # "fedbasin align: MESSAGE (see ...)"
        return re.sub(r"^fedbasin( \w+)?: ", "", line).split(" (see fedbasin")[0]
    return None


# ------------------------------------------------------------------------------------------------
# training (cached)


def say(message: str) -> None:
    sys.stderr.write(f"[suite {time.strftime('%H:%M:%S')}] {message}\n")  # one write: threads do not interleave
    sys.stderr.flush()


def _training_command(member: Member, recipe: Recipe, seed: int, path: Path, args) -> tuple[str, list[str], dict]:
    """(what it is, command, environment) that trains seed ``seed`` of a text recipe (``gpt2_pair``, into the
    recipe's folder) or of a recipe of ``fedbasin train`` options (into ``path``), each on one thread."""
    if recipe.kind == "text":
        out = Path(args.cache) / member.recipe
        return (f"gpt2_pair into {out}, ~30 min on 2 cores",
                [sys.executable, "-m", "fedbasin.benchmarks.gpt2_pair", "--model-type", recipe.task, "--seed", str(seed),
                 "--out", str(out), "--text", args.text, "--tokenizer", args.tokenizer, "--threads", "1", "--device",
                 args.train_device], child_env())
    return (f"fedbasin train {' '.join(recipe.train)}",
            [sys.executable, "-m", "fedbasin.cli", "train", "--data", data_spec(member, args), "--seed", str(seed),
             "--out", str(path), "--device", args.train_device, *recipe.train], {**child_env(), "OMP_NUM_THREADS": "1"})


def train_member(member: Member, args) -> list[Path]:
    """The member's models, trained into the cache where they are missing."""
    paths = model_dirs(member, args)
    missing = [(s, p) for s, p in zip(member.seeds, paths) if not trained(p)]
    if not missing:
        return paths
    recipe = RECIPES[member.recipe]
    if recipe.kind == "text" or recipe.train:  # a command per seed, up to --jobs of them side by side

        def train(seed: int, path: Path) -> None:
            what, command, env = _training_command(member, recipe, seed, path, args)
            with Slots.taken(f"training {member.recipe} seed {seed}"):
                say(f"{member.name}: training {member.recipe} seed {seed} ({what})")
                done = subprocess.run(command, check=False, env=env, stdout=sys.stderr)
            if done.returncode != 0:
                raise SuiteError(f"training {member.recipe} seed {seed} failed (exit {done.returncode})")

        side_by_side([lambda s=seed, p=path: train(s, p) for seed, path in missing])
        return paths
    import torch

    from fedbasin.benchmarks.barriers import TASKS, trained_pair
    from fedbasin.data import load_task

    base = TASKS[recipe.task]
    spec = {**base, "model": {**base["model"], **dict(recipe.model)}}
    task = load_task(base["source"].format(cifar=args.cifar, text=args.text), max_train_examples=base["max_train"])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the models `OMP_NUM_THREADS=1 fedbasin train` writes
    try:
        for seed, _ in missing:
            say(f"{member.name}: training {member.recipe} seed {seed} ({spec['epochs']} epochs)")
            trained_pair(member.recipe, spec, task, Path(args.cache), progress=False, seeds=(seed,))
    finally:
        torch.set_num_threads(threads)
    return paths


# ------------------------------------------------------------------------------------------------
# the command line, as a user runs it


class Slots:
    """How many child commands run at once (``--jobs``), the threads each may use, and whether the run
    is being stopped (an interrupt: no child starts after it)."""

    jobs = 1
    free = threading.BoundedSemaphore(1)
    stopping = threading.Event()

    @classmethod
    def set(cls, jobs: int) -> None:
        cls.jobs, cls.free, cls.stopping = jobs, threading.BoundedSemaphore(jobs), threading.Event()

    @classmethod
    @contextlib.contextmanager
    def taken(cls, what: str):
        """Context: one of the ``jobs`` slots, for a child command; refused once the run is being stopped."""
        with cls.free:
            if cls.stopping.is_set():
                raise SuiteError(f"{what}: not started (the run is being stopped)")
            yield

    @staticmethod
    def cores() -> int:
        return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def child_env() -> dict:
    """The environment of a child: ours, with this checkout first on the path (and, with ``--jobs`` > 1,
    ``OMP_NUM_THREADS`` = cores / jobs unless it is set)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    if Slots.jobs > 1:
        env.setdefault("OMP_NUM_THREADS", str(max(1, Slots.cores() // Slots.jobs)))
    return env


def side_by_side(calls: list) -> list:
    """The results of the zero-argument ``calls``, in order; with ``--jobs`` > 1 they run in threads (their
    child commands at most ``jobs`` at a time), else one after the other."""
    if Slots.jobs == 1 or len(calls) < 2:
        return [call() for call in calls]
    with ThreadPoolExecutor(len(calls)) as pool:
        return [f.result() for f in [pool.submit(call) for call in calls]]


@dataclass
class CliRun:
    summary: dict  # the JSON the command printed
    seconds: float  # wall clock of the child process
    peak_rss_mib: float  # the child's peak resident set size


# ``python -m fedbasin.cli ARGS`` (runpy, as -m does) that writes its own peak RSS at exit: VmHWM, the high-water
# mark of the memory of the process after exec. (``ru_maxrss`` of a child would also count what the parent held
# when it forked: Linux carries the pre-exec peak over, and this process may hold a data set.)
_MEASURED = ("import atexit, os, runpy\n"
             "def _peak():\n"
             "    with open('/proc/self/status') as f:\n"
             "        kib = next((line.split()[1] for line in f if line.startswith('VmHWM:')), '')\n"
             "    with open(os.environ['FEDBASIN_SUITE_PEAK'], 'w') as f:\n"
             "        f.write(kib)\n"
             "atexit.register(_peak)\n"
             "runpy.run_module('fedbasin.cli', run_name='__main__', alter_sys=True)\n")


def run_cli(arguments: list[str], log: Path | None = None) -> CliRun:
    """``python -m fedbasin.cli ARGUMENTS`` in a child process; its stderr goes to ``log``. A rerun
    replaces the endpoints and merges of the suite's own work directory (``--overwrite``)."""
    if arguments[0] in ("align", "merge"):
        arguments = [*arguments, "--overwrite"]
    if log is not None:
        log.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp, open(Path(tmp) / "out", "w+b") as out, \
            open(log or os.devnull, "wb") as err:
        peak = Path(tmp) / "peak"
        command = [sys.executable, "-c", _MEASURED, *map(str, arguments)]
        with Slots.taken(f"fedbasin {arguments[0]}"):
            started = time.perf_counter()
            child = subprocess.Popen(command, stdout=out, stderr=err,
                                     env={**child_env(), "FEDBASIN_SUITE_PEAK": str(peak)})
            try:
                returncode = child.wait()
            except BaseException:
                child.kill()
                child.wait()
                raise
            seconds = time.perf_counter() - started
        out.seek(0)
        text = out.read().decode()
        kib = peak.read_text().strip() if peak.is_file() else ""
    if returncode != 0:
        last = log.read_text(errors="replace").strip().splitlines()[-1:] if log else []
        raise SuiteError(f"fedbasin {arguments[0]} failed (exit {returncode}): {' '.join(last) or '?'}")
    return CliRun(json.loads(text), round(seconds, 1), round(int(kib) / 1024, 1) if kib.isdigit() else None)


def glmc_rows(a: Path, b: Path, args, blocks: int, work: Path) -> dict:
    """GLMC's weight matching barriers (permutation, orthogonal) through ``glmc_compare --glmc-only``."""
    out = work / "glmc.json"
    command = [sys.executable, "-m", "fedbasin.benchmarks.glmc_compare", str(a), str(b), "--glmc-only",
               "--glmc-path", args.glmc_path, "--glmc-python", args.glmc_python, "--text", args.text,
               "--max-blocks", str(blocks), "--points", str(POINTS), "--circuit-variant", "", "--out", str(out)]
    with open(work / "glmc.log", "wb") as err:
        done = subprocess.run(command, check=False, stdout=err, stderr=err, env=child_env())
    if done.returncode != 0:
        raise SuiteError(f"glmc_compare failed (exit {done.returncode}); see {work / 'glmc.log'}")
    rows = json.loads(out.read_text())["rows"]
    return {name.removeprefix("GLMC "): row["barrier"] for name, row in rows.items() if name.startswith("GLMC ")}


# ------------------------------------------------------------------------------------------------
# one member's row


def eval_examples(member: Member, args) -> int:
    return args.eval_examples.get(data_kind(member), EVAL_EXAMPLES[data_kind(member)])


def midpoint(a: Path, b: Path, out: Path) -> Path:
    """Write ``(A + B)/2`` (every floating tensor; the λ = 0.5 point of the barrier's path) as a checkpoint."""
    from fedbasin.alignment import interpolate
    from fedbasin.checkpoint import load_checkpoint, save_checkpoint

    ca, cb = load_checkpoint(a), load_checkpoint(b)
    save_checkpoint(out, ca.family, ca.config, interpolate(ca.state, cb.state, 0.5), kind=ca.kind)
    return out


def command_record(run: CliRun) -> dict:
    return {"seconds": run.seconds, "peak_rss_mib": run.peak_rss_mib}


def start_row(member: Member, paths: list[Path], args, work: Path, **fields) -> tuple[dict, str, list[str]]:
    """``(row, data spec, evaluation-slice arguments)`` of a member: its models evaluated (``fedbasin eval``);
    ``fields``: the row's further (empty) entries."""
    data, n = data_spec(member, args), eval_examples(member, args)
    slice_ = ["--data", data, "--max-examples", str(n)]
    row: dict = {"member": member.name, "group": member.group, "models": [str(p) for p in paths], "data": data,
                 "eval_examples": n, **fields}
    ends = [run_cli(["eval", p, *slice_], work / "logs" / f"eval-{i}.log").summary for i, p in enumerate(paths)]
    row["loss"] = [e["loss"] for e in ends]
    row["accuracy"] = [e["accuracy"] for e in ends]
    row["eval_examples"] = ends[0]["examples"]
    return row, data, slice_


def learned_runs(args) -> list[tuple[str, list[str]]]:
    """``(column, align options)`` of every learned endpoint of a pair: the default (``learned``) unless
    skipped, each variant (``learned:NAME``), and each again per ``--refine-seeds`` S (``…@sS``)."""
    runs = ([] if args.skip_learned else [("learned", [])]) + [
        (f"learned:{name}", options) for name, options in args.variants.items()]
    return [(column + (f"@s{seed}" if seed else ""), [*options, *(["--refine-seed", str(seed)] if seed else [])])
            for column, options in runs for seed in [0, *args.refine_seeds]]


def pair_row(member: Member, paths: list[Path], args, work: Path) -> dict:
    a, b = paths
    row, data, slice_ = start_row(member, paths, args, work, barrier={}, curves={}, commands={},
                                  midpoint_accuracy={})
    say(f"{member.name}: default data-free alignment (fedbasin align A B --out C)")
    run = run_cli(["align", a, b, "--out", work / "aligned-free"], work / "logs" / "align-free.log")
    row["commands"]["free"] = command_record(run)
    endpoints = {"vanilla": b, "free": work / "aligned-free"}

    def file_name(column: str) -> str:  # "learned:l28@s1" -> "learned-l28@s1": one folder / log per column
        return column.replace(":", "-")

    def align(column: str, options: list[str]) -> CliRun:
        say(f"{member.name}: {column} (fedbasin align A B --out C --refine-data {data} {' '.join(options)})")
        return run_cli(["align", a, b, "--out", endpoints[column], "--refine-data", data, *options],
                       work / "logs" / f"align-{file_name(column)}.log")

    runs = learned_runs(args)
    endpoints.update((column, work / f"aligned-{file_name(column)}") for column, _ in runs)
    calls = [lambda c=c, o=o: align(c, o) for c, o in runs]
    if args.merge:  # beside the learned alignments; the models' ensemble is what a merge is compared with
        say(f"{member.name}: the models' ensemble (fedbasin eval A B)")
        ensemble = run_cli(["eval", *paths, *slice_], work / "logs" / "eval-ensemble.log").summary
        row["ensemble"] = {"accuracy": ensemble["accuracy"], "loss": ensemble["loss"]}
        calls.append(lambda: merge_runs(member, paths, args, work, data, slice_))
    results = side_by_side(calls)
    if args.merge:
        row["merges"] = results.pop()
    for (column, options), run in zip(runs, results):
        row["commands"][column] = command_record(run)
        row.setdefault("refinements", {})[column] = run.summary.get("refinement")
    if "learned" in row["commands"]:
        row["refinement"] = row["refinements"]["learned"]  # what the default refinement did (steps, keep-best)
    for name, options in args.variants.items():
        row.setdefault("variants", {})[name] = {"options": options,
                                                "refinement": row["refinements"][f"learned:{name}"]}

    def measure(name: str, endpoint: Path) -> tuple[dict, float | None]:
        say(f"{member.name}: barrier {name} ({POINTS} points, {row['eval_examples']} test examples)")
        curve = run_cli(["barrier", a, endpoint, *slice_, "--points", str(POINTS)],
                        work / "logs" / f"barrier-{file_name(name)}.log").summary
        accuracy = None
        if member.group == "image":
            mid = midpoint(a, endpoint, work / f"mid-{file_name(name)}")
            accuracy = run_cli(["eval", mid, *slice_], work / "logs" / f"mid-{file_name(name)}.log").summary["accuracy"]
        return curve, accuracy

    measured = side_by_side([lambda n=n, e=e: measure(n, e) for n, e in endpoints.items()])
    for name, (curve, accuracy) in zip(endpoints, measured):
        row["barrier"][name], row["curves"][name] = curve["barrier"], curve["losses"]
        if accuracy is not None:
            row["midpoint_accuracy"][name] = accuracy
    if args.glmc_path and member.recipe == "gpt2":
        say(f"{member.name}: GLMC's weight matching (glmc_compare --glmc-only)")
        row["glmc"] = glmc_rows(a, b, args, eval_examples(member, args), work)
    return row


def merge_runs(member: Member, paths: list[Path], args, work: Path, data: str, slice_: list[str]) -> dict:
    """``fedbasin merge A B --out M --refine-data SPEC`` (and per ``--refine-seeds`` S with ``--refine-seed S``)
    evaluated on the slice: column (``merge``, ``merge@sS``) → accuracy, loss, wall time, peak RSS, and what
    the refinement and the distillation did (steps, keep-best)."""

    def one(name: str, variant: list[str], seed: int) -> tuple[str, dict]:
        column = "merge" + (f":{name}" if name else "") + (f"@s{seed}" if seed else "")
        options = [*variant, *(["--refine-seed", str(seed)] if seed else [])]
        say(f"{member.name}: {column} (fedbasin merge A B --out M --refine-data {data} {' '.join(options)})")
        out = work / column.replace(":", "-")
        run = run_cli(["merge", *paths, "--out", out, "--refine-data", data, *options],
                      work / "logs" / f"{out.name}.log")
        ev = run_cli(["eval", out, *slice_], work / "logs" / f"eval-{out.name}.log").summary
        refinement = dict(run.summary.get("refinement") or {})
        return column, {"accuracy": ev["accuracy"], "loss": ev["loss"], **command_record(run), "options": options,
                        "distillation": refinement.pop("distillation", None), "refinement": refinement}

    merges = [("", []), *args.merge_variants.items()]
    return dict(side_by_side([lambda n=n, v=v, s=s: one(n, v, s) for n, v in merges for s in [0, *args.refine_seeds]]))


def merge_table(rows: list[dict]) -> str:
    """With ``--merge``: per pair and seed the written merge's accuracy and loss against the better model
    (the higher accuracy, the lower loss), the models' ensemble and the learned midpoint; per group how many
    merges reach the better model and the ensemble (accuracy for image pairs, loss for text pairs)."""
    lines = ["| member | merge | accuracy: better model / ensemble / learned midpoint / merge | "
             "loss: better model / ensemble / merge | distillation steps (best) | merge s |", "|" + "---|" * 6]
    groups: dict[str, list[tuple[float | None, float, bool | None]]] = {}
    for r in rows:
        ensemble = r.get("ensemble") or {}
        for column, m in r.get("merges", {}).items():
            image = r["group"] == "image"
            better_acc, better_loss = max(r["accuracy"]), min(r["loss"])
            d = m.get("distillation") or {}
            accuracies = [better_acc, ensemble.get("accuracy"), r.get("midpoint_accuracy", {}).get("learned"),
                          m["accuracy"]]
            lines.append(f"| {r['member']} | {column} | {_pair(accuracies) if image else '—'} | "
                         f"{_pair([better_loss, ensemble.get('loss'), m['loss']], 4)} | "
                         f"{d.get('steps', '—')} ({d.get('best_step', '—')}) | {_pair([m.get('seconds')], 1)} |")
            reaches = None if not ensemble else (m["accuracy"] >= ensemble["accuracy"] if image
                                                 else m["loss"] <= ensemble["loss"])
            groups.setdefault(GROUPS[r["group"]], []).append(
                (m["accuracy"] - better_acc if image else None, better_loss - m["loss"], reaches))
    if not groups:
        return ""
    lines += ["", "| group | merges | accuracy − better model: mean (min) | better model's loss − merge's: mean (min) | "
              "merges ≥ better model | merges ≥ ensemble |", "|" + "---|" * 6]
    for group, gains in groups.items():
        acc = [a for a, _, _ in gains if a is not None]
        loss = [g for _, g, _ in gains]
        ahead = sum((a if a is not None else g) >= 0 for a, g, _ in gains)
        judged = [e for _, _, e in gains if e is not None]
        lines.append(f"| {group} | {len(gains)} | " + (f"{statistics.fmean(acc):+.4f} ({min(acc):+.4f})" if acc else "—")
                     + f" | {statistics.fmean(loss):+.4f} ({min(loss):+.4f}) | {ahead} of {len(gains)} | "
                     + (f"{sum(judged)} of {len(judged)} |" if judged else "— |"))
    return "\n".join(lines)


def universe_row(member: Member, paths: list[Path], args, work: Path) -> dict:
    row, data, slice_ = start_row(member, paths, args, work, barrier={}, commands={}, midpoint_accuracy={},
                                  merge_loss={})
    merges = {"vanilla": ["--no-align"], "free": []}
    if not args.skip_learned:
        merges["learned"] = ["--refine-data", data]
    mean_loss = statistics.fmean(row["loss"])
    for name, options in merges.items():
        say(f"{member.name}: merge ({name}: fedbasin merge M0 M1 M2 --out C {' '.join(options)})".replace(" )", ")"))
        run = run_cli(["merge", *paths, "--out", work / f"merge-{name}", *options], work / "logs" / f"merge-{name}.log")
        if name != "vanilla":
            row["commands"][name] = command_record(run)
        if name == "learned":
            row["refinement"] = run.summary.get("refinement")
        ev = run_cli(["eval", work / f"merge-{name}", *slice_], work / "logs" / f"eval-merge-{name}.log").summary
        row["merge_loss"][name] = ev["loss"]
        row["barrier"][name] = ev["loss"] - mean_loss  # the merge gap
        row["midpoint_accuracy"][name] = ev["accuracy"]
    return row


# ------------------------------------------------------------------------------------------------
# caching, aggregation, table


def code_version(root: Path = ROOT) -> str:
    """Git's tree hash of the ``fedbasin/`` package as it is on disk (committed or not: the hash the
    tree gets once committed), so a row is remeasured after any change of the code and only then;
    ``unknown`` without git. Written through a temporary index: the checkout's own index is untouched."""
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "GIT_INDEX_FILE": str(Path(tmp) / "index")}

        def git(*arguments) -> str:
            return subprocess.run(["git", "-C", str(root), *arguments], capture_output=True, text=True, check=True,
                                  env=env).stdout.strip()

        try:
            git("read-tree", "HEAD")
            git("add", "-A", "fedbasin")
            return git("write-tree", "--prefix=fedbasin/")
        except (OSError, subprocess.CalledProcessError):
            return "unknown"


def row_key(member: Member, args, version: str) -> dict:
    return {"code": version, "data": data_spec(member, args), "eval_examples": eval_examples(member, args),
            "points": POINTS, "models": [str(p) for p in model_dirs(member, args)],
            "glmc": bool(args.glmc_path) and member.recipe == "gpt2",
            **({"variants": args.variants} if args.variants and member.group != "universe" else {}),
            **({"refine_seeds": args.refine_seeds} if args.refine_seeds and member.group != "universe" else {}),
            **({"jobs": args.jobs} if args.jobs > 1 else {}),
            **({"merge": True} if args.merge and member.group != "universe" else {}),
            **({"merge_variants": args.merge_variants} if args.merge_variants and member.group != "universe" else {})}


def reusable(row: dict | None, key: dict, skip_learned: bool) -> bool:
    """A stored row answers this run: same key (code, evaluation) and, unless learned is skipped, with learned."""
    return bool(row) and row.get("key") == key and (skip_learned or "learned" in row.get("barrier", {}))


def load_rows(path: Path) -> dict:
    try:
        return json.loads(path.read_text())["rows"]
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def save_rows(path: Path, rows: dict, meta: dict) -> None:
    text = json.dumps({**meta, "rows": rows}, indent=1)
    atomic_write(path, lambda tmp: tmp.write_text(text))


def mean_spread(values: list[float]) -> tuple[float, float | None]:
    """Mean and spread (sample standard deviation; None for a single value) of ``values``."""
    if not values:
        raise ValueError("no values")
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else None)


COLUMNS = ("vanilla", "free", "learned")


def summarize(rows: list[dict]) -> dict:
    """Per group: members, and mean ± spread of each barrier, midpoint accuracy and align wall time / peak RSS."""
    groups: dict[str, dict] = {}
    for group in GROUPS:
        members = [r for r in rows if r["group"] == group]
        if not members:
            continue
        summary: dict = {"members": [r["member"] for r in members]}
        for column in COLUMNS:
            for field in ("barrier", "midpoint_accuracy"):
                values = [r[field][column] for r in members if column in r.get(field, {})]
                if values:
                    summary[f"{field}/{column}"] = mean_spread(values)
            for field in ("seconds", "peak_rss_mib"):
                values = [r["commands"][column][field] for r in members if column in r.get("commands", {})]
                if values:
                    summary[f"{field}/{column}"] = mean_spread(values)
        groups[group] = summary
    return groups


def _pair(values, digits=3) -> str:
    return " / ".join("—" if v is None else f"{v:.{digits}f}" for v in values)


ROW_HEADER = ("| member | loss (models) | accuracy (models) | vanilla | data-free | learned | GLMC perm / orth | "
              "mid acc vanilla / free / learned | align s free / learned | peak RSS MiB free / learned |")
GROUP_HEADER = ("| group | members | vanilla | data-free | learned | mid acc free | mid acc learned | align s free | "
                "align s learned | peak RSS MiB learned |")
GROUP_CELLS = (("barrier/vanilla", 3), ("barrier/free", 3), ("barrier/learned", 3), ("midpoint_accuracy/free", 3),
               ("midpoint_accuracy/learned", 3), ("seconds/free", 1), ("seconds/learned", 1),
               ("peak_rss_mib/learned", 0))


def learned_columns(row: dict) -> dict[str, tuple[str, list[str], dict]]:
    """A row's learned endpoints: column → (its name in the variant table: ``default`` or the variant's,
    with ``@sS`` for a further refinement seed; align options; what the refinement did)."""
    out = {}
    for column in row["barrier"]:
        base, _, seed = column.partition("@")
        if base != "learned" and not base.startswith("learned:"):
            continue
        name = base.partition(":")[2] or "default"
        variant = row.get("variants", {}).get(name, {})
        refinement = row.get("refinements", {}).get(column) or (
            row.get("refinement") if column == "learned" else variant.get("refinement")) or {}
        options = [*variant.get("options", []), *(["--refine-seed", seed[1:]] if seed else [])]
        out[column] = (name + (f"@{seed}" if seed else ""), options, refinement)
    return out


def variant_table(rows: list[dict]) -> str:
    """The learned endpoints beside each other when there are variants or refinement seeds: one line per
    member and run (barrier, refinement steps, wall time), then one per setting over all its runs (every
    pair and seed): barrier mean ± spread (max) and, for image pairs, the midpoint's accuracy minus the
    better model's."""
    lines = ["| member | learned | options | barrier | steps | align s |", "|" + "---|" * 6]
    settings: dict[str, dict[str, list[float]]] = {}
    beyond_default = False  # a variant or a further seed: else the member table says it all
    for r in rows:
        if r["group"] == "universe":  # its columns are merge gaps of three models, not pair barriers
            continue
        for column, (name, options, refinement) in learned_columns(r).items():
            beyond_default = beyond_default or column != "learned"
            steps, seconds = refinement.get("steps"), r.get("commands", {}).get(column, {}).get("seconds")
            lines.append(f"| {r['member']} | {name} | {' '.join(options) or '(none)'} | "
                         f"{r['barrier'][column]:.4f} | {steps if steps is not None else '—'} | "
                         f"{_pair([seconds], 1)} |")
            setting = settings.setdefault(f"{name.partition('@')[0]} ({GROUPS[r['group']]})", {"barrier": [], "gain": []})
            setting["barrier"].append(r["barrier"][column])
            if column in r.get("midpoint_accuracy", {}):
                setting["gain"].append(r["midpoint_accuracy"][column] - max(r["accuracy"]))
    if not beyond_default:
        return ""
    lines += ["", "| learned | runs | barrier mean ± spread (max) | midpoint − better model: mean (min) | "
              "merges ≥ better model |", "|" + "---|" * 5]
    for name, values in settings.items():
        barrier, gain = values["barrier"], values["gain"]
        lines.append(f"| {name} | {len(barrier)} | {_ms_cell(mean_spread(barrier), 4)} ({max(barrier):.4f}) | " + (
            f"{statistics.fmean(gain):+.4f} ({min(gain):+.4f}) | {sum(g >= 0 for g in gain)} of {len(gain)} |"
            if gain else "— | — |"))
    return "\n".join(lines)


def table(rows: list[dict]) -> str:
    """The markdown table of the members' rows and, below it, the per-group mean ± spread (and the
    ``--variant`` rows, when there are any)."""
    lines = [ROW_HEADER, "|" + "---|" * 10]
    for r in rows:
        b, mid, cmd = r["barrier"], r.get("midpoint_accuracy", {}), r.get("commands", {})
        glmc = r.get("glmc")
        lines.append("| " + " | ".join([
            r["member"], _pair(r["loss"]), _pair(r["accuracy"]),
            *(f"{b[c]:.3f}" if c in b else "—" for c in COLUMNS),
            _pair([glmc.get("permutation"), glmc.get("orthogonal")]) if glmc else "—",
            _pair([mid.get(c) for c in COLUMNS]) if mid else "—",
            _pair([cmd.get(c, {}).get("seconds") for c in COLUMNS[1:]], 1),
            _pair([cmd.get(c, {}).get("peak_rss_mib") for c in COLUMNS[1:]], 0)]) + " |")
    lines += ["", GROUP_HEADER, "|" + "---|" * 10]
    for group, s in summarize(rows).items():
        cells = [_ms_cell(s.get(key), digits) for key, digits in GROUP_CELLS]
        lines.append("| " + " | ".join([GROUPS[group], str(len(s["members"])), *cells]) + " |")
    for extra in (variant_table(rows), merge_table(rows)):
        if extra:
            lines += ["", extra]
    return "\n".join(lines)


def _ms_cell(value: tuple[float, float | None] | None, digits: int) -> str:
    if value is None:
        return "—"
    mean, spread = value
    return f"{mean:.{digits}f}" + (f" ± {spread:.{digits}f}" if spread is not None else " (n=1)")


# ------------------------------------------------------------------------------------------------


def parse_eval_examples(items: list[str]) -> dict[str, int]:
    out = {}
    for item in items:
        kind, sep, value = item.partition("=")
        if not sep or kind not in EVAL_EXAMPLES or not value.isdigit():
            raise ValueError(f"--eval-examples {item!r}: expected KIND=N with KIND one of {', '.join(EVAL_EXAMPLES)}")
        out[kind] = int(value)
    return out


def parse_variants(items: list[str], flag: str = "--variant") -> dict[str, list[str]]:
    """``NAME=OPTIONS`` items of ``flag`` as ``{name: [option, ...]}`` (OPTIONS split as a shell would)."""
    variants = {}
    for item in items:
        name, sep, options = item.partition("=")
        if not (sep and name.replace("-", "").replace("_", "").isalnum()):
            raise ValueError(f"{flag} {item!r}: expected NAME=OPTIONS (NAME of letters, digits, - and _)")
        if name in variants or name == "default":
            raise ValueError(f"{flag} {item!r}: the name {name!r} is taken")
        try:
            variants[name] = shlex.split(options)
        except ValueError as error:
            raise ValueError(f"{flag} {item!r}: {error}") from None
    return variants


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m fedbasin.benchmarks.suite", description=__doc__.splitlines()[0])
    p.add_argument("--members", nargs="+", metavar="NAME", help=f"members to run (default: all): {', '.join(MEMBERS)}")
    p.add_argument("--cache", default="runs/suite", help="trained models and per-member work (default runs/suite)")
    p.add_argument("--out", help="rows as JSON, rewritten after each member (default CACHE/suite.json)")
    p.add_argument("--pair-dir", action="append", default=[], metavar="MEMBER=DIR",
                   help="take a pair member's models from DIR/seed{S} (trained elsewhere; never trained into)")
    p.add_argument("--gpt2-pair", metavar="DIR", help="shorthand for --pair-dir gpt2-s01=DIR")
    p.add_argument("--text", default=DEFAULT_TEXT, help=f"Tiny Shakespeare (default {DEFAULT_TEXT})")
    p.add_argument("--tokenizer", default=DEFAULT_TOKENIZER, help="GPT-2 tokenizer to train text members with")
    p.add_argument("--cifar", default=DEFAULT_CIFAR, help="CIFAR-10 parquet directory")
    p.add_argument("--eval-examples", action="append", default=[], metavar="KIND=N",
                   help="evaluation slice: the first N test examples per data kind (0: all; defaults "
                   + ", ".join(f"{k}={v}" for k, v in EVAL_EXAMPLES.items()) + ")")
    p.add_argument("--glmc-path", help="GLMC's repository: adds its weight matching on the GPT-2 pairs")
    p.add_argument("--glmc-python", default=sys.executable, help="Python with GLMC's requirements")
    p.add_argument("--train-only", action="store_true", help="train (or find) the models, measure nothing")
    p.add_argument("--train-device", default="cpu", help="where the text members and the image members trained by "
                   "`fedbasin train` are trained (its --device: cpu, the default, reproduces the documented pairs; "
                   "a GPU trains a pair of the same recipe)")
    p.add_argument("--variant", action="append", default=[], metavar='NAME="OPTIONS"',
                   help="one more learned alignment per pair with these align options added (repeatable)")
    p.add_argument("--refine-seeds", type=int, nargs="+", default=[], metavar="S",
                   help="run every learned alignment of a pair again with --refine-seed S (rows learned@sS)")
    p.add_argument("--jobs", type=int, default=1, help="child commands side by side (default 1; each gets "
                   "OMP_NUM_THREADS = cores / jobs unless set)")
    p.add_argument("--skip-learned", action="store_true", help="leave out the learned alignment")
    p.add_argument("--merge", action="store_true", help="pairs: also the merge a user writes with data (fedbasin "
                   "merge A B --out M --refine-data SPEC: refined, then distilled) and its accuracy / loss")
    p.add_argument("--merge-variant", action="append", default=[], metavar='NAME="OPTIONS"',
                   help="pairs: one more merge with these merge options added (repeatable; implies --merge)")
    p.add_argument("--rerun", action="store_true", help="measure again even where a row of this code is stored")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:  # bad input: one line, exit 2, before any training
        members = select_members(args.members)
        args.pair_dirs = parse_pair_dirs(args.pair_dir + ([f"gpt2-s01={args.gpt2_pair}"] if args.gpt2_pair else []))
        args.eval_examples = parse_eval_examples(args.eval_examples)
        args.variants = parse_variants(args.variant)
        args.merge_variants = parse_variants(args.merge_variant, "--merge-variant")
        args.merge = args.merge or bool(args.merge_variants)
        if args.jobs < 1 or any(seed <= 0 for seed in args.refine_seeds):
            raise ValueError("--jobs must be >= 1 and --refine-seeds > 0 (seed 0 is the plain rows)")
        args.refine_seeds = list(dict.fromkeys(args.refine_seeds))
        check_inputs(members, args)
    except ValueError as error:
        print(f"{parser.prog}: error: {error}", file=sys.stderr)
        return 2
    out = Path(args.out or Path(args.cache) / "suite.json")
    version = code_version()
    stored = load_rows(out)
    meta = {"code": version, "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
            "threads_env": os.environ.get("OMP_NUM_THREADS"), "points": POINTS}
    rows: dict = dict(stored)
    started = time.perf_counter()
    Slots.set(args.jobs)
    todo = []
    try:
        for index, member in enumerate(members, 1):  # training (cached) one member after the other
            say(f"[{index}/{len(members)}] {member.name}")
            key = row_key(member, args, version)
            if not args.train_only and not args.rerun and reusable(stored.get(member.name), key, args.skip_learned):
                say(f"{member.name}: row of this code reused from {out}")
                continue
            todo.append((member, key, train_member(member, args)))
    except SuiteError as error:
        print(f"suite: {member.name}: {error}", file=sys.stderr)
        return 1

    def measure(member: Member, key: dict, paths: list[Path]) -> dict | SuiteError:
        t0 = time.perf_counter()
        build = universe_row if member.group == "universe" else pair_row
        try:
            row = build(member, paths, args, Path(args.cache) / "work" / member.name)
        except SuiteError as error:
            return error
        except Exception as error:  # noqa: BLE001 -- one member's surprise must not lose the others' rows
            return SuiteError(f"{type(error).__name__}: {error}")
        row.update(key=key, seconds=round(time.perf_counter() - t0, 1), date=time.strftime("%Y-%m-%d"))
        if args.jobs > 1:  # budgeted steps depend on the threads a child had
            row.update(jobs=args.jobs, child_threads=child_env()["OMP_NUM_THREADS"])
        return row

    def measured():  # (member, row or error), in order of completion; members side by side with --jobs
        if args.jobs == 1:
            yield from ((job[0], measure(*job)) for job in todo)
            return
        with ThreadPoolExecutor(len(todo)) as pool:
            futures = {pool.submit(measure, *job): job[0] for job in todo}
            try:
                yield from ((futures[f], f.result()) for f in as_completed(futures))
            except BaseException:  # an interrupt: the children running got it too; start no more
                Slots.stopping.set()
                raise

    failed = None
    for member, row in measured() if not args.train_only and todo else ():
        if isinstance(row, SuiteError):
            failed = failed or f"suite: {member.name}: {row}"
            continue
        rows[member.name] = row
        save_rows(out, rows, meta)
        say(f"{member.name}: done in {row['seconds']} s; " + ", ".join(
            f"{k} {v:.3f}" for k, v in row["barrier"].items()))
    if failed:
        print(failed, file=sys.stderr)
        return 1
    if args.train_only:
        say("models ready: " + ", ".join(m.name for m in members))
        return 0
    chosen = [rows[m.name] for m in members if m.name in rows]
    print(table(chosen))
    print(f"\n{len(chosen)} members, {time.perf_counter() - started:.0f} s; rows in {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
