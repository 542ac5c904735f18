"""``fedbasin align | merge | barrier | simulate``: the alignment core on checkpoints.

Checkpoints are directories (``config.json`` + ``model.safetensors``) of fedbasin models or of
Hugging Face models (GPT-2, ViT), detected from the config. A JSON summary goes to stdout;
progress bars and log lines go to stderr. Outputs are written atomically.
"""

from __future__ import annotations

import argparse
import errno
import functools
import json
import math
import os
import sys
import tempfile
from pathlib import Path

import torch
from torch import nn

# ------------------------------------------------------------------------------------------------
# errors and exit codes (the table in README.md, "Command line")

EXIT_OK = 0
EXIT_FAILED = 1  # the command ran but failed (reported by the command itself)
EXIT_USAGE = 2  # invalid option value or combination
EXIT_INPUT = 3  # an input checkpoint or data set is missing, unreadable, mismatched or not finite
EXIT_OUTPUT = 4  # an output path is unusable (not writable, read-only, not a checkpoint, disk full)
EXIT_INTERNAL = 70  # a bug: please report it (FEDBASIN_DEBUG=1 shows the traceback)
EXIT_INTERRUPTED = 130  # Ctrl-C / SIGINT; nothing partial is left behind


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
    """argparse with one-line errors (``prog: message (see prog --help)``, exit 2)."""

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"{self.prog}: {message} (see {self.prog} --help)\n")


def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def _number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def _positive_int(text: str) -> int:
    value = _integer(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value


def _nonnegative_float(text: str) -> float:
    value = _number(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text}")
    return value


def _positive_float(text: str) -> float:
    value = _number(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text}")
    return value


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
    return values


def _matching_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--symmetry", choices=["orthogonal", "permutation"], default="orthogonal",
                   help="group searched: full orthogonal maps (default) or permutations only")
    p.add_argument("--iterations", type=_positive_int, default=20, help="max weight-matching iterations")
    p.add_argument("--tol", type=_nonnegative_float, default=1e-4, help="stop when the relative objective gain is below this")
    p.add_argument("--seen-tokens", metavar="SPEC",
                   help="match token-embedding and output-head rows only for the tokens in this text's training "
                   "split (text:FILE, tokenised like the proxy data); the other rows are untrained noise")


def _refine_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--refine-data", help="proxy data for learned refinement: digits | cifar10:PATH | text:PATH")
    p.add_argument("--tokenizer", help="Hugging Face tokenizer directory for text data (default: the one saved "
                   "in the reference checkpoint's directory, if any)")
    p.add_argument("--refine-steps", type=_positive_int, default=100, help="learned-refinement optimiser steps")
    p.add_argument("--refine-examples", type=_positive_int, default=512,
                   help="proxy examples taken from the data's training split (20%% select the alignment kept, "
                   "20%% only report its loss)")
    p.add_argument("--refine-lr", type=_positive_float, default=1e-2)
    p.add_argument("--refine-permutations", choices=["ste", "sinkhorn"], default="ste",
                   help="straight-through Hungarian (default) or Sinkhorn relaxation")
    p.add_argument("--refine-batch-size", type=_positive_int, default=64)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="fedbasin",
        description="Align, merge and compare Transformer checkpoints by their exact symmetries; "
        "run federated simulations.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("align", help="write CANDIDATE transformed into REFERENCE's basis (same function)")
    p.add_argument("reference")
    p.add_argument("candidate")
    p.add_argument("--out", required=True, help="output checkpoint directory")
    _matching_options(p)
    _refine_options(p)
    p.add_argument("--stream", action="store_true",
                   help="layer by layer from disk, for checkpoints too large for memory (standard-layout "
                        "safetensors: Llama/Mistral/Qwen2, fedbasin); output written shard by shard")
    p.set_defaults(func=cmd_align)

    p = sub.add_parser("merge", help="align every MODEL to REFERENCE and write the weighted average")
    p.add_argument("reference")
    p.add_argument("models", nargs="+")
    p.add_argument("--out", required=True, help="output checkpoint directory")
    p.add_argument("--weights", type=_weights, help="w0,w1,...: one weight per model, reference first")
    p.add_argument("--universe-iterations", type=_positive_int, default=1,
                   help="re-align every model to the running average this many times")
    p.add_argument("--no-align", action="store_true", help="plain weighted averaging (no alignment)")
    _refine_options(p)
    _matching_options(p)
    p.set_defaults(func=cmd_merge)

    p = sub.add_parser("barrier", help="losses along λ·A + (1−λ)·B and the loss barrier, as JSON")
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--data", required=True, help="digits | cifar10 | cifar10:PATH | text:PATH")
    p.add_argument("--tokenizer", help="Hugging Face tokenizer directory for text data (default: the one saved "
                   "in A's checkpoint directory, if any)")
    p.add_argument("--split", default="test", choices=["train", "test"])
    p.add_argument("--max-examples", type=_positive_int, default=2000, help="evaluate on at most this many examples")
    p.add_argument("--points", type=_positive_int, default=11, help="λ grid size (≥ 2)")
    p.add_argument("--align", action="store_true", help="align B to A first")
    p.add_argument("--plot", help="write the curve to this PNG")
    _matching_options(p)
    p.set_defaults(func=cmd_barrier)

    try:
        from fedbasin.simulations import simulate
    except ImportError:  # pragma: no cover - the simulation needs flwr
        simulate = None
    if simulate is not None:
        simulate.add_parser(sub)
    return parser


# ------------------------------------------------------------------------------------------------


def _load(path: str, role: str):
    from fedbasin.checkpoint import load_checkpoint

    try:
        return load_checkpoint(path)
    except (OSError, ValueError, ImportError) as exc:
        raise InputError(f"{role} {path}: {exc}") from None


def _standard(checkpoint) -> dict:
    return checkpoint.adapter.to_standard(checkpoint.state)


def _same_architecture(reference, other, role: str, path: str) -> None:
    from fedbasin.checkpoint import architecture_mismatch

    if why := architecture_mismatch(reference, other):
        raise InputError(f"{role} {path}: {why}")


def _missing_ancestors(path: Path) -> list[Path]:
    """The directories above ``path`` (nearest first) that do not exist yet."""
    missing = []
    for parent in path.absolute().parents:
        if parent.exists():
            break
        missing.append(parent)
    return missing


def _check_writable(path: Path, option: str) -> None:
    """A file or directory can be created at ``path``: probe its nearest existing ancestor by
    creating (and removing) a hidden directory, so permissions, read-only file systems and
    non-directories in the way are all caught before any work."""
    missing = _missing_ancestors(path)
    anchor = (missing[-1] if missing else path.absolute()).parent
    if not anchor.is_dir():
        raise OutputError(f"{option} {path}: {anchor} is not a directory")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".fedbasin-probe-", dir=anchor))
    except OSError as exc:
        raise OutputError(f"{option} {path}: cannot write in {anchor} ({exc.strerror})") from None


def check_checkpoint_output(out: str, option: str = "--out") -> None:
    """``out`` can take a checkpoint: absent, an empty directory or an existing checkpoint
    (replaced atomically at the end), and writable."""
    from fedbasin.checkpoint import CONFIG_FILE

    path = Path(out)
    if path.exists() and not path.is_dir():
        raise OutputError(f"{option} {out} exists and is not a directory")
    if path.is_dir() and any(path.iterdir()) and not (path / CONFIG_FILE).is_file():
        raise OutputError(f"{option} {out} is a non-empty directory without {CONFIG_FILE}, "
                          "not a checkpoint; refusing to replace it")
    _check_writable(path, option)


def check_file_output(out: str, option: str) -> None:
    path = Path(out)
    if path.is_dir():
        raise OutputError(f"{option} {out} is a directory")
    _check_writable(path, option)


def _save(out: str, reference, standard_state: dict) -> None:
    from fedbasin.checkpoint import save_checkpoint

    state = reference.adapter.from_standard(standard_state)
    created = _missing_ancestors(Path(out))
    try:
        save_checkpoint(out, reference.family, reference.config, state, kind=reference.kind)
    except OSError as exc:  # disk full, quota, permissions changed meanwhile: nothing is left
        for directory in created:
            try:
                directory.rmdir()
            except OSError:
                break
        reason = exc.strerror or str(exc)
        raise OutputError(f"--out {out}: cannot write the checkpoint ({reason}); nothing was written") from None


def _emit(summary: dict) -> int:
    json.dump(summary, sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0


def cmd_align(args) -> int:
    from fedbasin.alignment import weight_match

    if getattr(args, "stream", False):
        return _stream_align(args)
    ref, cand = _load(args.reference, "reference"), _load(args.candidate, "candidate")
    _same_architecture(ref, cand, "candidate", args.candidate)
    summary = {"command": "align", "reference": args.reference, "candidate": args.candidate, "out": args.out,
               "symmetry": args.symmetry}
    try:
        if args.refine_data:
            refine, info = _refiner(args, ref, "align")
            result = refine(_standard(ref), [_standard(cand)])
            aligned = result.states[0]
            summary["refinement"] = {**info, **result.summary()}
        else:
            result = weight_match(ref.spec, _standard(ref), _standard(cand), mode=args.symmetry,
                                  iterations=args.iterations, tol=args.tol, progress=True,
                                  token_rows=_seen_tokens(args, ref, "align"))
            aligned = result.state
            summary.update(iterations=result.iterations, start=result.start,
                           initial_objective=result.initial_objective, objective=result.objective,
                           seconds=round(result.seconds, 3))
    except ValueError as exc:
        raise InputError(str(exc)) from None
    _save(args.out, ref, aligned)
    return _emit(summary)


def _stream_align(args) -> int:
    from fedbasin.checkpoint import stream_align

    try:
        result = stream_align(args.reference, args.candidate, args.out, mode=args.symmetry,
                              iterations=args.iterations, tol=args.tol, progress=True)
    except (FileNotFoundError, KeyError, ValueError) as exc:
        raise InputError(str(exc)) from None
    return _emit({
        "command": "align", "stream": True, "reference": args.reference, "candidate": args.candidate,
        "out": args.out, "symmetry": args.symmetry, "iterations": result.iterations,
        "initial_objective": result.objective[0], "objective": result.objective, "seconds": round(result.seconds, 3),
    })


def cmd_merge(args) -> int:
    from fedbasin.alignment import merge

    paths = [args.reference, *args.models]
    checkpoints = [_load(p, "reference" if i == 0 else "model") for i, p in enumerate(paths)]
    for path, ckpt in zip(paths[1:], checkpoints[1:]):
        _same_architecture(checkpoints[0], ckpt, "model", path)
    if args.weights is not None and len(args.weights) != len(paths):
        raise UsageError(f"--weights has {len(args.weights)} values for {len(paths)} models")
    if args.refine_data and args.no_align:
        raise UsageError("--refine-data needs alignment (drop --no-align)")
    summary = {"command": "merge", "models": paths, "weights": args.weights or [1.0] * len(paths), "out": args.out,
               "symmetry": None if args.no_align else args.symmetry}
    states = [_standard(c) for c in checkpoints]
    try:
        if args.refine_data:
            merged, info = _refined_merge(args, checkpoints, states)
            summary["refinement"] = info
        else:
            result = merge(checkpoints[0].spec, states, weights=args.weights, mode=args.symmetry,
                           iterations=args.iterations, tol=args.tol, universe_iterations=args.universe_iterations,
                           align=not args.no_align, progress=True,
                           token_rows=_seen_tokens(args, checkpoints[0], "merge"))
            merged = result.state
            summary.update(universe_change=result.universe_change, objectives=result.objectives,
                           seconds=round(result.seconds, 3))
    except ValueError as exc:
        raise InputError(str(exc)) from None
    _save(args.out, checkpoints[0], merged)
    return _emit(summary)


def _refined_merge(args, checkpoints, states) -> tuple[dict, dict]:
    """Weight (or universe) matching, then learned refinement on proxy data; returns (merged state,
    summary)."""
    from fedbasin.alignment import refined_merge

    refine, info = _refiner(args, checkpoints[0], "merge")
    merged, result = refined_merge(checkpoints[0].spec, states, args.weights or [1.0] * len(states), 0, refine)
    return merged, {**info, **result.summary()}


def _refiner(args, ref, command: str):
    """``refine(reference, candidates, **kw)`` on the proxy split of ``--refine-data`` (every matching and
    refinement option applied) and a summary of the data used."""
    from fedbasin.alignment import learned_refine, proxy_streams
    from fedbasin.checkpoint import build_torch_model
    from fedbasin.training import cross_entropy

    task = _task_for(ref, args.refine_data, args.tokenizer, args.reference, command, "--refine-data",
                     proxy_size=args.refine_examples)
    data = proxy_streams(task.proxy, args.refine_batch_size, seed=0)
    refine = functools.partial(
        learned_refine, ref.spec, build_torch_model(ref), loss_fn=cross_entropy, batches=data.batches,
        selection=data.selection, evaluation=data.evaluation, steps=args.refine_steps, lr=args.refine_lr,
        mode=args.symmetry, permutations=args.refine_permutations, match_iterations=args.iterations,
        match_tol=args.tol, universe_iterations=getattr(args, "universe_iterations", 1),
        token_rows=_seen_tokens(args, ref, command),
        to_module_state=ref.adapter.from_standard, progress=True)
    info = {"steps": args.refine_steps, "proxy_examples": len(task.proxy)}
    if task.tokenizer is not None:
        info["tokenizer"] = str(getattr(task.tokenizer, "path", "character-level"))
    return refine, info


class _Logits(nn.Module):
    """Return plain logits from fedbasin and Hugging Face models alike."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x):
        out = self.model(x)
        return out if isinstance(out, torch.Tensor) else out.logits


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json")


def _task_for(checkpoint, source: str, tokenizer: str | None, path: str, command: str, option: str,
              proxy_size: int = 0):
    """Load ``source`` for ``checkpoint``, refusing data the model cannot read (one-line errors).

    Text is tokenised with ``tokenizer``, else with the tokenizer saved in the checkpoint's
    directory, else character by character; blocks are the model's context length."""
    from fedbasin.data import load_task

    text = source.startswith("text:")
    if tokenizer and not text:
        raise UsageError(f"--tokenizer applies to text data only, not {option} {source}")
    if text and tokenizer is None and checkpoint.path is not None:
        if any((Path(checkpoint.path) / name).is_file() for name in TOKENIZER_FILES):
            tokenizer = str(checkpoint.path)
    options = {"proxy_size": proxy_size}
    if text:
        options["tokenizer"] = tokenizer
        if _context_length(checkpoint):
            options["block_size"] = _context_length(checkpoint)
    try:
        task = load_task(source, **options)
    except (OSError, ValueError, RuntimeError, ImportError) as exc:
        raise InputError(f"{option} {source}: {exc}") from None
    family = {"gpt2": "gpt", "vit": "vit"}.get(checkpoint.family, checkpoint.family)
    if family != task.family:
        raise InputError(f"{path} is a {checkpoint.family} model but {option} {task.name} "
                         f"needs a {task.family} model")
    if text:
        _check_vocabulary(checkpoint, task, path, command, option, tokenizer)
    return task


def _seen_tokens(args, checkpoint, command: str):
    """Token ids of ``--seen-tokens``' training split (None without the option)."""
    if not args.seen_tokens:
        return None
    if not args.seen_tokens.startswith("text:"):
        raise UsageError(f"--seen-tokens needs text data (text:FILE), got {args.seen_tokens}")
    task = _task_for(checkpoint, args.seen_tokens, args.tokenizer, str(checkpoint.path), command, "--seen-tokens")
    return torch.unique(torch.cat([task.train.inputs.reshape(-1), task.train.targets.reshape(-1)]))


def _context_length(checkpoint) -> int | None:
    """The model's context length (None for models without one, e.g. a ViT)."""
    config = checkpoint.config
    for name in ("n_positions", "block_size", "max_position_embeddings"):
        if getattr(config, name, None):
            return int(getattr(config, name))
    return None


def _check_vocabulary(checkpoint, task, path: str, command: str, option: str, tokenizer: str | None) -> None:
    """Refuse token ids the model has no embedding for, and character tokens for a model whose
    vocabulary is not that text's characters."""
    vocab = int(checkpoint.config.vocab_size)
    size = task.tokenizer.vocab_size
    where = f"{option} {task.name}"
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

    a, b = _load(args.a, "model A"), _load(args.b, "model B")
    _same_architecture(a, b, "model B", args.b)
    task = _task_for(a, args.data, args.tokenizer, args.a, "barrier", "--data")
    split = task.split(args.split)
    if args.max_examples and len(split) > args.max_examples:
        split = split.subset(torch.arange(args.max_examples))
    state_b = b.state
    summary = {"command": "barrier", "a": args.a, "b": args.b, "data": args.data, "split": args.split,
               "examples": len(split), "aligned": bool(args.align)}
    if args.align:
        try:
            result = weight_match(a.spec, _standard(a), _standard(b), mode=args.symmetry,
                                  iterations=args.iterations, tol=args.tol, progress=True,
                                  token_rows=_seen_tokens(args, a, "barrier"))
        except ValueError as exc:
            raise InputError(str(exc)) from None
        state_b = a.adapter.from_standard(result.state)
        summary.update(symmetry=args.symmetry, align_seconds=round(result.seconds, 3))

    def loss_of(state: dict) -> float:
        return task.evaluate(_Logits(build_torch_model(a, state)), split)["loss"]

    try:
        curve = interpolation_curve(a.state, state_b, loss_of, points=args.points)
    except ValueError as exc:
        raise InputError(str(exc)) from None
    summary.update(curve.to_dict())
    if args.plot:
        from fedbasin.plots import plot_curves

        plot_curves({"aligned" if args.align else "vanilla": curve}, args.plot,
                    title=f"{Path(args.a).name} (λ=1) ↔ {Path(args.b).name} (λ=0)")
        summary["plot"] = args.plot
    return _emit(summary)


# ------------------------------------------------------------------------------------------------


def _check_outputs(args) -> None:
    """Output paths are usable before any work starts."""
    if args.command in ("align", "merge", "train") and getattr(args, "out", None):
        check_checkpoint_output(args.out)
    if getattr(args, "plot", None):
        check_file_output(args.plot, "--plot")


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def main(argv=None) -> int:
    """Run one command; every error is one line on stderr and an exit code (see ``EXIT_*``)."""
    parser = build_parser()
    args = parser.parse_args(argv)  # usage errors: one line, EXIT_USAGE (_Parser.error)
    prog = f"fedbasin {args.command}"
    try:
        _check_outputs(args)
        return args.func(args)
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
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES):
            print(f"{prog}: {exc.filename or 'output'}: {exc.strerror}", file=sys.stderr)
            return EXIT_OUTPUT
        print(f"{prog}: {exc.filename or ''}: {_one_line(exc.strerror or exc)}", file=sys.stderr)
        return EXIT_FAILED
    except Exception as exc:  # a bug: one line unless asked for the traceback
        if os.environ.get("FEDBASIN_DEBUG"):
            raise
        print(f"{prog}: internal error: {type(exc).__name__}: {_one_line(exc)} "
              "(rerun with FEDBASIN_DEBUG=1 for the traceback and please report it)", file=sys.stderr)
        return EXIT_INTERNAL


if __name__ == "__main__":
    sys.exit(main())
