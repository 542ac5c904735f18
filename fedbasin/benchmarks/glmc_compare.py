"""fedbasin's data-free weight matching side by side with GLMC's own, on one GPT-2 pair.

The pair comes from ``gpt2_pair`` (HF GPT-2 checkpoints with the tokenizer beside the weights);
the barrier is evaluated on the test slice (the last 5% of the text, contiguous) at ``--points``
λ values. GLMC's weight matching (Theus et al., NeurIPS 2025) runs from its public repository at
``--glmc-path`` in the Python given by ``--glmc-python`` (it needs transformers 4.50.1, POT and
einops), through ``glmc_driver.py``; nothing of GLMC is copied here.

    python -m fedbasin.benchmarks.glmc_compare RUN/seed0 RUN/seed1 --glmc-path $GLMC \\
        --glmc-python $GLMC_PYTHON --out results.json

Rows: vanilla; fedbasin permutation / orthogonal variants (weighting; matching on all token
rows or on the tokens seen in training); GLMC permutation / orthogonal (15 iterations, embedding
rows restricted to tokens seen in training, as in its scripts); and one fedbasin alignment
evaluated on GLMC's path. GLMC evaluates its merge in its own merged architecture (LayerNorm
replaced by RMSNorm on mean-free weights, every attention head expanded to its full QK and OV
circuits — head width d + 1 — so attention scores and OV maps interpolate linearly), while
fedbasin's merge keeps the GPT-2 architecture of the inputs; the last row separates the quality
of the alignment from the path it is evaluated on.

Learned alignment: ``--aligned NAME=DIR`` adds the plain path from A to an endpoint already in A's
basis (``fedbasin align A B --refine-data ...`` output: its plain path is the learned curve);
``--glmc-learned-steps N`` adds GLMC's own learned matching (its merger's maps trained N steps on
``--glmc-proxy-examples`` training blocks drawn with seed 0, batch ``--glmc-batch-size``).
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from fedbasin.alignment import Curve, interpolate, lambda_grid, loss_barrier, weight_match
from fedbasin.alignment.matching import token_weights
from fedbasin.alignment.token_rows import infer_token_rows
from fedbasin.benchmarks.gpt2_pair import (
    DEFAULT_TEXT,
    device_label,
    mean_loss,
    pair_data,
    parsed_device,
)
from fedbasin.checkpoint import build_torch_model, load_checkpoint


def seen_tokens(train_ids: torch.Tensor) -> torch.Tensor:
    """Token ids that occur in the training text."""
    return torch.unique(train_ids)


def run_glmc(args, blocks_file: Path, permutations_only: bool, model1: str | None = None,
             iterations: int | None = None, train_steps: int = 0) -> dict:
    """GLMC's merger on (A, ``model1`` or B): its weight matching for ``iterations`` (0: none, to
    evaluate a given alignment on GLMC's path), losses on its λ grid."""
    iterations = args.glmc_iterations if iterations is None else iterations
    command = [args.glmc_python, str(Path(__file__).with_name("glmc_driver.py")), "--glmc-path", args.glmc_path,
               "--model0", args.a, "--model1", model1 or args.b, "--blocks", str(blocks_file),
               "--points", str(args.points), "--iterations", str(iterations)]
    if permutations_only:
        command.append("--permutations-only")
    if train_steps:
        command += ["--train-steps", str(train_steps), "--train-batch-size", str(args.glmc_batch_size),
                    "--lr", str(args.glmc_lr)]
    started = time.perf_counter()
    done = subprocess.run(command, stdout=subprocess.PIPE, text=True)  # its progress goes to our stderr
    if done.returncode != 0:
        raise SystemExit(f"glmc_compare: GLMC's driver failed (exit {done.returncode}; its error is printed above)")
    out = json.loads(done.stdout.strip().splitlines()[-1])
    out["barrier"], out["argmax"] = loss_barrier(out["lambdas"], out["losses"])
    out["wall_seconds"] = round(time.perf_counter() - started, 1)
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("a", help="model A (λ = 1), an HF GPT-2 directory from gpt2_pair")
    parser.add_argument("b", help="model B (λ = 0)")
    parser.add_argument("--text", default=DEFAULT_TEXT)
    parser.add_argument("--tokenizer", help="default: the tokenizer saved with model A")
    parser.add_argument("--glmc-path", help="GLMC's repository (omit to run fedbasin only)")
    parser.add_argument("--glmc-python", default=sys.executable, help="Python with GLMC's requirements")
    parser.add_argument("--glmc-iterations", type=int, default=15)
    parser.add_argument("--iterations", type=int, default=30, help="fedbasin's weight-matching iterations")
    parser.add_argument("--tol", type=float, default=1e-6)
    parser.add_argument("--variants", default="permutation/rms/all,permutation/rms/seen,orthogonal/rms/all,"
                        "orthogonal/rms/seen,permutation/rms/sqrt,orthogonal/rms/sqrt,orthogonal/cosine/seen,orthogonal/uniform/seen",
                        help="fedbasin rows as MODE/WEIGHTING/ROWS[/HEAD], ROWS: all, the tokens seen in training "
                        "weighted by seen (1), sqrt (√count) or count, or the rows the two models' weights judge "
                        "trained (no data): auto (= auto-zipf, the default of token_rows=\"auto\"), auto-mask (P > ½), auto-probability or auto-signal; HEAD: the output head's objective weight "
                        "(weight_match's head_weight; default 1)")
    parser.add_argument("--circuit-variant", default="orthogonal/rms/seen",
                        help="the fedbasin alignment also evaluated on GLMC's merged architecture ('' to skip)")
    parser.add_argument("--skip-vanilla", action="store_true", help="leave out the vanilla curve")
    parser.add_argument("--glmc-only", action="store_true",
                        help="skip fedbasin's curves (the --circuit-variant alignment is still computed)")
    parser.add_argument("--max-blocks", type=int, default=0, help="evaluate on the first N blocks of the split (0: all)")
    parser.add_argument("--split", choices=("test", "validation"), default="test",
                        help="where the barrier is measured: the test slice (the last 5%%) or the validation slice "
                        "before it (choose settings there, report on test)")
    parser.add_argument("--points", type=int, default=11)
    parser.add_argument("--device", default="cpu", help="where fedbasin's curves are evaluated: cpu (1 thread) | cuda "
                        "| cuda:N | auto (weight matching and GLMC's driver stay on the CPU)")
    parser.add_argument("--out", help="write the results JSON here")
    parser.add_argument("--aligned", action="append", default=[], metavar="NAME=DIR",
                        help="also evaluate the plain path from A to this endpoint already aligned to A")
    parser.add_argument("--aligned-on-glmc", action="store_true",
                        help="also evaluate every --aligned endpoint on GLMC's merged architecture (needs --glmc-path)")
    parser.add_argument("--glmc-learned-steps", type=int, default=0, help="GLMC's learned matching steps (0: skip)")
    parser.add_argument("--glmc-batch-size", type=int, default=64)
    parser.add_argument("--glmc-lr", type=float, default=3e-4, help="AdamW learning rate (GLMC's default 3e-4)")
    parser.add_argument("--glmc-proxy-examples", type=int, default=307)
    parser.add_argument("--glmc-rows", default="permutation,orthogonal",
                        help="GLMC weight-matching rows to run (comma-separated; empty: none)")
    args = parser.parse_args(argv)
    if args.aligned_on_glmc and not (args.aligned and args.glmc_path):
        raise SystemExit("glmc_compare: --aligned-on-glmc needs --aligned NAME=DIR and --glmc-path")
    for item in args.aligned:
        name, sep, path = item.partition("=")
        if not (name and sep and (Path(path) / "config.json").is_file()):
            raise SystemExit(f"glmc_compare: --aligned {item!r}: expected NAME=DIR with DIR/config.json")
    device = parsed_device(parser, args.device)
    torch.set_num_threads(1)
    a, b = load_checkpoint(args.a), load_checkpoint(args.b)
    _, splits = pair_data(args.text, args.tokenizer or args.a, a.config.n_positions)
    test = splits[args.split]
    if args.max_blocks:
        test = test.subset(torch.arange(min(args.max_blocks, len(test))))
    train_ids = splits["train"].token_ids()
    seen = seen_tokens(train_ids)
    machine = f"{platform.machine()} CPU, 1 thread" if device.type == "cpu" else device_label(device)
    results = {"a": args.a, "b": args.b, "split": args.split, "test_blocks": len(test), "points": args.points, "seen_tokens": len(seen),
               "vocab": a.config.vocab_size, "machine": machine, "rows": {}}

    def loss(state: dict) -> float:
        return mean_loss(build_torch_model(a, state).to(device), test)

    lambdas = lambda_grid(args.points)
    if args.glmc_only:
        args.variants = args.circuit_variant
    else:
        end_a, end_b = loss(a.state), loss(b.state)  # aligned B has B's function: its loss is B's

    def curve(state_b: dict) -> Curve:
        losses = [end_b] + [loss(interpolate(a.state, state_b, lam)) for lam in lambdas[1:-1]] + [end_a]
        return Curve(lambdas, losses, *loss_barrier(lambdas, losses))

    def record(name: str, result: Curve, seconds: float | None = None, **extra) -> None:
        results["rows"][name] = {"barrier": result.barrier, "argmax": result.argmax, "losses": result.losses,
                                 "seconds": None if seconds is None else round(seconds, 2), **extra}
        print(f"{name:40s} barrier {result.barrier:.4f}  midpoint loss {result.losses[len(lambdas) // 2]:.4f}",
              file=sys.stderr, flush=True)

    if not (args.glmc_only or args.skip_vanilla):
        record("vanilla", curve(b.state))
    standard_a, standard_b = a.adapter.to_standard(a.state), b.adapter.to_standard(b.state)
    aligned = {}
    for variant in filter(None, args.variants.split(",")):
        mode, weighting, rows, *head = variant.split("/")
        inferred = None
        if rows == "all":
            token_rows = None
        elif rows.startswith("auto"):  # from the two models' weights alone (auto = auto-zipf)
            started = time.perf_counter()
            inferred = infer_token_rows(a.spec, standard_a, standard_b, weighting=rows.partition("-")[2] or "zipf")
            inferring = time.perf_counter() - started
            token_rows = None if inferred is None else inferred.weights
            if inferred is not None:
                truth = torch.zeros(a.config.vocab_size, dtype=torch.bool)
                truth[seen] = True
                judged = inferred.probability > 0.5
                hits = int((judged & truth).sum())
                results.setdefault("token_rows", {})[variant] = {
                    **inferred.summary(), "seconds": round(inferring, 2), "seen": len(seen), "precision": round(hits / max(int(judged.sum()), 1), 4),
                    "recall": round(hits / len(seen), 4)}
                print(f"{variant}: {inferred.trained} rows judged trained of {inferred.vocab} "
                      f"(seen in training {len(seen)}; precision {hits / max(int(judged.sum()), 1):.4f}, "
                      f"recall {hits / len(seen):.4f})", file=sys.stderr, flush=True)
        else:
            token_rows = token_weights(train_ids, a.config.vocab_size, rows)
        match = weight_match(a.spec, standard_a, standard_b, mode=mode, iterations=args.iterations, tol=args.tol,
                             weighting=weighting, token_rows=token_rows, head_weight=float(head[0]) if head else 1.0)
        aligned[variant] = a.adapter.from_standard(match.state)
        if not args.glmc_only:
            record(f"fedbasin {variant}", curve(aligned[variant]), match.seconds, iterations=match.iterations)
    for item in args.aligned:
        name, _, path = item.partition("=")
        endpoint = load_checkpoint(path)
        end_b = loss(endpoint.state)  # the aligned endpoint's own loss (B's function up to rounding)
        record(f"aligned {name}", curve(endpoint.state), path=path)
    if args.glmc_path:
        with tempfile.TemporaryDirectory() as tmp:
            blocks = Path(tmp) / "blocks.pt"
            train = splits["train"]
            proxy = torch.randperm(len(train), generator=torch.Generator().manual_seed(0))[:args.glmc_proxy_examples]
            torch.save({"inputs": test.inputs, "targets": test.targets, "train_ids": train_ids,
                        "proxy_inputs": train.inputs[proxy], "proxy_targets": train.targets[proxy]}, blocks)
            wanted = set(filter(None, args.glmc_rows.split(",")))
            runs = [(f"GLMC {kind}", kind == "permutation", None, None) for kind in ("permutation", "orthogonal")
                    if kind in wanted]
            if args.glmc_learned_steps:
                runs.append(("GLMC learned (orthogonal)", False, None, None))
            if args.circuit_variant:
                from fedbasin.checkpoint import save_checkpoint

                path = Path(tmp) / "aligned_b"
                state = aligned.get(args.circuit_variant)
                if state is None:
                    raise SystemExit(f"glmc_compare: --circuit-variant {args.circuit_variant} is not in --variants")
                save_checkpoint(path, "gpt2", a.config, state, kind="hf")
                runs.append((f"fedbasin {args.circuit_variant} on GLMC's merged architecture", False, str(path), 0))
            if args.aligned_on_glmc:
                runs += [(f"aligned {name} on GLMC's merged architecture", False, path, 0)
                         for name, _, path in (item.partition("=") for item in args.aligned)]
            for name, perm, model1, iterations in runs:
                steps = args.glmc_learned_steps if name.startswith("GLMC learned") else 0
                out = run_glmc(args, blocks, perm, model1, iterations, train_steps=steps)
                results["rows"][name] = {k: out[k] for k in ("barrier", "argmax", "losses", "wall_seconds",
                                                             "match_seconds", "train_steps", "train_batch_size",
                                                             "proxy_examples", "train_seconds", "train_losses")
                                         if k in out}
                print(f"{name:40s} barrier {out['barrier']:.4f}", file=sys.stderr, flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    print(json.dumps({k: round(v["barrier"], 4) for k, v in results["rows"].items()}, indent=2))
    return results


if __name__ == "__main__":
    main()
