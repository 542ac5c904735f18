"""Which token rows were trained, from the weights alone (data-free ``token_rows="auto"``).

A token-indexed tensor (the token embedding, an output head over the vocabulary: see
:func:`~fedbasin.alignment.spec.token_indexed_keys`) has one row per token. Rows of tokens the
training text never showed keep their initialisation, up to a change every such row shares: the
embedding rows of unseen tokens get no gradient at all, and the head rows of unseen tokens all get
the same push (``−p_t Σ h`` with ``p_t`` about equal for all of them: their logits are pushed down
together). So in each model the untrained rows are

    x_t = c + σ ε_t,   ε_t ~ N(0, I_d) independent,

one tight cluster: ``‖x_t − c‖² / σ²`` is χ²_d, so ``z_t = log ‖x_t − c‖²`` has spread
``√(2/d)`` about ``log(d σ²)`` whatever the init scale σ. Trained rows carry structure learned from
the data: they leave the cluster (in the head, a seen token's row loses the shared push and gains
its own direction; in the embedding, a frequent token's row moves far from its init; a rare token's
embedding row may stay inside, its head row does not).

The rule, per model and per token-indexed tensor (:func:`tensor_evidence`):

1. centre ``c``: the coordinate-wise median of the rows; ``z_t = log ‖x_t − c‖²``;
2. the cluster: the window of half-width ``4√(2/d)`` in ``z`` holding the most rows; the rows within
   ``2√(2/d)`` of its median re-estimate ``c`` (their mean), then ``z`` (twice); finally the window's
   location ``m`` (median) and spread ``s`` (1.4826 × median absolute deviation, at least the χ²
   value ``√(2/d)``);
3. the cluster counts as "the untrained rows" only if it is as tight as the χ² law allows
   (``s ≤ 1.75√(2/d)``; rows spread evenly over the window would give ``2.97√(2/d)``) and has at least ``max(d, 1 %)`` rows: a model whose every row was trained has
   no such cluster (its rows' norms spread much wider), and then the tensor says nothing;
4. one EM step of a two-component mixture on ``z``: untrained ``N(m, s²)``, trained the histogram
   of the rows outside ``m ± 3s`` (bins of width ``s``, floored by a uniform density), prior the
   cluster's share; ``P(trained | z_t)`` is the posterior;
5. a pushed cluster (centre ``c`` at least half a noise norm ``√(d σ²)`` from 0: a softmax head) is
   tested along the push as well: an untrained row's logit along the push undone,
   ``u_t = ⟨x_t, −c/‖c‖⟩``, is ``−‖c‖ + σ ε`` (one direction, spread σ, not ``√(2/d)`` of a squared
   distance over d), while a token seen even once has undone part of the push. The same EM step on
   ``u`` (null: median and MAD of the cluster's rows, spread at least σ; one-sided, below the null's
   centre P = 0) joins step 4 by a noisy OR. On the GPT-2 pair it finds the tokens seen once or
   twice that the distance misses (recall 0.878 → 1.000, precision 1.000 both).

A row is trained in a model if any of its token-indexed tensors says so (noisy OR of the tensors
with a cluster; with none, every row is trained). For a pair the rows that inform a match are
those trained in **both** models: a row trained in only one of them adds ``⟨structure, noise⟩``,
zero in expectation, only noise to the objective. So :func:`infer_token_weights` returns
``P_ref,t · P_cand,t`` times a data-free √count (``weighting="zipf"``, the default: the rank of the
row's learned unigram logit under Zipf's law; see :func:`infer_token_rows`), the per-token weights
that ``weight_match(token_rows=w)`` takes. A model without token rows gives None (nothing to weight);
when fewer than ``d`` rows (or none) are judged trained, the weights are all ones (the rule cannot
have found the training set: matching on all rows is the safe answer).
"""

from __future__ import annotations

import math
import threading
import weakref
from dataclasses import dataclass, field

import torch

from .spec import SymmetrySpec, token_indexed_keys

TOKEN_ROW_WEIGHTINGS = ("mask", "probability", "signal", "zipf")
WINDOW = 4.0  # half-width of the cluster search window, in units of the χ² spread √(2/d)
TIGHT = 1.75  # the cluster's spread may exceed the χ² spread by at most this factor
MIN_SHARE = 0.01  # a cluster needs at least this share of the rows (and at least d rows)
PROJECTION = True  # also test each row's projection along a pushed cluster's push (one-sided)
PUSHED = 0.5  # a cluster whose centre is at least this many noise norms from 0 was pushed (a softmax head)


@dataclass
class TensorEvidence:
    """What one token-indexed tensor of one model says about its rows."""

    key: str
    trained: torch.Tensor  # P(trained) per row (float64, ones when the tensor has no cluster)
    cluster: bool  # whether an untrained cluster was found
    location: float = float("nan")  # m: log of the cluster's typical squared distance d σ²
    spread: float = float("nan")  # s
    excess: torch.Tensor | None = None  # ‖x_t − c‖² / (d σ²) − 1, clipped at 0 (the row's signal-to-noise)
    push: float = 0.0  # ‖c‖ / √(d σ²): the shared push of the untrained rows, in units of their noise
    frequency: torch.Tensor | None = None  # ⟨x_t, −c⟩ / ‖c‖: each row's logit along the push undone


@dataclass
class TokenRows:
    """The inferred trained rows of a pair (:func:`infer_token_rows`)."""

    weights: torch.Tensor  # (vocab,) float64: weight_match's token_rows
    probability: torch.Tensor  # P(trained in both models) per token
    trained: int  # tokens with probability > ½
    vocab: int
    evidence: list[list[TensorEvidence]] = field(default_factory=list)  # per model, per tensor

    def summary(self) -> dict:
        """A JSON-able record: the source and how many rows were judged trained."""
        return {"source": "weights", "trained": self.trained, "of": self.vocab,
                "clusters": sum(e.cluster for model in self.evidence for e in model)}


# tensor → its evidence, for tensors still alive and unchanged: one plain ``fedbasin align`` of a subword LM asks three
# times about the same weights (whether to run the data-free default, its synthetic proxy, the matching's token rows),
# two of them inside the refinement's budget
_MEMO: dict[tuple, tuple[weakref.ref, TensorEvidence]] = {}
_MEMO_LOCK = threading.Lock()


def tensor_evidence(key: str, rows: torch.Tensor) -> TensorEvidence:
    """P(trained) for every row of one token-indexed tensor (steps 1–4 of the module docstring); the same
    tensor object at the same version (no in-place change since) and the same rule constants get the answer
    already computed."""
    tag = (key, id(rows), rows._version, rows.data_ptr(), WINDOW, TIGHT, MIN_SHARE, PROJECTION, PUSHED)
    with _MEMO_LOCK:
        for dead in [old for old, (alive, _) in _MEMO.items() if alive() is None]:
            del _MEMO[dead]
        if (hit := _MEMO.get(tag)) is not None and hit[0]() is rows:
            return hit[1]
    evidence = _tensor_evidence(key, rows)
    with _MEMO_LOCK:
        _MEMO[tag] = (weakref.ref(rows), evidence)
    return evidence


def _tensor_evidence(key: str, rows: torch.Tensor) -> TensorEvidence:
    x = rows.detach().to(device="cpu", dtype=torch.float64).reshape(rows.shape[0], -1)  # a statistic: on the CPU
    n, d = x.shape
    ones = torch.ones(n, dtype=torch.float64)
    chi = math.sqrt(2.0 / d)  # spread of log χ²_d
    if n < max(d, 2):
        return TensorEvidence(key, ones, False)
    z = _log_distance(x, x.median(dim=0).values)
    for _ in range(2):  # re-centre on the cluster's core itself, then locate it again
        inside = _densest_window(z, WINDOW * chi)
        core = (z - z[inside].median()).abs() <= 2 * chi
        z = _log_distance(x, x[core].mean(dim=0))
    inside = _densest_window(z, WINDOW * chi)
    m = float(z[inside].median())
    s = max(1.4826 * float((z[inside] - m).abs().median()), chi)
    count = int(inside.sum())
    if s > TIGHT * chi or count < max(d, MIN_SHARE * n):
        return TensorEvidence(key, ones, False, m, s)
    p = _posterior(z, m, s)
    excess = (torch.exp(z - m) - 1).clamp_min(0)
    centre = x[(z - m).abs() <= 2 * chi].mean(dim=0)
    push = float(centre.norm()) / math.exp(m / 2)
    frequency = x @ (-centre / centre.norm().clamp_min(torch.finfo(torch.float64).tiny))
    if PROJECTION and push >= PUSHED:  # one-sided test along the push: σ per direction, not spread over d
        u0 = float(frequency[core].median())
        su = max(1.4826 * float((frequency[core] - u0).abs().median()), math.exp(m / 2) / math.sqrt(d))
        p = 1 - (1 - p) * (1 - _posterior(frequency, u0, su, above_only=True))
    return TensorEvidence(key, p, True, m, s, excess, push, frequency)


def _posterior(z: torch.Tensor, m: float, s: float, above_only: bool = False) -> torch.Tensor:
    """One EM step: untrained N(m, s²) against the histogram of the rows clearly outside it (bins of
    width s, floored by one row spread over the range), prior the share inside ``m ± 3s``;
    ``above_only``: values below m are untrained (P = 0)."""
    n = len(z)
    core = (z - m).abs() <= 3 * s
    prior = float(core.double().mean())
    untrained = prior * torch.exp(-0.5 * ((z - m) / s) ** 2) / (s * math.sqrt(2 * math.pi))
    outside = z[~core & (z > m)] if above_only else z[~core]
    low, high = float(z.min()), float(z.max())
    floor = 1.0 / (n * max(high - low, s))
    if outside.numel():
        bins = max(1, math.ceil((high - low) / s))
        counts = torch.histc(outside, bins=bins, min=low, max=high)
        width = (high - low) / bins if high > low else 1.0
        index = ((z - low) / width).long().clamp(0, bins - 1)
        density = counts[index] / (outside.numel() * width)
    else:
        density = torch.zeros(n, dtype=torch.float64)
    trained = (1 - prior) * density.clamp_min(floor)
    p = trained / (trained + untrained)
    return torch.where(z > m, p, torch.zeros_like(p)) if above_only else p


def _log_distance(x: torch.Tensor, centre: torch.Tensor) -> torch.Tensor:
    squared = (x - centre).square().sum(dim=1)
    return torch.log(squared.clamp_min(torch.finfo(torch.float64).tiny))


def _densest_window(z: torch.Tensor, half: float) -> torch.Tensor:
    """Mask of the rows in the window ``[a, a + 2·half]`` of ``z`` that holds the most rows."""
    ordered = torch.sort(z).values
    ends = torch.searchsorted(ordered, ordered + 2 * half, right=True)
    start = int(torch.argmax(ends - torch.arange(len(ordered))))
    a = float(ordered[start])
    return (z >= a) & (z <= a + 2 * half)


def model_evidence(spec: SymmetrySpec, state: dict) -> list[TensorEvidence] | None:
    """The evidence of every token-indexed tensor of one model (None without token rows)."""
    keys = token_indexed_keys(spec, state)
    if not keys:
        return None
    return [tensor_evidence(k, state[k]) for k in sorted(keys)]


def trained_probability(evidence: list[TensorEvidence]) -> torch.Tensor:
    """P(trained) of each row of one model: noisy OR over its tensors that found a cluster."""
    untrained = torch.ones_like(evidence[0].trained)
    for e in evidence:
        if e.cluster:
            untrained = untrained * (1 - e.trained)
    return 1 - untrained


def _signal(evidence: list[TensorEvidence]) -> torch.Tensor:
    """Per-row signal-to-noise of one model: the largest excess energy over its tensors with a cluster."""
    found = [e.excess for e in evidence if e.cluster and e.excess is not None]
    if not found:
        return torch.ones_like(evidence[0].trained)
    return torch.stack(found).amax(dim=0)


def _zipf(evidence: list[TensorEvidence], trained: torch.Tensor) -> torch.Tensor:
    """``rank_t^(-1/2)`` of each row among the rows judged trained, ranked by its logit along the
    untrained rows' push undone (the tensor with the largest push; ones if none is pushed)."""
    pushed = [e for e in evidence if e.cluster and e.frequency is not None and e.push >= PUSHED]
    if not pushed:
        return torch.ones_like(trained, dtype=torch.float64)
    score = max(pushed, key=lambda e: e.push).frequency
    order = torch.argsort(torch.where(trained, score, torch.full_like(score, -math.inf)), descending=True)
    rank = torch.empty_like(score)
    rank[order] = torch.arange(1, len(score) + 1, dtype=torch.float64)
    return rank.rsqrt()


def infer_token_rows(spec: SymmetrySpec, *states: dict, weighting: str = "zipf") -> TokenRows | None:
    """The token rows trained in every one of ``states`` (usually a reference and a candidate).

    ``weighting``: ``"mask"`` 1[P > ½], ``"probability"`` P, ``"signal"`` P × √(excess energy of the
    row in each model, geometric mean), ``"zipf"`` (default) P × (r_ref r_cand)^(−1/4) with r a row's
    rank among the rows judged trained by its logit along the untrained rows' push undone — weights
    scaled to mean 1 over the rows judged trained. Returns None if the model has no token rows.

    Why ``zipf``: weight matching does best when row t counts ∝ √n_t, n_t its count in the training
    text (docs/journal/merging-notes.md §2a). The counts are not in the weights, but their order is: the untrained
    rows of a softmax head all share one push ``c`` (their logits pushed down), and a trained row's
    logit along ``−c`` is its learned unigram log-frequency up to an unknown scale (correlation 0.99
    with log n_t on the GPT-2 pair). Zipf's law, n ∝ 1/rank, turns the order into √n_t ∝ rank^(−1/2)
    without the scale. A model whose token tensors have no pushed cluster (no untrained rows, or no
    softmax head over them) gets P alone.
    """
    if weighting not in TOKEN_ROW_WEIGHTINGS:
        raise ValueError(f"token-row weighting must be one of {TOKEN_ROW_WEIGHTINGS}, got {weighting!r}")
    if not states:
        raise ValueError("infer_token_rows needs at least one state")
    evidence = [model_evidence(spec, s) for s in states]
    if any(e is None for e in evidence):
        return None
    vocab = evidence[0][0].trained.shape[0]
    p = torch.ones(vocab, dtype=torch.float64)
    for model in evidence:
        p = p * trained_probability(model)
    mask = p > 0.5
    trained = int(mask.sum())
    d = spec.width
    if trained < min(d, vocab):  # nothing (or too little) found: the rule cannot have found the training set
        return TokenRows(torch.ones(vocab, dtype=torch.float64), torch.ones(vocab, dtype=torch.float64),
                         vocab, vocab, evidence)
    if weighting == "mask":
        w = mask.double()
    elif weighting == "probability":
        w = p.clone()
    elif weighting == "zipf":
        w = p.clone()
        for model in evidence:
            w = w * _zipf(model, mask).pow(1.0 / len(evidence))
    else:
        signal = torch.ones(vocab, dtype=torch.float64)
        for model in evidence:
            signal = signal * _signal(model).pow(1.0 / len(evidence))
        w = p * signal.sqrt()
    w = torch.where(w > 1e-6, w, torch.zeros_like(w))
    scale = w[mask].mean()
    if not bool(scale > 0):
        w = torch.ones(vocab, dtype=torch.float64)
    else:
        w = w / scale
    return TokenRows(w, p, trained, vocab, evidence)


def infer_token_weights(spec: SymmetrySpec, reference: dict, candidate: dict,
                        weighting: str = "zipf") -> torch.Tensor | None:
    """Per-token weights (vocab,) for ``weight_match(token_rows=...)`` inferred from the two models'
    weights alone: ``P(row t trained in the reference) · P(trained in the candidate)``, by default
    times the Zipf weight of the row's learned frequency rank (see :func:`infer_token_rows` and the
    module docstring for the rule). None for a model without token rows."""
    found = infer_token_rows(spec, reference, candidate, weighting=weighting)
    return None if found is None else found.weights
