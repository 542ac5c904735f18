"""Merging N ≥ 2 models: align each to a reference, average; universe matching iterates this.

Universe matching (DESIGN §8): ``U⁰`` = the reference; repeat ``U^t = Σ_k w_k g_k·θ_k / Σ_k w_k``
with every ``g_k`` found by weight matching against ``U^{t−1}``, until ``‖U^t − U^{t−1}‖ /
‖U^{t−1}‖ < tol`` or ``universe_iterations`` rounds. A model with weight 0 only serves as the
first alignment target (e.g. the previous global model in federated rounds).
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass, field

import torch

from .canonical import canonicalize, to_gauge
from .matching import MatchResult, progress_bar, weight_match
from .spec import SymmetrySpec, check_compatible


@dataclass
class MergeResult:
    """state: merged model in the reference's gauge; canonical: the same with unit gains.

    objectives: per universe iteration, the weight-matching records of every model;
    universe_change: relative change of the merged weights per universe iteration.
    With ``merge(..., release=True)`` the matches keep their transform and objective records
    only (``state`` and ``canonical`` are empty dicts).
    """

    state: dict
    canonical: dict
    matches: list[MatchResult]
    objectives: list[list[list[float]]] = field(default_factory=list)
    universe_change: list[float] = field(default_factory=list)
    seconds: float = 0.0
    untied: bool = False


def average_states(states: list[dict], weights: list[float], release: bool = False) -> dict:
    """``Σ_k w_k θ_k / Σ_k w_k`` for floating tensors; other entries come from the first state.

    ``release=True`` (the caller hands the dicts over): each key leaves every input dict once it
    is summed, so the inputs shrink while the output grows (one model's worth at most in flight).
    """
    total = float(sum(weights))
    if not math.isfinite(total) or total <= 0:
        raise ValueError(f"merge weights must be finite with a positive sum, got {weights}")
    out = {}
    for key in list(states[0]):
        first = states[0][key]
        if not first.is_floating_point():
            out[key] = first
        else:
            acc = torch.zeros_like(first, dtype=torch.float64 if first.dtype == torch.float64 else torch.float32)
            for s, w in zip(states, weights):
                if w:
                    acc += s[key].to(acc) * (w / total)
            out[key] = acc.to(first.dtype)
            del acc
        if release:
            for s in states:
                s.pop(key, None)
        del first
    return out


def _normalise_weights(weights, n):
    if weights is None:
        return [1.0] * n
    weights = [float(w) for w in weights]
    if len(weights) != n:
        raise ValueError(f"got {len(weights)} merge weights for {n} models")
    if not all(math.isfinite(w) for w in weights):
        raise ValueError(f"merge weights must be finite, got {weights}")
    if any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f"merge weights must be non-negative with a positive sum, got {weights}")
    return weights


def merge(
    spec: SymmetrySpec,
    states: list[dict],
    weights: list[float] | None = None,
    reference: int = 0,
    mode: str = "orthogonal",
    iterations: int = 20,
    tol: float = 1e-4,
    universe_iterations: int = 1,
    universe_tol: float = 1e-4,
    align: bool = True,
    weighting: str = "rms",
    progress: bool = False,
    token_rows: torch.Tensor | None = None,
    combine=average_states,
    release: bool = False,
    head_weight: float = 1.0,
) -> MergeResult:
    """Align every model to ``states[reference]`` (then to the running universe) and average.

    ``align=False`` is plain weighted averaging through the same path (FedAvg). The result is
    returned in the reference's gauge and keeps the architecture (tied tensors come back untied).
    ``token_rows``: match token-indexed rows of these ids only (see :func:`weight_match`);
    ``head_weight``: the output head's objective weight (likewise).
    ``combine(aligned_canonical_states, weights)`` replaces the weighted mean (e.g. a robust
    aggregator that screens the aligned models first); the dicts it gets are the merge's own.

    Memory: with one universe pass each model is canonicalised only while it is aligned (inside
    :func:`weight_match`), so the merge holds the aligned models plus one model in flight.
    ``release=True`` (the caller hands ``states`` over, the dicts included): model ``k``'s dict
    is emptied and ``states[k]`` set to None as soon as it has been read (the reference once
    canonicalised, the others by :func:`weight_match`), so its tensors go once nothing else
    refers to them; no gauged copy of the aligned models is made, ``combine`` may empty the
    dicts it gets (the default mean does, key by key) and the aligned models go after it.
    Universe matching (``universe_iterations > 1``) re-aligns the original models in every
    pass, so it holds all of them in canonical form.
    """
    t0 = time.perf_counter()
    if len(states) < 2:
        raise ValueError(f"merging needs at least 2 models, got {len(states)}")
    if not 0 <= reference < len(states):
        raise ValueError(f"reference index {reference} out of range for {len(states)} models")
    weights = _normalise_weights(weights, len(states))
    names = [f"model {i}" for i in range(len(states))]
    for i in range(len(states)):  # no loop variable may keep a model alive (release=True)
        check_compatible(spec, states[reference], states[i], (names[reference], names[i]))
    ref_c = canonicalize(spec, states[reference], names[reference], validate=False)
    if not align:
        canon = [canonicalize(spec, s, names[i], validate=False).state for i, s in enumerate(states)]
        merged = combine(canon, weights)
        return MergeResult(to_gauge(spec, merged, ref_c.gains), merged, [], seconds=time.perf_counter() - t0,
                           untied=ref_c.untied)

    passes = max(universe_iterations, 1)
    if passes > 1:
        canon = [canonicalize(spec, s, names[i], validate=False).state for i, s in enumerate(states)]
    else:  # one pass: weight_match canonicalises each model itself (the same tensors, bitwise)
        canon = None
        for i in range(len(states)):  # bad gains fail here, before any alignment starts
            canonicalize(spec, states[i], names[i], validate=False)
    if release:  # what is left of the raw models is read from their canonical forms
        for i in range(len(states)):
            if i == reference or canon is not None:
                states[i].clear()
                states[i] = None
        if combine is average_states:
            combine = functools.partial(average_states, release=True)
    universe = ref_c.state
    result = MergeResult({}, {}, [], untied=ref_c.untied)
    bar = progress_bar(len(states) * passes, progress, "aligning", "model")
    for t in range(passes):
        matches, aligned = [], []
        for k in range(len(states)):
            if (t == 0 and k == reference) or (t > 0 and weights[k] == 0):
                # the reference itself, or a weight-0 model (alignment target only)
                matches.append(None)
                aligned.append(dict(ref_c.state if canon is None else canon[k]))  # combine may empty it
            else:
                match = weight_match(spec, universe, states[k] if canon is None else canon[k], mode=mode,
                                     iterations=iterations, tol=tol, weighting=weighting, token_rows=token_rows,
                                     head_weight=head_weight,
                                     release=release and canon is None)
                if release and canon is None:
                    states[k] = None  # weight_match emptied the dict
                matches.append(match)
                aligned.append(match.canonical)
            bar.update(1)
        new_universe = combine(aligned, weights)
        del aligned
        result.matches = [m for m in matches if m is not None]
        if release:
            for m in result.matches:
                m.canonical = {}
        del matches
        change = _relative_change(spec, universe, new_universe)
        universe = new_universe
        result.objectives.append([m.objective for m in result.matches])
        result.universe_change.append(change)
        if change < universe_tol:
            break
    bar.close()
    result.canonical = universe
    result.state = to_gauge(spec, universe, ref_c.gains)
    result.seconds = time.perf_counter() - t0
    return result


def _relative_change(spec: SymmetrySpec, old: dict, new: dict) -> float:
    keys = sorted(spec.keys())
    num = sum(float((new[k].double() - old[k].double()).pow(2).sum()) for k in keys)
    den = sum(float(old[k].double().pow(2).sum()) for k in keys)
    return (num / max(den, 1e-30)) ** 0.5

