"""Where does an aligned pair's barrier come from? Its midpoint barrier split exactly over parameter groups.

For a model A and a candidate C already aligned into A's basis and gauge (``fedbasin align A B --out C``), the
path θ(λ) = θ_C + λ Δ with Δ = θ_A − θ_C has the midpoint barrier

    b = L(θ(½)) − (L(θ(0)) + L(θ(1)))/2 = ½ [ ∫_0^½ g(λ) dλ − ∫_½^1 g(λ) dλ ],   g(λ) = ∇L(θ(λ)) · Δ,

and g is a sum over parameter groups (g_G = ∇_G L · Δ_G), so b = Σ_G b_G with b_G the same integral of g_G: the
share of the barrier each group's difference carries along the path (a group's b_G can be negative). The
integrals use the midpoint rule on ``--intervals`` pieces (one forward and backward pass over the blocks per
piece); the script prints b measured directly beside Σ_G b_G, so the quadrature error shows. Groups: token
embedding, positions, output head, attention Q/K, V/O, MLP gate, up, down, norms, the token tables' rows seen in
the text's training split apart from the others; ``--by-layer`` splits the groups per layer too.

    python scripts/barrier_attribution.py A C --data text:FILE [--tokenizer DIR] [--max-examples 100]
"""

from __future__ import annotations

import argparse
import json
import re
import time

import torch

# (group, pattern on a standard-form key): the first match names a key's group; the patterns cover the GPT-2 and
# Llama families' Hugging Face names (GPT-2's fused attention is split into q, k, v in the standard form)
GROUPS = [
    ("token embedding", r"(embed_tokens|wte|tok_emb)\."),
    ("positions", r"(wpe|pos_emb)\b"),
    ("output head", r"(lm_head|head)\.weight$"),
    ("attention Q/K", r"(q_proj|k_proj|attn\.q|attn\.k)\."),
    ("attention V/O", r"(v_proj|o_proj|attn\.v|attn\.o)\."),
    ("MLP gate", r"gate_proj\."),
    ("MLP up", r"(up_proj|mlp\.up|mlp\.c_fc)\."),
    ("MLP down", r"(down_proj|mlp\.down|mlp\.c_proj)\."),
    ("norms", r"(norm|ln_\w+)\.(weight|bias)$"),
]


def group_of(key: str, by_layer: bool = False) -> str:
    """A standard-form key's group (with its layer, ``by_layer``)."""
    name = next((name for name, pattern in GROUPS if re.search(pattern, key)), "other")
    layer = re.search(r"\.(\d+)\.", key)
    return f"{name} [{layer.group(1)}]" if by_layer and layer else name


def attribute(a_path: str, c_path: str, data: str, tokenizer: str | None = None, max_examples: int = 100,
              intervals: int = 8, batch: int = 10, by_layer: bool = False, progress=print) -> dict:
    """The summary the script prints: the losses at λ = 0, ½, 1, the midpoint barrier b and each group's share."""
    from fedbasin.checkpoint import build_torch_model, load_checkpoint
    from fedbasin.cli import _Logits
    from fedbasin.data import load_task
    from fedbasin.training import cross_entropy

    if intervals < 2 or intervals % 2:
        raise ValueError("intervals must be even and >= 2 (½ is a piece boundary)")
    a, c = load_checkpoint(a_path), load_checkpoint(c_path)
    task = load_task(data, tokenizer=tokenizer or a_path, block_size=a.context_length)
    split = task.split("test")
    split = split.subset(torch.arange(min(max_examples, len(split))))
    sa, sc = a.adapter.to_standard(a.state), c.adapter.to_standard(c.state)
    delta = {k: v - sc[k] for k, v in sa.items() if v.is_floating_point()}
    module = build_torch_model(a)
    vocab = int(a.config.vocab_size)
    seen = torch.zeros(vocab, dtype=torch.bool)  # the token rows the training split uses
    seen[task.train.token_ids().unique()] = True
    started = time.perf_counter()

    def at(lam: float) -> dict:
        return {k: sc[k] + lam * delta[k] if k in delta else v for k, v in sc.items()}

    def loss(lam: float) -> float:
        return task.evaluate(_Logits(build_torch_model(a, a.adapter.from_standard(at(lam)))), split)["loss"]

    def slope(lam: float) -> dict[str, float]:
        """∇_k L(θ(λ)) · Δ_k per key (a token table's seen and unseen rows apart), L the mean token loss."""
        state = {k: v.detach().clone().requires_grad_(k in delta) for k, v in at(lam).items()}
        for x, y in split.batches(batch):
            out = torch.func.functional_call(module, a.adapter.from_standard(state), (x,))
            logits = out if isinstance(out, torch.Tensor) else out.logits
            (cross_entropy(logits, y) * len(x) / len(split)).backward()
        found = {}
        for k in delta:
            product = state[k].grad * delta[k]
            if product.ndim == 2 and product.shape[0] == vocab:
                rows = product.sum(1)
                found[k + " (seen rows)"], found[k + " (unseen rows)"] = float(rows[seen].sum()), float(rows[~seen].sum())
            else:
                found[k] = float(product.sum())
        return found

    h = 1.0 / intervals
    share: dict[str, float] = {}
    for i in range(intervals):
        lam = (i + 0.5) * h
        sign = 1.0 if lam < 0.5 else -1.0  # b = ½ [∫_0^½ g − ∫_½^1 g]
        for key, value in slope(lam).items():
            name, _, rows = key.partition(" ")
            group = f"{group_of(name, by_layer)} {rows}".rstrip()
            share[group] = share.get(group, 0.0) + 0.5 * sign * h * value
        progress(f"λ = {lam:.3f} done ({time.perf_counter() - started:.0f} s)")
    l0, lmid, l1 = loss(0.0), loss(0.5), loss(1.0)
    return {"a": a_path, "c": c_path, "examples": len(split), "intervals": intervals,
            "loss_a": l1, "loss_c": l0, "loss_mid": lmid, "barrier_mid": lmid - (l0 + l1) / 2,
            "sum_of_shares": sum(share.values()), "shares": dict(sorted(share.items(), key=lambda kv: -kv[1])),
            "seen_rows": int(seen.sum()), "seconds": round(time.perf_counter() - started, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("a", help="model A")
    p.add_argument("c", help="model C: B aligned into A's basis and gauge")
    p.add_argument("--data", required=True, help="text:FILE (its test split)")
    p.add_argument("--tokenizer", help="tokenizer directory (default: A's)")
    p.add_argument("--max-examples", type=int, default=100, help="the first N test blocks")
    p.add_argument("--intervals", type=int, default=8, help="midpoint-rule pieces of [0, 1] (even)")
    p.add_argument("--batch", type=int, default=10, help="blocks per forward pass")
    p.add_argument("--by-layer", action="store_true", help="groups per layer")
    args = p.parse_args()
    try:
        summary = attribute(args.a, args.c, args.data, args.tokenizer, args.max_examples, args.intervals, args.batch,
                            args.by_layer, progress=lambda line: print(line, flush=True))
    except ValueError as error:
        p.error(str(error))
    for group, b in summary["shares"].items():
        print(f"{group:36s} barrier share {b:+.4f}")
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
