"""Merging N ≥ 2 models: align each to a reference, average; universe matching iterates this.

Universe matching (DESIGN §8): ``U⁰`` = the reference; repeat ``U^t = Σ_k w_k g_k·θ_k / Σ_k w_k``
with every ``g_k`` found by weight matching against ``U^{t−1}``, until ``‖U^t − U^{t−1}‖ /
‖U^{t−1}‖ < tol`` or ``universe_iterations`` rounds. A model with weight 0 only serves as the
first alignment target (e.g. the previous global model in federated rounds).
"""

from __future__ import annotations

import abc
import math
import numbers
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from fedbasin.options import MatchOptions, checked, match_call

from .canonical import canonicalize, to_gauge
from .group import GroupElement, apply_group, inverse
from .matching import MatchResult, weight_match
from .progress import progress_bar
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
    #: with ``token_rows="auto"``: per model, the rows judged trained in it and the reference
    #: (:meth:`~fedbasin.alignment.token_rows.TokenRows.summary`; None for the reference)
    token_rows: list[dict | None] | None = None


def average_states(states: list[dict], weights: list[float], release: bool = False, on_key=None) -> dict:
    """``Σ_k w_k θ_k / Σ_k w_k`` for floating tensors; other entries come from the first state.

    ``release=True`` (the caller hands the dicts over): each key leaves every input dict once it
    is summed, so the inputs shrink while the output grows (one model's worth at most in flight).
    ``on_key(key, tensor)`` is called as each entry of the result is complete (see :func:`merge`).
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
        if on_key is not None:
            on_key(key, out[key])
    return out


class Combiner(abc.ABC):
    """How :func:`merge` (and :func:`~fedbasin.alignment.refine.refined_merge`) turns the aligned
    models into one; the merge calls :meth:`combine` once per pass. The default is the weighted
    mean (:class:`WeightedAverage`); e.g. the Flower strategy screens the aligned models first.
    This is the whole contract between the merge and a combiner:

    * :meth:`combine` ``(states, weights, on_key=None) -> dict``: ``states`` are the aligned
      models in canonical form (one per merged model, in order), ``weights`` their merge weights
      (a weight-0 model is an alignment target only, e.g. the previous global model); it returns
      the combined canonical state. The dicts are the merge's own: ``combine`` may empty them
      (key by key, as the result grows) and the merge never reads them afterwards. When given,
      ``on_key(key, tensor)`` is called as each entry of the result is complete, so the merge can
      drop the previous average's entry at once (one that never calls it is also correct: the
      merge then compares the averages at the end, holding both whole).
    * :attr:`reads_unweighted`: whether the *next* call reads the weight-0 models. The merge reads
      it before every pass after the first; when it is False the merge hands an empty dict in
      their place instead of making a canonical copy (it may change between calls, e.g. once a
      screening decision made in the first call no longer needs them).
    """

    reads_unweighted: bool = True

    @abc.abstractmethod
    def combine(self, states: list[dict], weights: list[float], on_key=None) -> dict:
        """The combined canonical state of ``states`` (see the class docstring)."""


class WeightedAverage(Combiner):
    """The default combiner: :func:`average_states`, ``Σ_k w_k θ_k / Σ_k w_k`` (``release=True``:
    empties the inputs key by key, which :func:`merge` asks for when the caller hands the models over)."""

    def __init__(self, release: bool = False):
        self.release = release

    def combine(self, states: list[dict], weights: list[float], on_key=None) -> dict:
        return average_states(states, weights, release=self.release, on_key=on_key)


class _PlainCombiner(Combiner):
    """A plain ``function(states, weights) -> dict`` as a :class:`Combiner` (reads every model,
    reports no entry early)."""

    def __init__(self, function: Callable[[list, list], dict]):
        self.function = function

    def combine(self, states: list[dict], weights: list[float], on_key=None) -> dict:
        return self.function(states, weights)


def as_combiner(combine: Combiner | Callable[[list, list], dict] | None) -> Combiner:
    """``combine`` as a :class:`Combiner`: None or :func:`average_states` is the weighted mean, a
    plain ``(states, weights)`` callable is wrapped, a combiner is returned as it is."""
    if combine is None or combine is average_states:
        return WeightedAverage()
    if isinstance(combine, Combiner):
        return combine
    if callable(combine):
        return _PlainCombiner(combine)
    raise TypeError(f"combine must be a Combiner or a (states, weights) callable, got {combine!r}")


def _normalise_weights(weights, n):
    if weights is None:
        return [1.0] * n
    if isinstance(weights, (str, bytes)) or not all(isinstance(w, numbers.Real) and not isinstance(w, bool)
                                                     for w in weights):
        raise ValueError(f"merge weights must be a list of numbers, one per model, got {weights!r}")
    weights = [float(w) for w in weights]
    if len(weights) != n:
        raise ValueError(f"got {len(weights)} merge weights for {n} models")
    if not all(math.isfinite(w) for w in weights):
        raise ValueError(f"merge weights must be finite, got {weights}")
    if any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f"merge weights must be non-negative with a positive sum, got {weights}")
    return weights


#: shares α of the way from the given merge weights to the best model alone that :func:`best_mixture` scores
#: (α = 0: the weights as given, α = 1: the best model; every model alone is scored to find the best)
MIXTURE_SHARES = (0.25, 0.5, 0.75)


def mixture_toward(weights: list[float], k: int, share: float) -> list[float]:
    """``w(α) = (1 − α)·w/Σw + α·e_k``: the normalised merge weights moved a share α of the way to model k alone."""
    total = float(sum(weights))
    return [(1 - share) * w / total + (share if i == k else 0.0) for i, w in enumerate(weights)]


@dataclass
class Mixture:
    """What :func:`best_mixture` chose: ``weights`` (normalised), the best single ``model``, the ``share`` α
    of the way to it, and every scored ``(share, loss)`` pair (α = 1: the model alone)."""

    weights: list[float]
    model: int
    share: float
    losses: list[tuple[float, float]]

    def summary(self) -> dict:
        return {"weights": [round(w, 6) for w in self.weights], "best_model": self.model, "share": self.share,
                "losses": {f"{a:g}": round(v, 6) for a, v in self.losses}}


def best_mixture(weights: list[float], loss_of: Callable[[list[float]], float],
                 shares: tuple[float, ...] = MIXTURE_SHARES) -> Mixture:
    """The merge weights of lowest ``loss_of`` on the line from ``weights`` toward the best model alone.

    Each model of positive weight is scored alone (``loss_of(e_k)``), k* = the lowest; then
    ``w(α) = (1 − α)·w/Σw + α·e_k*`` (:func:`mixture_toward`) for α = 0 and every share in ``shares``.
    The lowest loss wins, the smaller α on a tie; a non-finite loss never wins (all non-finite: α = 0).
    ``loss_of(w)`` scores the merge with weights w, e.g. on the proxy's selection split."""
    weights = _normalise_weights(weights, len(weights))
    singles = {k: loss_of(mixture_toward(weights, k, 1.0)) for k, w in enumerate(weights) if w > 0}
    finite = {k: v for k, v in singles.items() if math.isfinite(v)}
    best = min(finite, key=finite.get) if finite else next(iter(singles))
    scored = [(a, loss_of(mixture_toward(weights, best, a))) for a in (0.0, *sorted(set(shares) - {0.0, 1.0}))]
    scored.append((1.0, singles[best]))
    share, _ = min(scored, key=lambda p: (p[1] if math.isfinite(p[1]) else math.inf, p[0]))  # all non-finite: α = 0
    return Mixture(mixture_toward(weights, best, share), best, share, scored)


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
    token_rows: torch.Tensor | str | None = None,
    combine: Combiner | Callable[[list, list], dict] | None = None,
    release: bool = False,
    head_weight: float = 1.0,
    match: MatchOptions | None = None,
) -> MergeResult:
    """Align every model to ``states[reference]`` (then to the running universe) and average.

    ``align=False`` is plain weighted averaging through the same path (FedAvg). The result is
    returned in the reference's gauge and keeps the architecture (tied tensors come back untied).
    ``token_rows``: match token-indexed rows of these ids only (see :func:`weight_match`);
    ``"auto"``: for each model, the rows that its weights and the reference's judge trained in both
    (:func:`~fedbasin.alignment.token_rows.infer_token_rows` on the raw models, once, before any
    alignment; every pass uses them; the reference, re-aligned from the second pass on, takes the mean
    of the others' weights): a row trained in only one of the two adds only noise to their
    match, and the universe of later passes is an average, whose untrained rows no longer sit at the
    init scale, so the rows are judged on the models as given;
    ``head_weight``: the output head's objective weight (likewise).
    ``combine``: a :class:`Combiner` that replaces the weighted mean (e.g. a robust aggregator
    that screens the aligned models first; its contract is stated there), or a plain
    ``(states, weights)`` callable (wrapped by :func:`as_combiner`); default :class:`WeightedAverage`.

    Memory: each model is canonicalised only while it is aligned (inside :func:`weight_match`),
    so a pass holds the aligned models plus one model in flight. ``release=True`` (the caller
    hands ``states`` over, the dicts included): model ``k``'s dict is emptied and ``states[k]``
    set to None as soon as it has been read (the reference once canonicalised, the others by
    :func:`weight_match`), so its tensors go once nothing else refers to them; no gauged copy of
    the aligned models is made, ``combine`` may empty the dicts it gets (the default mean does,
    key by key) and, in the last pass, the aligned models go after it.

    Universe matching re-aligns the original models in every pass. Without ``release`` they are
    read from ``states`` again. With ``release`` a model of positive weight is kept only in its
    aligned form ``g_k·θ_k`` (its ``combine`` input): before its next alignment it is turned back
    into ``θ_k`` in place (``g_k⁻¹``, exact up to float round-off for orthogonal maps, bitwise for
    permutations), so the passes hold one form of each model, never two; a weight-0 model (an
    alignment target only, handed to ``combine`` unaligned in later passes) keeps its raw dict.

    ``match``: the options schema's :class:`~fedbasin.options.MatchOptions` (``auto`` values are set for
    the model by :func:`weight_match`); when given, its values replace ``mode``, ``iterations``, ``tol``,
    ``head_weight`` and ``universe_iterations``.
    """
    if match is not None:
        return merge(spec, states, weights=weights, reference=reference, universe_tol=universe_tol, align=align,
                     weighting=weighting, progress=progress, token_rows=token_rows, combine=combine, release=release,
                     universe_iterations=match.universe_iterations, **match_call(match))
    t0 = time.perf_counter()
    checked(MatchOptions(universe_iterations=universe_iterations))
    if len(states) < 2:
        raise ValueError(f"merging needs at least 2 models, got {len(states)}")
    if isinstance(reference, bool) or not isinstance(reference, int) or not 0 <= reference < len(states):
        raise ValueError(f"reference index {reference} out of range for {len(states)} models")
    weights = _normalise_weights(weights, len(states))
    combine = as_combiner(combine)
    names = [f"model {i}" for i in range(len(states))]
    for i in range(len(states)):  # no loop variable may keep a model alive (release=True)
        check_compatible(spec, states[reference], states[i], (names[reference], names[i]))
    ref_c = canonicalize(spec, states[reference], names[reference], validate=False)
    if not align:
        canon = [canonicalize(spec, s, names[i], validate=False, like=ref_c.gains).state
                 for i, s in enumerate(states)]
        merged = combine.combine(canon, weights)
        return MergeResult(to_gauge(spec, merged, ref_c.gains), merged, [], seconds=time.perf_counter() - t0,
                           untied=ref_c.untied)

    per_model = [token_rows] * len(states)
    inferred = None
    if isinstance(token_rows, str):
        if token_rows != "auto":
            raise ValueError(f"token_rows must be ids, per-token weights, 'auto' or None, got {token_rows!r}")
        from .token_rows import infer_token_rows

        inferred = [None if k == reference else infer_token_rows(spec, states[reference], states[k])
                    for k in range(len(states))]
        per_model = [None if found is None or found.trained == found.vocab else found.weights for found in inferred]
        others = [found for k, found in enumerate(inferred) if k != reference and found is not None]
        if any(w is not None for w in per_model):  # the reference (re-aligned in later passes): the mean
            per_model[reference] = torch.stack([f.weights for f in others]).mean(dim=0)  # over the others
    passes = universe_iterations
    for i in range(len(states)):  # bad gains fail here, before any alignment starts
        canonicalize(spec, states[i], names[i], validate=False)
    # models whose raw dict stays readable for later passes: all without release (the caller's),
    # with release only weight-0 models when there are later passes (their unaligned entry)
    readable = [not release or (passes > 1 and weights[k] == 0) for k in range(len(states))]
    if release:
        if not readable[reference]:
            states[reference].clear()
            states[reference] = None
        if type(combine) is WeightedAverage and not combine.release:
            combine = WeightedAverage(release=True)
    gains, universe = ref_c.gains, ref_c.state
    # model k between passes when its raw dict is gone: (g·θ_k canonical, g); g None: θ_k itself
    held = {reference: (ref_c.state, None)} if states[reference] is None else {}
    result = MergeResult({}, {}, [], untied=ref_c.untied,
                         token_rows=None if inferred is None else [f and f.summary() for f in inferred])
    del ref_c
    bar = progress_bar(len(states) * passes, progress, "aligning", "model")
    for t in range(passes):
        last = t == passes - 1
        matches, aligned = [], []
        result.matches = []  # the previous pass's transforms go as the models are restored
        for k in range(len(states)):
            if t == 0 and k == reference:
                matches.append(None)
                aligned.append(universe)
            elif t > 0 and weights[k] == 0:  # an alignment target only: canonicalised below, unaligned
                matches.append(None)
                aligned.append(None)
            else:
                candidate = states[k] if states[k] is not None else _restore(spec, *held.pop(k))
                match = weight_match(spec, universe, candidate, mode=mode, iterations=iterations, tol=tol,
                                     weighting=weighting, token_rows=per_model[k], head_weight=head_weight,
                                     release=release and not readable[k], like=gains)
                del candidate
                if not readable[k]:
                    states[k] = None  # weight_match emptied the dict
                matches.append(match)
                aligned.append(match.canonical)
                del match  # (no loop variable may keep a transform alive into the next pass)
            bar.update(1)
        for k in range(len(states)):  # only while combine runs, and only if it reads them
            if aligned[k] is None:
                aligned[k] = (canonicalize(spec, states[k], names[k], validate=False, like=gains).state
                              if combine.reads_unweighted else {})
        if not last:  # the merge keeps its aligned models for the next pass: combine gets copies
            held.update((k, (aligned[k], m.transform)) for k, m in enumerate(matches)
                        if m is not None and not readable[k])
        # combine may empty what it gets: never the universe's own dict
        inputs = [dict(a) if not last or a is universe else a for a in aligned]
        # Uᵗ is nobody's aligned form after the first pass (in it too when the reference's raw dict
        # is kept): each of its entries goes once compared, from it and from combine's copy of it
        drop = [universe, *(d for d, a in zip(inputs, aligned) if a is universe)] if t > 0 or readable[reference] else []
        del aligned
        change = _ChangeTracker(spec, universe, drop)
        new_universe = combine.combine(inputs, weights, on_key=change.entry_done)
        del inputs
        result.matches = [m for m in matches if m is not None]
        if release:
            _keep_records_only(result.matches)
        del matches
        change = change.finish(new_universe)
        universe = new_universe
        result.objectives.append([m.objective for m in result.matches])
        result.universe_change.append(change)
        if change < universe_tol:
            break
    held.clear()
    if release:  # the weight-0 models' raw dicts, read until the last pass
        for k in range(len(states)):
            if states[k] is not None:
                states[k].clear()
                states[k] = None
    bar.close()
    result.canonical = universe
    result.state = to_gauge(spec, universe, gains)
    result.seconds = time.perf_counter() - t0
    return result


def _is_identity(g: GroupElement) -> bool:
    """Every map of ``g`` leaves its axis in place: permutations the identity, matrices (the residual map,
    per-head maps, stacked ``(H, d, d)``) the identity, no neuron scales."""
    def eye(m: torch.Tensor | None) -> bool:
        return m is None or torch.equal(m, torch.eye(m.shape[-1], dtype=m.dtype, device=m.device).expand_as(m))

    def in_place(perm: torch.Tensor) -> bool:
        return torch.equal(perm, torch.arange(len(perm), device=perm.device))

    heads = all(h is None or (in_place(h.perm) and eye(h.qk) and eye(h.ov)) for h in g.heads)
    neurons = all(n is None or (in_place(n.perm) and n.scale is None) for n in g.neurons)
    return eye(g.residual) and heads and neurons


def shares_basis(spec: SymmetrySpec, reference: dict, state: dict, head_weight: float = 1.0) -> bool:
    """Whether ``state`` already sits in ``reference``'s basis: one pass of permutation weight matching
    from the identity leaves every head and every MLP neuron in place, i.e. the identity is a fixed point
    of the matching (``argmax_π ⟨θ_ref, π·θ⟩`` per layer, given the others). Models trained from one
    common model (a federated round's broadcast) pass; independently initialised ones do not. Costs one
    matching pass; neither input is changed."""
    match = weight_match(spec, reference, state, mode="permutation", iterations=1, tol=0.0,
                         head_weight=head_weight)
    return _is_identity(match.transform)


def _keep_records_only(matches: list[MatchResult]) -> None:
    """Drop the matches' states (a function of its own: no loop variable outlives it)."""
    for match in matches:
        match.canonical, match.state = {}, {}


def _restore(spec: SymmetrySpec, state: dict, g: GroupElement | None) -> dict:
    """``θ = g⁻¹·(g·θ)`` in place on ``state`` (each aligned tensor goes as its original replaces it)."""
    return state if g is None else apply_group(spec, state, inverse(g), in_place=True)


class _ChangeTracker:
    """``‖Uᵗ⁺¹ − Uᵗ‖ / ‖Uᵗ‖`` over the spec's tensors, summed per key in float64 blocks of
    ``block`` values, as ``combine`` completes the entries of Uᵗ⁺¹ (:meth:`entry_done`) or at
    :meth:`finish`. Each entry leaves the dicts in ``drop`` (Uᵗ and its copies) once compared,
    so Uᵗ shrinks while Uᵗ⁺¹ grows instead of both being held whole. The sum runs over the keys
    in sorted order whatever order they came in, so the value does not depend on the combine."""

    def __init__(self, spec: SymmetrySpec, old: dict, drop: list[dict], block: int = 1 << 18):
        self.keys, self.old, self.drop, self.block = set(spec.keys()), old, drop, block
        self.parts: dict[str, tuple[float, float]] = {}

    def entry_done(self, key: str, new: torch.Tensor) -> None:
        if key in self.keys and key not in self.parts:
            a, b = self.old[key].reshape(-1), new.reshape(-1)
            num = den = 0.0
            for start in range(0, a.numel(), self.block):
                before = a[start:start + self.block].double()
                num += float((b[start:start + self.block].double() - before).pow(2).sum())
                den += float(before.pow(2).sum())
            self.parts[key] = (num, den)
        for d in self.drop:
            d.pop(key, None)

    def finish(self, new: dict) -> float:
        for key in self.keys - set(self.parts):
            self.entry_done(key, new[key])
        parts = [self.parts[key] for key in sorted(self.keys)]
        num, den = sum(p[0] for p in parts), sum(p[1] for p in parts)
        return (num / max(den, 1e-30)) ** 0.5

