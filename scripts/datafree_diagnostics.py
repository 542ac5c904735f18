"""Where the data-free barrier of the GPT-2 recipe pair lives (docs/journal/merging-notes.md §14, first paragraph).

Aligns seed 1 to seed 0 by weight matching (orthogonal, √count token rows, head × 2) and prints:

* ``attention``: seed 0's loss on the first 48 validation blocks, and with every attention output's weight zeroed
  (what attention reads then reaches nothing; the output biases, constants, stay);
* ``families``: seed 0's loss rise when one family of tensors (token / position embedding, output head, each
  layer's attention or MLP) is replaced by the midpoint's, on the 141 validation blocks;
* ``objective``: weight matching's objective J and its share per family, for the matched candidate and for each
  ``--aligned DIR`` (an aligned candidate written by ``fedbasin align``, e.g. a learned one).

    python scripts/datafree_diagnostics.py --pair runs/gpt2pair6 --text ../shared/data/tinyshakespeare/input.txt \
        [--aligned OUT]

Prints one JSON line per part. Uses fedbasin internals (not a supported API)."""
import argparse
import json
import re

import torch

from fedbasin.alignment import interpolate, weight_match
from fedbasin.alignment.canonical import canonicalize
from fedbasin.alignment.matching import _Objective, token_indexed_keys, token_weights
from fedbasin.checkpoint import build_torch_model, load_checkpoint
from fedbasin.benchmarks.gpt2_pair import DEFAULT_TEXT, mean_loss, pair_data

#: the tensors swapped per family (HF GPT-2 keys with a leading "."): attention's fused q/k/v and its output apart
FAMILIES = {"token embedding": r"\.wte\.", "position embedding": r"\.wpe\.", "output head": r"^\.lm_head\.",
            **{f"layer {i} {name}": rf"\.h\.{i}\.{part}\." for i in range(4)
               for name, part in (("attention q/k/v", r"attn\.c_attn"), ("attention output", r"attn\.c_proj"),
                                  ("mlp", "mlp"))}}


def family_of(key: str) -> str:
    """The family of a standard-layout key (objective terms), e.g. ``layer 0 mlp``."""
    parts = key.split(".")
    if "wte" in parts or "wpe" in parts:
        return "token embedding" if "wte" in parts else "position embedding"
    if parts[0] == "lm_head":
        return "output head"
    return f"layer {parts[2]} {parts[3]}" if parts[1] == "h" else "other"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", required=True, help="directory with seed0 and seed1 from gpt2_pair")
    parser.add_argument("--text", default=DEFAULT_TEXT)
    parser.add_argument("--aligned", action="append", default=[], metavar="DIR")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    a, b = load_checkpoint(f"{args.pair}/seed0"), load_checkpoint(f"{args.pair}/seed1")
    _, splits = pair_data(args.text, f"{args.pair}/seed0", a.config.n_positions)
    spec, vocab = a.spec, a.config.vocab_size
    weights = token_weights(splits["train"].token_ids(), vocab, "sqrt")
    match = weight_match(spec, a.adapter.to_standard(a.state), b.adapter.to_standard(b.state), mode="orthogonal",
                         iterations=30, tol=1e-6, token_rows=weights, head_weight=2.0)
    matched = a.adapter.from_standard(match.state)
    validation = splits["validation"]

    def loss(state, split=validation):
        return mean_loss(build_torch_model(a, state), split, 32)

    first = validation.subset(torch.arange(48))
    no_attention = {k: torch.zeros_like(v) if re.search(r"\.attn\.c_proj\.weight$", k) else v for k, v in a.state.items()}
    print(json.dumps({"attention": {"seed 0": round(loss(a.state, first), 4),
                                    "seed 0, attention output weights zeroed": round(loss(no_attention, first), 4)}}))
    own, midpoint = loss(a.state), interpolate(a.state, matched, 0.5)
    rise = {name: round(loss({k: midpoint[k] if re.search(pattern, "." + k) else v for k, v in a.state.items()}) - own, 4)
            for name, pattern in FAMILIES.items()}
    print(json.dumps({"families": rise}))

    rows, scale = weights.nonzero().flatten(), weights[weights > 0].sqrt()

    def kept(state):  # the objective's view: canonical, token rows kept and scaled by √w
        state = {k: v.double() for k, v in canonicalize(spec, a.adapter.to_standard(state)).state.items()}
        for key in token_indexed_keys(spec, state):
            state[key] = state[key][rows] * scale[:, None]
        return state

    objective = _Objective(spec, kept(a.state), kept(b.state), "rms", head_weight=2.0)
    for name, state in [("weight matching", matched)] + [(d, load_checkpoint(d).state) for d in args.aligned]:
        total, terms = objective(kept(state))
        shares = {}
        for key, term in terms.items():
            shares[family_of(key)] = shares.get(family_of(key), 0.0) + term / objective.norm
        print(json.dumps({"objective": name, "J": round(total, 4), "per family": {k: round(v, 4) for k, v in shares.items()}}))


if __name__ == "__main__":
    main()
