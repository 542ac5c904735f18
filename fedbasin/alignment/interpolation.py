"""Interpolation paths and loss barriers between two models of one architecture.

``θ(λ) = λ θ_A + (1 − λ) θ_B`` and ``barrier = max_λ [L(θ(λ)) − (λ L_A + (1 − λ) L_B)]``
on a λ grid (default 11 points, 0 and 1 included).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch


@dataclass
class Curve:
    """Losses along the path; ``barrier`` as defined above, ``argmax`` the λ where it is reached."""

    lambdas: list[float]
    losses: list[float]
    barrier: float
    argmax: float

    def to_dict(self) -> dict:
        return {"lambdas": self.lambdas, "losses": self.losses, "barrier": self.barrier, "argmax": self.argmax}


def interpolate(a: dict, b: dict, lam: float) -> dict:
    """``λ a + (1 − λ) b`` for floating tensors; other entries from ``a``."""
    return {k: (lam * v + (1.0 - lam) * b[k]) if v.is_floating_point() else v for k, v in a.items()}


def lambda_grid(points: int = 11) -> list[float]:
    if points < 2:
        raise ValueError(f"a λ grid needs at least 2 points, got {points}")
    return [i / (points - 1) for i in range(points)]


def loss_barrier(lambdas: list[float], losses: list[float]) -> tuple[float, float]:
    """(barrier, λ at the max) from losses on a grid containing λ = 0 (θ_B) and λ = 1 (θ_A):
    ``max_λ L(λ) − (λ·L(1) + (1 − λ)·L(0))``; NaN (at the first such λ) when a loss on the path is not
    finite, since the barrier is then unknown (``max`` would skip a NaN)."""
    if len(lambdas) != len(losses):
        raise ValueError(f"{len(lambdas)} λ values but {len(losses)} losses")
    by_lam = dict(zip(lambdas, losses))
    if 0.0 not in by_lam or 1.0 not in by_lam:
        raise ValueError("the λ grid must contain 0 and 1")
    la, lb = by_lam[1.0], by_lam[0.0]
    gaps = [loss - (lam * la + (1 - lam) * lb) for lam, loss in zip(lambdas, losses)]
    if unknown := [i for i, gap in enumerate(gaps) if not math.isfinite(gap)]:
        return math.nan, lambdas[unknown[0]]
    i = max(range(len(gaps)), key=gaps.__getitem__)
    return gaps[i], lambdas[i]


@torch.no_grad()
def interpolation_curve(a: dict, b: dict, loss_fn: Callable[[dict], float], points: int = 11,
                        progress: bool = False, desc: str = "interpolating") -> Curve:
    """Evaluate ``loss_fn`` (state dict → loss) along the path from ``b`` (λ=0) to ``a`` (λ=1)
    (``progress``: a bar over the points, named ``desc``)."""
    from .progress import progress_bar

    lambdas = lambda_grid(points)
    losses = []
    with progress_bar(len(lambdas), progress, desc, "point") as bar:
        for lam in lambdas:
            losses.append(float(loss_fn(interpolate(a, b, lam))))
            bar.update()
    barrier, argmax = loss_barrier(lambdas, losses)
    return Curve(lambdas, losses, barrier, argmax)
