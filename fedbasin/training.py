"""Local training and evaluation, shared by the ClientApp, the ServerApp and the benchmarks."""

from __future__ import annotations

import math
import re

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

#: Model shape and training budget per data source kind: the defaults of ``fedbasin train`` and
#: what the barrier benchmark trains (docs/benchmarks.md). ``max_train_examples`` 0: all.
RECIPES: dict[str, dict] = {
    "digits": dict(epochs=40, lr=3e-3, batch_size=64, max_train_examples=0,
                   model=dict(dim=64, depth=2, heads=4, mlp_dim=128)),
    "cifar10": dict(epochs=4, lr=2e-3, batch_size=128, max_train_examples=20000,
                    model=dict(dim=96, depth=4, heads=4, mlp_dim=192)),
    "text": dict(epochs=2, lr=2e-3, batch_size=32, max_train_examples=0,
                 model=dict(dim=128, depth=4, heads=4, mlp_dim=512, position="learned")),
}


def resolve_device(name: str = "auto") -> torch.device:
    """``auto``: CUDA when available, else CPU; otherwise ``cpu``, ``cuda`` or ``cuda:N``, which
    must exist here (a ValueError in one line otherwise)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    problem = device_name_problem(name)
    if problem:
        raise ValueError(problem)
    device = torch.device(name)
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(f"device {name!r}: no CUDA GPU is visible here (torch.cuda.is_available() is "
                             "False); use auto or cpu")
        if (device.index or 0) >= count:
            raise ValueError(f"device {name!r}: only {count} CUDA GPU(s) here (cuda:0 to cuda:{count - 1})")
    return device


def device_name_problem(name) -> str:
    """Why ``name`` is not one of auto, cpu, cuda, cuda:N ("" when it is)."""
    if isinstance(name, str) and re.fullmatch(r"auto|cpu|cuda(:\d+)?", name):
        return ""
    return f"device {name!r}: expected auto, cpu, cuda or cuda:N"


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over every target: class logits (B, C) or next-token logits (B, T, V),
    with class ids (B,) / (B, T), or probabilities of the logits' shape (soft labels:
    ``−Σ_c t_c log softmax(z)_c``, averaged over the targets), or sparse probabilities: k
    ``(class id, weight)`` pairs per target, shape (B, k, 2) / (B, T, k, 2), ids stored as floats
    (exact below 2^24), distinct where the weight is > 0. Sparse weights summing to s ≤ 1 leave
    ``r = 1 − s`` on the unlisted classes as one bucket:
    ``−Σ_j t_j log p_{c_j} − r·log(1 − Σ_j p_{c_j})``, p = softmax(z) — the cross-entropy of the
    coarse distribution (listed classes, rest), minimal where p gives the listed classes exactly
    their weights. Without the bucket, truncated targets reward moving all probability onto the
    listed classes (docs/journal/merging-notes.md §14)."""
    if targets.is_floating_point() and targets.dim() == logits.dim() + 1:
        ids, weights = targets[..., 0].long(), targets[..., 1].to(logits.dtype)
        picked = logits.gather(-1, ids)
        normaliser = logits.logsumexp(-1)
        listed = weights.sum(-1)
        loss = listed * normaliser - (weights * picked).sum(-1)
        rest = (1.0 - listed).clamp_min(0.0)
        # log Σ_j p_{c_j} over the listed classes (a large finite fill keeps the gradient finite when none is)
        log_listed = picked.masked_fill(weights <= 0, torch.finfo(logits.dtype).min / 2).logsumexp(-1) - normaliser
        log_rest = torch.log(-torch.expm1(log_listed.clamp(max=-1e-6)))  # log(1 − Σ_j p_{c_j}), p_rest ≥ 1e-6
        return (loss - rest * log_rest).mean()
    flat = logits.reshape(-1, logits.shape[-1])
    if targets.is_floating_point():
        return F.cross_entropy(flat, targets.reshape(flat.shape).to(logits.dtype))
    return F.cross_entropy(flat, targets.reshape(-1))


def train(
    model: nn.Module,
    data,
    epochs: int = 1,
    lr: float = 3e-3,
    batch_size: int = 32,
    device: torch.device | str = "cpu",
    seed: int = 0,
    weight_decay: float = 0.01,
    progress: bool = False,
) -> dict:
    """Train ``model`` in place on a :class:`fedbasin.data.Split` with AdamW and a cosine schedule.

    ``lr_t = lr · (1 + cos(π t / T)) / 2`` for steps ``t = 0..T-1``, ``T = epochs · ⌈N / B⌉``;
    batches are reshuffled every epoch from ``seed``. Returns ``{"train_loss", "steps"}``, the
    loss being the mean over the last epoch's batches.
    """
    if len(data) == 0:
        raise ValueError("cannot train on an empty split")
    model.to(device).train()
    total = epochs * math.ceil(len(data) / batch_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda t: 0.5 * (1 + math.cos(math.pi * t / total))
    )
    generator = torch.Generator().manual_seed(seed)
    losses: list[float] = []
    with tqdm(total=total, desc="train", disable=not progress, leave=False) as bar:
        for _ in range(epochs):
            losses = []
            for x, y in data.batches(batch_size, device, generator):
                loss = cross_entropy(model(x), y)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                schedule.step()
                losses.append(loss.item())
                bar.update()
                bar.set_postfix(loss=f"{losses[-1]:.3f}")
    return {"train_loss": sum(losses) / len(losses), "steps": total}


OUTPUT_BUDGET = 2**26  # logit values per forward pass of evaluate: a 50,257-token LM runs 10 blocks of 128 (256 MB)


@torch.no_grad()
def evaluate(
    model: nn.Module, data, device: torch.device | str = "cpu", batch_size: int = 512,
    output_budget: int = OUTPUT_BUDGET,
) -> dict:
    """``{"loss", "accuracy"}``: mean cross-entropy and argmax accuracy over every target.

    Each batch runs in forward passes of at most ``output_budget`` logit values, sized by the first
    example's output (which runs alone), so a large vocabulary never holds gigabytes of logits
    (200 GPT-2 blocks in one batch of 512 would be 5 GB, and an ensemble a multiple of it)."""
    if len(data) == 0:
        raise ValueError("cannot evaluate on an empty split")
    model.to(device).eval()
    loss_sum, correct, count, per_pass = 0.0, 0, 0, None
    for x, y in data.batches(batch_size, device):
        start = 0
        while start < len(x):
            stop = start + (per_pass or 1)
            logits, target = model(x[start:stop]), y[start:stop]
            if per_pass is None:
                per_pass = max(1, output_budget // max(1, logits.numel()))
            n = target.numel()
            loss_sum += cross_entropy(logits, target).item() * n
            correct += (logits.argmax(-1) == target).sum().item()
            count += n
            start = stop
    return {"loss": loss_sum / count, "accuracy": correct / count}
