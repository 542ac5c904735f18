"""Canonical form (norm gains folded into readers, tied tensors untied) and the gauge back.

Folding a norm's gain γ (DESIGN §5): readers ``W ← diag(γ) W``, bias ``β ← β / γ``, ``γ ← 1``;
then ``(n γ + β) W = (n + β/γ) diag(γ) W`` — the function is unchanged and the residual map may
act on the norm: ``LN(x O) = LN(x) O`` for ``O·1 = 1``, ``RMS(x O) = RMS(x) O`` for any
orthogonal O. The gauge step is the inverse with another model's gains.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from .group import scale_axis
from .spec import SymmetrySpec


@dataclass
class Canonical:
    """A canonical state dict and the gains it had (norm weight key → γ)."""

    state: dict
    gains: dict
    untied: bool


def is_canonical(spec: SymmetrySpec, state: dict) -> bool:
    return all(n.weight is None or bool(torch.all(state[n.weight] == 1)) for n in spec.norms)


def canonicalize(spec: SymmetrySpec, state: dict, what: str = "model", validate: bool = True) -> Canonical:
    """Fold every norm gain into its readers and untie tied tensors (function unchanged).

    A zero gain with a non-zero bias at the same index cannot be folded: ``ValueError``.
    """
    if validate:
        spec.validate(state, what)
    out = dict(state)
    untied = False
    for source, alias in spec.tied:
        if alias in out:
            out[alias] = out[alias].clone()
            untied = True
    gains = {}
    for norm in spec.norms:
        if norm.weight is None:
            continue
        gain = state[norm.weight]
        gains[norm.weight] = gain.detach().clone()
        zero = gain == 0
        if norm.bias is not None and bool((zero & (state[norm.bias] != 0)).any()):
            idx = torch.nonzero(zero).flatten()[:5].tolist()
            raise ValueError(f"{what}: {norm.weight} has zero gain at {idx} with a non-zero bias; cannot fold")
        if not bool((gain == 1).all()):  # folding a unit gain changes nothing: no copy
            for key, axis in norm.readers:
                out[key] = scale_axis(out[key], axis, gain)
            if norm.bias is not None:
                safe = torch.where(zero, torch.ones_like(gain), gain)
                out[norm.bias] = out[norm.bias] / safe
        out[norm.weight] = torch.ones_like(gain)
    return Canonical(out, gains, untied)


def to_gauge(spec: SymmetrySpec, state: dict, gains: dict) -> dict:
    """Give a canonical state the norm gains ``gains`` (readers ``W ← diag(1/γ) W``, ``β ← β γ``).

    After this, a plain weighted average of the reference and the gauged model equals the
    reference-gauged interpolation of their canonical forms. Norms whose target gain has a
    zero entry keep γ = 1 (a warning says which).
    """
    out = dict(state)
    for norm in spec.norms:
        if norm.weight is None or norm.weight not in gains:
            continue
        gain = gains[norm.weight].to(state[norm.weight])
        if gain.shape != state[norm.weight].shape:
            continue  # width changed: stay canonical
        if bool((gain == 0).any()):
            warnings.warn(f"{norm.weight}: reference gain has zeros; keeping the canonical gain 1", stacklevel=2)
            continue
        for key, axis in norm.readers:
            out[key] = scale_axis(out[key], axis, 1.0 / gain)
        if norm.bias is not None:
            out[norm.bias] = out[norm.bias] * gain
        out[norm.weight] = gain.clone()
    return out
