"""Run GLMC's own weight matching on two GPT-2 checkpoints and print its interpolation losses as JSON.

Standalone on purpose: it runs in the Python environment GLMC needs (transformers 4.50.1, POT,
einops; see ``glmc_compare``) and imports GLMC's code from ``--glmc-path`` (its public repository,
not part of fedbasin). Nothing of fedbasin is imported here.

    python glmc_driver.py --glmc-path DIR --model0 A --model1 B --blocks blocks.pt [--permutations-only]

``blocks.pt``: ``{"inputs": (N, T), "targets": (N, T), "train_ids": (M,)}``; ``train_ids`` give
the token frequencies GLMC uses to restrict embedding rows to tokens seen in training.
``--train-steps N`` runs GLMC's learned matching after its weight matching: its learnable maps
(``merger.proj``) trained by AdamW on next-token loss at λ from its sampler (default
``narrow_uniform``, U(0.4, 0.6), as in its ``train_merger.py``), cosine schedule with 5 % warm-up,
on ``blocks.pt``'s ``proxy_inputs`` / ``proxy_targets`` (GLMC's HF ``Trainer`` is replaced by this
plain loop so the budget is the caller's). Losses
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
    parser.add_argument("--train-steps", type=int, default=0, help="GLMC's learned matching steps (0: none)")
    parser.add_argument("--train-batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument("--sampler", default="narrow_uniform")
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
    train = train_merger(merger, data, args) if args.train_steps else {}
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
               "token_freqs": freqs is not None, **train}, sys.stdout)


def train_merger(merger, data: dict, args) -> dict:
    """GLMC's learned matching: ``args.train_steps`` AdamW steps on its learnable maps, λ from its sampler."""
    import math

    params = [p for p in merger.parameters() if p.requires_grad]
    optimiser = torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay)
    warmup = max(1, math.ceil(0.05 * args.train_steps))
    schedule = torch.optim.lr_scheduler.LambdaLR(optimiser, lambda s: (s + 1) / warmup if s < warmup else
                                                 0.5 * (1 + math.cos(math.pi * (s - warmup) / max(1, args.train_steps - warmup))))
    inputs, targets = data["proxy_inputs"], data["proxy_targets"]
    generator = torch.Generator().manual_seed(args.seed)
    order, losses, started = torch.empty(0, dtype=torch.long), [], time.perf_counter()
    merger.train()
    merger.set_sampler(sampler_type=args.sampler)
    for step in range(args.train_steps):
        if len(order) < args.train_batch_size:
            order = torch.cat([order, torch.randperm(len(inputs), generator=generator)])
        batch, order = order[:args.train_batch_size], order[args.train_batch_size:]
        logits = merger(input_ids=inputs[batch]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets[batch].reshape(-1))
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
        schedule.step()
        losses.append(float(loss.detach()))
        print(f"GLMC learned step {step + 1}/{args.train_steps} loss {losses[-1]:.4f}", file=sys.stderr, flush=True)
    merger.eval()
    return {"train_steps": args.train_steps, "train_batch_size": args.train_batch_size, "train_losses": losses,
            "proxy_examples": len(inputs), "sampler": args.sampler, "train_seconds": time.perf_counter() - started}


if __name__ == "__main__":
    main()
