"""Robust statistics over a cohort of client models that are already in one basis (aligned).

Models are state dicts with the same keys and shapes; only floating tensors take part (other
entries come from the first model). With ``θ_k`` the models, ``c`` a centre (the previous global
model, or the coordinate-wise median ``m`` of the cohort when there is none):

* outliers (:func:`cohort_outliers`): a model is excluded when its distance to the others'
  coordinate-wise median ``‖θ_k − m_{−k}‖`` or its update norm ``‖θ_k − c‖`` is far above the
  cohort's: ``x_k > med(x) + t · max(1.4826 · MAD(x), 0.15 · med(x))`` (MAD = median absolute
  deviation). Leaving ``θ_k`` out of its own reference keeps honest distances alike even for
  K = 3 (in high dimension they concentrate); the floor keeps near-identical cohorts, whose MAD
  is tiny, from flagging honest spread: nothing within (1 + 0.15 t) × the median is flagged,
  nor anything below 1% of the norm of the cohort's median model (alignment residuals);
* clipping (:func:`clip_updates`): ``θ_k ← c + (θ_k − c) · min(1, τ / ‖θ_k − c‖)`` with
  ``τ = r · med_k ‖θ_k − c‖``;
* aggregators (:func:`aggregate`): example-weighted mean ``Σ w_k θ_k / Σ w_k``; coordinate-wise
  trimmed mean (drop the ``⌊f·K⌋`` largest and smallest values of every coordinate, average the
  rest, unweighted); coordinate-wise median (unweighted; mean of the two middle values for even K).
"""

from __future__ import annotations

import math
import statistics

import torch

AGGREGATORS = ("mean", "trimmed-mean", "median")
MIN_COHORT = 3  # the median of fewer models cannot tell an outlier from an honest model
MAD_SCALE = 1.4826  # MAD of a normal sample × this = its standard deviation
RELATIVE_FLOOR = 0.15  # never flag a model within (1 + 0.15 t) × the median
NEGLIGIBLE = 0.01  # nor one whose statistic is below this × the norm of the median model
CHUNK = 2**18  # float64 values per block of the cohort (all K models together: 2 MiB per copy)


def float_keys(state: dict) -> list[str]:
    return [k for k, v in state.items() if v.is_floating_point()]


def _sorted_reduce(states: list[dict], reduce, release: bool = False, on_key=None) -> dict:
    """``reduce(sorted values, K)`` per coordinate of the floating entries (values sorted along
    dim 0, in float64); other entries come from the first state.

    Computed over blocks of whole rows of the first dimension, about ``CHUNK // K``
    coordinates each, so a float64 working copy holds about :data:`CHUNK` values, not K
    copies of a tensor; ``release=True``
    (the caller hands the dicts over): each key leaves every input dict once reduced;
    ``on_key(key, tensor)`` is called as each entry of the result is complete."""
    out = {}
    for key in list(states[0]):
        first = states[0][key]
        if not first.is_floating_point() or first.dim() == 0:
            out[key] = first if not first.is_floating_point() else _sorted_block(states, key, None, reduce).to(
                first.dtype)
        else:
            result = torch.empty(first.shape, dtype=first.dtype, device=first.device)
            step = max(1, CHUNK // len(states) // max(1, first[0].numel()))  # rows per block
            for start in range(0, first.shape[0], step):
                result[start:start + step] = _sorted_block(states, key, slice(start, start + step), reduce)
            out[key] = result
        if release:
            for s in states:
                s.pop(key, None)
        del first
        if on_key is not None:
            on_key(key, out[key])
    return out


def _sorted_block(states: list[dict], key: str, rows: slice | None, reduce) -> torch.Tensor:
    """``reduce`` of the sorted float64 values of ``states[k][key][rows]`` (all rows for None)."""
    block = [s[key] if rows is None else s[key][rows] for s in states]
    return reduce(torch.stack([b.double() for b in block]).sort(dim=0).values, len(states))


def coordinate_median(states: list[dict], release: bool = False, on_key=None) -> dict:
    """Coordinate-wise median (mean of the two middle values when the count is even)."""
    return _sorted_reduce(states, lambda v, k: _median_rows(v), release, on_key)


def _median_rows(x: torch.Tensor) -> torch.Tensor:
    """Median over dim 0 (mean of the two middle rows when the count is even)."""
    v, k = x.sort(dim=0).values, x.shape[0]
    return v[(k - 1) // 2] if k % 2 else 0.5 * (v[k // 2 - 1] + v[k // 2])


def distance(a: dict, b: dict) -> float:
    """Euclidean distance over all floating entries (in float64)."""
    return math.sqrt(sum(float((a[k].double() - b[k].double()).pow(2).sum()) for k in float_keys(a)))


def mad_outliers(values: list[float], threshold: float, negligible: float = 0.0) -> list[int]:
    """Indices ``k`` with ``x_k > med + t·max(1.4826·MAD, 0.15·med)`` and ``x_k > negligible``
    (upper side only)."""
    med = statistics.median(values)
    mad = statistics.median(abs(v - med) for v in values)
    cut = max(med + threshold * max(MAD_SCALE * mad, RELATIVE_FLOOR * med), negligible)
    return [i for i, v in enumerate(values) if v > cut]


def cohort_outliers(states: list[dict], center: dict | None, threshold: float) -> dict[int, str]:
    """``{index: reason}`` of the models far from the cohort (see the module docstring); empty
    for fewer than ``MIN_COHORT`` models.

    The medians are coordinate-wise, so every squared norm is a sum over coordinates: the
    statistics are accumulated over blocks of ``CHUNK // K`` coordinates (float64), holding
    about :data:`CHUNK` values per working copy instead of the whole cohort a second time."""
    if len(states) < MIN_COHORT:
        return {}
    count = len(states)
    width = max(1, CHUNK // count)
    device = next(iter(states[0].values())).device
    median_sq = torch.zeros((), dtype=torch.float64, device=device)  # on the models' device: no sync per chunk
    to_others_sq, update_sq = (torch.zeros(count, dtype=torch.float64, device=device) for _ in range(2))
    for key in float_keys(states[0]):
        flat = [s[key].detach().reshape(-1) for s in states]
        center_flat = None if center is None else center[key].detach().reshape(-1)
        for start in range(0, flat[0].numel(), width):
            chunk = torch.stack([f[start:start + width].double() for f in flat])  # (K, ≤ width)
            median_sq += _median_rows(chunk).pow(2).sum()
            for k in range(count):
                others = _median_rows(torch.cat([chunk[:k], chunk[k + 1:]]))
                to_others_sq[k] += (chunk[k] - others).pow(2).sum()
            if center is not None:
                c = center_flat[start:start + width].double()
                update_sq += (chunk - c).pow(2).sum(dim=1)
    negligible = NEGLIGIBLE * math.sqrt(float(median_sq))
    checks = [("distance to the others' median", to_others_sq.sqrt().tolist())]
    if center is not None:
        checks.append(("update norm", update_sq.sqrt().tolist()))
    reasons: dict[int, str] = {}
    for name, values in checks:
        med = statistics.median(values)
        for k in mad_outliers(values, threshold, negligible):
            reasons.setdefault(k, f"{name} {values[k]:.4g} is an outlier (cohort median {med:.4g}, "
                                  f"MAD threshold {threshold:g})")
    return reasons


def clip_updates(states: list[dict], center: dict, ratio: float) -> tuple[list[dict], list[int]]:
    """Updates ``θ_k − c`` scaled down to norm at most ``ratio × median norm``; returns the
    clipped models and the indices that were clipped."""
    norms = [distance(s, center) for s in states]
    tau = ratio * statistics.median(norms)
    out, clipped = [], []
    for k, (state, norm) in enumerate(zip(states, norms)):
        if norm <= tau or norm == 0:
            out.append(state)
            continue
        scale = tau / norm
        clipped.append(k)
        out.append({key: (center[key].double() + (v.double() - center[key].double()) * scale).to(v.dtype)
                    if v.is_floating_point() else v for key, v in state.items()})
    return out, clipped


def trimmed_mean(states: list[dict], fraction: float, release: bool = False, on_key=None) -> dict:
    """Coordinate-wise mean after dropping the ``⌊fraction·K⌋`` largest and smallest values."""
    cut = min(int(fraction * len(states)), (len(states) - 1) // 2)
    return _sorted_reduce(states, lambda v, k: v[cut : k - cut].mean(dim=0), release, on_key)


def aggregate(states: list[dict], weights: list[float], how: str, trim_fraction: float, mean,
              release: bool = False, on_key=None) -> dict:
    """One of :data:`AGGREGATORS`; ``mean(states, weights, release=, on_key=)`` is the weighted
    mean (e.g. ``average_states``). ``release=True``: the caller hands the input dicts over; they
    are emptied key by key as the result grows; ``on_key(key, tensor)``: called as each entry of
    the result is complete."""
    if how == "mean":
        return mean(states, weights, release=release, on_key=on_key)
    if how == "trimmed-mean":
        return trimmed_mean(states, trim_fraction, release, on_key)
    if how == "median":
        return coordinate_median(states, release, on_key)
    raise ValueError(f"aggregator must be one of {AGGREGATORS}, got {how!r}")
