"""Canonical form (norm gains folded into readers, tied tensors untied) and the gauge back.

Folding a norm's gain γ (DESIGN §5): readers ``W ← diag(γ) W``, bias ``β ← β / γ``, ``γ ← 1``;
then ``(n γ + β) W = (n + β/γ) diag(γ) W`` — the function is unchanged and the residual map may
act on the norm: ``LN(x O) = LN(x) O`` for ``O·1 = 1``, ``RMS(x O) = RMS(x) O`` for any
orthogonal O. The gauge step is the inverse with another model's gains.

Tiny gains (:func:`tiny_gains`: ``|γ_i| ≤ TINY_GAIN · median_j |γ_j|`` within one norm, zeros
included) would make both steps ill-conditioned: ``β_i/γ_i`` in the fold and ``W_i/γ_ref,i`` in
the gauge turn noise of size δ into δ/γ. So on those dims:

* fold: the bias goes into the readers' biases first, ``b ← b + β_i W_i`` (row i of each reader
  on its residual axis), ``β_i ← 0``, then ``W_i ← γ_i W_i`` as usual (exact:
  ``(n_i γ_i + β_i) W_i + b = n_i (γ_i W_i) + (b + β_i W_i)``). Only when every reader has a bias;
  otherwise ``β_i/γ_i`` as before. The dims are those tiny in the model's own gains, and with
  ``like`` (a reference's gains) those tiny there and small here (``SMALL_GAIN``). A model
  aligned to a reference then has the reference's tiny dims folded alike (:func:`fold_tiny` on
  the aligned canonical state: ``b ← b + β_i W_i``, ``β_i ← 0`` with unit gains), so both fold
  the same dims the same way;
* gauge: those dims keep the canonical gain ``γ_i = 1`` (readers and bias unscaled).

Gains with no tiny entry are folded and gauged exactly as before (bitwise).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .group import scale_axis
from .spec import SymmetrySpec

#: a gain is tiny when ``|γ_i| ≤ TINY_GAIN × median |γ|`` over its norm (see the module docstring)
TINY_GAIN = 1e-2
#: with ``like``: a dim tiny in the other model is folded alike where this one's is below this
SMALL_GAIN = 1e-1


@dataclass
class Canonical:
    """A canonical state dict and the gains it had (norm weight key → γ)."""

    state: dict
    gains: dict
    untied: bool


def is_canonical(spec: SymmetrySpec, state: dict) -> bool:
    return all(n.weight is None or bool(torch.all(state[n.weight] == 1)) for n in spec.norms)


def tiny_gains(gain: torch.Tensor, factor: float = TINY_GAIN) -> torch.Tensor:
    """Mask of the dims with ``|γ_i| ≤ factor · median |γ|`` (zeros always; all for γ = 0)."""
    size = gain.detach().abs().double()
    return size <= factor * size.median()


def tiny_gain_dims(gains: dict) -> dict[str, list[int]]:
    """``{norm weight key: indices of its tiny dims}`` over ``gains`` (norm weight key → γ, e.g.
    ``Canonical.gains``; norms without a tiny dim are left out): the dims on which a model gauged
    with ``gains`` keeps ``γ_i = 1`` (:func:`to_gauge`), i.e. where its gauge differs from the
    model those gains came from."""
    return {key: idx for key, gain in gains.items()
            if (idx := torch.nonzero(tiny_gains(gain)).flatten().tolist())}


def _reader_biases(norm, state: dict) -> list[str] | None:
    """The bias key of every reader of ``norm`` (``….weight`` → ``….bias``), or None if one has none."""
    keys = []
    for key, axis in norm.readers:
        bias = key[: -len("weight")] + "bias" if key.endswith("weight") else None
        weight = state[key]
        if bias not in state or weight.dim() != 2 or state[bias].shape != (weight.shape[1 - axis],):
            return None
        keys.append(bias)
    return keys


def canonicalize(spec: SymmetrySpec, state: dict, what: str = "model", validate: bool = True,
                 like: dict | None = None) -> Canonical:
    """Fold every norm gain into its readers and untie tied tensors (function unchanged).

    ``like``: another model's gains (norm weight key → γ), e.g. the reference's; a dim tiny there
    and small here (``|γ_i| ≤ SMALL_GAIN · median |γ|``: the same dim in a model trained from it,
    not a coincidence of another basis) is folded like the model's own tiny dims (bias into the
    readers' biases, see the module docstring).
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
            if norm.bias is not None:
                tiny, other = tiny_gains(gain), _tiny_mask(norm, like, gain.shape)
                if other is not None:  # tiny there and small here (10 × the threshold)
                    tiny = tiny | (other.to(tiny.device) & tiny_gains(gain, SMALL_GAIN))
                _absorb_bias(norm, out, tiny)
            for key, axis in norm.readers:
                out[key] = scale_axis(out[key], axis, gain)
            if norm.bias is not None:
                safe = torch.where(zero, torch.ones_like(gain), gain)
                out[norm.bias] = out[norm.bias] / safe
        out[norm.weight] = torch.ones_like(gain)
    return Canonical(out, gains, untied)


def _tiny_mask(norm, gains: dict | None, shape) -> torch.Tensor | None:
    gain = None if gains is None else gains.get(norm.weight)
    return None if gain is None or gain.shape != shape else tiny_gains(gain)


def _absorb_bias(norm, out: dict, tiny: torch.Tensor) -> None:
    """``b ← b + β_i W_i`` for every reader, ``β_i ← 0``, on the dims i of ``tiny`` (in place on
    ``out``); nothing when a reader has no bias."""
    beta = out[norm.bias]
    tiny = tiny.to(beta.device)
    if not bool((tiny & (beta != 0)).any()):
        return
    biases = _reader_biases(norm, out)
    if biases is None:
        return
    moved = torch.where(tiny, beta, torch.zeros_like(beta))
    for (key, axis), bias in zip(norm.readers, biases):
        out[bias] = out[bias] + torch.tensordot(moved.to(out[key]), out[key], dims=([0], [axis])).to(out[bias])
    out[norm.bias] = beta - moved


def fold_tiny(spec: SymmetrySpec, state: dict, gains: dict) -> dict:
    """A canonical ``state`` (unit gains) with the norm bias of every dim tiny in ``gains`` moved
    into the readers' biases (``b ← b + β_i W_i``, ``β_i ← 0``: same function); e.g. a model
    aligned to a reference with the reference's gains, so both fold the same dims alike.
    Returns ``state`` itself when nothing moves."""
    out = dict(state)
    for norm in spec.norms:
        if norm.weight is not None and norm.bias is not None:
            tiny = _tiny_mask(norm, gains, out[norm.bias].shape)
            if tiny is not None and bool(tiny.any()):
                _absorb_bias(norm, out, tiny)
    return state if all(out[k] is state[k] for k in state) else out


def to_gauge(spec: SymmetrySpec, state: dict, gains: dict) -> dict:
    """Give a canonical state the norm gains ``gains`` (readers ``W ← diag(1/γ) W``, ``β ← β γ``).

    Dims where ``gains`` is tiny (:func:`tiny_gains`, zeros included) keep ``γ_i = 1`` instead
    (``c_i = 1`` in ``W_i ← W_i / c_i``, ``β_i ← β_i c_i``: no 1/γ amplification). The map is
    the same linear map for every model gauged with ``gains``, so a plain weighted average of
    gauged models equals the gauged interpolation of their canonical forms. The reference
    itself comes back exactly from ``to_gauge(canonicalize(ref).state, gains)`` unless it has
    tiny gains; on those dims its gauged form has ``γ_i = 1``, rows ``γ_ref,i W_i`` and its bias
    in the readers' biases (same function): average with that form, not the raw reference.
    """
    out = dict(state)
    for norm in spec.norms:
        if norm.weight is None or norm.weight not in gains:
            continue
        gain = gains[norm.weight].to(state[norm.weight])
        if gain.shape != state[norm.weight].shape:
            continue  # width changed: stay canonical
        tiny = tiny_gains(gain)
        if bool(tiny.all()):
            continue
        if bool(tiny.any()):
            gain = torch.where(tiny.to(gain.device), torch.ones_like(gain), gain)
        for key, axis in norm.readers:
            out[key] = scale_axis(out[key], axis, 1.0 / gain)
        if norm.bias is not None:
            out[norm.bias] = out[norm.bias] * gain
        out[norm.weight] = gain.clone()
    return out
