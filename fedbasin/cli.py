"""``fedbasin align | merge | barrier | simulate``: the alignment core on checkpoints.

Checkpoints are directories (``config.json`` + ``model.safetensors``) of fedbasin models or of
Hugging Face models (GPT-2, ViT), detected from the config. A JSON summary goes to stdout;
progress bars and log lines go to stderr. Outputs are written atomically.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import torch
from torch import nn


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value


def _weights(text: str) -> list[float]:
    try:
        values = [float(w) for w in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--weights must be comma-separated numbers, got {text!r}") from None
    return values


def _matching_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--symmetry", choices=["orthogonal", "permutation"], default="orthogonal",
                   help="group searched: full orthogonal maps (default) or permutations only")
    p.add_argument("--iterations", type=_positive_int, default=20, help="max weight-matching iterations")
    p.add_argument("--tol", type=float, default=1e-4, help="stop when the relative objective gain is below this")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
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
    p.add_argument("--refine-data", help="proxy data for learned refinement: digits | cifar10:PATH | text:PATH")
    p.add_argument("--refine-steps", type=_positive_int, default=100, help="learned-refinement optimiser steps")
    p.add_argument("--refine-examples", type=_positive_int, default=512,
                   help="proxy examples taken from the data's training split (20%% held out for keep-best)")
    p.add_argument("--refine-lr", type=float, default=1e-2)
    p.add_argument("--refine-permutations", choices=["ste", "sinkhorn"], default="ste",
                   help="straight-through Hungarian (default) or Sinkhorn relaxation")
    p.add_argument("--refine-batch-size", type=_positive_int, default=64)
    _matching_options(p)
    p.set_defaults(func=cmd_merge)

    p = sub.add_parser("barrier", help="losses along λ·A + (1−λ)·B and the loss barrier, as JSON")
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--data", required=True, help="digits | cifar10 | cifar10:PATH | text:PATH")
    p.add_argument("--split", default="test", choices=["train", "test"])
    p.add_argument("--max-examples", type=int, default=2000, help="evaluate on at most this many examples")
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
    except (FileNotFoundError, ValueError) as exc:
        raise SystemExit(f"fedbasin: {role} {path}: {exc}") from None


def _standard(checkpoint) -> dict:
    return checkpoint.adapter.to_standard(checkpoint.state)


def _same_architecture(reference, other, role: str, path: str) -> None:
    if (reference.kind, reference.family) != (other.kind, other.family):
        raise SystemExit(
            f"fedbasin: {role} {path} is a {other.kind} {other.family} model but the reference is a "
            f"{reference.kind} {reference.family} model"
        )


def _save(out: str, reference, standard_state: dict) -> None:
    from fedbasin.checkpoint import save_checkpoint

    state = reference.adapter.from_standard(standard_state)
    save_checkpoint(out, reference.family, reference.config, state, kind=reference.kind)


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
    try:
        result = weight_match(ref.spec, _standard(ref), _standard(cand), mode=args.symmetry,
                              iterations=args.iterations, tol=args.tol, progress=True)
    except ValueError as exc:
        raise SystemExit(f"fedbasin align: {exc}") from None
    _save(args.out, ref, result.state)
    return _emit({
        "command": "align", "reference": args.reference, "candidate": args.candidate, "out": args.out,
        "symmetry": args.symmetry, "iterations": result.iterations, "start": result.start,
        "initial_objective": result.initial_objective, "objective": result.objective,
        "seconds": round(result.seconds, 3),
    })


def _stream_align(args) -> int:
    from fedbasin.checkpoint import stream_align

    try:
        result = stream_align(args.reference, args.candidate, args.out, mode=args.symmetry,
                              iterations=args.iterations, tol=args.tol, progress=True)
    except (FileNotFoundError, KeyError, ValueError) as exc:
        raise SystemExit(f"fedbasin align --stream: {exc}") from None
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
        raise SystemExit(f"fedbasin merge: --weights has {len(args.weights)} values for {len(paths)} models")
    if args.refine_data and args.no_align:
        raise SystemExit("fedbasin merge: --refine-data needs alignment (drop --no-align)")
    if args.refine_data and args.universe_iterations > 1:
        raise SystemExit("fedbasin merge: --refine-data and --universe-iterations cannot be combined yet")
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
                           align=not args.no_align, progress=True)
            merged = result.state
            summary.update(universe_change=result.universe_change, objectives=result.objectives,
                           seconds=round(result.seconds, 3))
    except ValueError as exc:
        raise SystemExit(f"fedbasin merge: {exc}") from None
    _save(args.out, checkpoints[0], merged)
    return _emit(summary)


def _refined_merge(args, checkpoints, states) -> tuple[dict, dict]:
    """Weight matching, then learned refinement on proxy data; returns (merged state, summary)."""
    from fedbasin.alignment import learned_refine, refined_merge
    from fedbasin.checkpoint import build_torch_model
    from fedbasin.data import load_task
    from fedbasin.training import cross_entropy

    ref = checkpoints[0]
    try:
        task = load_task(args.refine_data, proxy_size=args.refine_examples)
    except (ValueError, FileNotFoundError) as exc:
        raise SystemExit(f"fedbasin merge: --refine-data {args.refine_data}: {exc}") from None
    _check_task(ref, task, args.reference, "merge", "--refine-data")
    train_split, held = task.proxy.split(0.2, seed=0)
    heldout = next(held.batches(len(held)))

    def batches():
        generator = torch.Generator().manual_seed(0)
        while True:
            yield from train_split.batches(args.refine_batch_size, generator=generator)

    refine = functools.partial(
        learned_refine, ref.spec, build_torch_model(ref), loss_fn=cross_entropy, batches=batches(), heldout=heldout,
        steps=args.refine_steps, lr=args.refine_lr, mode=args.symmetry, permutations=args.refine_permutations,
        match_iterations=args.iterations, to_module_state=ref.adapter.from_standard, progress=True)
    merged, result = refined_merge(ref.spec, states, args.weights or [1.0] * len(states), 0, refine)
    info = {"steps": args.refine_steps, "proxy_examples": len(task.proxy), "heldout_loss_start": result.initial_loss,
            "heldout_loss_best": result.best_loss, "best_step": result.best_step,
            "seconds": round(result.seconds, 3)}
    return merged, info


class _Logits(nn.Module):
    """Return plain logits from fedbasin and Hugging Face models alike."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x):
        out = self.model(x)
        return out if isinstance(out, torch.Tensor) else out.logits


def _check_task(checkpoint, task, path: str, command: str, option: str) -> None:
    family = {"gpt2": "gpt", "vit": "vit"}.get(checkpoint.family, checkpoint.family)
    if family != task.family:
        raise SystemExit(f"fedbasin {command}: {path} is a {checkpoint.family} model but {option} {task.name} "
                         f"needs a {task.family} model")


def cmd_barrier(args) -> int:
    from fedbasin.alignment import interpolation_curve, weight_match
    from fedbasin.checkpoint import build_torch_model
    from fedbasin.data import load_task

    a, b = _load(args.a, "model A"), _load(args.b, "model B")
    _same_architecture(a, b, "model B", args.b)
    try:
        task = load_task(args.data)
    except (ValueError, FileNotFoundError) as exc:
        raise SystemExit(f"fedbasin barrier: --data {args.data}: {exc}") from None
    _check_task(a, task, args.a, "barrier", "--data")
    split = task.split(args.split)
    if args.max_examples and len(split) > args.max_examples:
        split = split.subset(torch.arange(args.max_examples))
    state_b = b.state
    summary = {"command": "barrier", "a": args.a, "b": args.b, "data": args.data, "split": args.split,
               "examples": len(split), "aligned": bool(args.align)}
    if args.align:
        try:
            result = weight_match(a.spec, _standard(a), _standard(b), mode=args.symmetry,
                                  iterations=args.iterations, tol=args.tol, progress=True)
        except ValueError as exc:
            raise SystemExit(f"fedbasin barrier: {exc}") from None
        state_b = a.adapter.from_standard(result.state)
        summary.update(symmetry=args.symmetry, align_seconds=round(result.seconds, 3))

    def loss_of(state: dict) -> float:
        return task.evaluate(_Logits(build_torch_model(a, state)), split)["loss"]

    try:
        curve = interpolation_curve(a.state, state_b, loss_of, points=args.points)
    except ValueError as exc:
        raise SystemExit(f"fedbasin barrier: {exc}") from None
    summary.update(curve.to_dict())
    if args.plot:
        from fedbasin.plots import plot_curves

        plot_curves({"aligned" if args.align else "vanilla": curve}, args.plot,
                    title=f"{Path(args.a).name} (λ=1) ↔ {Path(args.b).name} (λ=0)")
        summary["plot"] = args.plot
    return _emit(summary)


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
