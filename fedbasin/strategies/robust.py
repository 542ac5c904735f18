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
  rest, unweighted); coordinate-wise median (unweighted; mean of the two middle values for even K);
* example counts (:func:`capped_counts`) and proxy losses (:func:`proxy_outliers`) are judged
  against the cohort's lower median, which up to half the cohort cannot push above every honest
  value; a cohort of two equal camps that disagree (:func:`equal_split`) cannot be decided at all.
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
SPLIT_RATIO = 2.0  # two equal camps: every cross distance > this × every distance within a camp
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
    (upper side only), the statistics over the finite values; a value that is not finite (a model
    whose distance overflowed) is always an outlier."""
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return list(range(len(values)))
    med = statistics.median(finite)
    mad = statistics.median(abs(v - med) for v in finite)
    cut = max(med + threshold * max(MAD_SCALE * mad, RELATIVE_FLOOR * med), negligible)
    return [i for i, v in enumerate(values) if not math.isfinite(v) or v > cut]


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


def lower_median(values: list[float]) -> float:
    """The ``⌈K/2⌉``-th smallest of K values. If at most ``⌊K/2⌋`` of them are hostile, at least
    ``⌈K/2⌉`` are honest, so it is at most the largest honest value; if fewer than ``K/2`` are
    hostile, it is also at least the smallest honest value."""
    return sorted(values)[(len(values) + 1) // 2 - 1]


def capped_counts(counts: list[float], most: float, ratio: float) -> tuple[list[float], float]:
    """Averaging weights ``w_k = min(n_k, M, ρ·q)`` and the cap, with ``q`` the lower median
    (:func:`lower_median`) of ``min(n_k, M)`` (``M = most``, ``ρ = ratio``; 0 switches either
    cap off).

    Guarantee: let ``f ≤ ⌊K/2⌋`` of the K nodes collude, whatever counts they report. Then
    ``q ≤`` the largest honest count, so every colluder's weight is at most ``ρ·q``; and at least
    ``⌊K/2⌋ + 1 − f`` honest nodes report ``n ≥ q`` (weight ``≥ min(1, ρ)·q``). The colluders'
    share of the total weight is therefore at most
    ``f·ρ·q / (f·ρ·q + Σ_honest min(n_h, ρ·q)) ≤ f·ρ / (f·ρ + min(1, ρ)·(⌊K/2⌋ + 1 − f))``;
    with ``ρ = 1`` and equal honest counts it is at most ``f / K`` (one half at ``f = K/2``).
    Two colluders of four against honest counts of 100: weights 100, 100, 100ρ, 100ρ."""
    limit = most if most > 0 else math.inf
    capped = [min(n, limit) for n in counts]
    if ratio > 0 and capped:
        limit = min(limit, ratio * lower_median(capped))
    return [min(n, limit) for n in counts], limit


def proxy_outliers(losses: list[float], factor: float) -> list[int]:
    """Indices ``k`` whose proxy loss ``L_k > (1 + t)·q`` (``t = factor``, ``q``: the lower
    median of the finite losses, :func:`lower_median`), and every non-finite ``L_k``.

    Guarantee: with at most ``⌊K/2⌋`` hostile replies, ``q ≤`` the largest honest loss, so a
    hostile reply is kept only if its proxy loss is at most ``1 + t`` times the worst honest
    reply's; with fewer than ``K/2`` hostile, ``q ≥`` the smallest honest loss, so an honest
    reply is excluded only if it does more than ``1 + t`` times worse than another honest reply.
    Unlike the MAD rule, the lower median is not moved by a camp of half the cohort."""
    finite = [v for v in losses if math.isfinite(v)]
    cut = (1.0 + factor) * lower_median(finite) if finite else -math.inf
    return [k for k, v in enumerate(losses) if not math.isfinite(v) or v > cut]


def pairwise_distances(states: list[dict]) -> torch.Tensor:
    """``(K, K)`` Euclidean distances between the models over their floating entries (float64),
    from Gram matrices accumulated over blocks of ``CHUNK // K`` coordinates."""
    count = len(states)
    width = max(1, CHUNK // max(1, count))
    device = next(iter(states[0].values())).device
    gram = torch.zeros(count, count, dtype=torch.float64, device=device)
    for key in float_keys(states[0]):
        flat = [s[key].detach().reshape(-1) for s in states]
        for start in range(0, flat[0].numel(), width):
            chunk = torch.stack([f[start:start + width].double() for f in flat])
            gram += chunk @ chunk.T
    sq = gram.diagonal()
    return (sq[:, None] + sq[None, :] - 2 * gram).clamp_min(0).sqrt().cpu()


def equal_split(states: list[dict], ratio: float = SPLIT_RATIO) -> tuple[list[int], list[int], float, float] | None:
    """Two equal camps that disagree: for an even cohort of ``K ≥ 4`` models, halves ``A`` and ``B``
    (``|A| = |B| = K/2``) with ``min_{a∈A, b∈B} ‖θ_a − θ_b‖ > ratio · max`` over the distances
    within ``A`` and within ``B``. Returns ``(A, B, smallest cross distance, largest within
    distance)``, or None.

    If such halves exist, each camp is every member's ``K/2 − 1`` nearest others, so trying the
    camp of each model's nearest neighbours finds them (K candidates). With half the cohort on
    each side, no median, MAD or count rule can tell which camp is honest. Needs two models per
    camp to measure a camp's spread: never true for ``K = 2`` (nor for odd K, which has a
    majority)."""
    count = len(states)
    if count < 4 or count % 2:
        return None
    d = pairwise_distances(states)
    half = count // 2
    for i in range(count):
        camp = sorted(int(j) for j in d[i].argsort(stable=True)[:half])
        if i not in camp:  # ties at distance 0 with i itself
            continue
        other = [j for j in range(count) if j not in camp]
        within = max(float(d[camp][:, camp].max()), float(d[other][:, other].max()))
        cross = float(d[camp][:, other].min())
        if cross > ratio * within:
            return camp, other, cross, within
    return None
