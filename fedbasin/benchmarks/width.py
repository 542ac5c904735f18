"""Width-heterogeneous merge on digits: a wide ViT (d=64) and a narrow one (d=32), same head width.

    python -m fedbasin.benchmarks.width [--epochs 150] [--threads 1] [--out runs/width]

Two clients hold disjoint halves of the digits training split; client A trains a wide ViT
(d=64, 4 heads, n=128), client B a narrow one (d=32, 2 heads, n=64; head width 16 in both), both
with ``norm_eps=0`` so that the width embedding is exact (``fedbasin.alignment.width``). Reports
test accuracy of each model, of the narrow model embedded into the wide architecture (equal to
the narrow model's), the loss barrier between the wide model and the embedded narrow one
(default embedding vs weight-matched), the merged wide model (aligned vs plain averaging of the
embeddings), and what the narrow client receives back (the merged model restricted to its slots).
Prints JSON and a markdown table; writes both to ``OUT`` when given.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch

from fedbasin.alignment import canonicalize, fedbasin_adapter, interpolation_curve, to_gauge
from fedbasin.alignment.width import embed, embed_and_align, merge_heterogeneous, restrict
from fedbasin.data import load_task
from fedbasin.models import build_model, make_config
from fedbasin.training import train

WIDE = dict(dim=64, depth=2, heads=4, mlp_dim=128, norm_eps=0.0)
NARROW = dict(dim=32, depth=2, heads=2, mlp_dim=64, norm_eps=0.0)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=150)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--iterations", type=int, default=20, help="weight-matching iterations")
    parser.add_argument("--weighting", default="rms", choices=["rms", "cosine", "uniform"])
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    task = load_task("digits")
    halves = task.train.split(0.5, seed=0)
    configs = [make_config("vit", {**task.model_overrides, **c}) for c in (WIDE, NARROW)]
    specs = [fedbasin_adapter("vit", c).spec for c in configs]
    states, train_seconds = [], []
    for seed, (config, data) in enumerate(zip(configs, halves)):
        model = build_model("vit", config, seed=seed)
        t0 = time.perf_counter()
        train(model, data, epochs=args.epochs, lr=args.lr, batch_size=64, seed=seed)
        train_seconds.append(round(time.perf_counter() - t0, 1))
        states.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    wide, narrow = states
    spec_w, spec_n = specs

    def evaluate(state: dict, config) -> dict:
        model = build_model("vit", config)
        model.load_state_dict(state)
        return task.evaluate(model, "test")

    def logits(state: dict, config) -> torch.Tensor:
        model = build_model("vit", config).double()
        model.load_state_dict(state)
        with torch.no_grad():
            return model(task.test.inputs.double())

    acc = lambda state, config: evaluate(state, config)["accuracy"]
    loss = lambda state: evaluate(state, configs[0])["loss"]
    t0 = time.perf_counter()
    # the narrow model embedded with the default residual map, in the wide model's gauge (no alignment)
    embedded = to_gauge(spec_w, embed(spec_n, narrow, spec_w, wide), canonicalize(spec_w, wide).gains)
    double = lambda state: {k: v.double() for k, v in state.items()}
    ref, emb = logits(narrow, configs[1]), logits(embed(spec_n, double(narrow), spec_w, double(wide)), configs[0])
    aligned = embed_and_align(spec_n, narrow, spec_w, wide, iterations=args.iterations, weighting=args.weighting)
    vanilla_curve = interpolation_curve(wide, embedded, loss)
    aligned_curve = interpolation_curve(wide, aligned.state, loss)
    merged = merge_heterogeneous(specs, states, iterations=args.iterations, weighting=args.weighting)
    plain = merge_heterogeneous(specs, states, align=False)
    member = merged.members[1]
    wide_slice = restrict(spec_w, wide, spec_n, member.residual_map, member.transform, member.gains)
    merge_seconds = round(time.perf_counter() - t0, 1)

    rows = {
        "wide (d=64)": acc(wide, configs[0]),
        "narrow (d=32)": acc(narrow, configs[1]),
        "narrow embedded in d=64": acc(embedded, configs[0]),
        "merged wide, plain average of embeddings": acc(plain.state, configs[0]),
        "merged wide, aligned": acc(merged.state, configs[0]),
        "narrow receives: plain merge restricted": acc(plain.restricted(1), configs[1]),
        "narrow receives: aligned merge restricted": acc(merged.restricted(1), configs[1]),
        "(wide model alone restricted to the narrow slots)": acc(wide_slice, configs[1]),
    }
    result = {
        "accuracy": rows,
        "embedding_logit_rel_err_float64": float((emb - ref).norm() / ref.norm()),
        "barrier_wide_vs_embedded_narrow": {"vanilla": vanilla_curve.barrier, "aligned": aligned_curve.barrier},
        "curves": {"vanilla": vanilla_curve.losses, "aligned": aligned_curve.losses},
        "alignment_objective": {"initial": aligned.match.initial_objective, "final": aligned.match.objective[-1]},
        "train_seconds": train_seconds,
        "epochs": args.epochs,
        "weighting": args.weighting,
        "merge_and_eval_seconds": merge_seconds,
        "wall_seconds": round(time.perf_counter() - t_start, 1),
        "machine": {"cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                    "processor": platform.processor() or platform.machine(), "torch": torch.__version__},
    }
    table = ["| model | test accuracy |", "|---|---|"] + [f"| {k} | {v:.3f} |" for k, v in rows.items()]
    table += ["", "| barrier (test loss), wide ↔ embedded narrow | value |", "|---|---|",
              f"| vanilla (default embedding) | {vanilla_curve.barrier:.3f} |",
              f"| aligned (weight matching, orthogonal) | {aligned_curve.barrier:.3f} |",
              "", (f"embedded vs narrow logits, relative error (float64): "
                   f"{result['embedding_logit_rel_err_float64']:.1e}; training {train_seconds} s, wall "
                   f"{result['wall_seconds']} s on {os.cpu_count()} CPU cores ({torch.get_num_threads()} torch threads)")]
    markdown = "\n".join(table)
    print(json.dumps(result, indent=2))
    print(markdown)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(result, indent=2))
        (out / "width.md").write_text(markdown + "\n")
    return result


if __name__ == "__main__":
    main()
