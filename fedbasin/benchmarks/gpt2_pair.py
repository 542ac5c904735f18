"""Train Hugging Face GPT-2 (or Llama-style) models with the GLMC paper's Tiny Shakespeare recipe (a pair for barriers).

Recipe (Theus et al., NeurIPS 2025, public repository): ``GPT2LMHeadModel`` with 4 layers, width
128, 4 heads, MLP 512, context 128, untied head, ``gelu_new``, dropout 0.1; the GPT-2 BPE
tokenizer; Tiny Shakespeare split by characters into contiguous 90/5/5 train/validation/test;
AdamW (lr 3e-4, weight decay 0.01), 5% linear warm-up then cosine decay, batch 32. Forward and
backward run under bfloat16 autocast (weights and optimiser in float32; the paper's scripts train
with fp16 mixed precision on a GPU) unless ``--fp32``.

    python -m fedbasin.benchmarks.gpt2_pair --seed 0 --epochs 6 --out runs/gpt2pair

``--model-type llama`` trains a Llama-style model on the same data with the same optimiser,
schedule, batch and context instead (``LlamaForCausalLM``: RoPE, grouped-query attention with 4
heads and 2 key/value heads, SwiGLU MLP of width 344 ≈ 2/3 · 512 so the MLP has about the
parameters of GPT-2's, RMSNorm, untied head, width 128, 4 layers; attention dropout 0.1, the only
dropout Llama has).

trains on the CPU (``--threads`` threads) unless ``--device cuda``: a GPU trains a pair of the same
recipe, not the same pair (other kernels, other rounding).

writes ``OUT/seed{S}/`` (an HF checkpoint directory with the tokenizer beside the weights, which
``fedbasin barrier/align/merge`` read) and ``OUT/seed{S}/train.json`` (losses, steps, seconds).
Training state is saved atomically every ``--save-every`` steps to ``OUT/seed{S}.state.pt`` and a
rerun resumes from it. ``--measure N`` times N steps and writes nothing.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from fedbasin.atomic import atomic_write
from fedbasin.data import HFTokenizer, Split, token_blocks
from fedbasin.training import resolve_device

DEFAULT_TEXT = "../shared/data/tinyshakespeare/input.txt"
DEFAULT_TOKENIZER = "../shared/data/gpt2_tokenizer"


def contiguous_split(text: str, val_fraction: float = 0.05, test_fraction: float = 0.05) -> tuple[str, str, str]:
    """(train, validation, test) character ranges: the first 90%, the next 5%, the last 5%."""
    n = len(text)
    n_test, n_val = round(n * test_fraction), round(n * val_fraction)
    return text[: n - n_val - n_test], text[n - n_val - n_test : n - n_test], text[n - n_test :]


def pair_data(text_path: str, tokenizer_dir: str, block_size: int = 128) -> tuple[HFTokenizer, dict[str, Split]]:
    """The tokenizer and the train/validation/test splits as token blocks."""
    tokenizer = HFTokenizer(tokenizer_dir)
    parts = contiguous_split(Path(text_path).read_text(encoding="utf-8"))
    return tokenizer, {name: token_blocks(tokenizer.encode(part), block_size)
                       for name, part in zip(("train", "validation", "test"), parts)}


def gpt2_config(tokenizer: HFTokenizer, block_size: int = 128, width: int = 128, layers: int = 4, heads: int = 4,
                mlp: int = 512, dropout: float = 0.1):
    from transformers import GPT2Config

    return GPT2Config(
        vocab_size=tokenizer.vocab_size, n_positions=block_size, n_embd=width, n_layer=layers, n_head=heads,
        n_inner=mlp, activation_function="gelu_new", resid_pdrop=dropout, embd_pdrop=dropout,
        attn_pdrop=dropout, tie_word_embeddings=False,
        bos_token_id=tokenizer.tokenizer.bos_token_id, eos_token_id=tokenizer.tokenizer.eos_token_id,
    )


def llama_config(tokenizer: HFTokenizer, block_size: int = 128, width: int = 128, layers: int = 4, heads: int = 4,
                 kv_heads: int = 2, mlp: int = 344, dropout: float = 0.1):
    """The Llama-style counterpart of :func:`gpt2_config` (RoPE, GQA, SwiGLU, RMSNorm)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=tokenizer.vocab_size, max_position_embeddings=block_size, hidden_size=width,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        intermediate_size=mlp, hidden_act="silu", rms_norm_eps=1e-5, rope_theta=10000.0,
        attention_dropout=dropout, tie_word_embeddings=False,
        bos_token_id=tokenizer.tokenizer.bos_token_id, eos_token_id=tokenizer.tokenizer.eos_token_id,
    )


#: ``--model-type`` (also the checkpoint's model_type) → (config builder, transformers model class name)
MODEL_TYPES = {"gpt2": (gpt2_config, "GPT2LMHeadModel"), "llama": (llama_config, "LlamaForCausalLM")}


def token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


@torch.no_grad()
def mean_loss(model, split: Split, batch_size: int = 16) -> float:
    """Mean next-token cross-entropy over every target of ``split``."""
    model.eval()
    device = next(model.parameters()).device
    total = 0.0
    for x, y in split.batches(batch_size):
        total += float(token_loss(model(x.to(device)).logits, y.to(device))) * y.numel()
    return total / split.targets.numel()


def lr_factor(step: int, total: int, warmup: int) -> float:
    """Linear warm-up to 1 over ``warmup`` steps, then ``(1 + cos(π (t − w)/(T − w)))/2``."""
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1.0 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


def train_one(args, seed: int, data: tuple | None = None) -> dict:
    """Train (or resume) seed ``seed``; ``data``: :func:`pair_data`'s result, shared by the seeds (else loaded)."""
    import transformers
    from tqdm import tqdm

    from fedbasin.checkpoint import save_checkpoint

    model_type = getattr(args, "model_type", "gpt2")
    make_config, model_class = MODEL_TYPES[model_type]
    tokenizer, splits = data or pair_data(args.text, args.tokenizer, args.block_size)
    config = make_config(tokenizer, args.block_size)
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(config).to(args.device)  # initialised on the CPU: the same start on any device
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    per_epoch = math.ceil(len(splits["train"]) / args.batch_size)
    total = args.measure or args.epochs * per_epoch
    warmup = max(1, round(0.05 * total))
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda t: lr_factor(t, total, warmup))
    out = Path(args.out)
    state_file, final = out / f"seed{seed}.state.pt", out / f"seed{seed}"
    if args.export_partial:  # the latest saved training state as a model directory, training untouched
        saved = torch.load(state_file, weights_only=False, map_location=args.device)
        model.load_state_dict(saved["model"])
        partial = out / f"seed{seed}-step{saved['step']}"
        save_checkpoint(partial, model_type, config, model.state_dict(), kind="hf")
        save_tokenizer(tokenizer, partial)
        return {"seed": seed, "exported": str(partial), "step": saved["step"], "of": saved["total"]}
    step, seconds = 0, 0.0
    if not args.measure and state_file.is_file():
        saved = torch.load(state_file, weights_only=False, map_location=args.device)
        if saved["total"] != total:
            raise SystemExit(f"{state_file} was saved for {saved['total']} steps, not {total}: remove it or "
                             f"rerun with the same --epochs")
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        schedule.load_state_dict(saved["schedule"])
        step, seconds = saved["step"], saved["seconds"]

    def save_state():
        snapshot = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "schedule": schedule.state_dict(), "step": step, "total": total, "seconds": seconds}
        atomic_write(state_file, lambda tmp: torch.save(snapshot, tmp))

    bar = tqdm(total=total, initial=step, desc=f"seed {seed}", unit="step")
    model.train()
    started = time.perf_counter() - seconds
    while step < total:
        epoch, offset = divmod(step, per_epoch)
        order = torch.randperm(len(splits["train"]), generator=torch.Generator().manual_seed(1000 * seed + epoch))
        index = order[offset * args.batch_size : (offset + 1) * args.batch_size]
        optimizer.zero_grad(set_to_none=True)
        loss_value = 0.0
        for chunk in index.split(args.micro_batch):  # gradient accumulation: the same mean over the batch
            x, y = splits["train"].inputs[chunk].to(args.device), splits["train"].targets[chunk].to(args.device)
            with torch.autocast(args.device.type, dtype=torch.bfloat16, enabled=not args.fp32):
                logits = model(x).logits
            loss = token_loss(logits.float(), y) * (len(chunk) / len(index))
            loss.backward()
            loss_value += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        step += 1
        seconds = time.perf_counter() - started
        bar.update(1)
        bar.set_postfix(loss=f"{loss_value:.3f}", epoch=epoch)
        if not args.measure and (step % args.save_every == 0 and step < total):
            save_state()
    bar.close()
    if args.measure:
        return {"seed": seed, "steps": step, "seconds_per_step": seconds / step, "steps_per_epoch": per_epoch}
    record = {"seed": seed, "model_type": model_type, "epochs": args.epochs, "autocast": None if args.fp32 else "bfloat16", "steps": total, "steps_per_epoch": per_epoch,
              "train_seconds": round(seconds, 1), "threads": torch.get_num_threads(), "device": device_label(args.device),
              "validation_loss": mean_loss(model, splits["validation"]), "test_loss": mean_loss(model, splits["test"]),
              "blocks": {name: len(s) for name, s in splits.items()}}
    save_checkpoint(final, model_type, config, model.state_dict(), kind="hf")
    save_tokenizer(tokenizer, final)
    atomic_write(final / "train.json", lambda tmp: tmp.write_text(json.dumps(record, indent=2)))
    state_file.unlink(missing_ok=True)
    return record


def parsed_device(parser: argparse.ArgumentParser, name: str) -> torch.device:
    """``--device`` resolved, or the parser's one-line usage error (exit 2) when it is not usable here."""
    try:
        return resolve_device(name)
    except ValueError as exc:
        parser.error(f"--{exc}")


def device_label(device: torch.device) -> str:
    """``cpu``, or the GPU's name (``cuda: NVIDIA H200``)."""
    return "cpu" if device.type == "cpu" else f"{device.type}: {torch.cuda.get_device_name(device)}"


def save_tokenizer(tokenizer: HFTokenizer, directory: Path) -> None:
    """Copy the tokenizer's files next to a model, each file written atomically."""
    for item in sorted(tokenizer.path.iterdir()):
        if item.is_file():
            data = item.read_bytes()
            atomic_write(directory / item.name, lambda tmp, data=data: tmp.write_bytes(data))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, action="append", help="seed(s) to train (repeatable; default 0 and 1)")
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--model-type", choices=sorted(MODEL_TYPES), default="gpt2",
                        help="gpt2 (the GLMC recipe's GPT2LMHeadModel, default) or llama (LlamaForCausalLM: RoPE, "
                        "GQA 4/2 heads, SwiGLU, RMSNorm; same data, optimiser and schedule)")
    parser.add_argument("--out", default="runs/gpt2pair")
    parser.add_argument("--text", default=DEFAULT_TEXT)
    parser.add_argument("--tokenizer", default=DEFAULT_TOKENIZER)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--micro-batch", type=int, default=16, help="gradient-accumulation chunk (memory only)")
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu", help="cpu (default: reproduces the documented pair) | cuda | "
                        "cuda:N | auto")
    parser.add_argument("--fp32", action="store_true", help="train in float32 (default: bfloat16 autocast)")
    parser.add_argument("--save-every", type=int, default=25, help="steps between resumable training states")
    parser.add_argument("--measure", type=int, default=0, help="time this many steps, write nothing")
    parser.add_argument("--export-partial", action="store_true",
                        help="write the latest saved training state as OUT/seed{S}-step{N} and stop")
    args = parser.parse_args(argv)
    args.device = parsed_device(parser, args.device)
    if not Path(args.text).is_file():  # bad input: one usage line before any work
        parser.error(f"--text {args.text}: no such file")
    try:  # the text tokenised once, for every seed; the tokenizer's own check names what is wrong
        data = pair_data(args.text, args.tokenizer, args.block_size)
    except (FileNotFoundError, ValueError, RuntimeError) as error:
        parser.error(f"--tokenizer {args.tokenizer}: {' '.join(str(error).split())}")
    torch.set_num_threads(args.threads)
    for seed in args.seed or [0, 1]:
        print(json.dumps(train_one(args, seed, data)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
