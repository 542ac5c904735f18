"""Speed benchmark: align two GPT-2-small-shaped models (12 layers, d=768, n=3072, 12 heads).

    python -m fedbasin.benchmarks.bench_speed [--layers 12] [--tol 1e-4] [--profile] [--device cpu]
    python -m fedbasin.benchmarks.bench_speed --previous-sweeps   # the previous iteration, same conditions
    python -m fedbasin.benchmarks.bench_speed --kernels   # the kernels alone, 1 vs n threads

Prints wall time per phase (setup = canonicalise + starts, heads, MLP, residual, finish = gauge;
I/O = writing the aligned model to safetensors and reading it back), CPU seconds per phase and per
part of a step (``mlp.score``: the n×n products, ``mlp.rotate``: rotating a layer's unrotated MLP
weights before scoring, ``mlp.assignment``, ``heads.values``: the batched ``svdvals``,
``residual.svd``, ``*.apply``: applying a step and re-evaluating J), when J first reaches
``--reference-objective``, the 1-minute load average (the machine may be shared) and the peak
resident memory of the process, as JSON on stdout; the same per-phase table in words on stderr.

It also measures this machine's GEMM rate on the MLP-score shape (float32, and bfloat16 for
reference) and counts the matrix-product FLOPs of one iteration, so ``blas_floor_seconds`` =
iterations × FLOPs / float32 rate says how much of the wall time no scheduling can remove.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import sys
import tempfile
import time

import safetensors.torch
import torch

from fedbasin.alignment import fedbasin_adapter, matching, weight_match
from fedbasin.models import build_model, make_config


def _peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def gemm_gflops(n: int, k: int, dtype: torch.dtype, device: str, repeats: int = 3) -> float:
    """Best-of-``repeats`` rate of an (n×k)·(k×n) product, GFLOP/s, with the current thread count."""
    a = torch.randn(n, k, device=device).to(dtype)
    b = torch.randn(n, k, device=device).to(dtype)
    best = float("inf")
    for _ in range(repeats + 1):  # the first call warms up
        start = time.perf_counter()
        (a @ b.T).sum().item()
        best = min(best, time.perf_counter() - start)
    return 2 * n * n * k / best / 1e9


def matmul_flops_per_iteration(spec, state: dict) -> dict:
    """Matrix-product FLOPs of one weight-matching iteration (a full sweep and
    ``INNER_SWEEPS`` maps-only sweeps), by step: MLP scores (n×n×K per layer, K = summed row
    lengths) plus rotating the (unrotated) MLP weights once; head pair products (H²·d_h²·row
    length per q/k/v/o tensor; the maps-only sweeps' H·d_h²·row length); and per residual step
    two passes over the attention weights (covariance, then applying O) — the MLP weights'
    covariance is kept up to date from the rows that move, not recomputed (with
    ``UNROTATED_MLP = False`` the MLP weights take both passes too and are not rotated to score)."""
    sweeps = 1 + (matching.INNER_SWEEPS if spec.attention else 0)
    mlp = 0
    for m in spec.mlp:
        n = state[m.up.weight].shape[0]
        k = sum(state[x].numel() // n for lin in (m.up, m.gate) if lin for x in (lin.weight, lin.bias) if x)
        mlp += 2 * n * n * (k + state[m.down.weight].numel() // n)
        if matching.UNROTATED_MLP:
            mlp += sum(2 * state[lin.weight].numel() * spec.width for lin in (m.up, m.gate, m.down) if lin)
    heads = 0
    for a in spec.attention:
        for lin in (a.q, a.k, a.v, a.o):
            row_length = state[lin.weight].numel() // a.num_heads // a.head_dim
            heads += 2 * a.num_heads * (a.num_heads + sweeps - 1) * a.head_dim ** 2 * row_length
    moved = {lin.weight for a in spec.attention for lin in (a.q, a.k, a.v, a.o)}
    if not matching.UNROTATED_MLP:
        moved |= {lin.weight for m in spec.mlp for lin in (m.up, m.gate, m.down) if lin}
    residual = sweeps * sum(2 * 2 * state[k].numel() * spec.width for k, _ in spec.residual if k in moved)
    return {"mlp": mlp, "heads": heads, "residual": residual}


def kernels(n: int = 3072, d: int = 768, head_dim: int = 64, heads: int = 12, repeats: int = 5) -> dict:
    """Best-of-``repeats`` wall seconds of the kernels one iteration is made of, at GPT-2-small
    shapes, with 1 thread and with the current thread count: the MLP score product in float32,
    in bfloat16 (bfloat16 result: unusable for scores, shown for the AMX rate) and in float32 with
    oneDNN's bf16 math mode (float32 result, the only CPU bf16 product with a float32 result that
    torch exposes); the assignment pieces (top-64 per row, sparse LAPJV); the SVDs."""
    from fedbasin.alignment.matching import _sparse_assignment

    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(n, 2 * d, generator=g), torch.randn(n, 2 * d, generator=g)
    score = a @ b.T
    top = torch.topk(score, 64, dim=1)
    c = torch.randn(d, d, generator=g, dtype=torch.float64)
    pairs = torch.randn(heads * heads, head_dim, head_dim, generator=g, dtype=torch.float64)

    def bf16_math():
        previous = torch.backends.mkldnn.matmul.fp32_precision
        torch.backends.mkldnn.matmul.fp32_precision = "bf16"
        try:
            return a @ b.T
        finally:
            torch.backends.mkldnn.matmul.fp32_precision = previous

    cases = {
        "mlp_score_float32": lambda: a @ b.T,
        "mlp_score_bfloat16_native": lambda: a.bfloat16() @ b.bfloat16().T,
        "mlp_score_float32_onednn_bf16_math": bf16_math,
        "topk64_rows": lambda: torch.topk(score, 64, dim=1),
        "sparse_lapjv": lambda: _sparse_assignment(top.values, top.indices, n),
        "svd_768_float64": lambda: torch.linalg.svd(c),
        "svd_12x64x64_float64": lambda: torch.linalg.svd(pairs[:heads]),
        "svdvals_144x64x64_float64": lambda: torch.linalg.svdvals(pairs),
    }
    threads = torch.get_num_threads()
    out = {}
    for count in sorted({1, threads}):
        torch.set_num_threads(count)
        try:
            for name, fn in cases.items():
                fn()
                best = float("inf")
                for _ in range(repeats):
                    start = time.perf_counter()
                    fn()
                    best = min(best, time.perf_counter() - start)
                out.setdefault(name, {})[f"{count}_threads"] = round(best, 4)
        finally:
            torch.set_num_threads(threads)
    return out


def compare_sweeps(config: dict, settings: list[str], args) -> dict:
    """One weight_match per setting on the same pair in this process (same conditions)."""
    a = build_model("gpt", config, seed=0).state_dict()
    b = build_model("gpt", config, seed=1).state_dict()
    spec = fedbasin_adapter("gpt", make_config("gpt", config)).spec
    out = {"threads": torch.get_num_threads(), "load_average_1min_start": round(os.getloadavg()[0], 2), "runs": {}}
    for setting in settings:
        previous = setting == "previous"
        matching.INNER_SWEEPS, matching.UNROTATED_MLP = (0, False) if previous else (int(setting), True)
        cpu0, wall0 = time.process_time(), time.perf_counter()
        r = weight_match(spec, a, b, mode=args.mode, iterations=args.iterations, tol=args.tol)
        out["runs"][setting] = {
            "cpu_seconds": round(time.process_time() - cpu0, 1), "wall_seconds": round(time.perf_counter() - wall0, 1),
            "iterations": r.iterations, "objective": [round(x, 6) for x in r.objective],
            "cpu_seconds_by_part": {k[:-4]: round(v, 1) for k, v in r.phases.items() if k.endswith("_cpu")}}
        print(setting, json.dumps(out["runs"][setting]), file=sys.stderr, flush=True)
    out["load_average_1min_end"] = round(os.getloadavg()[0], 2)
    print(json.dumps(out, indent=1))
    return out


def _cpu_flags() -> set:
    try:
        with open("/proc/cpuinfo") as f:
            return set(next((line for line in f if line.startswith("flags")), "").split())
    except OSError:
        return set()


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--tol", type=float, default=1e-4, help="relative objective gain to stop at")
    parser.add_argument("--mode", default="orthogonal", choices=["orthogonal", "permutation"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--previous-sweeps", action="store_true",
                        help="the previous iteration for an A/B in the same conditions: full sweeps only "
                             "(INNER_SWEEPS = 0) and MLP weights rotated with every residual step "
                             "(UNROTATED_MLP = False); same iterates as the code before the maps-only sweeps")
    parser.add_argument("--compare-sweeps", default=None, metavar="LIST",
                        help="A/B in one process, e.g. 'previous,2,3': for each setting (previous = "
                             "--previous-sweeps, N = INNER_SWEEPS N) one weight_match to convergence; prints "
                             "CPU and wall seconds, iterations, objectives and CPU seconds per part")
    parser.add_argument("--reference-objective", type=float, default=0.10350,
                        help="report when J first reaches this value (default: what the previous "
                             "algorithm converged to on the default pair, 11 iterations)")
    parser.add_argument("--profile", action="store_true",
                        help="also report process CPU seconds per matching function (cProfile; it sees the "
                             "main thread only, so steps run in per-layer worker threads appear in the "
                             "phases' *_cpu parts instead); works on older fedbasin versions too, for "
                             "same-conditions comparisons")
    parser.add_argument("--kernels", action="store_true",
                        help="only time the kernels an iteration is made of (1 thread and the current count)")
    args = parser.parse_args(argv)
    if args.kernels:
        out = {"kernels_best_wall_seconds": kernels(), "load_average_1min": round(os.getloadavg()[0], 2),
               "threads": torch.get_num_threads(), "torch": torch.__version__,
               "amx": sorted(f for f in _cpu_flags() if f.startswith("amx"))}
        print(json.dumps(out, indent=1))
        return out
    if args.previous_sweeps:
        matching.INNER_SWEEPS, matching.UNROTATED_MLP = 0, False
    config = dict(vocab_size=50257, block_size=1024, dim=768, depth=args.layers, heads=12, mlp_dim=3072)
    if args.compare_sweeps:
        return compare_sweeps(config, args.compare_sweeps.split(","), args)
    t0 = time.perf_counter()
    a = build_model("gpt", config, seed=0).state_dict()
    b = build_model("gpt", config, seed=1).state_dict()
    a = {k: v.to(args.device) for k, v in a.items()}
    b = {k: v.to(args.device) for k, v in b.items()}
    spec = fedbasin_adapter("gpt", make_config("gpt", config)).spec
    build_s = time.perf_counter() - t0
    flops = matmul_flops_per_iteration(spec, b)
    rates = {"float32": round(gemm_gflops(config["mlp_dim"], 2 * config["dim"], torch.float32, args.device), 1),
             "bfloat16": round(gemm_gflops(config["mlp_dim"], 2 * config["dim"], torch.bfloat16, args.device), 1)}
    rss_before = _peak_rss_gib()
    load_before = os.getloadavg()[0]
    cpu0 = time.process_time()
    profiler = None
    if args.profile:
        import cProfile

        profiler = cProfile.Profile(time.process_time)
        profiler.enable()
    result = weight_match(spec, a, b, mode=args.mode, iterations=args.iterations, tol=args.tol, progress=True)
    cpu_align = time.process_time() - cpu0
    profile = {}
    if profiler is not None:
        import pstats

        profiler.disable()
        stats = pstats.Stats(profiler).stats
        for (_, _, name), (_, _, _, cumulative, _) in stats.items():
            if name in ("head_step", "neuron_step", "residual_step", "try_step", "canonicalize", "to_gauge"):
                profile[name] = round(profile.get(name, 0.0) + cumulative, 2)
    t_io = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        safetensors.torch.save_file({k: v.cpu().contiguous() for k, v in result.state.items()}, f"{tmp}/aligned.safetensors")
        safetensors.torch.load_file(f"{tmp}/aligned.safetensors")
    io_s = time.perf_counter() - t_io
    gain = result.objective[-1] - result.objective[0]
    to_99 = next(t for j, t in zip(result.objective, result.elapsed) if j - result.objective[0] >= 0.99 * gain)
    to_reference = next((t for j, t in zip(result.objective, result.elapsed) if j >= args.reference_objective), None)
    out = {
        "shape": config,
        "parameters_millions": round(sum(v.numel() for v in a.values()) / 1e6, 1),
        "mode": args.mode,
        "sweeps": {"inner_sweeps": matching.INNER_SWEEPS, "unrotated_mlp": matching.UNROTATED_MLP},
        "device": args.device,
        "iterations_run": result.iterations,
        "align_seconds": round(result.seconds, 2),
        "align_cpu_seconds": round(cpu_align, 2),  # all threads; robust to other processes on the machine
        "profile_cpu_seconds": profile,
        "seconds_to_99pct_of_gain": round(to_99, 2),
        "seconds_to_reference_objective": None if to_reference is None else round(to_reference, 2),
        "reference_objective": args.reference_objective,
        "seconds_per_iteration": round((result.elapsed[-1] - result.elapsed[0]) / max(result.iterations, 1), 2),
        "objective": [round(x, 5) for x in result.objective],
        "phase_seconds": {**{k: round(v, 2) for k, v in getattr(result, "phases", {}).items()}, "io": round(io_s, 2)},
        "load_average_1min": [round(os.getloadavg()[0], 2), round(load_before, 2)],
        "build_seconds": round(build_s, 1),
        "peak_rss_gib": round(_peak_rss_gib(), 2),
        "peak_rss_before_align_gib": round(rss_before, 2),
        "threads": torch.get_num_threads(),
        "machine": platform.processor() or platform.machine(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "amx": sorted(f for f in _cpu_flags() if f.startswith("amx")),
        "torch": torch.__version__,
        "gemm_gflops": rates,
        "matmul_gflop_per_iteration": {k: round(v / 1e9, 1) for k, v in flops.items()},
        "blas_floor_seconds": round(result.iterations * sum(flops.values()) / (rates["float32"] * 1e9), 2),
    }
    print(json.dumps(out, indent=1))
    print(_summary(out), file=sys.stderr)
    return out


def _summary(out: dict) -> str:
    """The per-phase table in words (stderr; the JSON above is the record)."""
    p = out["phase_seconds"]
    rows = [("setup (canonicalise, starts)", "setup"), ("head steps", "heads"), ("MLP steps", "mlp"),
            ("residual steps", "residual"), ("finish (gauge)", "finish")]
    lines = [f"aligned in {out['align_seconds']} s wall, {out['align_cpu_seconds']} CPU s "
             f"({out['iterations_run']} iterations, J {out['objective'][0]} -> {out['objective'][-1]}; "
             f"J >= {out['reference_objective']} at {out['seconds_to_reference_objective']} s)",
             f"{'phase':32s} {'wall s':>8s} {'CPU s':>8s}"]
    lines += [f"{name:32s} {p[key]:8.2f} {p[key + '_cpu']:8.2f}" for name, key in rows]
    lines.append(f"{'I/O (write + read safetensors)':32s} {p['io']:8.2f}")
    lines.append(f"peak RSS {out['peak_rss_gib']} GiB; load average {out['load_average_1min']}; "
                 f"BLAS floor {out['blas_floor_seconds']} s at {out['gemm_gflops']['float32']} GFLOP/s")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
