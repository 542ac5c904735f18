"""Learned refinement of an alignment on proxy data (DESIGN §8).

Starting from the weight-matching solution, every candidate k gets free parameters that are
projected onto the group in each forward pass, so the merged model is always an exact element
of the symmetry orbit:

* orthogonal maps by the Cayley transform ``O = (I − S)(I + S)⁻¹`` of a skew-symmetric S
  (residual map; LayerNorm models rotate only the complement of 1; per-head QK/OV maps; under
  RoPE one angle per rotary plane);
* permutations (heads, MLP neurons) by Hungarian projection of a free score matrix Z with a
  straight-through gradient (forward: the hard permutation, backward: d/dZ as if P = Z), or by
  a Sinkhorn relaxation ``P = sinkhorn(Z / τ)`` during training, hardened at the end.

The loss is taken at ``θ(λ) = λ₀ θ_ref + Σ_k λ_k T_k(θ_k)`` with ``λ ~ Dirichlet(α·1)`` (two
models: ``λ₀ ~ U(0.4, 0.6)``) through ``torch.func.functional_call`` — the models stay frozen.
Three disjoint proxy splits keep the result honest: the optimiser sees only the *training*
batches; the hard alignment is scored at the centroid on a *selection* split every
``eval_every`` steps and the best one seen (the start included) is returned, so refinement never
returns something worse than its start on that split; an optional *evaluation* split, never
used for any decision, reports the loss of the start and of the returned alignment.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fedbasin.data.task import Split
from fedbasin.models.weights import weightless_copy

from .canonical import canonicalize, to_gauge
from .group import (
    GroupElement,
    HeadMap,
    NeuronMap,
    apply_group,
    compose,
    group_head_perm,
    ones_complement,
    per_query_head,
    plane_rotations,
)
from .matching import MODES, hungarian, one_thread, progress_bar, token_indexed_keys, weight_match
from .merge import average_states, merge
from .spec import SymmetrySpec, check_compatible


def cayley(skew_params: torch.Tensor) -> torch.Tensor:
    """Orthogonal ``(I − S)(I + S)⁻¹`` for ``S = A − Aᵀ`` (batched over leading dims)."""
    s = skew_params - skew_params.transpose(-1, -2)
    eye = torch.eye(s.shape[-1], dtype=s.dtype, device=s.device).expand_as(s)
    return torch.linalg.solve(eye + s, eye - s, left=False)


def sinkhorn(log_alpha: torch.Tensor, iterations: int = 20) -> torch.Tensor:
    """Doubly-stochastic matrix from log scores by alternate row/column normalisation."""
    for _ in range(iterations):
        log_alpha = log_alpha - torch.logsumexp(log_alpha, dim=-1, keepdim=True)
        log_alpha = log_alpha - torch.logsumexp(log_alpha, dim=-2, keepdim=True)
    return log_alpha.exp()


def permutation_matrix(perm: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """P with ``P[i, perm[i]] = 1``, so ``(P X)[i] = X[perm[i]]``."""
    n = perm.numel()
    out = torch.zeros(n, n, dtype=dtype)
    out[torch.arange(n), perm] = 1.0
    return out


def project_permutation(scores: torch.Tensor, method: str, tau: float, hard: bool) -> torch.Tensor:
    """Permutation matrix from free scores: straight-through Hungarian or (soft) Sinkhorn."""
    hard_p = permutation_matrix(hungarian(scores), scores.dtype).to(scores.device)
    if hard:
        return hard_p
    if method == "sinkhorn":
        return sinkhorn(scores / tau)
    return hard_p + scores - scores.detach()  # straight-through: forward hard, gradient as if P = Z


GROUPS = ("orthogonal", "invertible")


class _Delta(nn.Module):
    """Free parameters of one model's correction g_Δ (identity at initialisation).

    ``group="orthogonal"``: Cayley rotations for the residual and per-head QK/OV maps (RoPE: one
    angle per rotary plane). ``group="invertible"`` keeps the orthogonal residual map (the only
    maps that commute with the norms) and enlarges the exact per-head and per-neuron freedoms:
    ``A = exp(X)``, ``A⁻ᵀ = exp(−Xᵀ)`` for QK (RoPE: ``A = e^ρ·R(φ)`` per rotary plane, the maps
    commuting with every position rotation, ``A⁻ᵀ = e^−ρ·R(φ)``), ``B = exp(Y)``, ``B⁻ᵀ = exp(−Yᵀ)``
    for OV, and positive neuron scalings ``s = exp(σ)`` for ReLU MLPs (other activations are not
    positively homogeneous: no scaling). ``permutations="fixed"`` keeps the start's permutations.

    Grouped-query attention (G key/value heads, r = H/G query heads each): the QK and OV maps
    belong to the G groups (``q_i ← q_i A_g``, ``k_g ← k_g A_g⁻ᵀ``, ``v_g ← v_g B_g``, output block
    of every query head i of group g ``← B_g⁻¹ o_i``), and the head permutation is
    ``P = (P_G ⊗ I_r)·blockdiag(T_0 … T_{G−1})``: T_g reorders the query heads inside group g, P_G
    moves whole groups (and the key/value heads). Partial rotary (r_d < d_h rotating dims): the
    rotary planes get (scaled) rotations as above and the d_h − r_d position-free dims one free
    block, Cayley (orthogonal group) or ``exp(X)`` with dual ``exp(−Xᵀ)`` (invertible group).
    """

    def __init__(self, spec: SymmetrySpec, state: dict, permutations: str, init_scale: float,
                 group: str = "orthogonal"):
        if group not in GROUPS:
            raise ValueError(f"group must be one of {GROUPS}, got {group!r}")
        super().__init__()
        d = spec.width
        dtype = next(v.dtype for v in state.values() if v.is_floating_point())
        self.spec, self.permutations, self.invertible = spec, permutations, group == "invertible"
        self.fix_ones = spec.norm_kind == "layernorm"
        inner = d - 1 if self.fix_ones else d
        self.residual = nn.Parameter(torch.zeros(inner, inner, dtype=dtype))
        learn_perms = permutations != "fixed"
        self.head_scores = nn.ParameterList()  # (G, G): key/value groups (= heads without GQA)
        self.within_scores = nn.ParameterDict()  # layer → (G, r, r): query heads inside a group (GQA)
        self.qk = nn.ParameterList()  # (G, d_h, d_h), or under RoPE one angle per plane (G, r_d/2)
        self.qk_log_scale = nn.ParameterList()  # RoPE planes, invertible group only
        self.qk_passthrough = nn.ParameterDict()  # layer → (G, d_h−r_d, d_h−r_d): partial rotary
        self.ov = nn.ParameterList()
        for i, a in enumerate(spec.attention):
            G, r, dh, rd = a.kv_heads, a.group_size, a.head_dim, a.rotated
            if learn_perms:
                self.head_scores.append(nn.Parameter(torch.eye(G, dtype=dtype) * init_scale))
                if r > 1:
                    self.within_scores[str(i)] = nn.Parameter(torch.eye(r, dtype=dtype).repeat(G, 1, 1) * init_scale)
            self.qk.append(nn.Parameter(torch.zeros((G, rd // 2) if a.rotary else (G, dh, dh), dtype=dtype)))
            if self.invertible and a.rotary:
                self.qk_log_scale.append(nn.Parameter(torch.zeros(G, rd // 2, dtype=dtype)))
            if a.rotary and rd < dh:
                self.qk_passthrough[str(i)] = nn.Parameter(torch.zeros(G, dh - rd, dh - rd, dtype=dtype))
            self.ov.append(nn.Parameter(torch.zeros(G, dh, dh, dtype=dtype)))
        self.neuron_scores = nn.ParameterList(
            nn.Parameter(torch.eye(state[m.up.weight].shape[0], dtype=dtype) * init_scale)
            for m in (spec.mlp if learn_perms else ())
        )
        self.scaled_mlps = [i for i, m in enumerate(spec.mlp) if self.invertible and m.activation == "relu"]
        self.neuron_log_scale = nn.ParameterList(
            nn.Parameter(torch.zeros(state[spec.mlp[i].up.weight].shape[0], dtype=dtype)) for i in self.scaled_mlps
        )

    def head_parameters(self) -> list:
        """The per-head maps' parameters (QK and OV maps, RoPE scales, partial-rotary blocks)."""
        families = (self.qk, self.qk_log_scale, self.qk_passthrough.values(), self.ov)
        return [p for family in families for p in family]

    def residual_map(self) -> torch.Tensor:
        o = cayley(self.residual)
        if not self.fix_ones:
            return o
        d = self.spec.width
        q = ones_complement(d, o.dtype).to(o.device)
        return torch.full((d, d), 1.0 / d, dtype=o.dtype, device=o.device) + q @ o @ q.T

    def _free_map(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(M, M⁻ᵀ) of the group from free square matrices: Cayley (M⁻ᵀ = M) or ``exp``."""
        if not self.invertible:
            m = cayley(x)
            return m, m
        return torch.linalg.matrix_exp(x), torch.linalg.matrix_exp(-x.transpose(-1, -2))

    def within_head(self, i: int):
        """(A, A⁻ᵀ, B, B⁻ᵀ) of layer i, each (G, d_h, d_h): one map per key/value group."""
        a = self.spec.attention[i]
        ov, ov_dual = self._free_map(self.ov[i])
        if not a.rotary:
            return (*self._free_map(self.qk[i]), ov, ov_dual)
        passthrough = passthrough_dual = None
        if str(i) in self.qk_passthrough:
            passthrough, passthrough_dual = self._free_map(self.qk_passthrough[str(i)])
        if not self.invertible:
            qk = plane_rotations(self.qk[i], a.head_dim, a.rotary, passthrough=passthrough)
            return qk, qk, ov, ov_dual
        scale = self.qk_log_scale[sum(1 for b in self.spec.attention[:i] if b.rotary)].exp()
        qk = plane_rotations(self.qk[i], a.head_dim, a.rotary, scale, passthrough)
        qk_dual = plane_rotations(self.qk[i], a.head_dim, a.rotary, 1.0 / scale, passthrough_dual)
        return qk, qk_dual, ov, ov_dual

    def head_permutations(self, i: int, tau: float, hard: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(P over the H query heads, P_G over the G key/value heads) of layer i as matrices,
        ``P = (P_G ⊗ I_r)·blockdiag(T_g)`` (= P_G without grouped-query attention)."""
        a = self.spec.attention[i]
        G, r = a.kv_heads, a.group_size
        p_kv = self._perm(self.head_scores, i, G, tau, hard)
        if r == 1:
            return p_kv, p_kv
        if self.permutations == "fixed":
            return torch.eye(a.num_heads, dtype=p_kv.dtype, device=p_kv.device), p_kv
        within = [project_permutation(z, self.permutations, tau, hard) for z in self.within_scores[str(i)]]
        eye = torch.eye(r, dtype=p_kv.dtype, device=p_kv.device)
        return torch.kron(p_kv, eye) @ torch.block_diag(*within), p_kv

    def hard_head_perm(self, i: int) -> torch.Tensor:
        """The query-head permutation (H,) that :meth:`head_permutations` projects to."""
        a = self.spec.attention[i]
        if self.permutations == "fixed":
            return torch.arange(a.num_heads)
        groups = hungarian(self.head_scores[i])
        if a.group_size == 1:
            return groups
        within = torch.stack([hungarian(z) for z in self.within_scores[str(i)]])
        return group_head_perm(groups, within[groups])  # T acts before P_G: slot g holds old group groups[g]

    def _perm(self, scores: nn.ParameterList, i: int, n: int, tau: float, hard: bool):
        if self.permutations == "fixed":
            return torch.eye(n, dtype=self.residual.dtype, device=self.residual.device)
        return project_permutation(scores[i], self.permutations, tau, hard)

    def neuron_scale(self, i: int) -> torch.Tensor | None:
        return self.neuron_log_scale[self.scaled_mlps.index(i)].exp() if i in self.scaled_mlps else None

    def hard_element(self) -> GroupElement:
        """The exact group element the current parameters project to."""
        with torch.no_grad():
            heads, neurons = [], []
            for i, a in enumerate(self.spec.attention):
                qk, qk_dual, ov, ov_dual = (m.clone() for m in self.within_head(i))
                heads.append(HeadMap(self.hard_head_perm(i), qk, ov, qk_dual if self.invertible else None,
                                     ov_dual if self.invertible else None))
            for i, m in enumerate(self.spec.mlp):
                scale = self.neuron_scale(i)
                if self.permutations != "fixed":
                    perm = hungarian(self.neuron_scores[i])
                elif scale is not None:
                    perm = torch.arange(scale.numel())
                else:
                    neurons.append(None)
                    continue
                neurons.append(NeuronMap(perm, None if scale is None else scale.clone()))
            return GroupElement(self.residual_map().clone(), heads, neurons)

    def transform(self, state: dict, tau: float, hard: bool = False) -> dict:
        """Differentiable ``g_Δ · state`` (permutations as matrices so gradients reach the scores)."""
        out = dict(state)
        moves = self.permutations != "fixed"  # fixed permutations are the identity: their products are skipped
        for i, a in enumerate(self.spec.attention):
            H, G, dh = a.num_heads, a.kv_heads, a.head_dim
            p, p_kv = self.head_permutations(i, tau, hard)
            qk, qk_dual, ov, ov_dual = self.within_head(i)
            for lin, heads, perm, m in ((a.q, H, p, per_query_head(qk, a)), (a.k, G, p_kv, qk_dual),
                                        (a.v, G, p_kv, ov)):
                w = out[lin.weight].reshape(heads, dh, -1)
                w = torch.einsum("hg,gjd->hjd", perm, w) if moves else w
                out[lin.weight] = torch.einsum("hji,hjd->hid", m, w).reshape(heads * dh, -1)
                if lin.bias:
                    b = out[lin.bias].reshape(heads, dh)
                    b = perm @ b if moves else b
                    out[lin.bias] = torch.einsum("hj,hji->hi", b, m).reshape(heads * dh)
            w = out[a.o.weight].reshape(-1, H, dh)
            w = torch.einsum("hg,dgj->dhj", p, w) if moves else w
            out[a.o.weight] = torch.einsum("dhj,hji->dhi", w, per_query_head(ov_dual, a)).reshape(w.shape[0], H * dh)
        for i, m in enumerate(self.spec.mlp):
            p = self._perm(self.neuron_scores, i, out[m.up.weight].shape[0], tau, hard) if moves else None
            scale = self.neuron_scale(i)
            for lin in (m.up, m.gate):
                if lin is not None:
                    if moves:
                        out[lin.weight] = p @ out[lin.weight]
                        if lin.bias:
                            out[lin.bias] = p @ out[lin.bias]
                    if scale is not None:  # ReLU: W_1[:, i] *= s_i (torch rows), b_1[i] *= s_i
                        out[lin.weight] = out[lin.weight] * scale[:, None]
                        if lin.bias:
                            out[lin.bias] = out[lin.bias] * scale
            down = out[m.down.weight] @ p.T if moves else out[m.down.weight]
            out[m.down.weight] = down if scale is None else down / scale
        o = self.residual_map()
        for key, axis in self.spec.residual:
            out[key] = (out[key].movedim(axis, -1) @ o).movedim(-1, axis)
        return out


Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass
class RefineResult:
    """states: refined candidates (reference's gauge, same functions as the inputs);
    canonical: the same in canonical form; transforms: g_k with canonical_k = g_k · canon(θ_k);
    history: (step, selection-split score of the hard alignment: its loss at the centroid, or for two
    models averaged over ``selection_lambdas``); best_step: the step whose alignment is returned (0 = the weight-matching start, i.e. no improvement).
    initial_loss / best_loss: selection-split loss of the start / of the returned alignment;
    evaluation_initial_loss / evaluation_loss: the same on the evaluation split (NaN without one),
    which no decision ever looked at. reference_canonical / reference_transform: the canonical
    reference the candidates are aligned to and g_ref with it = g_ref · canon(θ_ref) (the identity
    unless universe matching or ``dual`` moved the reference); start_mode: the weight-matching mode the
    refinement started from; workers: the threads that shared each batch (``batch_workers``)."""

    states: list[dict]
    canonical: list[dict]
    transforms: list[GroupElement]
    history: list[tuple[int, float]] = field(default_factory=list)
    initial_loss: float = float("nan")
    best_loss: float = float("nan")
    best_step: int = 0
    seconds: float = 0.0
    evaluation_initial_loss: float = float("nan")
    evaluation_loss: float = float("nan")
    reference_canonical: dict | None = None
    reference_transform: GroupElement | None = None
    start_mode: str = ""
    workers: int = 1
    diverged_step: int = 0  # the step whose loss or maps became non-finite (training stopped there); 0: none

    @property
    def improved(self) -> bool:
        """Whether any refined alignment beat the weight-matching start on the selection split."""
        return self.best_step > 0

    def summary(self) -> dict:
        """JSON-ready record; says plainly when refinement returned its start unchanged."""
        out = keep_best_record(self, "refinement", "the weight-matching start", "maps")
        if self.start_mode:
            out["start"] = self.start_mode
        out["batch_workers"] = self.workers
        return out


def check_step_options(steps, eval_every, **positive) -> None:
    """Refuse a bad optimisation budget: ``steps`` an integer >= 0, ``eval_every`` >= 1, and each
    ``positive`` value a finite number > 0 (shared by refinement and distillation)."""
    for name, value in (("steps", steps), ("eval_every", eval_every)):
        if isinstance(value, bool) or not isinstance(value, int) or value < (name == "eval_every"):
            raise ValueError(f"{name} must be an integer >= {int(name == 'eval_every')}, got {value!r}")
    for name, value in positive.items():
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
            raise ValueError(f"{name} must be a finite number > 0, got {value!r}")


def keep_best_record(result, what: str, start: str, learned: str) -> dict:
    """The keep-best fields shared by refinement and distillation results: selection loss at the
    start and at the kept step, the kept step, the evaluation split's losses when measured, the
    step where training diverged (if it did), and a ``note`` saying so and when ``start`` came back."""
    out = {"selection_loss_start": result.initial_loss, "selection_loss_best": result.best_loss,
           "best_step": result.best_step, "improved": result.improved, "seconds": round(result.seconds, 3)}
    if not np.isnan(result.evaluation_loss):
        out.update(evaluation_loss_start=result.evaluation_initial_loss, evaluation_loss=result.evaluation_loss)
    notes = []
    if result.diverged_step:
        out["diverged_step"] = result.diverged_step
        notes.append(f"{what} diverged at step {result.diverged_step} (non-finite loss or {learned}; a lower "
                     "learning rate avoids it) and stopped there")
    if not result.improved:
        notes.append(f"{what} could not improve on {start} (best_step 0): it is returned unchanged")
    if notes:
        out["note"] = "; ".join(notes)
    return out


@dataclass
class ProxyStreams:
    """Disjoint proxy data for :func:`learned_refine`: an endless shuffled training stream, and the
    selection and evaluation splits as lists of batches."""

    batches: Iterable[Batch]
    selection: list[Batch]
    evaluation: list[Batch] | None


class TrainingStream:
    """Endless training batches of ``split`` (a :class:`fedbasin.data.Split`): epoch after epoch,
    each in a new random order drawn from one generator seeded with ``seed``."""

    def __init__(self, split, batch_size: int, seed: int = 0):
        self.split, self.batch_size, self.seed = split, batch_size, seed
        self._batches = self._endless()

    def _endless(self) -> Iterator[Batch]:
        generator = torch.Generator().manual_seed(self.seed)
        while True:
            yield from self.split.batches(self.batch_size, generator=generator)

    def __iter__(self) -> TrainingStream:
        return self

    def __next__(self) -> Batch:
        return next(self._batches)

    def relabelled(self, targets: torch.Tensor) -> TrainingStream:
        """A fresh stream (the batch order of this one's start) of the same inputs with ``targets``."""
        return TrainingStream(dataclasses.replace(self.split, targets=targets), self.batch_size, self.seed)


#: soft labels are refused above this size (the mixed models' probabilities on the training part)
SOFT_LABEL_BYTES = 1 << 30


def split_share_problem(selection_fraction: float, evaluation_fraction: float) -> str | None:
    """Why these proxy split shares are refused (None if they are fine): the selection share must be
    > 0, the evaluation share >= 0, and the two below 1 together, so that some examples train."""
    if 0 < selection_fraction and 0 <= evaluation_fraction and selection_fraction + evaluation_fraction < 1:
        return None
    return "needs a selection share > 0, an evaluation share >= 0, and both below 1 together (the rest trains)"


def proxy_streams(proxy, batch_size: int, seed: int = 0, selection_fraction: float = 0.2,
                  evaluation_fraction: float = 0.2, eval_batch_size: int = 256) -> ProxyStreams:
    """Split ``proxy`` (a :class:`fedbasin.data.Split`) into training / selection / evaluation parts
    (evaluation may be 0: then ``evaluation`` is None); the training part as a
    :class:`TrainingStream`."""
    if problem := split_share_problem(selection_fraction, evaluation_fraction):
        raise ValueError(f"proxy split shares selection {selection_fraction!r}, evaluation {evaluation_fraction!r}: "
                         f"{problem}")
    rest, selection = proxy.split(selection_fraction, seed=seed)
    evaluation = None
    if evaluation_fraction > 0:
        share = evaluation_fraction / (1.0 - selection_fraction)
        rest, evaluation = rest.split(share, seed=seed + 1)
        evaluation = list(evaluation.batches(eval_batch_size))
    return ProxyStreams(TrainingStream(rest, batch_size, seed), list(selection.batches(eval_batch_size)), evaluation)


def _as_batches(data) -> list[Batch]:
    """One ``(inputs, targets)`` batch or a list of them → a list."""
    if isinstance(data, tuple) and len(data) == 2 and isinstance(data[0], torch.Tensor):
        return [data]
    return list(data)


def learned_refine(
    spec: SymmetrySpec,
    model: nn.Module,
    reference: dict,
    candidates: list[dict],
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    batches: Iterable[Batch],
    selection: Batch | list[Batch],
    evaluation: Batch | list[Batch] | None = None,
    steps: int = 100,
    lr: float = 1e-2,
    mode: str = "orthogonal",
    permutations: str = "ste",
    alpha: float = 1.0,
    tau: float = 0.1,
    eval_every: int = 10,
    seed: int = 0,
    match_iterations: int = 20,
    match_tol: float = 1e-4,
    weighting: str = "rms",
    include_reference: bool = True,
    universe_iterations: int = 1,
    token_rows: torch.Tensor | None = None,
    to_module_state: Callable[[dict], dict] | None = None,
    progress: bool = False,
    group: str = "orthogonal",
    lambda_range: tuple[float, float] = (0.4, 0.6),
    schedule: str = "constant",
    dual: bool = False,
    selection_lambdas: tuple[float, ...] = (0.5,),
    head_weight: float = 1.0,
    start: str = "weights",
    start_batches: int = 4,
    vocabulary: torch.Tensor | None = None,
    vocabulary_samples: int = 0,
    vocabulary_batch_samples: int = 0,
    soft_labels: float = 0.0,
    soft_label_top_k: int = 0,
    batch_workers: int = 0,
    head_lr: float | None = None,
    model_labels: bool = False,
) -> RefineResult:
    """Refine the alignment of ``candidates`` to ``reference`` on proxy data.

    model: any module of the architecture (its parameters are not used or changed);
    loss_fn(outputs, targets): scalar (mean) loss; batches: an (endless or long enough) iterable of
    ``(inputs, targets)`` training batches; selection: a batch or list of batches, disjoint from
    the training ones, on which keep-best chooses; evaluation: optional batches disjoint from
    both, only reported (see :func:`proxy_streams`). ``mode`` (``"permutation"``, ``"orthogonal"``
    or ``"best"``: both, keeping the one with the lower selection loss), ``match_iterations`` and
    ``match_tol`` apply to the weight-matching start; ``permutations``: ``"ste"``, ``"sinkhorn"`` or
    ``"fixed"`` (the start's permutations are kept; only the continuous maps learn).
    ``group``: ``"orthogonal"`` or ``"invertible"`` (per-head invertible QK/OV maps and ReLU neuron
    scalings, see :class:`_Delta`). ``lambda_range``: two models train at ``λ₀ ~ U(lo, hi)``.
    ``schedule``: ``"constant"`` or ``"cosine"`` (learning rate decays to 0 over ``steps``).
    ``selection_lambdas``: two models are scored (selection and evaluation splits) by the mean loss
    at ``λ₀`` in this tuple (default the midpoint); more models at their centroid.
    ``dual=True`` lets the reference carry a learned transform as well (both endpoints move toward
    a shared path; the moved reference is ``reference_canonical``; the same path from the unmoved
    reference has the candidate ``apply_group(spec, canonical[0], inverse(reference_transform))``,
    as ``fedbasin align --refine-dual`` writes it).
    ``start``: ``"weights"`` (weight matching in ``mode``) or ``"activations"``
    (:func:`~fedbasin.alignment.activations.activation_match` on the first ``start_batches`` training
    batches, which are trained on as well; with ``mode="best"`` it competes with both weight-matching
    starts on the selection split).
    ``vocabulary``: token ids (language models); the *training* loss is computed as if the model's
    vocabulary were only these tokens — embedding and output-head rows of the others are left out
    before the transform, inputs and targets are renumbered — so the softmax costs |vocabulary|
    instead of V per token. Keep-best and the reported losses stay exact (full vocabulary). A
    training token outside it is refused. With every token it is the full loss.
    ``vocabulary_samples`` = k: each step the softmax also covers k tokens drawn from outside the
    vocabulary, their logits raised by ``log(m/k)`` (m outside tokens): a sampled estimate of the
    probability mass the restricted softmax would otherwise drop (:class:`_TrainingVocabulary`).
    ``vocabulary_batch_samples`` = k: each step the vocabulary itself is sampled the same way — the
    step's own tokens exactly, and k of the vocabulary's other tokens with their logits raised by
    ``log(m'/k)`` — so a step's softmax costs |batch tokens| + k (+ ``vocabulary_samples``) rows.
    ``soft_labels`` = w > 0: the maps train on ``(1 − w)·one-hot(y) + w·p̄(x)`` instead of the
    labels, p̄ the mixed models' mean predicted probabilities (their ensemble; each endpoint keeps
    its function, so p̄ is computed once, on the training part of ``batches``, which must then be
    a :class:`TrainingStream`; ``loss_fn`` must accept probability targets, as
    :func:`fedbasin.training.cross_entropy` does). Keep-best and the reported losses use the labels.
    ``soft_label_top_k`` = k > 0 keeps each target's k largest entries as sparse (id, weight) pairs,
    the mass they leave trained as one bucket of the unlisted tokens (``cross_entropy``): the targets
    then take N·k·8 bytes instead of N·C·4 (a GPT-2's 50,257-way probabilities on 1,000 blocks of 128
    tokens would take 24 GiB; k = 32 takes 31 MiB), and they
    combine with a training ``vocabulary``: p̄ is then the softmax over its tokens (computed on their
    rows only), and a step's weight on tokens outside its rows joins that bucket.
    ``batch_workers`` = n > 1 (0: one per torch CPU thread; always 1 on a GPU): each training
    batch is cut into n slices whose forward and backward passes run at once on n threads, and the
    selection, evaluation and labelling batches are shared among them (:class:`_Workers`); the
    gradient is ``Σ_i (n_i/n)·∇L_i`` (``loss_fn`` is a mean over the batch's examples), equal to the
    whole batch's up to rounding.
    ``head_lr``: Adam's learning rate for the per-head maps (:meth:`_Delta.head_parameters`); the
    residual map, neuron scalings and permutation scores keep ``lr`` (None: ``lr`` for all).
    ``model_labels``: the proxy's own targets are not used: training, keep-best and the report all
    score p̄, the mixed models' mean predictions (soft labels of weight 1, sparse with
    ``soft_label_top_k``; ``soft_labels`` stays 0). For inputs without labels, e.g. the synthetic
    token streams of :func:`fedbasin.data.unigram_blocks` (data-free alignment).
    ``include_reference=False`` leaves the reference out of the mixture and the scored centroid
    (it is then only the alignment target, like the previous global model in a federated round).
    ``to_module_state`` maps a standard-layout state to the module's own keys (an adapter's
    ``from_standard``; it must be differentiable). Outputs with a ``.logits`` field are unwrapped.
    """
    if permutations not in ("ste", "sinkhorn", "fixed"):
        raise ValueError(f"permutations must be 'ste', 'sinkhorn' or 'fixed', got {permutations!r}")
    if group not in GROUPS:
        raise ValueError(f"group must be one of {GROUPS}, got {group!r}")
    if schedule not in ("constant", "cosine"):
        raise ValueError(f"schedule must be 'constant' or 'cosine', got {schedule!r}")
    if mode not in (*MODES, "best"):
        raise ValueError(f"symmetry mode must be one of {(*MODES, 'best')}, got {mode!r}")
    lo, hi = (float(v) for v in lambda_range)
    if not 0.0 <= lo <= hi <= 1.0:
        raise ValueError(f"lambda_range must satisfy 0 <= lo <= hi <= 1, got {lambda_range!r}")
    if not selection_lambdas or not all(0.0 <= float(v) <= 1.0 for v in selection_lambdas):
        raise ValueError(f"selection_lambdas must be a non-empty tuple of values in [0, 1], got {selection_lambdas!r}")
    if start not in ("weights", "activations"):
        raise ValueError(f"start must be 'weights' or 'activations', got {start!r}")
    if start == "activations" and mode == "permutation":
        raise ValueError("start='activations' finds an orthogonal residual map: use mode 'orthogonal' or 'best'")
    if start == "activations" and universe_iterations > 1:
        raise ValueError("start='activations' aligns each candidate to the reference: universe_iterations must be 1")
    if isinstance(start_batches, bool) or not isinstance(start_batches, int) or start_batches < 1:
        raise ValueError(f"start_batches must be an integer >= 1, got {start_batches!r}")
    if not (isinstance(soft_labels, (int, float)) and 0.0 <= soft_labels <= 1.0):
        raise ValueError(f"soft_labels must be a number in [0, 1], got {soft_labels!r}")
    if model_labels:
        if soft_labels:
            raise ValueError("model_labels already trains on the models' predictions alone: leave soft_labels at 0")
        soft_labels = 1.0
    if vocabulary_batch_samples and (vocabulary is None or soft_labels):
        raise ValueError("vocabulary_batch_samples needs a training vocabulary and hard labels (no soft_labels)")
    if soft_labels and not isinstance(batches, TrainingStream):
        raise ValueError("soft_labels needs the training stream of proxy_streams (a TrainingStream): its "
                         "examples are labelled once, before training")
    if isinstance(soft_label_top_k, bool) or not isinstance(soft_label_top_k, int) or soft_label_top_k < 0:
        raise ValueError(f"soft_label_top_k must be an integer >= 0 (0: every class), got {soft_label_top_k!r}")
    if soft_labels and vocabulary is not None and not soft_label_top_k:
        raise ValueError("soft_labels over every class cannot be combined with a training vocabulary: "
                         "give soft_label_top_k (sparse targets)")
    if isinstance(batch_workers, bool) or not isinstance(batch_workers, int) or batch_workers < 0:
        raise ValueError(f"batch_workers must be an integer >= 0 (0: one per CPU thread), got {batch_workers!r}")
    if dual and not include_reference:
        raise ValueError("dual=True moves the reference along the path: it needs include_reference=True")
    if not candidates:
        raise ValueError("learned refinement needs at least one candidate")
    check_step_options(steps, eval_every, lr=lr, alpha=alpha, tau=tau, **({} if head_lr is None else {"head_lr": head_lr}))
    if not _as_batches(selection):
        raise ValueError("learned refinement: the selection split is empty (keep-best needs data to choose on)")
    t0 = time.perf_counter()
    for i, c in enumerate(candidates):
        check_compatible(spec, reference, c, ("reference", f"candidate {i}"))
    ref_c = canonicalize(spec, reference, "reference", validate=False)
    device = next(iter(ref_c.state.values())).device
    workers = _Workers(model, device, batch_workers)
    frozen = workers.modules[0]
    members = len(candidates) + int(include_reference)
    selection = [(x.to(device), y.to(device)) for x, y in _as_batches(selection)]
    evaluation = None if evaluation is None else [(x.to(device), y.to(device)) for x, y in _as_batches(evaluation)]
    module_state = to_module_state or (lambda state: state)

    def mixture(lam, ref_state, states) -> dict:
        """``Σ_i λ_i θ_i`` over the mixed models (the reference first when it takes part)."""
        models = ([ref_state] if include_reference else []) + list(states)
        return {k: sum(w * m[k] for w, m in zip(lam, models)) if v.is_floating_point() else v
                for k, v in ref_state.items()}

    def forward(state: dict, x: torch.Tensor, module: nn.Module = frozen) -> torch.Tensor:
        out = torch.func.functional_call(module, module_state(state), (x,))
        return out if isinstance(out, torch.Tensor) else out.logits

    # two models are scored along the path at selection_lambdas; more at their centroid
    score_weights = [[lam, 1.0 - lam] for lam in selection_lambdas] if members == 2 else [[1.0 / members] * members]

    def centroid_loss(ref_state, states, split: list[Batch]) -> float:
        """Example-weighted mean loss over a split's batches, averaged over the scored mixtures."""
        total = 0.0
        for lam in score_weights:
            state = mixture(lam, ref_state, states)
            with torch.no_grad():
                total += sum(workers.map(lambda module, b, state=state: float(loss_fn(forward(state, b[0], module), b[1])) * len(b[1]),
                                         split))
        return total / sum(len(y) for _, y in split) / len(score_weights)

    def matched(match_mode: str):
        """(re-aligned reference match or None, candidate matches) of the weight-matching start."""
        if universe_iterations > 1:
            universe = merge(spec, [reference, *candidates], [float(include_reference)] + [1.0] * len(candidates),
                             0, match_mode, match_iterations, match_tol, universe_iterations=universe_iterations,
                             weighting=weighting, token_rows=token_rows, head_weight=head_weight)
            found = universe.matches
            # the reference is re-aligned to the universe too when the merge returns its match
            return (found[0], found[1:]) if len(found) > len(candidates) else (None, found)
        return None, [weight_match(spec, reference, c, mode=match_mode, iterations=match_iterations, tol=match_tol,
                                   weighting=weighting, token_rows=token_rows, head_weight=head_weight) for c in candidates]

    def reference_of(ref_start) -> dict:
        return {k: v.detach() for k, v in (ref_start.canonical if ref_start else ref_c.state).items()}

    # with worker threads everything from here runs single-threaded, so a given batch_workers gives the
    # same figures on any thread count
    with workers.serial():
        vocab = None if vocabulary is None else _TrainingVocabulary(spec, ref_c.state, vocabulary, vocabulary_samples,
                                                                      seed + 1, vocabulary_batch_samples)
        if soft_labels:
            mixed = [reference] * include_reference + list(candidates)

            def label(split):
                return _soft_labels(split, mixed, workers, soft_labels, device, forward, soft_label_top_k, vocab)

            batches = batches.relabelled(label(batches.split))
            if model_labels:  # keep-best and the report score the models' predictions too
                selection = _relabelled(selection, label)
                evaluation = None if evaluation is None else _relabelled(evaluation, label)
        iterator = iter(batches)
        options = []
        if start == "activations":
            from .activations import activation_match

            first = list(itertools.islice(iterator, start_batches))
            iterator = itertools.chain(first, iterator)  # the start's batches are training batches too
            found = [activation_match(spec, frozen, reference, c, first, to_module_state) for c in candidates]
            options.append((centroid_loss(ref_c.state, [s.canonical for s in found], selection), "activations", None, found))
        for match_mode in (("permutation", "orthogonal") if mode == "best" else (mode,) if start == "weights" else ()):
            ref_start, starts = matched(match_mode)
            loss = centroid_loss(reference_of(ref_start), [s.canonical for s in starts], selection)
            options.append((loss, match_mode, ref_start, starts))
        initial, start_mode, ref_start, starts = min(options, key=lambda o: o[0])
        ref_state = reference_of(ref_start)
        base = [s.canonical for s in starts]
        movers = [ref_state] * dual + base  # the models that carry a learned transform
        deltas = nn.ModuleList(_Delta(spec, b, permutations, init_scale=1.0, group=group) for b in movers).to(device)
        optimiser = torch.optim.Adam(_parameter_groups(deltas, lr, head_lr), lr=lr)
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimiser, (lambda i: 1.0) if schedule == "constant" else (lambda i: 0.5 * (1 + math.cos(math.pi * i / max(steps, 1)))))
        rng = np.random.default_rng(seed)  # private: the caller's torch RNG stream is left alone

        def split_members(states, reference_state=ref_state):
            """(reference state, candidate states) from the moved models."""
            return (states[0], states[1:]) if dual else (reference_state, states)

        fixed_rows = vocab is not None and vocab.fixed  # the restricted rows never change: cut them once
        if fixed_rows:
            cut_movers, cut_ref = [vocab.restrict(b, vocab.ids) for b in movers], vocab.restrict(ref_state, vocab.ids)

        best_states, best_elements = movers, [GroupElement.identity(spec) for _ in movers]
        best = initial
        result = RefineResult([], [], [], initial_loss=initial, start_mode=start_mode)
        if evaluation is not None:
            result.evaluation_initial_loss = centroid_loss(ref_state, base, evaluation)
        result.history.append((0, initial))
        bar = progress_bar(steps, progress, "learned refinement", "step")
        # a single model's loss does not depend on its alignment: nothing to refine
        for step in range(1, steps + 1 if members > 1 else 1):
            x, y = next(iterator)
            x, y, train_movers, train_ref, correction = x.to(device), y.to(device), movers, ref_state, None
            if fixed_rows:
                x, y = vocab.renumber(x), vocab.renumber(y)
                train_movers, train_ref = cut_movers, cut_ref
            elif vocab is not None:
                rows, correction, x, y = vocab.draw(x, y)
                train_movers, train_ref = [vocab.restrict(b, rows) for b in movers], vocab.restrict(ref_state, rows)
            if members == 2:
                first = rng.uniform(lo, hi)
                lam = [first, 1.0 - first]
            else:
                lam = rng.dirichlet([alpha] * members).tolist()
            moved_ref, moved = split_members([d.transform(b, tau) for d, b in zip(deltas, train_movers)], train_ref)
            optimiser.zero_grad(set_to_none=True)
            loss = workers.backward(lambda logits, y, c=correction: loss_fn(logits if c is None else logits + c.to(logits), y),
                                    forward, mixture(lam, moved_ref, moved), x, y)
            optimiser.step()
            scheduler.step()
            if not all_finite(loss, deltas.parameters()):  # diverged: keep the best alignment scored so far
                result.diverged_step = step
                break
            bar.update(1)
            if progress:  # loss.item() synchronises with the device: only when shown
                bar.set_postfix(loss=f"{loss.item():.4f}", best=f"{best:.4f}")
            if step % eval_every == 0 or step == steps:
                elements = [d.hard_element() for d in deltas]
                hard = [apply_group(spec, b, g) for b, g in zip(movers, elements)]
                value = centroid_loss(*split_members(hard), selection)
                result.history.append((step, value))
                if value < best:
                    best, best_states, best_elements, result.best_step = value, hard, elements, step
    bar.close()
    best_ref, result.canonical = split_members(best_states)
    result.states = [to_gauge(spec, s, ref_c.gains) for s in result.canonical]
    ref_element, cand_elements = (best_elements[0], best_elements[1:]) if dual else (None, best_elements)
    result.transforms = [compose(s.transform, g) for s, g in zip(starts, cand_elements)]
    result.best_loss = best
    result.reference_canonical = best_ref
    ref_transform = ref_start.transform if ref_start else GroupElement.identity(spec)
    result.reference_transform = ref_transform if ref_element is None else compose(ref_transform, ref_element)
    if evaluation is not None:
        result.evaluation_loss = (result.evaluation_initial_loss if result.best_step == 0
                                  else centroid_loss(best_ref, result.canonical, evaluation))
    result.seconds = time.perf_counter() - t0
    result.workers = workers.count
    workers.close()
    return result


def all_finite(loss: torch.Tensor, parameters) -> bool:
    """Whether the step's loss and every learned parameter after it are finite (one device sync)."""
    flags = [torch.isfinite(loss).all()] + [torch.isfinite(p).all() for p in parameters]
    return bool(torch.stack(flags).all())


def _parameter_groups(deltas: nn.ModuleList, lr: float, head_lr: float | None) -> list:
    """Adam's parameter groups: the per-head maps at ``head_lr``, everything else at ``lr``."""
    if head_lr is None:
        return [{"params": list(deltas.parameters())}]
    heads = [p for d in deltas for p in d.head_parameters()]
    chosen = {id(p) for p in heads}
    return [{"params": [p for p in deltas.parameters() if id(p) not in chosen]}, {"params": heads, "lr": head_lr}]


class _Workers:
    """Model passes on ``count`` CPU threads at once (see :func:`learned_refine`'s ``batch_workers``).

    Each thread gets its own weightless copy of the model, since ``functional_call`` swaps a
    module's tensors in place and one module cannot serve two threads; torch runs single-threaded
    inside (:func:`~fedbasin.alignment.matching.one_thread`). Small passes side by side use the
    cores better than one pass with intra-op threads: a CIFAR-10 ViT (width 96, 65 tokens) forward
    and backward on 64 images took 0.078 s wall as two slices of 32 on 2 threads, 0.116 s with 2
    intra-op threads and 0.157 s on one (2-core AMD EPYC; ``python -m
    fedbasin.simulations.bench_workers``)."""

    def __init__(self, model: nn.Module, device: torch.device, count: int = 0):
        if device.type != "cpu":
            count = 1
        self.count, self.device = count or torch.get_num_threads(), device
        self.modules = []
        for _ in range(self.count):  # the states bring the weights; RoPE tables follow them
            module = weightless_copy(model, device).eval()
            for p in module.parameters():
                p.requires_grad_(False)
            self.modules.append(module)
        self.pool = ThreadPoolExecutor(self.count) if self.count > 1 else None

    def map(self, fn: Callable[[nn.Module, object], object], items) -> list:
        """``[fn(module, item) for item in items]``: thread j takes items j, j + n, … with module j."""
        items = list(items)
        n = min(self.count, len(items))
        if n < 2:
            return [fn(self.modules[0], item) for item in items]
        def thread(j: int) -> list:
            torch.set_num_threads(1)  # per thread: the main thread's setting does not reach the pool's threads
            return [fn(self.modules[j], item) for item in items[j::n]]

        with one_thread(self.device):
            done = [c.result() for c in [self.pool.submit(thread, j) for j in range(n)]]
        return [done[i % n][i // n] for i in range(len(items))]

    def backward(self, loss_fn, forward, state: dict, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Back-propagate ``loss_fn(forward(state, x), y)`` into whatever ``state`` was computed
        from; returns the (detached) loss. With n > 1 slices, each thread differentiates
        ``(n_i/n)·L(slice_i)`` with respect to detached copies of the state's differentiable tensors,
        and their gradients, summed in slice order, continue the backward pass from ``state``."""
        slices = min(self.count, len(y))
        if slices < 2:
            loss = loss_fn(forward(state, x), y)
            loss.backward()
            return loss.detach()
        keys = [k for k, v in state.items() if v.requires_grad]
        leaves = {k: v.detach().requires_grad_(k in keys) for k, v in state.items()}

        def one_slice(module, part):
            xs, ys = part
            loss = loss_fn(forward(leaves, xs, module), ys) * (len(ys) / len(y))
            return loss.detach(), torch.autograd.grad(loss, [leaves[k] for k in keys], allow_unused=True)

        done = self.map(one_slice, zip(x.tensor_split(slices), y.tensor_split(slices)))
        grads = [sum(g[i] for _, g in done if g[i] is not None) for i in range(len(keys))]
        used = [i for i, g in enumerate(grads) if isinstance(g, torch.Tensor)]
        torch.autograd.backward([state[keys[i]] for i in used], [grads[i] for i in used])
        return sum(loss for loss, _ in done)

    def serial(self):
        """Context: torch single-threaded while worker threads are in use (a no-op with one)."""
        return one_thread(self.device) if self.count > 1 else contextlib.nullcontext()

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown()


def _soft_labels(split, states: list[dict], workers: _Workers, weight: float, device, forward,
                 top_k: int = 0, vocabulary: _TrainingVocabulary | None = None) -> torch.Tensor:
    """``t = (1 − w)·one-hot(y) + w·p̄(x)`` for every example of ``split``, p̄ the mean softmax of
    ``forward(state, x, module)`` (logits) over ``states``. ``top_k`` = k > 0 keeps each target's k
    largest entries as (class id, weight) pairs of shape (…, k, 2); their weights are not renormalised:
    the mass they leave is the unlisted classes' bucket of :func:`fedbasin.training.cross_entropy`.
    With a training ``vocabulary`` (sparse targets only) p̄ is the softmax over its tokens (their rows
    only: |vocabulary| instead of V logits per token), the ids stay the full model's. Targets over
    :data:`SOFT_LABEL_BYTES` are refused."""
    if vocabulary is not None:
        states = [vocabulary.restrict(state, vocabulary.ids) for state in states]

    def target_of(module, batch):
        x, y = batch[0].to(device), batch[1].to(device)
        if vocabulary is not None:
            x, y = vocabulary.renumber(x), vocabulary.renumber(y)
        p = None
        for state in states:  # summed in this order, each term divided first: the figures do not depend on batching
            term = forward(state, x, module).float().softmax(-1) / len(states)
            p = term if p is None else p + term
        t = (1.0 - weight) * F.one_hot(y, p.shape[-1]).to(p) + weight * p
        if not top_k:
            return t.cpu()
        values, ids = t.topk(min(top_k, t.shape[-1]), dim=-1)
        if vocabulary is not None:
            ids = vocabulary.ids.to(ids.device)[ids]
        return torch.stack([ids.to(values), values], -1).cpu()

    with torch.no_grad():
        first = next(split.batches(1))[0].to(device)  # the model's input: the split's transform applied
        classes = forward(states[0], first if vocabulary is None else vocabulary.renumber(first),
                          workers.modules[0]).shape[-1]
        per_example = split.targets[:1].numel()
        size = len(split) * per_example * (min(top_k, classes) * 8 if top_k else classes * 4)
        if size > SOFT_LABEL_BYTES:
            raise ValueError(f"soft_labels: the targets of {len(split)} training examples would take "
                             f"{size / 2**30:.1f} GiB (limit {SOFT_LABEL_BYTES / 2**30:.0f} GiB): use fewer proxy "
                             "examples" + (", a smaller top-k" if top_k else " or sparse top-k targets"))
        # a labelling batch's dense probabilities stay under 128 MiB per thread
        rows = max(1, min(256, (128 << 20) // (per_example * classes * 4)))
        return torch.cat(workers.map(target_of, split.batches(rows)))


def _relabelled(batches: list[Batch], label: Callable[[Split], torch.Tensor]) -> list[Batch]:
    """The same inputs, batch for batch, with the targets ``label`` gives for them all at once."""
    split = Split(torch.cat([x.cpu() for x, _ in batches]), torch.cat([y.cpu() for _, y in batches]))
    targets = label(split).split([len(y) for _, y in batches])
    return [(x, t.to(x.device)) for (x, _), t in zip(batches, targets)]


class _TrainingVocabulary:
    """The token set of the *training* loss (see :func:`learned_refine`'s ``vocabulary``).

    The token-indexed rows (embedding, output head; :func:`token_indexed_keys`) are cut to the
    kept tokens, whose ids become 0 … n−1, so the model computes exactly the full model's logits
    at those tokens. With ``samples`` = k > 0, each step also draws k of the m tokens outside the
    vocabulary (uniformly, without replacement) and adds ``log(m/k)`` to their logits: the
    softmax's normaliser then contains ``(m/k)·Σ_sampled e^z``, an unbiased estimate of the
    outside tokens' share ``Σ_outside e^z`` (the uniform-proposal sampled softmax); k = m is the
    full softmax. With ``batch_samples`` = k' > 0 the vocabulary is sampled the same way each step: the
    step's own tokens (inputs and targets) exactly, then k' of the vocabulary's other m' tokens with
    ``log(m'/k')`` added. Inputs and targets must lie in the vocabulary (else ``ValueError``).
    """

    def __init__(self, spec: SymmetrySpec, state: dict, vocabulary, samples: int = 0, seed: int = 0,
                 batch_samples: int = 0):
        self.keys = token_indexed_keys(spec, state)
        if not self.keys:
            raise ValueError("vocabulary given but the model has no token embedding")
        size = state[spec.embedding_keys[0]].shape[0]
        ids = torch.as_tensor(vocabulary).reshape(-1)
        if ids.is_floating_point() or ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= size:
            raise ValueError(f"vocabulary must be non-empty integer token ids in [0, {size})")
        for name, value in (("vocabulary_samples", samples), ("vocabulary_batch_samples", batch_samples)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        self.ids = torch.unique(ids.long())
        self.lookup = torch.full((size,), -1, dtype=torch.long)
        self.lookup[self.ids] = torch.arange(self.ids.numel())
        inside = torch.zeros(size, dtype=torch.bool)
        inside[self.ids] = True
        self.outside = torch.nonzero(~inside).flatten()
        self.samples = min(samples, self.outside.numel())
        self.batch_samples = batch_samples
        self.generator = torch.Generator().manual_seed(seed)

    @property
    def fixed(self) -> bool:
        """Whether every step uses the same rows (the whole vocabulary, nothing sampled)."""
        return not (self.samples or self.batch_samples)

    def _sample(self, pool: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """k tokens of ``pool`` drawn uniformly without replacement, and their logit correction log(m/k)."""
        k = min(k, pool.numel())
        drawn = pool[torch.randperm(pool.numel(), generator=self.generator)[:k]]
        return drawn, torch.full((k,), math.log(pool.numel() / k) if k else 0.0)

    def draw(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(token ids of this step's rows, the logit correction of each row, x and y renumbered to the rows)."""
        x, y = self.renumber(x), self.renumber(y)  # also refuses tokens outside the vocabulary
        if self.batch_samples:
            used = torch.zeros(self.ids.numel(), dtype=torch.bool)
            used[torch.cat([x.reshape(-1), y.reshape(-1)]).cpu()] = True
            rest, correction = self._sample(self.ids[~used], self.batch_samples)
            rows, corrections = [self.ids[used], rest], [torch.zeros(int(used.sum())), correction]
            local = torch.full((self.ids.numel(),), -1, dtype=torch.long)
            local[used] = torch.arange(int(used.sum()))
            x, y = local.to(x.device)[x], local.to(y.device)[y]
        else:
            rows, corrections = [self.ids], [torch.zeros(self.ids.numel())]
        if self.samples:
            drawn, correction = self._sample(self.outside, self.samples)
            rows.append(drawn)
            corrections.append(correction)
        return torch.cat(rows), torch.cat(corrections), x, y

    def restrict(self, state: dict, ids: torch.Tensor) -> dict:
        return {k: v.index_select(0, ids.to(v.device)) if k in self.keys else v for k, v in state.items()}

    def renumber(self, t: torch.Tensor) -> torch.Tensor:
        """Token ids → row numbers. Sparse (id, weight) targets (floats, see ``soft_label_top_k``) keep
        the weight of the vocabulary's tokens only; the weight of the others joins the unlisted bucket."""
        if t.is_floating_point():
            ids = self.lookup.to(t.device)[t[..., 0].long()]
            return torch.stack([ids.clamp(min=0).to(t), t[..., 1] * (ids >= 0)], -1)
        out = self.lookup.to(t.device)[t]
        if bool((out < 0).any()):
            raise ValueError(f"a training batch holds token {int(t[out < 0][0])}, outside the refinement vocabulary")
        return out


def refined_merge(
    spec: SymmetrySpec,
    states: list[dict],
    weights: list[float],
    reference: int,
    refine: Callable[..., RefineResult],
    combine: Callable[[list, list], dict] = average_states,
) -> tuple[dict, RefineResult]:
    """``Σ_k w_k g_k·θ_k / Σ_k w_k`` with every g_k from ``refine(θ_ref, others, include_reference=
    w_ref > 0)`` (e.g. a partial of :func:`learned_refine`), in the reference's gauge; returns
    (merged state, refine result). ``combine`` replaces the weighted mean (see :func:`merge`)."""
    others = [s for k, s in enumerate(states) if k != reference]
    result = refine(states[reference], others, include_reference=weights[reference] > 0)
    ref = canonicalize(spec, states[reference])
    aligned = list(result.canonical)
    aligned.insert(reference, ref.state if result.reference_canonical is None else result.reference_canonical)
    return to_gauge(spec, combine(aligned, weights), ref.gains), result
