"""Data-free weight matching: coordinate ascent on ``J(g) = Σ_p w_p ⟨θ_ref,p, (g·θ)_p⟩ / P``.

The weights w_p set how much each tensor counts; every choice gives J = 1 for a perfect match:

* ``"rms"`` (default): ``w_p = n_p / (‖θ_ref,p‖ ‖θ_p‖)`` with n_p entries, J normalised by Σ n_p —
  the L2 distance after scaling every tensor to unit RMS: tensors count by size, none by scale;
* ``"cosine"``: ``w_p = 1 / (‖θ_ref,p‖ ‖θ_p‖)``, J the mean cosine over tensors (a bias vector
  counts as much as a matrix);
* ``"uniform"``: ``w_p = 1`` — the plain L2 distance of canonical weights (J not normalised).

``head_weight`` h multiplies w_p of the output head over the vocabulary (a token-indexed reader,
:func:`token_indexed_keys`, other than the embedding), J normalised so that a perfect match still
gives 1: the head's rows are what the loss reads directly (see docs/journal/merging-notes.md §2a for the effect).

Each step maximises J exactly over one factor of the group, the others fixed, so the
recorded objective never decreases:

1. residual map O: ``max tr(Oᵀ C)``, ``C = Σ_p w_p unfold(θ_p)ᵀ unfold(θ_ref,p)`` — Procrustes
   ``O = U Vᵀ`` (LayerNorm: within the complement of 1), or Hungarian on C (``permutation``);
2. heads per layer: Hungarian on the best within-head match value of every head pair,
   ``‖M_qk,ij‖_* + ‖M_ov,ij‖_*`` from d_h×d_h factor products (basis-invariant like the QK/OV
   circuit similarity, and the exact maximiser of J), then per-head Procrustes for A (QK; RoPE:
   one angle per rotary plane) and B (OV);
3. MLP per layer: Hungarian on ``w₁ W_1,ref W_1ᵀ + w_b b_1,ref b_1ᵀ + w₂ W_2,refᵀ W_2`` (gate included).

An iteration of :func:`weight_match` is one full sweep (heads, MLPs, residual) and
``INNER_SWEEPS`` maps-only sweeps (within-head maps with the heads in place, then the residual map).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch
from scipy.optimize import linear_sum_assignment

from fedbasin import heap
from fedbasin.options import AUTO, HEAD_WEIGHT, MatchOptions, checked, match_call, model_kind

from .canonical import canonicalize, fold_tiny, to_gauge
from .group import (
    GroupElement,
    HeadMap,
    NeuronMap,
    apply_group,
    compose,
    contract_axis,
    rotary_planes,
)
from .progress import progress_bar
from .spec import AttentionSpec, MLPSpec, SymmetrySpec, check_compatible, token_indexed_keys  # noqa: F401 (re-exported)

MODES = ("orthogonal", "permutation")
#: match gated (SwiGLU) units as signed permutations. Exact, and on the Llama pair about half the matched units
#: flip, but no barrier fell (docs/journal/merging-notes.md §32; ``scripts/gated_signs_probe.py``): off
SIGNED_GATED_UNITS = False
WEIGHTINGS = ("cosine", "rms", "uniform")
TOKEN_WEIGHTINGS = ("seen", "sqrt", "count")


@dataclass
class MatchResult:
    """Aligned candidate and how it was found.

    state: the candidate aligned to the reference, in the reference's gauge (same function).
    canonical: the aligned candidate in canonical form (unit gains).
    transform: the group element g with ``canonical = g · canonicalize(candidate)``.
    objective: J after the start and after every iteration (non-decreasing).
    initial_objective: J of the unaligned candidate.
    """

    state: dict
    canonical: dict
    transform: GroupElement
    objective: list[float]
    initial_objective: float
    seconds: float
    iterations: int = 0
    start: str = "identity"
    elapsed: list[float] = field(default_factory=list)  # seconds since the call, per objective entry
    #: wall (and ``*_cpu`` process CPU) seconds per phase; ``<phase>.<part>_cpu``: CPU seconds of a
    #: part of the steps (:class:`PartClock`; ``heads.values`` is inside the head step, the
    #: ``residual.*`` parts include the setup's residual start)
    phases: dict = field(default_factory=dict)
    #: with ``token_rows="auto"``: how many token rows the weights judged trained
    #: (:meth:`~fedbasin.alignment.token_rows.TokenRows.summary`); None otherwise
    token_rows: dict | None = None


#: maps-only sweeps (within-head maps with heads in place, then the residual map) after each full
#: sweep (heads, MLPs, residual): the slow tail of the ascent is the coupling of the residual map
#: with the within-head maps (a maps-only sweep gains about what a full one does there), and it
#: costs a fraction of a full sweep (no MLP scores or assignments, no head pair values).
#: GPT-2-small pair, one thread: 0 → 82.4 CPU s to J = 0.103501; 2 → 49.8 s to 0.103511; 3 → 49.7 s
#: to 0.103533 (0.103503 after 3 of its 4 iterations) — docs/journal/scale-notes.md, "Fourth pass"
INNER_SWEEPS = 3
#: keep the MLP weights unrotated during matching (see weight_match); False: rotate them with every
#: residual step and recompute their covariance (the reference computation the tests compare with)
UNROTATED_MLP = True
SPARSE_ASSIGNMENT_ABOVE = 1024  # n above which assignments are solved on a top-k candidate graph
SPARSE_CANDIDATES = 64


def hungarian(score: torch.Tensor) -> torch.Tensor:
    """Permutation p maximising ``Σ_i score[i, p[i]]`` (rows: reference, columns: candidate).

    If the row-wise argmaxes already form a permutation it is optimal (it reaches the upper
    bound ``Σ_i max_j score[i, j]``) and no solver runs. Above ``SPARSE_ASSIGNMENT_ABOVE`` rows
    the assignment is solved (LAPJVsp) on the graph of each row's ``SPARSE_CANDIDATES`` best
    columns — about 10x faster than the dense O(n³) solver, optimal whenever the optimum uses
    only candidate edges (always in our checks); without a perfect matching there, the dense
    solver runs. Callers keep a step only if the objective does not decrease.
    """
    best = score.max(1).indices.cpu()  # = argmax(1) (first maximum), twice as fast on CPU here
    if torch.unique(best).numel() == best.numel():
        return best
    n = score.shape[0]
    if n > SPARSE_ASSIGNMENT_ABOVE and score.shape[1] == n:
        top = torch.topk(score, min(SPARSE_CANDIDATES, n), dim=1)
        perm = _sparse_assignment(top.values.cpu(), top.indices.cpu(), n)
        if perm is not None:
            return perm
    return _dense_assignment(score)


def _dense_assignment(score: torch.Tensor) -> torch.Tensor:
    rows, cols = linear_sum_assignment(score.detach().double().cpu().numpy(), maximize=True)
    perm = np.empty_like(cols)
    perm[rows] = cols
    return torch.as_tensor(perm, dtype=torch.long)


def _sparse_assignment(values: torch.Tensor, index: torch.Tensor, n: int) -> torch.Tensor | None:
    """Max-score perfect matching using only the candidate edges (row i → ``index[i]``, scores ``values[i]``)."""
    from scipy.sparse import csr_matrix
    from scipy.sparse.csgraph import min_weight_full_bipartite_matching

    rows = np.repeat(np.arange(n), index.shape[1])
    v = values.double().numpy().reshape(-1)
    cost = v.max() - v + 1.0  # positive costs: minimising cost maximises the score
    graph = csr_matrix((cost, (rows, index.numpy().reshape(-1))), shape=(n, n))
    try:
        _, cols = min_weight_full_bipartite_matching(graph)
    except ValueError:  # no perfect matching among the candidate edges
        return None
    return torch.as_tensor(cols, dtype=torch.long)


@contextlib.contextmanager
def one_thread(device: torch.device):
    """Run the block single-threaded on CPU. Used around the small dense decompositions (SVDs of
    d×d and of batches of d_h×d_h matrices): with 2 threads MKL's SVD took 2–4× longer than with
    one here (768×768 float64: 0.98 s against 0.28 s wall; 12 64×64: 0.031 s against 0.015 s)."""
    threads = torch.get_num_threads()
    if device.type != "cpu" or threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


_worker = threading.local()  # ``_worker.layer`` is True inside a :func:`per_layer` worker thread


class PartClock:
    """CPU seconds per named part of the matching steps, summed over threads: in a per-layer
    worker its own CPU time, elsewhere the process CPU time (all BLAS threads; no worker runs then)."""

    def __init__(self):
        self.cpu: dict[str, float] = {}
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def __call__(self, part: str):
        clock = time.thread_time if getattr(_worker, "layer", False) else time.process_time
        start = clock()
        try:
            yield
        finally:
            with self._lock:
                self.cpu[part] = self.cpu.get(part, 0.0) + clock() - start


def per_layer(step, layers: list, device: torch.device) -> list:
    """``[step(x) for x in layers]``; on CPU with n > 1 threads, n worker threads take one layer
    each, single-threaded. Valid because a layer's step reads and writes only that layer's tensors
    (checked by the caller), so the results equal the sequential ones; the parts of a step that
    run on one core anyway (``svdvals``, ``topk``, the sparse assignment) then use every core."""
    threads = torch.get_num_threads()
    if device.type != "cpu" or threads == 1 or len(layers) < 2:
        return [step(x) for x in layers]
    def in_worker(layer):
        _worker.layer = True
        return step(layer)

    with one_thread(device), ThreadPoolExecutor(threads) as pool:
        results = list(pool.map(in_worker, layers))
    heap.trim()  # memory the worker threads freed stays in their arenas otherwise (+0.29 GiB peak)
    return results


POLAR_BY_EIGH_FROM = 256  # square matrices from this size get their polar factor from eigh


def _decomposed_where(m: torch.Tensor) -> torch.device:
    """Where the SVD of ``m`` runs: a batch of small matrices on a GPU goes to the CPU. cuSOLVER
    decomposes such a batch (GPT-2 small: 144 head pairs of 64×64, float64) one matrix at a time:
    on an H200 the head step's ``svdvals`` took 20.2 of the 30.1 s of a GPT-2-small alignment
    (docs/scale.md, "On a GPU"). Unlike the CPU path's decompositions (:func:`one_thread`) these
    keep every thread: switching the thread count around each call made that alignment slower
    (7.1 → 10.1 s)."""
    return torch.device("cpu") if m.device.type != "cpu" and m.dim() > 2 else m.device


def procrustes(m: torch.Tensor, value: bool = False):
    """Orthogonal O maximising ``tr(Oᵀ M)``: ``O = U Vᵀ`` for ``M = U Σ Vᵀ`` (batched, float64);
    with ``value`` also the maximum ``‖M‖_* = Σ σ``. A single large M (the residual map) goes
    through :func:`_polar_by_eigh` when it is well conditioned."""
    if not value and m.dim() == 2 and m.shape[0] == m.shape[1] >= POLAR_BY_EIGH_FROM:
        o = _polar_by_eigh(m.double())
        if o is not None:
            return o.to(m.dtype)
    with one_thread(m.device):
        u, sv, vh = torch.linalg.svd(m.double().to(_decomposed_where(m)))
    o = (u @ vh).to(m.device, m.dtype)
    return (o, sv.sum(-1).to(m.device, m.dtype)) if value else o


def _polar_by_eigh(m: torch.Tensor) -> torch.Tensor | None:
    """``U Vᵀ`` of ``M = U Σ Vᵀ`` (float64, square) as ``M V Σ⁻¹ Vᵀ`` from ``Mᵀ M = V Σ² Vᵀ``: one
    symmetric eigendecomposition instead of an SVD (768×768, one thread: 0.07 against 0.17 CPU s),
    then one Newton–Schulz step ``O (3I − OᵀO) / 2`` that squares the orthogonality error.
    None (use the SVD) if ``σ_min < 1e-4 σ_max``: the round-off of Σ⁻¹ grows like (σ_max/σ_min)².
    Only the eigendecomposition runs single-threaded (:func:`one_thread`); the products use every
    BLAS thread."""
    gram = m.T @ m
    with one_thread(m.device):
        lam, v = torch.linalg.eigh(gram)
    if not bool(lam[0] > 1e-8 * lam[-1]):
        return None
    o = ((m @ v) * lam.rsqrt()) @ v.T
    eye = torch.eye(o.shape[0], dtype=o.dtype, device=o.device)
    return o @ (1.5 * eye - 0.5 * (o.T @ o))


def residual_procrustes(c: torch.Tensor, fix_ones: bool) -> torch.Tensor:
    """Orthogonal O maximising ``tr(Oᵀ C)``; with ``fix_ones`` (LayerNorm) among those with
    ``O·1 = 1``: ``O = 11ᵀ/d + Q R Qᵀ``, R the Procrustes map of ``Qᵀ C Q`` (Q: complement of 1)."""
    if not fix_ones:
        return procrustes(c)
    # Q = columns 2..d of the Householder reflection H (symmetric, orthogonal) with H e₁ = 1/√d:
    # Qᵀ C Q is the lower-right block of H C H and O = H diag(1, R) H — rank-one updates, O(d²),
    # instead of four d×d×d products with a dense basis (any orthonormal Q gives the same O)
    d = c.shape[0]
    u = torch.full((d,), d ** -0.5, dtype=torch.float64, device=c.device)
    u[0] -= 1.0
    beta = 2.0 / float(u @ u)

    def reflect_both_sides(x: torch.Tensor) -> torch.Tensor:  # H X H
        x = x - beta * torch.outer(u, u @ x)
        return x - beta * torch.outer(x @ u, u)

    hch = reflect_both_sides(c.double())
    block = torch.zeros_like(hch)
    block[0, 0] = 1.0
    block[1:, 1:] = procrustes(hch[1:, 1:])
    return reflect_both_sides(block).to(c.dtype)


def nuclear_norms(m: torch.Tensor) -> torch.Tensor:
    """``‖M‖_*`` (sum of singular values) of every matrix in the batch, computed in float64."""
    with one_thread(m.device):
        return torch.linalg.svdvals(m.double().to(_decomposed_where(m))).sum(-1).to(m.device, m.dtype)


def plane_procrustes(m: torch.Tensor, layout: str, rotary_dims: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Best per-plane rotations for ``max tr(Aᵀ M)`` with A block-rotational on rotary planes.

    For the plane (a, b): ``tr = cos θ (M_aa + M_bb) + sin θ (M_ba − M_ab)``, maximised at
    ``θ = atan2(M_ba − M_ab, M_aa + M_bb)`` with value ``hypot(·, ·)``. With partial rotary
    (``rotary_dims`` r_d < d_h) the position-free dims get the Procrustes map of their block,
    value its nuclear norm. Returns (A, value per head).
    """
    dh = m.shape[-1]
    rd = rotary_dims or dh
    planes = rotary_planes(dh, layout, rd).to(m.device)
    a, b = planes[:, 0], planes[:, 1]
    cos_part = m[..., a, a] + m[..., b, b]
    sin_part = m[..., b, a] - m[..., a, b]
    theta = torch.atan2(sin_part, cos_part)
    out = torch.zeros_like(m)
    c, s = torch.cos(theta), torch.sin(theta)
    out[..., a, a], out[..., a, b], out[..., b, a], out[..., b, b] = c, -s, s, c
    value = torch.hypot(cos_part, sin_part).sum(-1)
    if rd < dh:
        out[..., rd:, rd:], passthrough = procrustes(m[..., rd:, rd:], value=True)
        value = value + passthrough
    return out, value


def _unfold(x: torch.Tensor, axis: int) -> torch.Tensor:
    return x.movedim(axis, -1).reshape(-1, x.shape[axis])


class _Objective:
    """Weights w_p and the objective J for one reference."""

    def __init__(self, spec: SymmetrySpec, ref: dict, cand: dict, weighting: str, head_weight: float = 1.0):
        gains = {n.weight for n in spec.norms if n.weight}
        self.keys = sorted(k for k in spec.keys() if k not in gains)
        self.ref = ref
        self.w = {}
        blocks = {k for a in spec.attention for lin in (a.q, a.k, a.v, a.o) for k in (lin.weight, lin.bias)}
        blocks |= {k for m in spec.mlp for lin in (m.up, m.gate, m.down) if lin for k in (lin.weight, lin.bias)}
        heads = token_indexed_keys(spec, ref) - set(spec.embedding_keys) - blocks
        factor = {k: head_weight if k in heads else 1.0 for k in self.keys}
        for k in self.keys:
            if weighting == "cosine":
                denom = float(ref[k].norm()) * float(cand[k].norm())
                self.w[k] = 1.0 / denom if denom > 0 else 0.0
            elif weighting == "rms":
                denom = float(ref[k].norm()) * float(cand[k].norm())
                self.w[k] = ref[k].numel() / denom if denom > 0 else 0.0
            elif weighting == "uniform":
                self.w[k] = 1.0
            else:
                raise ValueError(f"weighting must be one of {WEIGHTINGS}, got {weighting!r}")
            self.w[k] *= factor[k]
        self.norm = {"cosine": float(sum(factor.values())),
                     "rms": float(sum(ref[k].numel() * factor[k] for k in self.keys))}.get(weighting, 1.0)
        #: keys whose terms the caller counts through ``free`` (kept unrotated, see weight_match)
        self.implicit: set = set()

    def contribution(self, key: str, tensor: torch.Tensor) -> float:
        ref = self.ref[key].to(tensor).reshape(-1)
        return self.w[key] * float(torch.dot(ref, tensor.reshape(-1)))

    def __call__(self, state: dict, previous: dict | None = None, residual: torch.Tensor | None = None,
                 free: torch.Tensor | None = None) -> tuple[float, dict]:
        """(J, per-key terms); with ``previous`` = (old state, old terms) only changed keys are recomputed.

        ``free`` = K₀ (d×d, see :meth:`_Matcher.free_covariance`) stands for the tensors that
        only the residual map O moves and that ``state`` leaves out: they add ``tr(Oᵀ K₀)``.
        """
        keys = [k for k in self.keys if k in state and k not in self.implicit]
        if previous is None:
            terms = {k: self.contribution(k, state[k]) for k in keys}
        else:
            old_state, old_terms = previous
            terms = {k: old_terms[k] if state[k] is old_state[k] else self.contribution(k, state[k]) for k in keys}
        total = sum(terms.values())
        if free is not None:
            total += float(torch.trace(free) if residual is None else (residual.to(free) * free).sum())
        return total / self.norm, terms


class _Matcher:
    def __init__(self, spec: SymmetrySpec, ref: dict, objective: _Objective, mode: str):
        self.spec, self.ref, self.J, self.mode = spec, ref, objective, mode
        self.w = objective.w  # per-tensor weights of the objective
        self.clock = PartClock()
        block = set()
        for a in spec.attention:
            block |= {a.q.weight, a.k.weight, a.v.weight, a.o.weight}
        for m in spec.mlp:
            block |= {lin.weight for lin in (m.up, m.gate, m.down) if lin}
        self.free_axes = [(k, ax) for k, ax in spec.residual if k not in block]
        self.fixed_ones = spec.norm_kind == "layernorm"
        counts = {}
        for k, _ in spec.residual:
            counts[k] = counts.get(k, 0) + 1
        #: keys that only the residual map moves (embeddings, head, residual biases): kept
        #: un-rotated during matching, their cross-covariance with the reference fixed (K₀)
        self.lazy = {k for k, _ in self.free_axes if counts[k] == 1}
        neuron_weights = {lin.weight for m in spec.mlp for lin in (m.up, m.gate, m.down) if lin}
        #: residual axes of the MLP weights (2-d, one residual axis each). :func:`weight_match`
        #: keeps these weights unrotated like the lazy keys, moved by neuron permutations only;
        #: their C (float64) changes by a few rows per permutation
        #: (:meth:`neuron_delta`) and joins K₀
        self.neuron_axes = [(k, ax) for k, ax in spec.residual
                            if k in neuron_weights and counts[k] == 1 and ref[k].dim() == 2]

    # -- residual ---------------------------------------------------------------------------
    def covariance(self, state: dict, axes) -> torch.Tensor | None:
        """``C = Σ_p w_p unfold(θ_p)ᵀ unfold(θ_ref,p)`` over ``axes`` (None if all weights are 0)."""
        c = None
        for key, axis in axes:
            if self.w[key] == 0:
                continue
            term = _unfold(state[key], axis).T @ _unfold(self.ref[key], axis).to(state[key])
            c = term * self.w[key] if c is None else c + term * self.w[key]
        return c

    def free_covariance(self, state: dict) -> torch.Tensor:
        """K₀ = C over the lazy keys at their unmoved values. After residual maps with product
        O, those tensors are ``θ_p ×_axis O``, their C is ``Oᵀ K₀`` and their J term ``tr(Oᵀ K₀)``:
        the big embedding products are computed once, not every iteration."""
        c = self.covariance(state, [(k, ax) for k, ax in self.free_axes if k in self.lazy])
        if c is None:
            first = state[self.spec.residual[0][0]]
            c = torch.zeros(self.spec.width, self.spec.width, dtype=first.dtype, device=first.device)
        return c

    def neuron_covariance(self, state: dict) -> torch.Tensor | None:
        """C over :attr:`neuron_axes` (float64; None if all their weights are 0)."""
        c = self.covariance(state, self.neuron_axes)
        return None if c is None else c.double()

    def neuron_delta(self, m: MLPSpec, before: dict, step: NeuronMap) -> torch.Tensor:
        """Change of :meth:`neuron_covariance` when ``step`` moves MLP ``m`` (row i of the new state
        = σ_i · row perm[i] of ``before``, σ = s for up rows, 1/s for down columns, 1 for the gate):
        only moved rows count, ``ΔC = Σ_i w (σ_i x_perm[i] − x_i)ᵀ r_i`` — a gather and a
        (moved × d × d) product."""
        d = self.spec.width
        first = before[self.neuron_axes[0][0]]
        delta = torch.zeros(d, d, dtype=torch.float64, device=first.device)
        perm = step.perm.to(first.device)
        moved = perm != torch.arange(perm.numel(), device=perm.device)
        scale = None if step.scale is None else step.scale.to(first.device, torch.float64)
        if scale is not None:
            moved |= scale != 1
        rows = moved.nonzero().flatten()
        factors = {m.up.weight: scale, m.down.weight: None if scale is None else 1.0 / scale}
        for key, axis in self.neuron_axes:
            if key not in {lin.weight for lin in (m.up, m.gate, m.down) if lin} or self.w[key] == 0:
                continue
            x = before[key].movedim(1 - axis, 0)  # (neurons, d): the unfolded rows
            r = self.ref[key].to(x).movedim(1 - axis, 0)
            new = x[perm[rows]].double()
            if factors.get(key) is not None:
                new = new * factors[key][rows, None]
            delta += ((new - x[rows].double()).T @ r[rows].double()) * self.w[key]
        return delta

    def residual_step(self, state: dict, axes=None, free: torch.Tensor | None = None,
                      residual: torch.Tensor | None = None) -> torch.Tensor:
        """Best residual map O for ``state`` (keys in ``axes``, default every residual axis of a
        key present in ``state``) plus, with ``free`` = K₀, the lazy tensors now at
        ``θ_p ×_axis residual``."""
        if axes is None:
            axes = [(k, ax) for k, ax in self.spec.residual if k in state]
        with self.clock("residual.covariance"):
            c = self.covariance(state, axes)
            if free is not None:
                moved = free if residual is None else residual.to(free).T @ free
                c = moved if c is None else c + moved
        with self.clock("residual.svd"):
            return self.orthogonal_map(c, state)

    def orthogonal_map(self, c: torch.Tensor | None, state: dict) -> torch.Tensor:
        """O maximising ``tr(Oᵀ C)`` in the group (Procrustes; LayerNorm: fixing 1; or a permutation)."""
        d = self.spec.width
        if c is None:
            first = next(iter(state.values()))
            return torch.eye(d, dtype=first.dtype, device=first.device)
        if self.mode == "permutation":
            perm = hungarian(c.T)  # reference dim j takes candidate dim perm[j]
            o = torch.zeros_like(c)
            o[perm.to(c.device), torch.arange(d, device=c.device)] = 1.0
            return o
        return residual_procrustes(c, self.fixed_ones)

    # -- heads ------------------------------------------------------------------------------
    def _head_factors(self, a: AttentionSpec, which: dict):
        """Per-head factors (heads, d_h, ·) of q, k, v (bias as an extra input column) and o, each
        scaled by √w so that products of reference and candidate factors carry the weight."""
        dh = a.head_dim

        def rows(lin, heads):
            w = which[lin.weight].reshape(heads, dh, -1) * (self.w[lin.weight] ** 0.5)
            if lin.bias:
                w = torch.cat([w, (which[lin.bias].reshape(heads, dh, 1) * (self.w[lin.bias] ** 0.5))], -1)
            return w

        o = which[a.o.weight].reshape(-1, a.num_heads, dh).permute(1, 2, 0) * (self.w[a.o.weight] ** 0.5)
        return {"q": rows(a.q, a.num_heads), "k": rows(a.k, a.kv_heads), "v": rows(a.v, a.kv_heads), "o": o}

    def head_step(self, a: AttentionSpec, state: dict) -> HeadMap:
        """Maximise J over (head permutation, within-head maps), O and MLPs fixed.

        For reference head i and candidate head j, ``M_qk[i, j] = Q_jᵀ Q_ref,i + K_jᵀ K_ref,i`` and
        ``M_ov[i, j] = V_jᵀ V_ref,i + O_j O_ref,iᵀ`` are d_h×d_h factor products (biases as extra
        rows; no d×d circuit is formed). The best within-head maps give the pair's value
        ``‖M_qk‖_* + ‖M_ov‖_*`` (per-plane values under RoPE), which — like the QK/OV circuit
        similarity — ignores the candidate's within-head basis; Hungarian on these values then
        Procrustes gives the joint optimum.

        Grouped-query attention (r = H/G query heads per key/value head): a pair of groups gets
        the query heads matched inside it by the same per-head values (Hungarian on r×r), then
        ``M_qk``/``M_ov`` sum the key/value term and the matched query/output terms; groups are
        matched on those values and share one map. (The r×r pairing uses each head's own best
        map, so this step is a heuristic for r > 1; the caller keeps it only if J does not drop.)
        """
        ref = self._head_factors(a, self.ref)
        cand = self._head_factors(a, state)
        ref = {k: v.to(cand[k]) for k, v in ref.items()}
        pair = lambda x, y: torch.einsum("jad,ibd->ijab", y, x)  # noqa: E731  (cand j rows) · (ref i rows)ᵀ
        rotary_ok = self.mode == "orthogonal" or not a.rotary
        r, G = a.group_size, a.kv_heads
        if r == 1:
            m_qk = pair(ref["q"], cand["q"]) + pair(ref["k"], cand["k"])
            m_ov = pair(ref["v"], cand["v"]) + pair(ref["o"], cand["o"])
            within = None
        else:
            m_q, m_o = pair(ref["q"], cand["q"]), pair(ref["o"], cand["o"])
            head_value = (self._pair_values(m_q, a, rotary_ok) + self._pair_values(m_o, None, True)).cpu()
            m_qk, m_ov = pair(ref["k"], cand["k"]), pair(ref["v"], cand["v"])
            within = torch.empty(G, G, r, dtype=torch.long)
            for gi in range(G):
                for gj in range(G):
                    p = hungarian(head_value[gi * r:(gi + 1) * r, gj * r:(gj + 1) * r])
                    within[gi, gj] = p
                    rows, cols = gi * r + torch.arange(r), gj * r + p
                    m_qk[gi, gj] += m_q[rows.to(m_q.device), cols.to(m_q.device)].sum(0)
                    m_ov[gi, gj] += m_o[rows.to(m_o.device), cols.to(m_o.device)].sum(0)
        gperm = hungarian(self._pair_values(m_qk, a, rotary_ok) + self._pair_values(m_ov, None, True))  # CPU
        chosen = lambda t: t[torch.arange(G, device=t.device), gperm.to(t.device)]  # noqa: E731
        qk = self._best_maps(chosen(m_qk), a, rotary_ok)
        ov = self._best_maps(chosen(m_ov), None, True)
        if within is None:
            return HeadMap(gperm, qk, ov)
        perm = (gperm[:, None] * r + within[torch.arange(G), gperm]).reshape(-1)
        return HeadMap(perm, qk, ov)

    def head_maps(self, a: AttentionSpec, state: dict) -> HeadMap:
        """Maximise J over the within-head maps alone, every candidate head kept on the reference
        head it faces now (identity permutation): ``M_qk[g] = K_gᵀ K_ref,g + Σ_{h∈g} Q_hᵀ Q_ref,h``
        and ``M_ov[g] = V_gᵀ V_ref,g + Σ_{h∈g} O_h O_ref,hᵀ`` (g: key/value group), then the maps
        of :meth:`_best_maps` — the G diagonal pairs of :meth:`head_step` only: no pair values,
        no assignment, H instead of H² factor products."""
        ref = self._head_factors(a, self.ref)
        cand = self._head_factors(a, state)
        ref = {k: v.to(cand[k]) for k, v in ref.items()}
        same = lambda x, y: torch.einsum("iad,ibd->iab", y, x)  # noqa: E731  the diagonal of head_step's pairs
        grouped = lambda m: m.reshape(a.kv_heads, a.group_size, *m.shape[1:]).sum(1)  # noqa: E731
        m_qk = same(ref["k"], cand["k"]) + grouped(same(ref["q"], cand["q"]))
        m_ov = same(ref["v"], cand["v"]) + grouped(same(ref["o"], cand["o"]))
        rotary_ok = self.mode == "orthogonal" or not a.rotary
        return HeadMap(torch.arange(a.num_heads), self._best_maps(m_qk, a, rotary_ok),
                       self._best_maps(m_ov, None, True))

    def _pair_values(self, m: torch.Tensor, attention: AttentionSpec | None, allow: bool) -> torch.Tensor:
        """``max_A tr(Aᵀ M[i, j])`` for every (ref i, cand j) pair over the within-head maps A
        allowed (``attention`` given: its rotary layout constrains A; None: any orthogonal A;
        ``allow`` False: A = identity). Orthogonal: the nuclear norm (singular values only —
        the maps are solved for the chosen pairs alone, see :meth:`_best_maps`)."""
        if not allow:  # permutation mode with RoPE: no within-head freedom
            return torch.diagonal(m, dim1=-2, dim2=-1).sum(-1)
        if self.mode == "permutation":
            return self._within_permutations(m)[0]
        if attention is not None and attention.rotary:
            return plane_procrustes(m, attention.rotary, attention.rotated)[1]
        with self.clock("heads.values"):
            return nuclear_norms(m)

    def _best_maps(self, m: torch.Tensor, attention: AttentionSpec | None, allow: bool) -> torch.Tensor | None:
        """The maximising maps A (batch, d_h, d_h) of :meth:`_pair_values` for a batch of M."""
        if not allow:
            return None
        if self.mode == "permutation":
            return self._within_permutations(m)[1]
        if attention is not None and attention.rotary:
            return plane_procrustes(m, attention.rotary, attention.rotated)[0]
        return procrustes(m)

    @staticmethod
    def _within_permutations(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Best within-head permutation matrices and values for every matrix in the batch ``m``."""
        flat = m.reshape(-1, *m.shape[-2:])
        dh = m.shape[-1]
        value = torch.empty(flat.shape[0], dtype=m.dtype, device=m.device)
        fit = torch.zeros_like(flat)
        cols = torch.arange(dh)
        for i, block in enumerate(flat):
            p = hungarian(block.T)  # ref dim b ← cand dim p[b]
            fit[i, p, cols] = 1.0
            value[i] = block[p.to(m.device), cols.to(m.device)].sum()
        return value.reshape(m.shape[:-2]), fit.reshape(m.shape)

    # -- MLP --------------------------------------------------------------------------------
    def neuron_step(self, m: MLPSpec, state: dict) -> NeuronMap:
        """Hungarian on ``score[i, j] = Σ_p w_p ⟨row i of θ_ref,p, row j of θ_p⟩`` over the tensors
        with a neuron axis (up/gate rows and biases, down columns).

        A gated MLP ``down(act(gate·x) ⊙ up·x)`` is unchanged when unit j's up row (and bias) and
        down column both change sign, so its units match as signed permutations (not in
        ``permutation`` mode, GLMC's group): ``score = G + |U|`` with G the gate's terms and U the
        up and down ones, and unit j flips where it is matched with ``U_ij < 0``. Off by default
        (:data:`SIGNED_GATED_UNITS`)."""
        with self.clock("mlp.score"):
            signed = SIGNED_GATED_UNITS and m.activation == "gated" and self.mode != "permutation"
            score = self.neuron_scores(m, state, linear_branch=True if signed else None)
            if signed:
                branch = score
                score = self.neuron_scores(m, state, linear_branch=False).add_(branch.abs())
        with self.clock("mlp.assignment"):
            perm = hungarian(score)
            if not signed:
                return NeuronMap(perm)
            flips = branch[torch.arange(perm.numel(), device=branch.device), perm.to(branch.device)] < 0
            return NeuronMap(perm, 1.0 - 2.0 * flips.cpu().double()) if bool(flips.any()) else NeuronMap(perm)

    def neuron_scores(self, m: MLPSpec, state: dict, linear_branch: bool | None = None) -> torch.Tensor:
        """The n×n score of :meth:`neuron_step`, accumulated tensor by tensor into one buffer
        (no concatenated copies: down columns enter as a transposed view, biases as rank one).
        ``linear_branch``: only the up and down terms (True) or only the gate's (False)."""
        ups = [(k, False) for k in (m.up.weight, m.up.bias) if k] + [(m.down.weight, True)]
        gates = [(k, False) for k in ((m.gate.weight, m.gate.bias) if m.gate else ()) if k]
        pieces = {None: ups[:-1] + gates + ups[-1:], True: ups, False: gates}[linear_branch]
        score = None
        for key, transpose in pieces:
            ref, cand = self.ref[key].to(state[key]), state[key]
            if transpose:
                ref, cand = ref.T, cand.T
            if cand.dim() == 1:
                score.addr_(ref, cand, alpha=self.w[key])  # a bias never comes first
            elif score is None:
                score = (ref.reshape(ref.shape[0], -1) @ cand.reshape(cand.shape[0], -1).T).mul_(self.w[key])
            else:
                score.addmm_(ref.reshape(ref.shape[0], -1), cand.reshape(cand.shape[0], -1).T, alpha=self.w[key])
        return score


def kind_of_state(spec: SymmetrySpec, state: dict) -> str:
    """What the model ``state`` holds is (:func:`~fedbasin.options.model_kind`): no token embedding, an image
    classifier; else a causal LM of its vocabulary's size."""
    vocab = int(state[spec.embedding_keys[0]].shape[0]) if spec.embedding_keys else None
    return model_kind("text" if vocab else "images", vocab)


def auto_head_weight(spec: SymmetrySpec, state: dict) -> float:
    """``head_weight`` ``auto`` for the model ``state`` holds: :data:`~fedbasin.options.HEAD_WEIGHT` of its kind."""
    return HEAD_WEIGHT[kind_of_state(spec, state)]


def weight_match(
    spec: SymmetrySpec,
    reference: dict,
    candidate: dict,
    mode: str = "orthogonal",
    iterations: int = 20,
    tol: float = 1e-4,
    weighting: str = "rms",
    init: GroupElement | None = None,
    progress: bool = False,
    token_rows: torch.Tensor | str | None = None,
    release: bool = False,
    head_weight: float = 1.0,
    like: dict | None = None,
    match: MatchOptions | None = None,
) -> MatchResult:
    """Align ``candidate`` to ``reference`` (raw state dicts of the same architecture).

    ``init``: an extra starting element (acting on the canonical candidate), e.g. the
    ``transform`` of a permutation-mode result; the start with the highest objective is used.

    Returns the candidate transformed by an exact group element (same function), in the
    reference's gauge, with the objective record. One iteration is a full sweep (head, MLP and
    residual steps) and ``INNER_SWEEPS`` maps-only sweeps (within-head maps, residual map); it
    stops when the relative gain of J per sweep over an iteration is below ``tol`` or after
    ``iterations`` iterations. Runs on the tensors' device.

    ``token_rows``: token ids whose rows count in the objective (e.g. the tokens seen in
    training); the other rows of token-indexed tensors (:func:`token_indexed_keys`) are left out
    of the matching — they are untrained noise — but transformed like the rest. The objective
    record then refers to the kept rows. A floating tensor of one weight per token (length
    vocabulary, e.g. :func:`token_weights` of the training tokens) instead weights row t's terms
    by ``w_t`` (rows with ``w_t = 0`` left out): the embedding term becomes an expectation over
    the training tokens rather than a sum over the vocabulary. ``"auto"``: the weights are inferred
    from the two models' weights alone (:func:`~fedbasin.alignment.token_rows.infer_token_rows`:
    P(row trained in both), from the tight cluster the untrained rows form at the init scale, times
    a data-free √count: rank^(−1/2) of the row's learned unigram logit (Zipf); all rows when no such
    cluster is found; no effect without token rows), and ``token_rows`` of the
    result records how many rows were judged trained. None: every row counts.

    Memory: besides its inputs, the match holds the candidate's current state and, while a
    residual step is tried, its successor (each about the size of the tensors that carry heads
    and neurons); the canonical copy of the candidate goes once the start point is chosen.
    ``release=True`` (the caller hands ``candidate`` over): the ``candidate`` dict is emptied
    once canonicalised, so its tensors go as soon as the match no longer needs them, and only
    ``canonical`` is returned (``state`` is an empty dict). Results are the same either way.

    ``head_weight``: factor on the objective weight of the output head over the vocabulary
    (see the module docstring; no effect on models without a token embedding); ``"auto"``: the
    measured best for what the model is (:func:`auto_head_weight`).
    ``like``: the reference's norm gains, whose tiny dims the aligned candidate folds alike
    (:func:`~fedbasin.alignment.canonical.fold_tiny`; default: ``reference``'s own; give the
    original gains when ``reference`` is already canonical, e.g. a universe): before matching
    where the candidate's own gain is small too (same basis, e.g. trained from the reference),
    and after it (aligned basis) everywhere.
    ``match``: the options schema's :class:`~fedbasin.options.MatchOptions` (``auto`` values are set
    for the model here); when given, its values replace ``mode``, ``iterations``, ``tol`` and ``head_weight``.
    """
    if match is not None:
        return weight_match(spec, reference, candidate, weighting=weighting, init=init, progress=progress,
                            token_rows=token_rows, release=release, like=like, **match_call(match))
    checked(MatchOptions(align_iterations=iterations, align_tol=tol, head_weight=head_weight))
    if head_weight == AUTO:
        head_weight = auto_head_weight(spec, reference)
    inferred = None
    if isinstance(token_rows, str):
        if token_rows != "auto":
            raise ValueError(f"token_rows must be ids, per-token weights, 'auto' or None, got {token_rows!r}")
        from .token_rows import infer_token_rows

        started = time.perf_counter()
        inferred = infer_token_rows(spec, reference, candidate)
        inferring = time.perf_counter() - started  # counted in the result's seconds
        token_rows = None if inferred is None or inferred.trained == inferred.vocab else inferred.weights
    if token_rows is not None:
        result = _match_on_token_rows(spec, reference, candidate, token_rows, mode=mode, iterations=iterations,
                                      tol=tol, weighting=weighting, init=init, progress=progress,
                                      release=release, head_weight=head_weight, like=like)
        if inferred is not None:
            result.token_rows = inferred.summary()
            result.seconds += inferring
            result.phases["token_rows"] = inferring
        return result
    if mode not in MODES:
        raise ValueError(f"symmetry mode must be one of {MODES}, got {mode!r}")
    t0, cpu_t0 = time.perf_counter(), time.process_time()
    check_compatible(spec, reference, candidate)
    dtypes = {k: v.dtype for k, v in candidate.items()}
    given = candidate
    reference, candidate = _at_least_float32(reference), _at_least_float32(candidate)
    ref_c = canonicalize(spec, reference, "reference", validate=False)  # no copy if already canonical
    cand_c = canonicalize(spec, candidate, "candidate", validate=False, like=like or ref_c.gains)
    del reference, candidate
    if release:
        given.clear()
    device = next(iter(cand_c.state.values())).device
    ref_state = {k: v.to(device) for k, v in ref_c.state.items()}
    J = _Objective(spec, ref_state, cand_c.state, weighting, head_weight)
    matcher = _Matcher(spec, ref_state, J, mode)
    initial, _ = J(cand_c.state)
    # tensors only the residual map moves stay unrotated until the end (see free_covariance)
    lazy = {k: cand_c.state[k] for k in matcher.lazy}
    free = matcher.free_covariance(cand_c.state)
    # so do the MLP weights (moved by neuron permutations only): their C, ``neurons`` below, is
    # kept up to date and joins K₀; the MLP step rotates a layer's weights when it scores them
    unrotated = {k for k, _ in matcher.neuron_axes} if UNROTATED_MLP else set()
    J.implicit = unrotated
    inner = dataclasses.replace(spec, residual=tuple(a for a in spec.residual
                                                     if a[0] not in lazy and a[0] not in unrotated))
    cand_inner = {k: v for k, v in cand_c.state.items() if k not in lazy}
    neurons = None  # C of the unrotated MLP weights (float64), set with the start point

    def fixed(delta: torch.Tensor | None = None) -> torch.Tensor:
        """K₀ + C of the unrotated MLP weights (+ ``delta``): C of everything ``inner`` leaves out."""
        if neurons is None:
            return free
        return free + (neurons if delta is None else neurons + delta).to(free)

    phases = dict.fromkeys(("setup", "heads", "mlp", "residual", "finish"), 0.0)
    cpu = dict.fromkeys(phases, 0.0)  # process CPU seconds (all threads): robust on a shared machine
    cpu_clock = [cpu_t0]

    def timed(phase: str, clock: float) -> float:
        if device.type == "cuda":  # the phase's kernels count to it, not to the next sync
            torch.cuda.synchronize(device)
        now = time.perf_counter()
        phases[phase] += now - clock
        cpu[phase] += time.process_time() - cpu_clock[0]
        cpu_clock[0] = time.process_time()
        return now

    disjoint = _layers_disjoint(spec)

    def layer_steps(step, layers):
        return per_layer(step, layers, device) if disjoint else [step(x) for x in layers]

    # ``point`` (the current state, set below) is advanced in place by the closures, so that no
    # frame holds an earlier state: a replaced layer's tensors go as soon as its step is taken
    def apply_each(factor: str, maps: list) -> None:
        """Apply layer i's map of ``factor`` (``heads`` or ``neurons``) in turn, each kept only if J
        does not fall."""
        nonlocal point, neurons
        moves = [factor == "heads" or layer_map.scale is not None
                 or not bool((layer_map.perm == torch.arange(layer_map.perm.numel())).all()) for layer_map in maps]
        deltas = [None] * len(maps)
        if factor == "neurons" and neurons is not None and disjoint:
            # the change of the unrotated MLP weights' C, per layer in parallel: a layer's weights
            # are the same now as when its step is applied (no other layer's step touches them)
            with matcher.clock("mlp.apply"):
                deltas = per_layer(lambda i, state=point.state: matcher.neuron_delta(spec.mlp[i], state, maps[i])
                                   if moves[i] else None, list(range(len(maps))), device)
        with matcher.clock("heads.apply" if factor == "heads" else "mlp.apply"), one_thread(device):
            for i, layer_map in enumerate(maps):
                if not moves[i]:
                    continue  # the identity: nothing moves
                step = GroupElement.identity(spec)
                getattr(step, factor)[i] = layer_map
                delta, deltas[i] = deltas[i], None
                if factor == "neurons" and neurons is not None and delta is None:
                    delta = matcher.neuron_delta(spec.mlp[i], point.state, layer_map)
                before = point
                point = point.try_step(inner, J, step, fixed(delta))
                if delta is not None and point is not before:
                    neurons += delta
                del before

    def layer_maps(step, layers, state: dict) -> list:
        """``step(layer, state)`` for every layer (``state`` is not kept once the maps exist)."""
        return layer_steps(lambda x: step(x, state), layers)

    def neuron_step(m: MLPSpec, state: dict) -> NeuronMap:
        """The MLP step on the layer's weights as they stand: the unrotated ones rotated first."""
        o = point.g.residual
        keys = [k for lin in (m.up, m.gate, m.down) if lin for k in (lin.weight, lin.bias) if k]
        layer = {k: state[k] for k in keys if k in state}
        with matcher.clock("mlp.rotate"):
            for key, axis in matcher.neuron_axes:
                if key in layer and key in unrotated and o is not None:
                    layer[key] = contract_axis(layer[key], axis, o.to(layer[key]))
        return matcher.neuron_step(m, layer)

    def residual_step() -> None:
        nonlocal point
        step = GroupElement.identity(spec)
        step.residual = matcher.residual_step(point.state, inner.residual, free=fixed(), residual=point.g.residual)
        with matcher.clock("residual.apply"):
            point = point.try_step(inner, J, step, fixed())

    def iterate() -> None:
        nonlocal point
        clock = time.perf_counter()
        cpu_clock[0] = time.process_time()
        # each layer's step reads only its own tensors: all layers from the same state, in parallel
        # when the layers share no tensor (identical to the sequential loop), then applied in turn
        # (applying one layer's step is small, memory-bound work: single-threaded); the state the
        # maps were computed from is not held while they are applied (its replaced layers go)
        apply_each("heads", layer_maps(matcher.head_step, spec.attention, point.state))
        clock = timed("heads", clock)
        apply_each("neurons", layer_maps(neuron_step, spec.mlp, point.state))
        clock = timed("mlp", clock)
        residual_step()
        clock = timed("residual", clock)
        for _ in range(INNER_SWEEPS if spec.attention else 0):
            apply_each("heads", layer_maps(matcher.head_maps, spec.attention, point.state))
            clock = timed("heads", clock)
            residual_step()
            clock = timed("residual", clock)

    # two starts: identity (right for models fine-tuned from a common parent) and the residual map
    # fitted on the tensors without head/neuron axes (independent inits); keep the higher J
    starts = [("identity", GroupElement.identity(spec))]
    if matcher.free_axes:
        g0 = GroupElement.identity(spec)
        # the lazy tensors' part of C is K₀ (computed once above), the rest of the free axes is small
        g0.residual = matcher.residual_step(cand_c.state, [a for a in matcher.free_axes if a[0] not in lazy], free=free)
        starts.append(("free-residual", g0))
    if init is not None:
        starts.append(("given", init))
    start_name, point = None, None
    unmoved = None  # C of the unrotated MLP weights for starts without neuron maps (computed once)
    for name, g0 in starts:  # one start state at a time; the first of equal ones wins
        state0 = apply_group(inner, cand_inner, g0)
        own = None
        if unrotated:
            if any(n is not None for n in g0.neurons):
                own = matcher.neuron_covariance(state0)
            else:
                unmoved = matcher.neuron_covariance(state0) if unmoved is None else unmoved
                own = unmoved
        neurons = own
        tried = _Point(state0, g0, *J(state0, residual=g0.residual, free=fixed()))
        if point is None or tried.value > point.value:
            start_name, point, kept = name, tried, own
        del state0, tried
    neurons = kept
    del unmoved, own, kept
    order = list(cand_c.state)  # the candidate's key order
    del cand_c, cand_inner  # the canonical candidate: what the start point does not use goes
    objective = [point.value]
    elapsed = [time.perf_counter() - t0]
    timed("setup", t0)

    bar = progress_bar(iterations, progress, "weight matching", "it")
    done = 0
    sweeps = 1 + (INNER_SWEEPS if spec.attention else 0)  # sweeps per iteration: tol is per sweep
    while done < iterations:
        before = point.value
        iterate()
        objective.append(point.value)
        elapsed.append(time.perf_counter() - t0)
        done += 1
        bar.update(1)
        if point.value - before <= sweeps * tol * max(abs(before), 1e-12):
            break
    bar.close()
    clock = time.perf_counter()
    cpu_clock[0] = time.process_time()
    g = point.g
    state = dict(point.state)
    del point
    for key, axis in spec.residual:
        if key in lazy or key in unrotated:
            moved = lazy.pop(key) if key in lazy else state.pop(key)  # the unrotated tensor goes once rotated
            state[key] = moved if g.residual is None else contract_axis(moved, axis, g.residual.to(moved))
            del moved
    state = {k: state[k] for k in order}
    state = fold_tiny(spec, state, like or ref_c.gains)
    aligned = {} if release else {k: v.to(dtypes[k]) for k, v in to_gauge(spec, state, ref_c.gains).items()}
    canonical = {k: v.to(dtypes[k]) for k, v in state.items()}
    del state
    timed("finish", clock)
    return MatchResult(
        token_rows=None if inferred is None else inferred.summary(),
        state=aligned,
        canonical=canonical,
        transform=g,
        objective=objective,
        initial_objective=initial,
        seconds=time.perf_counter() - t0 + (0.0 if inferred is None else inferring),
        iterations=done,
        start=start_name,
        elapsed=elapsed,
        phases={**phases, **{f"{k}_cpu": v for k, v in cpu.items()},
                **{f"{k}_cpu": v for k, v in sorted(matcher.clock.cpu.items())}},
    )


def _layers_disjoint(spec: SymmetrySpec) -> bool:
    """True if no two attention layers and no two MLPs share a tensor (then per-layer steps commute)."""
    def keys(lins):
        return [k for lin in lins if lin for k in (lin.weight, lin.bias) if k]

    for groups in ([keys((a.q, a.k, a.v, a.o)) for a in spec.attention],
                   [keys((m.up, m.gate, m.down)) for m in spec.mlp]):
        flat = [k for g in groups for k in g]
        if len(flat) != len(set(flat)):
            return False
    return True


def token_weights(token_ids: torch.Tensor, vocab: int, weighting: str = "sqrt") -> torch.Tensor:
    """Per-token weights (vocab,) for :func:`weight_match`'s ``token_rows`` from the training
    tokens' counts ``n_t``: ``"seen"`` 1[n_t > 0], ``"sqrt"`` √n_t, ``"count"`` n_t (each scaled to
    mean 1 over the seen tokens)."""
    if weighting not in TOKEN_WEIGHTINGS:
        raise ValueError(f"token weighting must be one of {TOKEN_WEIGHTINGS}, got {weighting!r}")
    counts = torch.bincount(torch.as_tensor(token_ids).reshape(-1).long(), minlength=vocab)[:vocab].double()
    w = {"seen": (counts > 0).double(), "sqrt": counts.sqrt(), "count": counts}[weighting]
    seen = counts > 0
    return w / w[seen].mean() if bool(seen.any()) else w


def _match_on_token_rows(spec, reference, candidate, token_rows, **options) -> MatchResult:
    """Match on the kept token rows only, then apply the group element found to the full candidate."""
    t0 = time.perf_counter()
    keys = token_indexed_keys(spec, reference)
    if not keys:
        raise ValueError("token_rows given but the model has no token embedding")
    vocab = reference[spec.embedding_keys[0]].shape[0]
    token_rows = torch.as_tensor(token_rows)
    scale = None
    if token_rows.is_floating_point():  # one weight per token: keep the weighted rows, scaled by √w
        w = token_rows.double()
        if w.shape != (vocab,) or not bool(torch.isfinite(w).all()) or bool((w < 0).any()):
            raise ValueError(f"token weights must be {vocab} finite values >= 0, got shape {tuple(w.shape)}")
        token_rows = w.nonzero().flatten()
        scale = w[token_rows].sqrt()
    rows = token_rows.long()
    if rows.numel() == 0 or int(rows.min()) < 0 or int(rows.max()) >= vocab:
        raise ValueError(f"token_rows must be non-empty ids in [0, {vocab})")

    def kept(state):
        out = {k: v.index_select(0, rows.to(v.device)) if k in keys else v for k, v in state.items()}
        if scale is not None:  # both models' rows scaled by √w_t: each row's term counts w_t times
            out.update({k: out[k] * scale.to(out[k])[:, None] for k in keys})
        return out

    release = options.pop("release", False)
    small = weight_match(spec, kept(reference), kept(candidate), **options)
    dtypes = {k: v.dtype for k, v in candidate.items()}
    gains = canonicalize(spec, _at_least_float32(reference), "reference", validate=False).gains
    cand_c = canonicalize(spec, _at_least_float32(candidate), "candidate", validate=False,
                          like=options.get("like") or gains)
    if release:
        candidate.clear()
    state = fold_tiny(spec, apply_group(spec, cand_c.state, small.transform), options.get("like") or gains)
    del cand_c
    small.state = {} if release else {k: v.to(dtypes[k]) for k, v in to_gauge(spec, state, gains).items()}
    small.canonical = {k: v.to(dtypes[k]) for k, v in state.items()}
    small.seconds = time.perf_counter() - t0
    return small


def _at_least_float32(state: dict) -> dict:
    """fp16/bf16 tensors as float32: maps are found and applied in float32, rounded once at the end."""
    return {k: v.float() if v.is_floating_point() and v.element_size() < 4 else v for k, v in state.items()}


@dataclass
class _Point:
    """Current candidate state, the group element that produced it, J and its per-key terms."""

    state: dict
    g: GroupElement
    value: float
    terms: dict

    def try_step(self, spec: SymmetrySpec, J: _Objective, step: GroupElement, free=None) -> "_Point":
        """Move by ``step`` only if J does not decrease (exact maximisers can lose to round-off)."""
        state = apply_group(spec, self.state, step)
        g = compose(self.g, step)
        value, terms = J(state, (self.state, self.terms), g.residual, free)
        if value >= self.value:
            return _Point(state, g, value, terms)
        return self
