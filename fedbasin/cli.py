"""``fedbasin align | merge | barrier | simulate``: the alignment core on checkpoints.

Checkpoints are directories (``config.json`` + ``model.safetensors``) of fedbasin models or of
Hugging Face models of every registered family (GPT-2, ViT, Llama/Mistral/Qwen2, GPT-NeoX, Phi;
``fedbasin.alignment.families``), detected from the config; what a model reads (text or images)
and its context length are its family's declarations, never a branch on names here. A JSON
summary goes to stdout; progress bars and log lines go to stderr. Outputs are written atomically.
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import functools
import json
import math
import os
import re
import sys
import time
from pathlib import Path

import torch
from torch import nn

from fedbasin import heap
from fedbasin.alignment.progress import close_open_bars
from fedbasin.commandline import (  # the README's exit-code table and the --help formatter
    EXIT_FAILED,
    EXIT_INPUT,
    EXIT_INTERNAL,
    EXIT_INTERRUPTED,
    EXIT_OUTPUT,
    EXIT_USAGE,
    HelpFormatter,
)
from fedbasin.data.sources import TOKENIZER_FILES, TOKENIZER_MARKERS
from fedbasin.options import AUTO, distillation_off, int64_problem

# ------------------------------------------------------------------------------------------------
# errors (exit codes: fedbasin.commandline, the table in README.md, "Command line")


class CliError(Exception):
    """A one-line error for the user; ``code`` is the process exit status."""

    code = EXIT_FAILED


class UsageError(CliError):
    code = EXIT_USAGE


class InputError(CliError):
    code = EXIT_INPUT


class OutputError(CliError):
    code = EXIT_OUTPUT


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (``prog: message (see prog --help)``, exit 2).

    A value that starts like a negative number (``-1,1``, ``-0.5``, ``-inf``) is taken as an
    option's value, not as an unknown option, so its type can judge it (no option of fedbasin
    looks like a number)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = re.compile(r"^-(\d|\.\d|inf|nan)", re.IGNORECASE)

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"{self.prog}: {message} (see {self.prog} --help)\n")

    def parse_known_args(self, args=None, namespace=None):
        self._refuse_repeated_options(sys.argv[1:] if args is None else list(args))
        return super().parse_known_args(args, namespace)

    def _refuse_repeated_options(self, tokens: list[str]) -> None:
        """An option's value given twice (also through its alias, or as --X and --no-X) is refused:
        argparse would keep the last one without a word. Repeatable options (action="append") are exempt; tokens
        after a subcommand's name are that subcommand's parser's to judge."""
        commands = {name for a in self._actions if isinstance(a, argparse._SubParsersAction) for name in a.choices}
        seen: dict[str, tuple[str, str]] = {}
        for token in tokens:
            if token == "--" or token in commands:
                return
            if not token.startswith("-") or self._negative_number_matcher.match(token):
                continue
            spelling = token.partition("=")[0]  # as typed
            found = self._option_named(spelling)
            if found is None or isinstance(found[0], (argparse._AppendAction, argparse._HelpAction)):
                continue
            action, option = found  # option: the spelling it stands for (an abbreviation's full name)
            if action.dest in seen:
                typed, before = seen[action.dest]
                if before != option:
                    self.error(f"both {typed} and {spelling} given; give one of them")
                if action.nargs != 0:  # a flag repeated means the same; a value given twice does not
                    self.error(f"{spelling} given twice; give it once" if typed == spelling else
                               f"both {typed} and {spelling} given (one option); give it once")
            seen[action.dest] = spelling, option

    def _option_named(self, text: str) -> tuple[argparse.Action, str] | None:
        """``(action, option string)`` of the option spelled ``text``, or of the one long option it
        abbreviates (None: no option, or an ambiguous abbreviation argparse refuses itself)."""
        if text in self._option_string_actions:
            return self._option_string_actions[text], text
        matches = {(a, spelling) for spelling, a in self._option_string_actions.items()
                   if text.startswith("--") and spelling.startswith(text)}
        return matches.pop() if len(matches) == 1 else None  # several: argparse's own "ambiguous option"


def _integer(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if why := int64_problem(value):
        raise argparse.ArgumentTypeError(f"{why}, got {text}")
    return value


def _number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


DATA_HELP = ("digits (scikit-learn, offline) | cifar10 (Hugging Face hub) | cifar10:DIR (train.parquet + "
             "test.parquet) or cifar10:FILE.parquet | text:FILE (UTF-8 text, character tokens)")


def _bounded(parse, low: float, strict: bool, what: str, high: float | None = None):
    """An argparse type: ``parse(text)``, refused unless ``> low`` (strict) or ``>= low``, and
    ``<= high`` when given."""

    def check(text: str):
        value = parse(text)
        if value < low or (strict and value == low) or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text}")
        return value

    return check


_positive_int = _bounded(_integer, 1, False, "a positive integer")
_nonnegative_int = _bounded(_integer, 0, False, "an integer >= 0")
_nonnegative_float = _bounded(_number, 0, False, "a number >= 0")
_positive_float = _bounded(_number, 0, True, "a number > 0")
_unit_float = _bounded(_number, 0, False, "a number in [0, 1]", high=1)


MAX_POINTS = 1001  # barrier --points: a λ step of 0.001 (each point evaluates the model on the whole split)


def _weights(text: str) -> list[float]:
    """Comma-separated finite weights >= 0, not all zero."""
    values = []
    for i, item in enumerate(text.split(",")):
        try:
            value = float(item)
        except ValueError:
            raise argparse.ArgumentTypeError(f"weight {i} is {item!r}, not a number") from None
        if not math.isfinite(value) or value < 0:
            raise argparse.ArgumentTypeError(f"weight {i} is {item}; weights must be finite and >= 0")
        values.append(value)
    if not any(values):
        raise argparse.ArgumentTypeError(f"all weights are zero in {text!r}")
    if not math.isfinite(sum(values)):
        raise argparse.ArgumentTypeError(f"the weights' sum overflows in {text!r}; give them on a smaller scale")
    return values


def _checkpoint_output_options(p, help: str = "output checkpoint directory") -> None:
    p.add_argument("--out", required=True, metavar="DIR", help=help)
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing checkpoint at --out (its weights and what describes them: config, "
                   "train.json, tokenizer; other files, e.g. a README, stay)")


def _device_option(p) -> None:
    p.add_argument("--device", default="auto", help="where the work runs: auto (CUDA when available) | cpu | "
                   "cuda | cuda:N (assignment problems are solved on the CPU)")


def _device(args) -> torch.device:
    """``--device`` resolved (one-line error when it is not usable here)."""
    from fedbasin.training import resolve_device

    try:
        return resolve_device(args.device)
    except ValueError as exc:
        raise UsageError(f"--{exc}") from None


def _matching_options(p: argparse.ArgumentParser, universe: bool = False) -> None:
    from fedbasin.options import MatchOptions, add_arguments

    g = p.add_argument_group("weight matching")
    add_arguments(g, MatchOptions, skip=() if universe else ("universe-iterations",))
    g.add_argument("--seen-tokens", metavar="SPEC",
                   help="weight token-embedding and output-head rows: text:FILE by their counts in that text's "
                   "training split (tokenised like the proxy data); auto: no data, the rows the two models' weights "
                   "judge trained (the untrained rows form a tight cluster at the init scale), weighted by the "
                   "frequency order the head reads; all: every row. Default: --refine-data's text when it is "
                   "text:FILE, else auto")
    g.add_argument("--token-weighting", choices=("seen", "sqrt", "count"), default="sqrt",
                   help="with --seen-tokens, weight token row t by √n_t (default), n_t or 1 (n_t: its count "
                   "in the training split)")


def _refine_options(p: argparse.ArgumentParser) -> None:
    from fedbasin.options import RefineOptions, add_arguments

    g = p.add_argument_group("learned refinement (on when --refine-data is given, and in align / merge of subword "
                             "LMs whose weights show untrained token rows on the data-free --refine-data bigram; "
                             "--refine-budget 0 turns that off; 'auto': the measured best for the model's kind, "
                             "sized by --refine-budget)")
    g.add_argument("--refine-data", metavar="SPEC", help="proxy data: " + DATA_HELP + " | unigram (data-free: "
                   "synthetic token blocks drawn by the token frequencies judged from the models' weights - the "
                   "rows judged trained, Zipf by the head's learned order - labelled by the models' own mean "
                   "predictions for training, keep-best and the report) | unigram:FILE (the same, drawn by the token "
                   "counts of FILE's training split) | bigram (as unigram, each next token drawn from the models' "
                   "mean prediction after the previous one alone)")
    g.add_argument("--tokenizer", metavar="DIR", help="Hugging Face tokenizer directory for text data (default: "
                   "the one saved in the reference checkpoint's directory, if any)")
    add_arguments(g, RefineOptions)


def _distill_options(p: argparse.ArgumentParser) -> None:
    from fedbasin.options import DistillOptions, add_arguments

    g = p.add_argument_group("ensemble distillation (on with --refine-data of real data: after the refinement the "
                             "models' ensemble is distilled into the merge on the same proxy data, keep-best on its "
                             "selection part; the models of weight 0 are no teachers; 'auto': by model kind, sized by "
                             "--distill-budget; --distill-steps 0 turns it off)")
    add_arguments(g, DistillOptions)


def _schema_dests(cls, surface_skip=()) -> tuple[str, ...]:
    from fedbasin.options import CLI, schema_fields

    return tuple(name.replace("-", "_") for name, _, _ in schema_fields(cls, CLI) if name not in surface_skip)


def _dest_groups():
    from fedbasin.options import DistillOptions, MatchOptions, RefineOptions

    matching = (*_schema_dests(MatchOptions, ("universe-iterations",)), "seen_tokens", "token_weighting")
    refine = _schema_dests(RefineOptions)
    return (matching, refine, _schema_dests(DistillOptions),
            ("seen_tokens", "token_weighting", "head_weight", "tokenizer", "refine_data", *refine))


MATCHING_OPTIONS, REFINE_OPTIONS, DISTILL_OPTIONS, STREAM_UNSUPPORTED = _dest_groups()
# the refinement options that act only through its steps: ignored with --refine-steps 0 (the start, the proxy's size,
# split, vocabulary, batches and seed still count: the start is written, the distillation reads the same proxy)
REFINE_STEP_OPTIONS = tuple(f"refine_{name}" for name in (
    "budget", "lr", "head_lr", "permutations", "group", "lambda", "schedule", "soft_labels", "soft_label_top_k", "dual",
    "vocabulary_samples", "vocabulary_batch_samples", "eval_every"))
# the distillation options ignored when --distill-steps 0 or --distill-budget 0 turn it off (the mixture still acts)
DISTILL_STEP_OPTIONS = tuple(d for d in DISTILL_OPTIONS if d not in ("distill_steps", "distill_budget", "distill_mixture"))


def _record_defaults(p: argparse.ArgumentParser) -> None:
    """Remember the defaults of the options whose effect depends on other options."""
    from fedbasin.options import CLI, GROUPS, schema_fields

    schema = {name.replace("-", "_"): f.default for cls in GROUPS for name, f, _ in schema_fields(cls, CLI)}
    dests = {*MATCHING_OPTIONS, *STREAM_UNSUPPORTED, *DISTILL_OPTIONS, "universe_iterations"}
    # a schema option not given is None; spelt out at its default it is not "given" either
    p.set_defaults(option_defaults={d: schema.get(d, p.get_default(d)) for d in dests})


def _plain(value):
    if isinstance(value, list) and all(isinstance(v, str) for v in value):  # --refine-lambda LO HI, LO,HI
        return ",".join(value)
    return list(value) if isinstance(value, tuple) else value


def _given(args) -> set[str]:
    """The dependent options of ``args`` set to something other than their default."""
    return {d for d, default in args.option_defaults.items()
            if getattr(args, d, None) is not None and _plain(getattr(args, d)) != _plain(default)}


def _refuse_ineffective_options(args) -> None:
    """An option that would be silently ignored is a usage error: every option given is honoured."""
    if not hasattr(args, "option_defaults"):  # commands without dependent options
        return
    given = _given(args)
    rules = []
    if getattr(args, "stream", False):
        rules.append((STREAM_UNSUPPORTED, "is not supported with --stream (layer-by-layer matching)"))
    if getattr(args, "no_align", False):
        rules.append(((*MATCHING_OPTIONS, "universe_iterations"), "has no effect with --no-align"))
    if args.command == "barrier" and not args.align:
        rules.append((MATCHING_OPTIONS, "has no effect without --align"))
    if "refine_data" not in given:  # (align / merge: --refine-budget also sizes the data-free refinement)
        rules.append((tuple(d for d in REFINE_OPTIONS if d != "refine_budget" or args.command not in ("align", "merge")),
                      "has no effect without --refine-data"))
        rules.append((DISTILL_OPTIONS, "has no effect without --refine-data (the proxy data it distils on)"))
        if args.command != "barrier" and not (args.seen_tokens or "").startswith("text:"):
            rules.append((("tokenizer",), "has no effect without --seen-tokens text:FILE or --refine-data"))
    elif _unigram_proxy(args):
        rules.append((DISTILL_OPTIONS, "has no effect with --refine-data unigram: distillation needs real proxy data"))
    if getattr(args, "refine_steps", None) == 0:  # the start and the proxy (also the distillation's) still count
        rules.append((REFINE_STEP_OPTIONS, "has no effect with --refine-steps 0 (no refinement steps)"))
    if hasattr(args, "distill_steps"):
        defaults = args.option_defaults  # (not given: None)
        steps = defaults["distill_steps"] if args.distill_steps is None else args.distill_steps
        budget = defaults["distill_budget"] if args.distill_budget is None else args.distill_budget
        if distillation_off(steps, budget):
            off = "--distill-steps 0" if steps == 0 else "--distill-budget 0"
            rules.append((DISTILL_STEP_OPTIONS, f"has no effect with {off} (no distillation)"))
    text_rows = (args.seen_tokens or "").startswith("text:") or (
        args.seen_tokens is None and (getattr(args, "refine_data", None) or "").startswith("text:"))
    if not text_rows:
        rules.append((("token_weighting",), "has no effect without --seen-tokens text:FILE (or --refine-data "
                      "text:FILE): auto rows are weighted from the models, all rows equally"))
    for dests, why in rules:
        for dest in dests:
            if dest in given:
                raise UsageError(f"--{dest.replace('_', '-')} {why}")


def _kind(checkpoint) -> str:
    """What the checkpoint's model is (:func:`fedbasin.options.model_kind`): it chooses the ``auto`` values."""
    from fedbasin.options import model_kind

    return model_kind(checkpoint.data, getattr(checkpoint.config, "vocab_size", None))


def _match_options(args):
    """The weight-matching options of ``args`` (:class:`fedbasin.options.MatchOptions`), checked by the
    schema (the first problem is a usage error); ``auto`` stays for :func:`_for_model` to set."""
    from fedbasin.options import CLI, MatchOptions, from_args, problems

    try:
        match = from_args(MatchOptions, args)
    except ValueError as error:
        raise UsageError(str(error).splitlines()[0]) from None
    if found := problems([match], CLI):
        raise UsageError(found[0])
    return match


def _for_model(match, checkpoint):
    """``match`` with ``auto`` set for what ``checkpoint``'s model is."""
    from fedbasin.options import resolve_match

    return resolve_match(match, _kind(checkpoint))


CHECKPOINT_HELP = "checkpoint directory (fedbasin or Hugging Face GPT-2/ViT/Llama/GPT-NeoX: config.json + model.safetensors)"


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="fedbasin", formatter_class=HelpFormatter,
        description="Align, merge and compare Transformer checkpoints by their exact symmetries; train and "
        "evaluate checkpoints; run federated simulations. Every command prints a JSON summary on stdout "
        "(simulate: a table); progress goes to stderr; outputs are written atomically.",
        epilog="Run 'fedbasin COMMAND --help' for a command's options. Design: docs/design.md. "
        "Exit codes: README.md, 'Command line'.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("align", formatter_class=HelpFormatter,
                       help="write CANDIDATE transformed into REFERENCE's basis (same function)",
                       description="Weight matching: find the symmetry transformation of CANDIDATE that best "
                       "matches REFERENCE and write the transformed CANDIDATE (it computes the same function) "
                       "in REFERENCE's format. Prints the objective per iteration.")
    p.add_argument("reference", metavar="REFERENCE", help=CHECKPOINT_HELP)
    p.add_argument("candidate", metavar="CANDIDATE", help="checkpoint of the same architecture as REFERENCE")
    _checkpoint_output_options(p)
    _matching_options(p)
    _refine_options(p)
    _device_option(p)
    p.add_argument("--stream", action="store_true",
                   help="layer by layer from disk, for checkpoints too large for memory (standard-layout "
                        "safetensors: Llama/Mistral/Qwen2, fedbasin); output written shard by shard")
    p.set_defaults(func=cmd_align)
    _record_defaults(p)

    p = sub.add_parser("merge", formatter_class=HelpFormatter,
                       help="align every MODEL to REFERENCE and write the weighted average",
                       description="Align every MODEL to REFERENCE (weight matching, optionally universe "
                       "matching) and write the weighted average in REFERENCE's basis and format. With "
                       "--refine-data, the alignment is refined on that proxy data and the models' ensemble is "
                       "then distilled into the average (each within its budget, 2 minutes by default); the merge, each "
                       "model and their ensemble are then scored on the proxy's held-out split (one stderr line; "
                       "refinement.against_models in the summary).")
    p.add_argument("reference", metavar="REFERENCE", help=CHECKPOINT_HELP + "; the merge lives in its basis")
    p.add_argument("models", nargs="+", metavar="MODEL", help="checkpoints of the same architecture")
    _checkpoint_output_options(p)
    p.add_argument("--weights", type=_weights, metavar="W0,W1,...",
                   help="one weight per model, REFERENCE first, normalised to sum 1 (default: equal)")
    p.add_argument("--no-align", action="store_true", help="plain weighted averaging (no alignment)")
    _refine_options(p)
    _distill_options(p)
    _matching_options(p, universe=True)
    _device_option(p)
    p.set_defaults(func=cmd_merge)
    _record_defaults(p)

    p = sub.add_parser("barrier", formatter_class=HelpFormatter,
                       help="losses along λ·A + (1−λ)·B and the loss barrier, as JSON",
                       description="Loss of λ·A + (1−λ)·B on a λ grid and the barrier max_λ [L(λ) − (λ·L(A) + "
                       "(1−λ)·L(B))]. With --align, B is aligned to A first and both curves are reported "
                       "(vanilla and aligned).")
    p.add_argument("a", metavar="A", help=CHECKPOINT_HELP + " (λ = 1)")
    p.add_argument("b", metavar="B", help="checkpoint of the same architecture (λ = 0)")
    p.add_argument("--data", required=True, metavar="SPEC", help=DATA_HELP)
    p.add_argument("--tokenizer", metavar="DIR", help="Hugging Face tokenizer directory for text data "
                   "(default: the one saved in A's checkpoint directory, if any)")
    p.add_argument("--split", default="test", choices=["train", "test"], help="split the losses are measured on")
    p.add_argument("--max-examples", type=_nonnegative_int, default=2000, metavar="N",
                   help="evaluate on the first N examples of the split (0: all)")
    points = _bounded(_integer, 2, False, f"an integer from 2 to {MAX_POINTS}", high=MAX_POINTS)
    p.add_argument("--points", type=points, default=11, help=f"λ grid size (2 to {MAX_POINTS}), λ evenly spaced in [0, 1]")
    p.add_argument("--align", action="store_true", help="align B to A first; report vanilla and aligned curves")
    p.add_argument("--plot", metavar="PNG", help="also draw the curves (vanilla, aligned) to this PNG file")
    _matching_options(p)
    _device_option(p)
    p.set_defaults(func=cmd_barrier)
    _record_defaults(p)

    _add_train_parser(sub)
    _add_eval_parser(sub)

    try:
        from fedbasin import simulate
    except ImportError:  # pragma: no cover - the simulation needs flwr
        simulate = None
    if simulate is not None:
        simulate.add_parser(sub)
    return parser


# ------------------------------------------------------------------------------------------------


def _load(path: str, role: str):
    """The checkpoint at ``path``, computing in float32 (outputs are written in its stored dtype)."""
    from fedbasin.checkpoint import in_float32, load_checkpoint

    try:
        return in_float32(load_checkpoint(path))
    except (OSError, ValueError, ImportError) as exc:
        raise InputError(f"{role} {path}: {exc}") from None


def _standard(checkpoint, device: torch.device | None = None) -> dict:
    """The checkpoint's state in its spec's standard layout, on ``device`` (default: where it is)."""
    state = checkpoint.adapter.to_standard(checkpoint.state)
    return state if device is None else {k: v.to(device) for k, v in state.items()}


def _same_architecture(reference, other, role: str, path: str) -> None:
    from fedbasin.checkpoint import architecture_mismatch
    from fedbasin.data.sources import CharTokenizer

    if why := architecture_mismatch(reference, other):
        raise InputError(f"{role} {path}: {why}")
    if reference.path is None or other.path is None:
        return
    try:  # a character model's ids are its characters' ranks: two tables of one size may still differ
        mine, theirs = CharTokenizer.saved_characters(reference.path), CharTokenizer.saved_characters(other.path)
    except ValueError as exc:
        raise InputError(f"{role} {path}: {exc}") from None
    if mine is not None and theirs is not None and mine != theirs:
        first = next(i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b)
        raise InputError(f"{role} {path}: its characters.json differs from {reference.path}'s (token {first} is "
                         f"{theirs[first]!r} there, {mine[first]!r} here): the models read different token ids")


def _check_writable(path: Path, option: str) -> None:
    """Something can be written at ``path`` (:func:`fedbasin.atomic.write_problem`: a probe write
    in the directories involved), checked before any work."""
    from fedbasin.atomic import write_problem

    if problem := write_problem(path):
        raise OutputError(f"{option} {path}: {problem}")


def check_checkpoint_output(out: str, option: str = "--out", overwrite: bool = False) -> None:
    """``out`` can take a checkpoint: absent, an empty directory, or with ``overwrite`` an existing
    checkpoint (replaced atomically at the end, files beside its weights such as train.json with
    it); and writable. Nothing stored is replaced unless asked."""
    from fedbasin.checkpoint import CONFIG_FILE

    if not str(out):
        raise UsageError(f"{option} is empty: give the output checkpoint directory")
    path = Path(out)
    if path.exists() and not path.is_dir():
        raise OutputError(f"{option} {out} exists and is not a directory")
    if path.is_dir() and any(path.iterdir()):
        if not (path / CONFIG_FILE).is_file():
            raise OutputError(f"{option} {out} is a non-empty directory without {CONFIG_FILE}, "
                              "not a checkpoint; refusing to replace it")
        if not overwrite:
            raise OutputError(f"{option} {out} already holds a checkpoint; pass --overwrite to replace it "
                              "or choose another directory")
    _check_writable(path, option)


def check_file_output(out: str, option: str) -> None:
    path = Path(out)
    if path.is_dir():
        raise OutputError(f"{option} {out} is a directory")
    _check_writable(path, option)


def check_plot_output(out: str, option: str) -> None:
    """A writable file whose suffix names a format matplotlib writes (png, pdf, svg, ...)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    check_file_output(out, option)
    formats = FigureCanvasAgg(Figure()).get_supported_filetypes()
    suffix = Path(out).suffix.lstrip(".").lower()
    if suffix not in formats:
        raise OutputError(f"{option} {out}: cannot draw a {suffix or 'suffix-less'} file; "
                          f"name one of {', '.join(sorted(formats))}")


def _tokenizer_copier(checkpoint_dir):
    """``copy(directory)``: the tokenizer files beside the checkpoint ``checkpoint_dir`` (if any) copied into it."""
    import shutil

    tokenizer = [Path(checkpoint_dir) / name for name in TOKENIZER_FILES] if checkpoint_dir is not None else []

    def copy(directory: Path) -> None:
        for source in tokenizer:
            if source.is_file():
                shutil.copyfile(source, directory / source.name)

    return copy


def _save(out: str, reference, standard_state: dict) -> None:
    """Write ``standard_state`` in the reference's format and family, with the tokenizer files saved beside the
    reference (a merged or aligned language model reads the same tokens), in one atomic write."""
    from fedbasin.atomic import missing_ancestors
    from fedbasin.checkpoint import cast_floating, save_checkpoint

    state = {k: v.cpu() for k, v in reference.adapter.from_standard(standard_state).items()}
    if reference.stored_dtype is not None:  # computed in float32 (_load): written as the reference's file is
        state = cast_floating(state, reference.stored_dtype)
    copy_tokenizer = _tokenizer_copier(reference.path)
    created = missing_ancestors(Path(out))
    try:
        save_checkpoint(out, reference.family, reference.config, state, kind=reference.kind,
                        extra_files=copy_tokenizer)
    except OSError as exc:  # disk full, quota, permissions changed meanwhile: nothing is left
        for directory in created:
            try:
                directory.rmdir()
            except OSError:
                break
        reason = exc.strerror or str(exc)
        raise OutputError(f"--out {out}: cannot write the checkpoint ({reason}); nothing was written") from None


def _note_tiny_gains(summary: dict, gains: dict) -> None:
    """The reference's tiny-gain dims (canonical.py) go into the summary, and one stderr line says
    that the output's gauge differs from the reference's there (γ = 1)."""
    from fedbasin.alignment.canonical import tiny_gain_dims

    if dims := tiny_gain_dims(gains):
        summary["tiny_gain_dims"] = dims
        ref = summary.get("reference") or summary["models"][0]
        print(f"fedbasin {summary['command']}: the reference has tiny norm gains (tiny_gain_dims in the summary): "
              "the output keeps γ = 1 there, so its gauge differs from the reference's and averaging it with the "
              f"raw reference is not the canonical interpolation; use the reference's gauged form instead "
              f"(fedbasin align {ref} {ref} --out GAUGED)", file=sys.stderr)


def _gauged_form(checkpoint, summary: dict) -> dict:
    """The checkpoint's weights in its own gauge as the aligned models get it: itself, unless it
    has tiny norm gains (then γ = 1 there, canonical.py; recorded as ``tiny_gain_dims``)."""
    from fedbasin.alignment import canonicalize, to_gauge
    from fedbasin.alignment.canonical import tiny_gain_dims

    standard = _standard(checkpoint)
    if not (dims := tiny_gain_dims(_gains(checkpoint.spec, standard))):
        return checkpoint.state
    summary["tiny_gain_dims"] = dims
    c = canonicalize(checkpoint.spec, standard)
    return checkpoint.adapter.from_standard(to_gauge(checkpoint.spec, c.state, c.gains))


def _gains(spec, state: dict) -> dict:
    return {n.weight: state[n.weight] for n in spec.norms if n.weight}


def _finite_or_null(value):
    """``value`` with every NaN or infinite float as ``None``: the summary stays valid JSON (``null``)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite_or_null(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_or_null(v) for v in value]
    return value


def _emit(summary: dict) -> int:
    """The command's summary on stdout as strict JSON (a non-finite number is ``null``)."""
    json.dump(_finite_or_null(summary), sys.stdout, indent=2, allow_nan=False)
    sys.stdout.write("\n")
    return 0


def cmd_align(args) -> int:
    from fedbasin.alignment import weight_match

    if getattr(args, "stream", False):
        return _stream_align(args)
    device, match = _device(args), _match_options(args)  # usage errors before the checkpoints load
    ref, cand = _load(args.reference, "reference"), _load(args.candidate, "candidate")
    _same_architecture(ref, cand, "candidate", args.candidate)
    match = _for_model(match, ref)
    summary = {"command": "align", "reference": args.reference, "candidate": args.candidate, "out": args.out,
               "symmetry": match.symmetry, "matching": dataclasses.asdict(match)}
    try:
        reference, candidate = _standard(ref, device), _standard(cand, device)
        _default_data_free(args, ref, [reference, candidate], match, summary)
        if args.refine_data:
            refine, info, _ = _refiner(args, ref, "align", match, [reference, candidate])
            result = refine(reference, [candidate])
            aligned = result.states[0]
            if info["dual"]:  # g_ref⁻¹·g_cand·B: the same path from the unmoved reference (the maps act linearly)
                from fedbasin.alignment import apply_group, canonicalize, inverse, to_gauge

                back = apply_group(ref.spec, result.canonical[0], inverse(result.reference_transform))
                aligned = to_gauge(ref.spec, back, canonicalize(ref.spec, reference).gains)
            summary["refinement"] = {**info, **result.summary()}
        else:
            result = weight_match(ref.spec, reference, candidate, match=match,
                                  progress=True, token_rows=_seen_tokens(args, ref, "align"))
            aligned = result.state
            summary.update(iterations=result.iterations, start=result.start,
                           initial_objective=result.initial_objective, objective=result.objective,
                           seconds=round(result.seconds, 3))
            if result.token_rows is not None:
                summary["token_rows"] = result.token_rows
    except ValueError as exc:
        raise InputError(str(exc)) from None
    _save(args.out, ref, aligned)
    _note_tiny_gains(summary, _gains(ref.spec, ref.adapter.to_standard(ref.state)))
    return _emit(summary)


def _stream_align(args) -> int:
    from fedbasin.checkpoint import stream_align

    try:
        match = _match_options(args)
        result = stream_align(args.reference, args.candidate, args.out, mode=match.symmetry,
                              iterations=match.align_iterations, tol=match.align_tol, device=_device(args),
                              progress=True, extra_files=_tokenizer_copier(args.reference))
    except (FileNotFoundError, KeyError, ValueError) as exc:
        raise InputError(str(exc)) from None
    summary = {
        "command": "align", "stream": True, "reference": args.reference, "candidate": args.candidate,
        "out": args.out, "symmetry": match.symmetry, "iterations": result.iterations,
        "initial_objective": result.objective[0], "objective": result.objective, "seconds": round(result.seconds, 3),
    }
    _note_tiny_gains(summary, result.gains)
    return _emit(summary)


def cmd_merge(args) -> int:
    from fedbasin.alignment import merge

    device, match = _device(args), _match_options(args)  # usage errors before the checkpoints load
    paths = [args.reference, *args.models]
    checkpoints = [_load(p, "reference" if i == 0 else "model") for i, p in enumerate(paths)]
    match = _for_model(match, checkpoints[0])
    for path, ckpt in zip(paths[1:], checkpoints[1:]):
        _same_architecture(checkpoints[0], ckpt, "model", path)
    if args.weights is not None and len(args.weights) != len(paths):
        raise UsageError(f"--weights has {len(args.weights)} values for {len(paths)} models")
    if args.refine_data and args.no_align:
        raise UsageError("--refine-data needs alignment (drop --no-align)")
    summary = {"command": "merge", "models": paths, "weights": args.weights or [1.0] * len(paths), "out": args.out,
               "symmetry": None if args.no_align else match.symmetry,
               "matching": None if args.no_align else dataclasses.asdict(match)}
    states = [_standard(c, device) for c in checkpoints]
    gains = _gains(checkpoints[0].spec, states[0])
    try:
        if not args.no_align:
            _default_data_free(args, checkpoints[0], states, match, summary)
        if args.refine_data:
            merged, info = _refined_merge(args, checkpoints, states, match)
            summary["refinement"] = info
        else:
            result = merge(checkpoints[0].spec, states, weights=args.weights, match=match,
                           align=not args.no_align, progress=True,
                           token_rows=_seen_tokens(args, checkpoints[0], "merge"))
            merged = result.state
            summary.update(universe_change=result.universe_change, objectives=result.objectives,
                           seconds=round(result.seconds, 3))
            if result.token_rows is not None:
                summary["token_rows"] = result.token_rows
    except ValueError as exc:
        raise InputError(str(exc)) from None
    _save(args.out, checkpoints[0], merged)
    _note_tiny_gains(summary, gains)
    return _emit(summary)


def _refined_merge(args, checkpoints, states, match) -> tuple[dict, dict]:
    """Weight (or universe) matching, then learned refinement on proxy data, then (by default, on real data)
    the models' ensemble distilled into the merge; returns (merged state, summary)."""
    from fedbasin.alignment import refined_merge

    weights = args.weights or [1.0] * len(states)
    refine, info, proxy = _refiner(args, checkpoints[0], "merge", match, states)
    options = _resolved_distill(args, info["kind"])  # checked before any long work
    distill = _distiller(checkpoints[0], info["kind"], proxy, options)
    chosen: dict = {}
    mix = _mixer(checkpoints[0], proxy, states[0], [args.reference, *args.models], chosen) \
        if options.mixture == "best" and proxy.split is not None else None
    merged, result = refined_merge(checkpoints[0].spec, states, weights, 0, refine, mix=mix)
    summary = {**info, **result.summary(), **chosen}
    if distill is not None:
        merged, summary["distillation"] = distill(merged, [s for s, w in zip(states, weights) if w > 0])
    if proxy.test is not None:
        paths = [args.reference, *args.models]
        summary["against_models"] = _against_models(checkpoints[0], proxy, merged, states, paths)
    return merged, summary


# The test examples a merge is scored on beside its models: the first ones, at most this many and at most
# AGAINST_MODELS_TARGETS predicted targets (512 blocks of 128 tokens), one pass of the merge and of each model
AGAINST_MODELS_EXAMPLES, AGAINST_MODELS_TARGETS = 2048, 65536


def _against_models(ref, proxy: _Proxy, merged: dict, states: list[dict], paths) -> dict:
    """The written merge beside its models (:func:`fedbasin.server.distill.merge_against_members`) on the test
    split of ``--refine-data``, which neither the refinement nor the distillation read (its first examples, see
    :data:`AGAINST_MODELS_EXAMPLES`), and one stderr line saying whether the merge is better than the best of them."""
    from fedbasin.server.distill import merge_against_members
    from fedbasin.training import cross_entropy
    from fedbasin.weights import holding_weights

    rows, cut, split = proxy.test_in_vocabulary(ref.spec, merged)
    module_states = [ref.adapter.from_standard(cut(s)) for s in (merged, *states)]
    device = next(iter(merged.values())).device
    with holding_weights(proxy.module, module_states[0], device, reshaped=rows is not None):
        found = merge_against_members(proxy.module, module_states[0], module_states[1:], cross_entropy, split,
                                      progress=True)
    gap, best = found["merge_minus_best_model"], found["best_model"]
    points = 100 * gap["accuracy"]
    accuracy = ("level in accuracy" if abs(points) < 0.05
                else f"{'ahead' if points > 0 else 'behind'} by {abs(points):.1f} points of accuracy")
    print(f"fedbasin merge: on {found['examples']} examples of the test split of --refine-data (read by neither "
          f"the refinement nor the distillation): loss of the "
          f"merge {found['merge']['loss']:.4f}, of the best model ({paths[best]}) {found['models'][best]['loss']:.4f}, "
          f"of the models' ensemble {found['ensemble']['loss']:.4f}; the merge is "
          f"{'better than' if gap['loss'] < 0 else 'behind'} the best model by {abs(gap['loss']):.4f} in loss, "
          f"{accuracy}", file=sys.stderr)
    return {"split": "test", "vocabulary": None if rows is None else len(rows.ids), **found}


@dataclasses.dataclass
class _Proxy:
    """The proxy data of ``--refine-data`` as the refinement read it: ``split`` (None for a synthetic unigram
    proxy, which the models label), the module that evaluates the spec's states, and the resolved options."""

    split: object
    module: torch.nn.Module
    options: object
    vocabulary: torch.Tensor | None = None  # the refinement's training vocabulary (token ids; None: every token)
    test: object = None  # the data's test split (never read by the refinement); None for a proxy the models label

    def streams(self, split=None):
        """``split`` (default: the proxy's own) cut into training / selection / evaluation parts as the
        refinement cut its proxy (:func:`~fedbasin.alignment.proxy_streams`, the same shares and seed)."""
        from fedbasin.alignment import proxy_streams
        from fedbasin.config import eval_batch_size

        o = self.options
        # selection/report batches of at most 32 examples whose logits stay under 2^26 values: GPT-2's
        # 50,257 tokens give 10 blocks of 128, and its head's product then runs 2.7 times faster per value
        # than with 32 blocks (a 206 MB output instead of 823 MB; docs/journal/merging-notes.md §13)
        return proxy_streams(self.split if split is None else split, o.batch_size, seed=o.seed,
                             selection_fraction=o.selection_fraction, evaluation_fraction=o.evaluation_fraction,
                             eval_batch_size=eval_batch_size(self.split, self.module, most=32))

    def in_vocabulary(self, spec, state: dict):
        """``(rows, cut, streams)``: the refinement's training vocabulary (a :class:`TrainingVocabulary` of
        ``state``, or None: every token), the map cutting a standard state's token rows to it, and the proxy's
        streams renumbered into it — the full model's logits at those tokens, a fraction of the head's cost."""
        from fedbasin.alignment.vocabulary import TrainingVocabulary

        if self.vocabulary is None:
            return None, (lambda s: s), self.streams()
        rows = TrainingVocabulary(spec, state, self.vocabulary)
        return rows, rows.cut, self.streams(rows.renumber_split(self.split))

    def test_in_vocabulary(self, spec, state: dict):
        """``(rows, cut, batches)`` as :meth:`in_vocabulary` gives them, for the test split's first examples
        (:data:`AGAINST_MODELS_EXAMPLES`): the vocabulary is the refinement's and the test tokens, so every
        target is scored."""
        from fedbasin.alignment.vocabulary import TrainingVocabulary
        from fedbasin.config import eval_batch_size

        per_example = self.test.targets[0].numel()
        test = self.test.subset(torch.arange(min(len(self.test), AGAINST_MODELS_EXAMPLES,
                                                 max(1, AGAINST_MODELS_TARGETS // per_example))))
        rows, cut = None, (lambda s: s)
        if self.vocabulary is not None:
            rows = TrainingVocabulary(spec, state, torch.cat([self.vocabulary, test.token_ids()]))
            cut, test = rows.cut, rows.renumber_split(test)
        return rows, cut, list(test.batches(eval_batch_size(test, self.module, most=32)))


# The merge weights are chosen (--distill-mixture best) on at most this many targets of the selection split: the
# first 128 blocks of 128 tokens of a subword LM's, every image of an image proxy's
MIXTURE_TARGETS = 16384


def _mixer(ref, proxy: _Proxy, like: dict, paths: list[str], chosen: dict):
    """``mix(weights, merge_of) -> weights`` for :func:`~fedbasin.alignment.refined_merge`:
    :func:`~fedbasin.alignment.merge.best_mixture` scored by the cross-entropy on the first
    :data:`MIXTURE_TARGETS` targets of the proxy's selection split (as the refinement cut it; a subword LM
    over the refinement's vocabulary); what it chose goes into ``chosen["mixture"]`` and one stderr line."""
    from fedbasin.alignment.merge import MIXTURE_SHARES, best_mixture
    from fedbasin.alignment.progress import progress_bar
    from fedbasin.server.distill import StateEnsemble, mean_loss
    from fedbasin.training import cross_entropy
    from fedbasin.weights import holding_weights

    def mix(weights: list[float], merge_of) -> list[float]:
        rows, cut, data = proxy.in_vocabulary(ref.spec, like)
        per_batch = data.selection[0][1].numel()
        selection = data.selection[:max(1, MIXTURE_TARGETS // per_batch)]
        device = next(iter(like.values())).device
        bar = progress_bar(sum(w > 0 for w in weights) + 1 + len(MIXTURE_SHARES), True,
                           "choosing the merge weights", "candidate")

        def loss_of(w: list[float]) -> float:
            state = ref.adapter.from_standard(cut(merge_of(w)))
            with holding_weights(proxy.module, state, device, reshaped=rows is not None):
                loss = mean_loss(StateEnsemble(proxy.module, [state]), cross_entropy, selection, device)
            bar.update()
            return loss

        start = time.perf_counter()
        found = best_mixture(weights, loss_of)
        bar.close()
        chosen["mixture"] = {**found.summary(), "selection_examples": sum(len(y) for _, y in selection),
                             "seconds": round(time.perf_counter() - start, 3)}
        print(f"fedbasin merge: merge weights {', '.join(f'{w:.3g}' for w in found.weights)} "
              f"(a share {found.share:g} of the way from the given weights to {paths[found.model]}, the lowest "
              f"selection loss of the line: {dict(found.losses)[found.share]:.4f}, given weights "
              f"{found.losses[0][1]:.4f})", file=sys.stderr)
        return found.weights

    return mix


def _resolved_distill(args, kind: str):
    """The schema's :class:`~fedbasin.options.DistillOptions` of ``args``, ``auto`` set for ``kind`` and
    ``fedbasin merge`` (:func:`~fedbasin.options.resolve_distill`); a bad value is a usage error."""
    from fedbasin.options import DistillOptions, from_args, resolve_distill

    try:
        return resolve_distill(from_args(DistillOptions, args), kind, merge=True)
    except ValueError as error:
        raise UsageError(str(error).splitlines()[0]) from None


def _distiller(ref, kind: str, proxy: _Proxy, options):
    """``distill(merged, teachers) -> (state, summary)``: the teachers' ensemble (their mean logits, or
    probabilities) distilled into ``merged`` on ``proxy``'s split, split as the refinement split it (its
    selection part keeps the best student, θ₀ included), with resolved ``options`` (:func:`_resolved_distill`,
    the steps sized by ``--distill-budget``); None when off (no real proxy data, ``--distill-steps 0`` or a
    budget of 0)."""
    from fedbasin.options import MERGE_DISTILL_CHECKS_AT_END, distill_call
    from fedbasin.server.distill import EVAL_EVERY, ensemble_distill, named_augment
    from fedbasin.training import cross_entropy
    from fedbasin.weights import holding_weights

    auto = options.steps == AUTO
    if proxy.split is None or distillation_off(options.steps, options.budget):
        return None
    try:
        augment = named_augment(options.augment, tuple(proxy.split.inputs.shape[1:]))
    except ValueError as error:
        raise UsageError(f"--{error}") from None
    refine, call = proxy.options, distill_call(options)
    eval_every = sys.maxsize if kind in MERGE_DISTILL_CHECKS_AT_END else EVAL_EVERY  # (the start and the last step)

    def distill(merged: dict, teachers: list[dict]) -> tuple[dict, dict]:
        rows, cut, data = proxy.in_vocabulary(ref.spec, merged)
        start = ref.adapter.from_standard(cut(merged))
        device = next(iter(start.values())).device  # --device: where the states are
        with holding_weights(proxy.module, start, device, reshaped=rows is not None) as student:  # and runs there
            result = ensemble_distill(
                proxy.module, student, [ref.adapter.from_standard(cut(t)) for t in teachers], cross_entropy,
                data.batches, data.selection, data.evaluation, steps=None if auto else options.steps,
                budget=options.budget if auto else None, augment=augment, seed=refine.seed, progress=True,
                eval_every=eval_every, **call)
        state = ref.adapter.to_standard(result.state)
        return (state if rows is None else rows.paste(merged, state)), {
            **call, **result.summary(), "teachers": len(teachers), "budget_seconds": options.budget if auto else None,
            "augment": options.augment, "vocabulary": None if rows is None else len(rows.ids),
            "keep_best_checks": "start and end" if eval_every == sys.maxsize else f"every {eval_every} steps"}

    return distill


def _refiner(args, ref, command: str, match, states: list[dict]):
    """``refine(reference, candidates, **kw)`` on the proxy split of ``--refine-data``: the schema's options
    (``auto`` resolved for the model's kind, :func:`fedbasin.options.resolve_refine`) through the one
    translator :func:`fedbasin.options.refine_call` with ``match`` (resolved for ``ref``) for its start; a
    summary of what was used; and the proxy data it reads (:class:`_Proxy`)."""
    from fedbasin.alignment import learned_refine
    from fedbasin.alignment.vocabulary import vocabulary_ids
    from fedbasin.checkpoint import build_torch_model
    from fedbasin.data import unigram_blocks
    from fedbasin.options import (
        CLI,
        WEIGHTS_PROXIES,
        RefineOptions,
        from_args,
        problems,
        resolve_refine,
        synthetic_proxy,
    )
    from fedbasin.training import cross_entropy

    try:
        chosen = from_args(RefineOptions, args)
    except ValueError as error:
        raise UsageError(str(error).splitlines()[0]) from None
    synthetic = synthetic_proxy(args.refine_data)
    unigram = synthetic is not None
    kind = _kind(ref)
    resolved = resolve_refine(chosen, kind, synthetic=synthetic, gpu=_device(args).type == "cuda")
    options = resolved.options
    if found := problems([chosen, match], CLI, data=args.refine_data):  # what the user gave
        raise UsageError(found[0])
    if resolved.steps is None and options.budget <= 0:
        raise UsageError("--refine-budget 0 --refine-steps auto: nothing to refine (give --refine-steps N or a "
                         "budget > 0, or drop --refine-data)")
    if options.dual and getattr(args, "weights", None) and args.weights[0] == 0:
        if "dual" not in resolved.chosen:
            raise UsageError("--refine-dual moves the reference along the path: its --weights entry must be > 0")
        options = resolved.options = dataclasses.replace(options, dual=False)  # auto yields to --weights
    train = None
    module = build_torch_model(ref)
    if args.refine_data in WEIGHTS_PROXIES:  # the frequencies judged from the models' weights
        proxy = _weights_proxy(ref, states, options, module, chained=args.refine_data == "bigram")
    elif unigram:  # the text's training split gives the counts; the proxy is drawn from them
        text_file = args.refine_data.partition(":")[2]
        if not text_file:
            raise UsageError("--refine-data unigram:FILE needs the text file whose token counts it draws from "
                             "(or unigram alone: frequencies judged from the models' weights)")
        task = _task_for(ref, "text:" + text_file, args.tokenizer, args.reference, command, "--refine-data",
                         shown=args.refine_data)
        proxy, train = unigram_blocks(task.train.token_ids(), int(ref.config.vocab_size), options.examples,
                                      task.train.inputs.shape[1], seed=options.seed), task.train
    else:
        task = _task_for(ref, args.refine_data, args.tokenizer, args.reference, command, "--refine-data",
                         proxy_size=options.examples, proxy_at_most="examples" in resolved.chosen)
        proxy, train = task.proxy, task.train
    if found := problems([options, match], CLI, data=args.refine_data):  # with the auto choices, on data it reads
        raise UsageError(found[0])
    data = _Proxy(proxy, module, options).streams()
    vocabulary = vocabulary_ids(options.vocabulary, proxy, train)  # None for the full vocabulary
    refine = functools.partial(
        learned_refine, ref.spec, module, loss_fn=cross_entropy, batches=data.batches,
        selection=data.selection, evaluation=data.evaluation, options=resolved, match=match,
        token_rows=_seen_tokens(args, ref, command), vocabulary=vocabulary,
        to_module_state=ref.adapter.from_standard, progress=True, model_labels=unigram)
    info = {"kind": kind, "budget_seconds": options.budget, "seed": options.seed, "lr": options.lr,
            "head_lr": options.head_lr or options.lr, "auto": resolved.chosen,
            "proxy_examples": len(proxy), "proxy": args.refine_data.partition(":")[0] if unigram else "data",
            "labels": "models" if unigram else "data", "selection_fraction": options.selection_fraction,
            "evaluation_fraction": options.evaluation_fraction, "soft_labels": options.soft_labels,
            "soft_label_top_k": options.soft_label_top_k, "dual": options.dual,
            "vocabulary": options.vocabulary, "vocabulary_samples": options.vocabulary_samples,
            "vocabulary_batch_samples": options.vocabulary_batch_samples}
    # every other setting the run used, given or chosen (lambda, group, ...); budget, workers and steps are
    # recorded as budget_seconds, batch_workers and the run's own steps, an auto left unset not at all
    for f in dataclasses.fields(options):
        value = getattr(options, f.name)
        if f.name not in ("budget", "workers", "steps") and value != AUTO:
            info.setdefault(f.name.rstrip("_"), value)
    if args.refine_data in WEIGHTS_PROXIES:
        info["frequencies"] = "weights"
    elif task.tokenizer is not None:
        info["tokenizer"] = str(getattr(task.tokenizer, "path", "character-level"))
    test = None if args.refine_data in WEIGHTS_PROXIES or not len(task.test) else task.test
    return refine, info, _Proxy(None if unigram else proxy, module, options, vocabulary, test)


def _default_data_free(args, checkpoint, states: list[dict], match, summary: dict) -> None:
    """Plain ``align`` / ``merge`` (no ``--refine-data``, the orthogonal symmetry) of causal LMs with a subword
    vocabulary whose weights tell the trained token rows from the untrained ones: the best data-free alignment measured,
    weight matching refined on ``--refine-data bigram`` (:data:`fedbasin.options.DATA_FREE_PROXY`: synthetic
    blocks the models label) within
    ``--refine-budget`` seconds (default 120; 0: weight matching alone). Sets ``args.refine_data``;
    ``summary["data_free"]`` says which was run. A ``--refine-budget`` that sizes nothing is refused."""
    from fedbasin.alignment.token_rows import infer_token_rows
    from fedbasin.options import DATA_FREE_PROXY, SUBWORD_LM, RefineOptions

    if args.refine_data:
        return
    budget = RefineOptions.budget if args.refine_budget is None else args.refine_budget
    rows = infer_token_rows(checkpoint.spec, *states) if _kind(checkpoint) == SUBWORD_LM else None
    untrained = rows is not None and rows.trained < rows.vocab and checkpoint.context_length
    if untrained and budget > 0 and match.symmetry == "orthogonal":
        args.refine_data = DATA_FREE_PROXY
        summary["data_free"] = f"weight matching refined on --refine-data {DATA_FREE_PROXY}"
    elif args.refine_budget:
        raise UsageError(f"--refine-budget has no effect without --refine-data here: the data-free refinement runs for "
                         "subword LMs whose weights show untrained token rows, with --symmetry orthogonal, and "
                         f"{checkpoint.path} " + ("is matched by permutations" if untrained else "is not one"))
    else:
        summary["data_free"] = "weight matching"


def _weights_proxy(ref, states: list[dict], options, module: nn.Module, chained: bool = False):
    """``--refine-data unigram``: synthetic blocks of the context length drawn by token frequencies judged
    from the models' weights alone, f_t ∝ w_t² with w the token-row weights of data-free matching
    (P(row trained in every model) × Zipf rank^(−1/2) by the head's learned order: f ∝ 1/rank,
    :func:`fedbasin.alignment.token_rows.infer_token_rows`). ``bigram`` (``chained``): the first token
    drawn so, each next one from the models' mean prediction after the previous token alone, over the rows
    judged trained (:func:`_one_token_transitions`, run by ``module``, the reference's architecture)."""
    from fedbasin.alignment.token_rows import infer_token_rows
    from fedbasin.data import chain_blocks, frequency_blocks

    spec = "bigram" if chained else "unigram"
    found = infer_token_rows(ref.spec, *states)
    if found is None or found.trained == found.vocab:
        raise UsageError(f"--refine-data {spec} draws the tokens the models were trained on, judged from their "
                         f"weights, but {ref.path} " +
                         ("has no token rows" if found is None else "shows no untrained token rows to tell them from") +
                         ": give unigram:FILE (token counts of a text) or text:FILE")
    block = ref.context_length
    if not block:
        raise UsageError(f"--refine-data {spec}: {ref.path} records no context length to draw blocks of")
    frequencies = found.weights.square()
    if not chained:
        return frequency_blocks(frequencies, options.examples, block, seed=options.seed)
    rows = torch.nonzero(found.probability > 0.5)[:, 0]
    rows = rows[frequencies[rows].argsort(descending=True)[:CHAIN_ROWS]].sort().values
    transitions = _one_token_transitions(ref, module, states, rows)
    return chain_blocks(rows, frequencies[rows], transitions, options.examples, block, seed=options.seed)


# the bigram proxy's transitions are an n × n float32 matrix over the rows judged trained: at most the 16,384 most
# frequent (1 GiB)
CHAIN_ROWS = 16384


def _one_token_transitions(ref, module: nn.Module, states: list[dict], rows: torch.Tensor) -> torch.Tensor:
    """P[i, k] = the mean over ``states`` of softmax(model(rows[i]))[rows[k]]: each model's next-token prediction
    after the one token ``rows[i]``, over ``rows`` only (``module`` run on the states cut to those token rows)."""
    from fedbasin.alignment.vocabulary import TrainingVocabulary

    vocabulary = TrainingVocabulary(ref.spec, states[0], rows)
    x = torch.arange(len(rows), device=next(iter(states[0].values())).device)[:, None]  # row numbers
    p = torch.zeros(len(rows), len(rows))
    with torch.no_grad():
        for state in states:
            weights = ref.adapter.from_standard(vocabulary.cut(state))
            for start in range(0, len(rows), 1024):
                out = torch.func.functional_call(module, weights, (x[start:start + 1024],))
                logits = (out if isinstance(out, torch.Tensor) else out.logits)[:, -1].float()
                p[start:start + len(logits)] += (logits.softmax(-1) / len(states)).cpu()
    return p


class _Logits(nn.Module):
    """Return plain logits from fedbasin and Hugging Face models alike."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x):
        out = self.model(x)
        return out if isinstance(out, torch.Tensor) else out.logits


def _task_for(checkpoint, source: str, tokenizer: str | None, path: str, command: str, option: str,
              proxy_size: int = 0, shown: str | None = None, proxy_at_most: bool = False):
    """Load ``source`` for ``checkpoint``, refusing data the model cannot read (one-line errors that
    name ``option`` and ``shown``, the data as the user gave it, else ``source``).

    Text is tokenised with ``tokenizer``, else with the tokenizer saved in the checkpoint's
    directory, else character by character (with the model's saved characters where it has them);
    blocks are the model's context length."""
    from fedbasin.data import load_task
    from fedbasin.data.sources import CharTokenizer

    text = source.startswith("text:")
    if tokenizer and not text:
        raise UsageError(f"--tokenizer applies to text data only, not {option} {source}")
    if text and tokenizer is None and checkpoint.path is not None:
        if any((Path(checkpoint.path) / name).is_file() for name in TOKENIZER_MARKERS):
            tokenizer = str(checkpoint.path)
    options = {"proxy_size": proxy_size, "proxy_at_most": proxy_at_most}
    if text:
        options["tokenizer"] = tokenizer
        if tokenizer is None and checkpoint.path is not None:  # a character model's own ids
            try:
                options["characters"] = CharTokenizer.saved_characters(checkpoint.path)
            except ValueError as exc:
                raise InputError(f"{path}: {exc}") from None
        if checkpoint.context_length:
            options["block_size"] = checkpoint.context_length
    try:
        task = load_task(source, **options)
    except (OSError, ValueError, RuntimeError, ImportError) as exc:
        raise InputError(f"{option} {shown or source}: {exc}") from None
    where = f"{option} {shown or task.name}"
    if checkpoint.data != task.data:
        raise InputError(f"{path} is a {checkpoint.family} model but {where} holds {task.data}; "
                         f"{checkpoint.family} models read {checkpoint.data}")
    if text:
        _check_vocabulary(checkpoint, task, path, where, tokenizer)
    return task


def _unigram_proxy(args) -> bool:
    """Whether ``--refine-data`` is ``unigram`` or ``unigram:FILE`` (synthetic blocks the models' predictions
    label)."""
    from fedbasin.options import is_unigram

    return is_unigram(getattr(args, "refine_data", None))


def _seen_tokens(args, checkpoint, command: str):
    """Per-token weights of the matching's token rows: ``--seen-tokens text:FILE``'s training-split counts;
    without the option those of ``--refine-data text:FILE`` (the text that defines them is given), else
    ``"auto"`` (inferred from the models' weights by the matching itself; nothing for models without token
    rows); ``--seen-tokens all``: None (every row)."""
    source, option = args.seen_tokens, "--seen-tokens"
    if not source and (getattr(args, "refine_data", None) or "").startswith("text:"):
        source, option = args.refine_data, "--refine-data"
    if source in (None, "auto"):
        return "auto"
    if source == "all":
        return None
    if not source.startswith("text:"):
        raise UsageError(f"--seen-tokens takes text:FILE, auto or all, got {source}")
    task = _task_for(checkpoint, source, args.tokenizer, str(checkpoint.path), command, option)
    from fedbasin.alignment.matching import token_weights

    return token_weights(task.train.token_ids(), int(checkpoint.config.vocab_size), args.token_weighting)


def _check_vocabulary(checkpoint, task, path: str, where: str, tokenizer: str | None) -> None:
    """Refuse token ids the model has no embedding for, and character tokens for a model whose
    vocabulary is not that text's characters (``where``: the option and data the messages name)."""
    vocab = int(checkpoint.config.vocab_size)
    size = task.tokenizer.vocab_size
    if tokenizer is None and size != vocab:
        raise InputError(f"{where}: character-level tokens ({size} symbols) do not match the {vocab}-token "
                         f"vocabulary of {path}; pass --tokenizer DIR with the tokenizer the model was trained with")
    if size > vocab:
        raise InputError(f"{where}: tokenizer {tokenizer} has {size} tokens but {path} embeds only {vocab}")
    largest = max(int(s.inputs.max()) for s in (task.train, task.test, task.proxy) if s is not None and len(s))
    if largest >= vocab:
        raise InputError(f"{where}: token id {largest} is outside the {vocab}-token vocabulary of {path}")


def cmd_barrier(args) -> int:
    from fedbasin.alignment import interpolation_curve, weight_match
    from fedbasin.checkpoint import build_torch_model

    device = _device(args)
    a, b = _load(args.a, "model A"), _load(args.b, "model B")
    _same_architecture(a, b, "model B", args.b)
    task = _task_for(a, args.data, args.tokenizer, args.a, "barrier", "--data")
    split = task.split(args.split)
    if args.max_examples and len(split) > args.max_examples:
        split = split.subset(torch.arange(args.max_examples))
    summary = {"command": "barrier", "a": args.a, "b": args.b, "data": args.data, "split": args.split,
               "examples": len(split), "aligned": bool(args.align)}

    def loss_of(state: dict) -> float:
        return task.evaluate(_Logits(build_torch_model(a, state)), split, device=device)["loss"]

    try:
        curves = {"vanilla": interpolation_curve(a.state, b.state, loss_of, points=args.points, progress=True,
                                                 desc="vanilla path")}
        if args.align:
            match = _for_model(_match_options(args), a)
            result = weight_match(a.spec, _standard(a, device), _standard(b, device), match=match,
                                  progress=True, token_rows=_seen_tokens(args, a, "barrier"))
            summary.update(symmetry=match.symmetry, align_seconds=round(result.seconds, 3))
            if result.token_rows is not None:
                summary["token_rows"] = result.token_rows
            aligned = a.adapter.from_standard({k: v.cpu() for k, v in result.state.items()})  # A's side
            curves["aligned"] = interpolation_curve(_gauged_form(a, summary), aligned, loss_of, points=args.points,
                                                    progress=True, desc="aligned path")
    except ValueError as exc:
        raise InputError(str(exc)) from None
    summary.update(curves["aligned" if args.align else "vanilla"].to_dict())
    if args.align:
        summary["vanilla"] = curves["vanilla"].to_dict()
    if args.plot:
        from fedbasin.plots import distinct_names, plot_curves

        name_a, name_b = distinct_names([args.a, args.b])
        plot_curves(curves, args.plot, title=f"A = {name_a} (λ=1)  ↔  B = {name_b} (λ=0)\n{task.name}, "
                    f"{args.split} split, {len(split)} examples")
        summary["plot"] = args.plot
    return _emit(summary)


# ------------------------------------------------------------------------------------------------


_INPUT_OPTIONS = {"reference": "REFERENCE", "candidate": "CANDIDATE", "models": "MODEL", "a": "A", "b": "B",
                  "checkpoints": "CHECKPOINT", "data": "--data", "refine_data": "--refine-data",
                  "seen_tokens": "--seen-tokens", "tokenizer": "--tokenizer"}


def _input_paths(args) -> list[tuple[str, Path]]:
    """(what, path) of every existing file or directory the command reads: checkpoints, and the
    file or directory of a ``KIND:PATH`` data spec and of ``--tokenizer``."""
    found = []
    for dest, what in _INPUT_OPTIONS.items():
        values = getattr(args, dest, None)
        for value in values if isinstance(values, list) else [values]:
            if not value:
                continue
            candidates = [value] if dest in ("reference", "candidate", "models", "a", "b", "checkpoints",
                                            "tokenizer") else [value, value.partition(":")[2]]
            for text in candidates:
                if text and Path(text).exists():
                    found.append((what, Path(text)))
                    break
    return found


def _refuse_input_as_output(output: str, option: str, args) -> None:
    """An output that is an input, lies inside one or holds one would replace it: refused."""
    out = Path(output).resolve()
    for what, path in _input_paths(args):
        inp = path.resolve()
        how = ("is" if out == inp else "is inside" if inp in out.parents
               else "holds" if out in inp.parents else None)
        if how:
            raise OutputError(f"{option} {output} {how} the input {path} ({what}); an output never "
                              "replaces an input: choose another path")


def _check_outputs(args) -> None:
    """Output paths are usable, and replace no input, before any work starts."""
    outputs = []
    if args.command in ("align", "merge", "train") and getattr(args, "out", None) is not None:
        outputs.append((args.out, "--out", functools.partial(check_checkpoint_output, overwrite=args.overwrite)))
    if getattr(args, "plot", None):
        outputs.append((args.plot, "--plot", check_plot_output))
    for output, option, check in outputs:
        _refuse_input_as_output(output, option, args)
        check(output, option)


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


# train / eval

HF_PREFIX = "hf-"  # --model hf-<model_type>: a new Hugging Face model of a registered family


def _models() -> tuple[str, ...]:
    """``--model`` choices: the fedbasin families and ``hf-<model_type>`` for every registered model type
    whose family builds new models (``Family.config_fields``)."""
    from fedbasin.alignment.families import trainable
    from fedbasin.models import names

    return (*names(), *(HF_PREFIX + t for t in trainable()))


_SHAPE_OPTIONS = ("dim", "depth", "heads", "mlp_dim", "patch_size", "norm", "activation", "position")
_FEDBASIN_ONLY = ("norm", "activation", "position")


DEFAULT_BLOCK_SIZE = 64  # train --block-size on text


def _add_train_parser(sub) -> None:
    p = sub.add_parser(
        "train", formatter_class=HelpFormatter,
        help="train a model from scratch on a data source and write it as a checkpoint",
        description="Train a fedbasin or Hugging Face model from scratch (AdamW, cosine schedule) and write "
        "OUT atomically, with OUT/train.json. Unset shape and budget options take the data's recipe "
        "(fedbasin.training.RECIPES: digits 40 epochs, ViT d=64×2 layers; cifar10 4 epochs on 20,000 images, "
        "ViT d=96×4; text 2 epochs, GPT d=128×4). Every seed sees the same training examples; --seed sets "
        "the initialisation and the batch order, so two seeds give two independent models. An hf-<model_type> "
        "model takes --dim/--depth/--heads/--mlp-dim (as many key/value heads as heads), the data's fields "
        "(vocabulary and --block-size positions; image size, channels, classes), no dropout, and its config "
        "class's defaults otherwise.",
    )
    p.add_argument("--data", required=True, metavar="SPEC", help=DATA_HELP + "; --tokenizer for subword tokens")
    models = _models()
    p.add_argument("--model", choices=models, metavar="MODEL",
                   help="architecture: vit (images) or gpt (character-level text), fedbasin models; or "
                   "hf-<model_type>, a new Hugging Face model of that registered family, written with "
                   "save_pretrained: " + ", ".join(m for m in models if m.startswith(HF_PREFIX))
                   + "; the text ones need --tokenizer (default: vit for images, gpt for text)")
    _checkpoint_output_options(p, "checkpoint directory to write (config.json + model.safetensors + train.json)")
    p.add_argument("--seed", type=_integer, default=0, help="initialisation and batch-order seed")
    p.add_argument("--tokenizer", metavar="DIR", help="text only: a Hugging Face tokenizer directory "
                   "(needed by every hf-* text model, e.g. --model hf-gpt2 or hf-llama)")
    budget = p.add_argument_group("training budget (default: the data's recipe)")
    budget.add_argument("--epochs", type=_positive_int, help="passes over the training split")
    budget.add_argument("--lr", type=_positive_float, help="peak AdamW learning rate (cosine decay to 0)")
    budget.add_argument("--batch-size", type=_positive_int, help="examples per step")
    budget.add_argument("--weight-decay", type=_nonnegative_float, default=0.01, help="AdamW weight decay")
    budget.add_argument("--max-train-examples", type=_nonnegative_int, metavar="N",
                        help="train on the first N examples of the (seed-0 shuffled) training split; 0: all")
    _device_option(budget)
    shape = p.add_argument_group("model shape (default: the data's recipe)")
    shape.add_argument("--dim", type=_positive_int, help="residual width")
    shape.add_argument("--depth", type=_positive_int, help="Transformer blocks")
    shape.add_argument("--heads", type=_positive_int, help="attention heads (must divide --dim)")
    shape.add_argument("--mlp-dim", type=_positive_int, help="MLP hidden units")
    shape.add_argument("--patch-size", type=_positive_int, help="images: patch side in pixels (default: 2 for "
                       "digits, 4 for cifar10)")
    shape.add_argument("--block-size", type=_positive_int, help=f"text: tokens per example (context; default "
                       f"{DEFAULT_BLOCK_SIZE})")
    shape.add_argument("--norm", choices=["layernorm", "rmsnorm"], help="fedbasin models: norm (default: layernorm)")
    shape.add_argument("--activation", choices=["gelu", "relu", "swiglu"],
                       help="fedbasin models: MLP activation (default: gelu)")
    shape.add_argument("--position", choices=["learned", "rope"], help="fedbasin gpt: positions (default: learned)")
    p.set_defaults(func=cmd_train)


def _add_eval_parser(sub) -> None:
    p = sub.add_parser(
        "eval", formatter_class=HelpFormatter, help="test loss and accuracy of a checkpoint (or an ensemble), as JSON",
        description="Mean cross-entropy and argmax accuracy of CHECKPOINT on a split of the data (for text: "
        "per next token, with the checkpoint's context length). Given several checkpoints of one architecture, "
        "of their ensemble: the mean of their logits (--ensemble logits) or of their probabilities. Prints JSON.",
    )
    p.add_argument("checkpoints", nargs="+", metavar="CHECKPOINT", help=CHECKPOINT_HELP + "; more than one: their "
                   "ensemble (the first one's tokenizer and context length read the data)")
    p.add_argument("--ensemble", choices=("logits", "probabilities"), default="logits",
                   help="several checkpoints: average their logits, or their probabilities (log of the mean)")
    p.add_argument("--data", required=True, metavar="SPEC", help=DATA_HELP + "; --tokenizer for subword tokens")
    p.add_argument("--split", default="test", choices=["train", "test"], help="which split to score")
    p.add_argument("--max-examples", type=_nonnegative_int, default=0, metavar="N", help="score the first N examples only; 0: all")
    p.add_argument("--tokenizer", metavar="DIR", help="text only: the Hugging Face tokenizer the model was trained with")
    p.add_argument("--batch-size", type=_positive_int, default=512, help="examples per forward pass")
    _device_option(p)
    p.set_defaults(func=cmd_eval)


def _load_data(spec: str, tokenizer: str | None = None, **kwargs):
    """:func:`fedbasin.data.load_task` with a one-line error naming ``--data``."""
    from fedbasin.data import load_task

    if tokenizer is not None and not spec.startswith("text:"):
        raise UsageError(f"--tokenizer applies to text:FILE data, not {spec}")
    try:
        return load_task(spec, tokenizer=tokenizer, **kwargs)
    except (ValueError, FileNotFoundError, RuntimeError, OSError, ImportError) as exc:
        raise InputError(f"--data {spec}: {exc}") from None


def _new_model(args, task, recipe: dict):
    """(module returning logits, checkpoint format, config) for ``--model``, initialised from ``--seed``.

    ``hf-<model_type>``: the registered family's ``new_config`` of the shape and the data's fields;
    a family that reads text is fed subword tokens, so it needs ``--tokenizer``."""
    from fedbasin.formats import HFFormat, NativeFormat

    name = args.model or task.family
    hf = name.startswith(HF_PREFIX)
    fmt = HFFormat(name.removeprefix(HF_PREFIX)) if hf else NativeFormat(name)
    reads = fmt.data  # what the family reads, as it declares it
    if reads != task.data:
        needs = {"images": "image data (digits, cifar10)", "text": "text data (text:FILE)"}[reads]
        raise UsageError(f"--model {name} needs {needs}; --data {args.data} holds {task.data}")
    given = {k: getattr(args, k) for k in _SHAPE_OPTIONS if getattr(args, k) is not None}
    shape = {**recipe["model"], **given}
    if reads == "images":
        shape.pop("position", None)
        if "position" in given:
            raise UsageError("--position applies to gpt models only")
    elif "patch_size" in given:
        raise UsageError("--patch-size applies to image models only")
    torch.manual_seed(args.seed)
    if hf:
        fedbasin_only = [f"--{k}" for k in _FEDBASIN_ONLY if k in given]
        if fedbasin_only:
            raise UsageError(f"{', '.join(fedbasin_only)} apply to fedbasin models only, not {name}")
        if reads == "text" and args.tokenizer is None:
            raise UsageError(f"--model {name} on text needs --tokenizer DIR (a Hugging Face tokenizer "
                             "directory, e.g. GPT-2's); for character-level text use --model gpt")
        from fedbasin.alignment.hf import hf_adapter, hf_model_class

        try:
            config = fmt.entry.new_config(fmt.family, shape, task.model_overrides)
            if reads == "text":
                from fedbasin.causal_lm import set_special_token_ids

                set_special_token_ids(config, task.tokenizer)
            hf_adapter(config)  # a shape fedbasin cannot align (heads not dividing the width) fails here
        except ValueError as exc:
            raise UsageError(f"--model {name}: {_one_line(exc)}") from None
        return _Logits(hf_model_class(fmt.family)(config)), fmt, config
    try:
        config = fmt.entry.make_config({**task.model_overrides, **shape})
        return fmt.entry.build(config, seed=args.seed), fmt, config
    except ValueError as exc:
        raise UsageError(f"{exc}") from None


def cmd_train(args) -> int:
    import time

    from fedbasin import causal_lm
    from fedbasin.checkpoint import TRAIN_RECORD, save_checkpoint
    from fedbasin.training import RECIPES, train

    out = Path(args.out)
    device = _device(args)
    kind = args.data.partition(":")[0]
    recipe = RECIPES.get(kind, RECIPES["digits"])  # an unknown source fails in load_task just below
    max_train = recipe["max_train_examples"] if args.max_train_examples is None else args.max_train_examples
    if kind != "text" and args.block_size is not None:
        raise UsageError(f"--block-size applies to text data only, not --data {args.data}")
    task = _load_data(args.data, args.tokenizer, max_train_examples=max_train,
                     **({"block_size": args.block_size or DEFAULT_BLOCK_SIZE} if kind == "text" else {}))
    module, fmt, config = _new_model(args, task, recipe)
    epochs, lr, batch_size = (recipe[k] if getattr(args, k) is None else getattr(args, k)
                              for k in ("epochs", "lr", "batch_size"))
    print(f"fedbasin train: {args.model or task.family} on {task.name} ({len(task.train)} examples, "
          f"{epochs} epochs, seed {args.seed}, {device})", file=sys.stderr)

    def diverged(why: str) -> int:
        print(f"fedbasin train: training diverged ({why}, {epochs} epochs at lr {lr}); nothing was written to "
              f"{out}: try a lower --lr", file=sys.stderr)
        return EXIT_FAILED

    t0 = time.perf_counter()
    try:
        stats = train(module, task.train, epochs=epochs, lr=lr, batch_size=batch_size, device=device,
                      seed=args.seed, weight_decay=args.weight_decay, progress=True)  # Ctrl-C: nothing written
    except RuntimeError as exc:  # an optimiser step beyond float32 ("cannot be converted ... without overflow")
        if "overflow" not in str(exc):
            raise
        close_open_bars()
        return diverged("an optimiser step overflowed float32")
    seconds = time.perf_counter() - t0
    model = module.model if isinstance(module, _Logits) else module
    if bad := [k for k, v in model.state_dict().items() if v.is_floating_point() and not bool(v.isfinite().all())]:
        return diverged(f"{bad[0]} holds NaN or infinite values")
    test = task.evaluate(module, "test", device=device)
    if not math.isfinite(test["loss"]):
        return diverged(f"the test loss is {test['loss']}")
    summary = {"command": "train", "out": str(out), "data": args.data, "model": args.model or task.family,
               "kind": fmt.kind, "family": fmt.family, "seed": args.seed, "epochs": epochs, "lr": lr,
               "batch_size": batch_size, "train_examples": len(task.train), **stats,
               "test_loss": test["loss"], "test_accuracy": test["accuracy"], "seconds": round(seconds, 1)}
    save_tokenizer = causal_lm.save_tokenizer(task)  # subword text: eval, barrier, align find it there

    def extra_files(tmp: Path) -> None:  # part of the checkpoint's atomic write: never beside other weights
        (tmp / TRAIN_RECORD).write_text(json.dumps(summary, indent=2))
        if save_tokenizer is not None:
            save_tokenizer(tmp)

    save_checkpoint(out, fmt.family, config, {k: v.cpu() for k, v in model.state_dict().items()}, kind=fmt.kind,
                    extra_files=extra_files)
    return _emit(summary)


def cmd_eval(args) -> int:
    import time

    from fedbasin.checkpoint import build_torch_model
    from fedbasin.server.distill import LogitEnsemble

    device = _device(args)
    if len(args.checkpoints) == 1 and args.ensemble != "logits":
        raise UsageError(f"--ensemble {args.ensemble} has no effect with one CHECKPOINT (it combines several)")
    checkpoints = [_load(path, "checkpoint") for path in args.checkpoints]
    ckpt, first = checkpoints[0], args.checkpoints[0]
    for path, other in zip(args.checkpoints[1:], checkpoints[1:]):
        _same_architecture(ckpt, other, "checkpoint", path)
    fields = ckpt.data_values()
    task = _task_for(ckpt, args.data, args.tokenizer, first, "eval", "--data")
    for key, value in task.model_overrides.items():
        have = fields.get(key)
        if have is not None and (have < value if key == "vocab_size" else key != "block_size" and have != value):
            raise InputError(f"{first} has {key}={have} but --data {args.data} needs "
                             f"{key}={value}")
    split = task.split(args.split)
    if args.max_examples and len(split) > args.max_examples:
        split = split.subset(torch.arange(args.max_examples))
    t0 = time.perf_counter()
    models = [_Logits(build_torch_model(c)) for c in checkpoints]
    model = models[0] if len(models) == 1 else LogitEnsemble(models, args.ensemble)
    metrics = task.evaluate(model, split, device=device, batch_size=args.batch_size)
    ensemble = {"checkpoints": args.checkpoints, "ensemble": args.ensemble} if len(models) > 1 else {}
    return _emit({"command": "eval", "checkpoint": first, **ensemble, "kind": ckpt.kind, "family": ckpt.family,
                  "data": args.data, "split": args.split, "examples": len(split), **metrics,
                  "seconds": round(time.perf_counter() - t0, 3)})


def _out_of_memory(exc: Exception) -> str | None:
    """For a failed CPU allocation (``MemoryError``, or torch's ``RuntimeError`` "can't allocate memory"): the size
    asked for, as " (N GiB in one allocation)" when torch names it, else ""; None for any other error."""
    if not (isinstance(exc, MemoryError) or (isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc))):
        return None
    wanted = re.search(r"allocate (\d+) bytes", str(exc))
    return f" ({int(wanted.group(1)) / 2**30:,.1f} GiB in one allocation)" if wanted else ""


def main(argv=None) -> int:
    """Run one command; every error is one line on stderr and an exit code (see ``EXIT_*``)."""
    parser = build_parser()
    args = parser.parse_args(argv)  # usage errors: one line, EXIT_USAGE (_Parser.error)
    prog = f"fedbasin {args.command}"
    try:
        _refuse_ineffective_options(args)
        _check_outputs(args)
        if getattr(args, "refine_data", None):
            # before any thread starts (tokenizers, torch): refinement steps, on every thread, reuse their
            # large blocks' pages (fedbasin.heap)
            heap.keep_freed_blocks()
        try:
            return args.func(args)
        except BaseException:
            close_open_bars()
            raise
    except CliError as exc:
        print(f"{prog}: {_one_line(exc)}", file=sys.stderr)
        return exc.code
    except SystemExit as exc:  # raise SystemExit("fedbasin cmd: message") inside a command
        if isinstance(exc.code, str):
            print(_one_line(exc.code), file=sys.stderr)
            return EXIT_FAILED
        raise
    except KeyboardInterrupt:
        print(f"{prog}: interrupted; outputs are written atomically, nothing partial was kept", file=sys.stderr)
        return EXIT_INTERRUPTED
    except torch.OutOfMemoryError as exc:  # a GPU too small for the work: not a bug; nothing was written
        print(f"{prog}: out of GPU memory ({_one_line(exc)[:160]}); nothing was written; try --device cpu",
              file=sys.stderr)
        return EXIT_FAILED
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES):
            print(f"{prog}: {exc.filename or 'output'}: {exc.strerror}", file=sys.stderr)
            return EXIT_OUTPUT
        print(f"{prog}: {exc.filename or ''}: {_one_line(exc.strerror or exc)}", file=sys.stderr)
        return EXIT_FAILED
    except Exception as exc:  # a bug: one line unless asked for the traceback
        if (shortfall := _out_of_memory(exc)) is not None:  # work too large for this machine: not a bug
            print(f"{prog}: out of memory{shortfall}; nothing was written", file=sys.stderr)
            return EXIT_FAILED
        if os.environ.get("FEDBASIN_DEBUG"):
            raise
        print(f"{prog}: internal error: {type(exc).__name__}: {_one_line(exc)} "
              "(rerun with FEDBASIN_DEBUG=1 for the traceback and please report it)", file=sys.stderr)
        return EXIT_INTERNAL


if __name__ == "__main__":
    sys.exit(main())
