"""Exploratory probe (docs/journal/merging-notes.md §30): does a statistics correction of an aligned merge help?

For a model A and a candidate C already in A's basis (``fedbasin align A B --out C``, data-free or learned), the
merge θ_M = λθ_A + (1 − λ)θ_C is corrected layer by layer, REPAIR-style (Jordan et al., 2022): each MLP hidden unit
i's pre-activation z_i = x·W_up[:, i] + b_i gets the mean and standard deviation that interpolate the endpoints'
(μ* = λμ_A + (1 − λ)μ_C, σ* likewise), measured on ``--examples`` training examples,

    W_up[:, i] ← W_up[:, i] · σ*/σ_M,   b_i ← (b_i − μ_M) · σ*/σ_M + μ*,

with μ_M, σ_M the merge's own statistics after the layers before it were corrected. This changes the merge's
function (it is no group element): a candidate for ``fedbasin merge``, not for ``align`` or the barrier.

    python scripts/repair_probe.py A C --data cifar10:DIR [--examples 2000] [--eval-examples 2000] [--lam 0.5]

Prints one JSON line: the endpoints', the merge's and the corrected merge's test loss and accuracy, and the merge's
mean σ_M/σ* per layer before correction. Uses fedbasin internals (not a supported API).
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("a")
    p.add_argument("c")
    p.add_argument("--data", required=True, help="digits | cifar10:DIR | text:FILE (with --tokenizer)")
    p.add_argument("--tokenizer")
    p.add_argument("--examples", type=int, default=2000, help="training examples the statistics are taken on")
    p.add_argument("--eval-examples", type=int, default=2000, help="first N test examples scored (0: all)")
    p.add_argument("--lam", type=float, default=0.5, help="A's weight in the merge")
    args = p.parse_args(argv)

    from fedbasin.alignment.activations import _module_name
    from fedbasin.checkpoint import build_torch_model, load_checkpoint
    from fedbasin.cli import _Logits
    from fedbasin.data import load_task
    from fedbasin.server.distill import mean_loss
    from fedbasin.training import cross_entropy

    a, c = load_checkpoint(args.a), load_checkpoint(args.c)
    task = load_task(args.data, tokenizer=args.tokenizer or (args.a if args.data.startswith("text:") else None),
                     block_size=a.context_length or 64)
    spec, lam = a.spec, args.lam
    sa, sc = a.adapter.to_standard(a.state), c.adapter.to_standard(c.state)
    merged = {k: lam * v + (1 - lam) * sc[k] if v.is_floating_point() else v for k, v in sa.items()}
    model = build_torch_model(a).eval()
    modules = dict(model.named_modules())
    n_stats = min(args.examples, len(task.train))
    stats_batches = list(task.train.subset(torch.arange(n_stats)).batches(64))
    n_test = len(task.test) if args.eval_examples <= 0 else min(args.eval_examples, len(task.test))
    test_batches = list(task.test.subset(torch.arange(n_test)).batches(64))

    def run(state: dict, batches, hook_key: str | None = None):
        """Test loss and accuracy of ``state``, or the pre-activations of the module holding ``hook_key``."""
        model.load_state_dict(a.adapter.from_standard(state))
        if hook_key is None:
            logits = _Logits(model)
            with torch.no_grad():
                loss = mean_loss(logits, cross_entropy, batches, torch.device("cpu"))
                right = sum(int((logits(x).argmax(-1) == y).sum()) for x, y in batches)
            return loss, right / sum(y.numel() for _, y in batches)
        kept = []
        module = modules[_module_name(hook_key, a.adapter.from_standard, modules)]
        handle = module.register_forward_hook(lambda m, i, o: kept.append(o.reshape(-1, o.shape[-1]).double()))
        try:
            with torch.no_grad():
                for x, _ in batches:
                    model(x)
        finally:
            handle.remove()
        z = torch.cat(kept)
        return z.mean(0), z.std(0)

    started = time.perf_counter()
    repaired, ratios = dict(merged), []
    for mlp in spec.mlp:
        key = mlp.up.weight
        (mu_a, sd_a), (mu_c, sd_c) = run(sa, stats_batches, key), run(sc, stats_batches, key)
        mu_m, sd_m = run(repaired, stats_batches, key)
        mu_t, sd_t = lam * mu_a + (1 - lam) * mu_c, lam * sd_a + (1 - lam) * sd_c
        ratios.append(round(float((sd_m / sd_t.clamp_min(1e-12)).mean()), 4))
        gain = sd_t / sd_m.clamp_min(1e-12)
        w = repaired[key]  # torch's layout: (n, d_in), a unit per row
        repaired[key] = (w.double() * gain[:, None]).to(w.dtype)
        if mlp.up.bias:
            b = repaired[mlp.up.bias]
            repaired[mlp.up.bias] = ((b.double() - mu_m) * gain + mu_t).to(b.dtype)
    seconds = time.perf_counter() - started
    out = {"a": run(sa, test_batches), "c": run(sc, test_batches), "merge": run(merged, test_batches),
           "repaired": run(repaired, test_batches), "std_ratio_by_layer": ratios, "seconds": round(seconds, 1),
           "examples": n_stats, "eval_examples": n_test, "lam": lam}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
