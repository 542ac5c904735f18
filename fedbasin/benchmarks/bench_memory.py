"""Memory benchmark: streamed alignment of two Llama-shaped checkpoints stored in bfloat16.

    python -m fedbasin.benchmarks.bench_memory [--dir /tmp/fedbasin-mem] [--iterations 1] [--device cpu]

Default shape: TinyLlama-1.1B (22 layers, width 2048, 32 query heads, 4 key/value heads, MLP
5632, vocabulary 32000; 1.1 B parameters, 2.2 GB per model in bfloat16). Step 1 writes both
checkpoints with random initialisation (seeds 0 and 1) shard by shard, never holding more than
one layer in float32. Step 2 runs :func:`fedbasin.checkpoint.stream_align` in a fresh process
and reports its wall time, CPU time, peak RSS (``getrusage``, the whole process lifetime) and
the ratio of peak RSS to one model's size on disk (on CUDA also the peak GPU memory), as JSON. Files are removed afterwards
unless ``--keep``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

TINYLLAMA = dict(layers=22, width=2048, heads=32, kv_heads=4, mlp=5632, vocab=32000)


def _config(shape: dict):
    import transformers

    return transformers.LlamaConfig(
        vocab_size=shape["vocab"], hidden_size=shape["width"], intermediate_size=shape["mlp"],
        num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"], max_position_embeddings=2048, tie_word_embeddings=False,
        dtype=torch.bfloat16, architectures=["LlamaForCausalLM"],
    )


def make_checkpoint(path: Path, shape: dict, seed: int, shard_bytes: int) -> int:
    """Random Llama-shaped bf16 checkpoint at ``path`` (std 0.02 weights, norm gains ~1); bytes written."""
    from fedbasin.checkpoint import CONFIG_FILE, ShardWriter

    path.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    d, n, dh = shape["width"], shape["mlp"], shape["width"] // shape["heads"]
    kv = shape["kv_heads"] * dh

    def w(*size):
        return (0.02 * torch.randn(*size, generator=g)).to(torch.bfloat16)

    def gain():
        return (1.0 + 0.1 * torch.randn(d, generator=g)).to(torch.bfloat16)

    writer = ShardWriter(path, shard_bytes)
    writer.add({"model.embed_tokens.weight": w(shape["vocab"], d)})
    for i in range(shape["layers"]):
        p = f"model.layers.{i}."
        writer.add({
            p + "self_attn.q_proj.weight": w(d, d), p + "self_attn.k_proj.weight": w(kv, d),
            p + "self_attn.v_proj.weight": w(kv, d), p + "self_attn.o_proj.weight": w(d, d),
            p + "mlp.gate_proj.weight": w(n, d), p + "mlp.up_proj.weight": w(n, d),
            p + "mlp.down_proj.weight": w(d, n),
            p + "input_layernorm.weight": gain(), p + "post_attention_layernorm.weight": gain(),
        })
    writer.add({"model.norm.weight": gain(), "lm_head.weight": w(shape["vocab"], d)})
    writer.close()
    (path / CONFIG_FILE).write_text(_config(shape).to_json_string(use_diff=True))
    return writer.total


def _align(args) -> dict:
    """Runs in a fresh process: stream_align and this process's peak RSS."""
    from fedbasin.checkpoint import LazyWeights, stream_align

    torch.set_num_threads(args.threads)
    ref, cand, out = Path(args.dir) / "a", Path(args.dir) / "b", Path(args.dir) / "aligned"
    size = LazyWeights(cand).nbytes()
    t0, cpu0 = time.perf_counter(), time.process_time()
    result = stream_align(ref, cand, out, iterations=args.iterations, tol=0.0, progress=True,
                          max_shard_bytes=args.shard_bytes, device=args.device)
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    gpu = {}
    if torch.device(args.device).type == "cuda":
        gpu = {"gpu": torch.cuda.get_device_name(args.device),
               "peak_gpu_memory_gib": round(torch.cuda.max_memory_allocated(args.device) / 2**30, 2)}
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {
        "iterations": result.iterations, "objective": [round(x, 6) for x in result.objective],
        "align_wall_seconds": round(wall, 1), "align_cpu_seconds": round(cpu, 1),
        "phase_seconds": {k: round(v, 1) for k, v in result.phases.items()},
        "model_bytes_on_disk": size, "peak_rss_bytes": peak,
        "peak_rss_gib": round(peak / 2**30, 2), "peak_rss_over_model_size": round(peak / size, 2),
        "load_average_1min_after": round(os.getloadavg()[0], 2), "threads": args.threads,
        "device": args.device, **gpu,
    }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default="/tmp/fedbasin-bench-memory")
    parser.add_argument("--iterations", type=int, default=1, help="coordinate-ascent passes (each reads both models)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--shard-bytes", type=int, default=1 << 30)
    parser.add_argument("--keep", action="store_true", help="keep the checkpoints")
    parser.add_argument("--device", default="cpu", help="where the alignment works: cpu | cuda | cuda:N")
    parser.add_argument("--phase", choices=["all", "align"], default="all", help=argparse.SUPPRESS)
    for key, value in TINYLLAMA.items():
        parser.add_argument(f"--{key.replace('_', '-')}", type=int, default=value)
    args = parser.parse_args(argv)
    if args.phase == "align":
        out = _align(args)
        print(json.dumps(out))
        return out
    shape = {k: getattr(args, k) for k in TINYLLAMA}
    root = Path(args.dir)
    if root.exists():
        shutil.rmtree(root)
    t0 = time.perf_counter()
    sizes = [make_checkpoint(root / name, shape, seed, args.shard_bytes) for seed, name in ((0, "a"), (1, "b"))]
    make_s = time.perf_counter() - t0
    child = [sys.executable, "-m", "fedbasin.benchmarks.bench_memory", "--phase", "align", "--dir", str(root),
             "--iterations", str(args.iterations), "--threads", str(args.threads),
             "--shard-bytes", str(args.shard_bytes), "--device", args.device]
    proc = subprocess.run(child, check=True, stdout=subprocess.PIPE, text=True)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    params = sizes[0] // 2
    out = {"shape": shape, "parameters_billions": round(params / 1e9, 3), "dtype": "bfloat16",
           "make_checkpoints_seconds": round(make_s, 1), **result,
           "creation_peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)}
    print(json.dumps(out, indent=1))
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    return out


if __name__ == "__main__":
    main()
