"""Exploratory probe of data-free objectives on the GPT-2 recipe pair (docs/journal/merging-notes.md §2a, "Two more
objectives"): weight matching (√count token rows, head × --head) on tensors changed before matching, then
the group element it found applied to the unchanged candidate (exact either way), and the barrier (11 λ).

* ``--source real|unigram``: every reader of a norm multiplied by Σ^{p/2} (``--power`` p, ``--ridge``),
  Σ = E[x̂ x̂ᵀ] of the normalised residual at that norm in each model's own basis, from ``--blocks``
  training blocks (real) or tokens drawn by their training counts (unigram); ``--sites`` restricts it.
* ``--center``: every residual axis projected onto the complement of the all-ones vector.
* ``--factor REGEX=VALUE`` (repeatable): the objective weight of every key matching REGEX times VALUE.
* ``--head-maps``: after matching, each head's invertible QK map A and OV map B fitted (L-BFGS on A = exp(X))
  to ``‖Q_ref − Q A‖² + ‖K_ref − K A⁻ᵀ‖²`` and ``‖V_ref − V B‖² + ‖O_ref − B⁻¹ O‖²`` (biases included), then applied.
* ``--source none`` without ``--center``, ``--factor`` or ``--head-maps`` reproduces the plain objective.
* ``--points 3``: the barrier is the midpoint's excess over the endpoints' mean.

    python scripts/datafree_probe.py --pair runs/gpt2pair6 --text ../shared/data/tinyshakespeare/input.txt \
        [--source real --sites attn] [--center] [--factor wte=2] [--head-maps] [--split test --max-blocks 32]

Prints one JSON line. Uses fedbasin internals (not a supported API)."""
import argparse
import contextlib
import json
import math
import re
import time

import torch

from fedbasin.alignment import interpolate, lambda_grid, loss_barrier, matching, weight_match
from fedbasin.alignment.activations import _normalised, _Recorder
from fedbasin.alignment.canonical import canonicalize, to_gauge
from fedbasin.alignment.group import GroupElement, HeadMap, apply_group, contract_axis
from fedbasin.alignment.matching import token_weights
from fedbasin.checkpoint import build_torch_model, load_checkpoint
from fedbasin.weights import weightless_copy
from fedbasin.benchmarks.gpt2_pair import DEFAULT_TEXT, mean_loss, pair_data


def second_moments(checkpoint, spec, sites, state: dict, blocks: torch.Tensor) -> list[torch.Tensor]:
    """Σ = E[x̂ x̂ᵀ] of the normalised input of each norm in ``sites`` (the model ``state`` on ``blocks``)."""
    frozen = weightless_copy(build_torch_model(checkpoint), torch.device("cpu")).eval()
    recorder = _Recorder(spec, frozen, checkpoint.adapter.from_standard)
    sums = {}
    with torch.no_grad():
        for start in range(0, len(blocks), 16):
            recorder.acts = {}
            torch.func.functional_call(frozen, checkpoint.adapter.from_standard(state), (blocks[start:start + 16],))
            for (kind, index), value in recorder.acts.items():
                if kind == "norm":  # (input, output) of the norm
                    x = _normalised(value[0], layernorm=True)
                    sums[index] = sums.get(index, 0) + x.T @ x
    recorder.close()
    return [sums[i] / blocks.numel() for i in range(len(sites))]


@contextlib.contextmanager
def objective_factors(factors: list[tuple[re.Pattern, float]]):
    """While open, weight matching's objective weight of each key is multiplied by the factors whose
    pattern the key matches."""
    original = matching._Objective.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        for key in self.w:
            self.w[key] *= math.prod(value for pattern, value in factors if pattern.search(key))

    matching._Objective.__init__ = init
    try:
        yield
    finally:
        matching._Objective.__init__ = original


def fit_map(first_ref, first, second_ref, second, iterations: int = 300):
    """(M, M⁻ᵀ) per head, M = exp(X) from X = 0, minimising ``‖first_ref − first M‖² + ‖second_ref − second M⁻ᵀ‖²``."""
    generator = torch.zeros(first.shape[0], first.shape[2], first.shape[2], dtype=torch.float64, requires_grad=True)
    optimiser = torch.optim.LBFGS([generator], lr=1, max_iter=iterations, line_search_fn="strong_wolfe",
                                  tolerance_grad=1e-12, tolerance_change=1e-14)

    def closure():
        optimiser.zero_grad()
        m, dual = torch.linalg.matrix_exp(generator), torch.linalg.matrix_exp(-generator.transpose(1, 2))
        value = ((first_ref - first @ m) ** 2).sum() + ((second_ref - second @ dual) ** 2).sum()
        value.backward()
        return value

    optimiser.step(closure)
    with torch.no_grad():
        return torch.linalg.matrix_exp(generator), torch.linalg.matrix_exp(-generator.transpose(1, 2))


def fit_head_maps(spec, ref: dict, cand: dict) -> GroupElement:
    """Per-head invertible QK and OV maps bringing the canonical ``cand``'s head factors closest to
    ``ref``'s in squared distance (module docstring); the identity is the start."""
    def heads(w, h, dh):  # torch rows (H·d_h, d) → per head (H, d, d_h)
        return w.reshape(h, dh, -1).transpose(1, 2)

    def with_bias(state, lin, h, dh):
        return torch.cat([heads(state[lin.weight], h, dh), state[lin.bias].reshape(h, 1, dh)], 1).double()

    element = GroupElement.identity(spec)
    for layer, a in enumerate(spec.attention):
        h, dh = a.num_heads, a.head_dim
        outputs = [s[a.o.weight].reshape(-1, h, dh).transpose(0, 1).double() for s in (ref, cand)]  # O_hᵀ: (H, d, d_h)
        pairs = {"qk": ((with_bias(ref, a.q, h, dh), with_bias(cand, a.q, h, dh)),
                        (with_bias(ref, a.k, h, dh), with_bias(cand, a.k, h, dh))),
                 "ov": ((with_bias(ref, a.v, h, dh), with_bias(cand, a.v, h, dh)), tuple(outputs))}
        maps = {name: fit_map(first_ref, first, second_ref, second)
                for name, ((first_ref, first), (second_ref, second)) in pairs.items()}
        element.heads[layer] = HeadMap(torch.arange(h), qk=maps["qk"][0], ov=maps["ov"][0], qk_dual=maps["qk"][1],
                                       ov_dual=maps["ov"][1])
    return element


def factor(text: str) -> tuple[re.Pattern, float]:
    """``REGEX=VALUE`` of ``--factor`` (argparse type: a bad one is a one-line usage error)."""
    pattern, _, value = text.rpartition("=")
    try:
        return re.compile(pattern), float(value)
    except (re.error, ValueError):
        raise argparse.ArgumentTypeError(f"expected REGEX=VALUE with a number VALUE, got {text!r}") from None


def site_kind(norm) -> str:
    """attn | mlp | head: what the norm's readers are."""
    keys = " ".join(k for k, _ in norm.readers)
    return "attn" if "attn" in keys else "mlp" if "mlp" in keys else "head"


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", required=True, help="directory with seed0 and seed1 from gpt2_pair")
    parser.add_argument("--text", default=DEFAULT_TEXT)
    parser.add_argument("--source", choices=("real", "unigram", "none"), default="real")
    parser.add_argument("--power", type=float, default=1.0, help="readers × Σ^(power/2)")
    parser.add_argument("--ridge", type=float, default=0.0, help="Σ + ridge·tr(Σ)/d·I")
    parser.add_argument("--blocks", type=int, default=64)
    parser.add_argument("--sites", default="all", help="all, or a comma list of attn, mlp, head")
    parser.add_argument("--center", action="store_true")
    parser.add_argument("--split", choices=("test", "validation"), default="validation")
    parser.add_argument("--max-blocks", type=int, default=0)
    parser.add_argument("--head", type=float, default=2.0, help="weight_match's head_weight")
    parser.add_argument("--factor", action="append", default=[], type=factor, metavar="REGEX=VALUE",
                        help="objective weight of the keys matching REGEX times VALUE (repeatable)")
    parser.add_argument("--head-maps", action="store_true", help="fit per-head invertible maps after matching")
    parser.add_argument("--points", type=int, default=11, help="λ values of the barrier (3: the midpoint's excess)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    a, b = load_checkpoint(f"{args.pair}/seed0"), load_checkpoint(f"{args.pair}/seed1")
    _, splits = pair_data(args.text, f"{args.pair}/seed0", a.config.n_positions)
    train_ids = splits["train"].token_ids()
    spec = a.spec
    ref, cand = (canonicalize(spec, m.adapter.to_standard(m.state)) for m in (a, b))
    sites = [n for n in spec.norms if n.weight is not None]
    generator = torch.Generator().manual_seed(0)
    train = splits["train"]
    if args.source == "real":
        blocks = train.inputs[torch.randperm(len(train), generator=generator)[:args.blocks]]
    else:
        counts = torch.bincount(train_ids, minlength=a.config.vocab_size).double()
        blocks = torch.multinomial(counts / counts.sum(), args.blocks * train.inputs.shape[1], replacement=True,
                                   generator=generator).reshape(args.blocks, -1)

    def changed(state: dict) -> dict:
        state = dict(state)
        d = spec.width
        if args.center:
            off_ones = torch.eye(d, dtype=torch.float64) - 1.0 / d
            for key, axis in spec.residual:
                state[key] = contract_axis(state[key], axis, off_ones.to(state[key]))
        if args.source == "none":
            return state
        for norm, sigma in zip(sites, second_moments(a, spec, sites, state, blocks)):
            if args.sites != "all" and site_kind(norm) not in args.sites.split(","):
                continue
            sigma = sigma + args.ridge * torch.trace(sigma) / d * torch.eye(d, dtype=sigma.dtype)
            values, vectors = torch.linalg.eigh(sigma)
            scale = (vectors * values.clamp_min(0).pow(args.power / 2)) @ vectors.T
            scale = scale / (torch.trace(scale) / d)  # the site's overall scale kept
            for key, axis in norm.readers:
                state[key] = contract_axis(state[key], axis, scale.to(state[key]))
        return state

    t0 = time.time()
    with objective_factors(args.factor):
        match = weight_match(spec, changed(ref.state), changed(cand.state), mode="orthogonal", iterations=30, tol=1e-6,
                             token_rows=token_weights(train_ids, a.config.vocab_size, "sqrt"), head_weight=args.head)
    moved = apply_group(spec, cand.state, match.transform)
    if args.head_maps:
        moved = apply_group(spec, moved, fit_head_maps(spec, ref.state, moved))
    aligned = a.adapter.from_standard(to_gauge(spec, moved, ref.gains))
    seconds = time.time() - t0
    split = splits[args.split]
    if args.max_blocks:
        split = split.subset(torch.arange(min(args.max_blocks, len(split))))
    lambdas = lambda_grid(args.points)
    losses = [mean_loss(build_torch_model(a, interpolate(a.state, aligned, lam)), split) for lam in lambdas]
    result = {"args": {**vars(args), "factor": [f"{p.pattern}={v}" for p, v in args.factor]}, "barrier": round(loss_barrier(lambdas, losses)[0], 4),
              "midpoint_loss": round(losses[len(lambdas) // 2], 4), "objective": match.objective[-1],
              "iterations": match.iterations, "match_seconds": round(seconds, 1)}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
