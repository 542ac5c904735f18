"""Run GLMC's own weight matching on two GPT-2 checkpoints and print its interpolation losses as JSON.

Standalone on purpose: it runs in the Python environment GLMC needs (transformers 4.50.1, POT,
einops; see ``glmc_compare``) and imports GLMC's code from ``--glmc-path`` (its public repository,
not part of fedbasin). Nothing of fedbasin is imported here.

    python glmc_driver.py --glmc-path DIR --model0 A --model1 B --blocks blocks.pt [--permutations-only]

``blocks.pt``: ``{"inputs": (N, T), "targets": (N, T), "train_ids": (M,)}``; ``train_ids`` give
the token frequencies GLMC uses to restrict embedding rows to tokens seen in training. Losses
are mean next-token cross-entropy over every target, at ``λ`` = 0, 0.1, …, 1 of GLMC's merger
(``λ θ_0 + (1 − λ) g·θ_1``, GLMC's convention).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--glmc-path", required=True)
    parser.add_argument("--model0", required=True)
    parser.add_argument("--model1", required=True)
    parser.add_argument("--blocks", required=True)
    parser.add_argument("--permutations-only", action="store_true")
    parser.add_argument("--iterations", type=int, default=15)
    parser.add_argument("--points", type=int, default=11)
    parser.add_argument("--no-token-freqs", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    sys.path.insert(0, args.glmc_path)
    from merger import GPTMerger  # GLMC's code
    from transformers import GPT2LMHeadModel

    torch.manual_seed(args.seed)  # GLMC initialises its (near-identity) learnable maps randomly
    torch.set_num_threads(1)
    data = torch.load(args.blocks)
    models = [GPT2LMHeadModel.from_pretrained(p, attn_implementation="eager").eval() for p in (args.model0, args.model1)]
    vocab = models[0].config.vocab_size
    freqs = None if args.no_token_freqs else torch.bincount(data["train_ids"], minlength=vocab)
    started = time.perf_counter()
    with torch.no_grad():
        merger = GPTMerger(models[0], models[1], token_freqs=freqs, permutations_only=args.permutations_only,
                           iterations=args.iterations).eval()
    seconds = time.perf_counter() - started
    lambdas = [i / (args.points - 1) for i in range(args.points)]
    losses = []
    with torch.no_grad():
        for lam in lambdas:
            merger.set_sampler(sampler_type=None, fixed_coeff=lam)
            total = 0.0
            for x, y in zip(data["inputs"].split(16), data["targets"].split(16)):
                logits = merger(input_ids=x).logits
                total += float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                                 y.reshape(-1), reduction="sum"))
            losses.append(total / data["targets"].numel())
    json.dump({"lambdas": lambdas, "losses": losses, "match_seconds": seconds,
               "permutations_only": args.permutations_only, "iterations": args.iterations,
               "token_freqs": freqs is not None}, sys.stdout)


if __name__ == "__main__":
    main()
