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

import copy
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable

import numpy as np
import torch
from torch import nn

from .canonical import canonicalize, to_gauge
from .group import GroupElement, HeadMap, NeuronMap, apply_group, compose, ones_complement, rotary_planes
from .matching import hungarian, progress_bar, weight_match
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


class _Delta(nn.Module):
    """Free parameters of one candidate's correction g_Δ (identity at initialisation)."""

    def __init__(self, spec: SymmetrySpec, state: dict, permutations: str, init_scale: float):
        if not all(a.is_plain for a in spec.attention):
            raise ValueError(f"{spec.name}: learned refinement does not support grouped-query attention "
                             "or partial rotary yet (weight matching and merging do)")
        super().__init__()
        d = spec.width
        dtype = next(v.dtype for v in state.values() if v.is_floating_point())
        self.spec, self.permutations = spec, permutations
        self.fix_ones = spec.norm_kind == "layernorm"
        inner = d - 1 if self.fix_ones else d
        self.residual = nn.Parameter(torch.zeros(inner, inner, dtype=dtype))
        self.head_scores = nn.ParameterList()
        self.qk = nn.ParameterList()
        self.ov = nn.ParameterList()
        for a in spec.attention:
            H, dh = a.num_heads, a.head_dim
            self.head_scores.append(nn.Parameter(torch.eye(H, dtype=dtype) * init_scale))
            qk_shape = (H, dh // 2) if a.rotary else (H, dh, dh)
            self.qk.append(nn.Parameter(torch.zeros(qk_shape, dtype=dtype)))
            self.ov.append(nn.Parameter(torch.zeros(H, dh, dh, dtype=dtype)))
        self.neuron_scores = nn.ParameterList(
            nn.Parameter(torch.eye(state[m.up.weight].shape[0], dtype=dtype) * init_scale) for m in spec.mlp
        )

    def residual_map(self) -> torch.Tensor:
        o = cayley(self.residual)
        if not self.fix_ones:
            return o
        d = self.spec.width
        q = ones_complement(d, o.dtype).to(o.device)
        return torch.full((d, d), 1.0 / d, dtype=o.dtype, device=o.device) + q @ o @ q.T

    def within_head(self, i: int):
        a = self.spec.attention[i]
        if a.rotary:
            qk = _plane_rotation(self.qk[i], a.head_dim, a.rotary)
        else:
            qk = cayley(self.qk[i])
        return qk, cayley(self.ov[i])

    def hard_element(self) -> GroupElement:
        """The exact group element the current parameters project to."""
        with torch.no_grad():
            heads = []
            for i in range(len(self.spec.attention)):
                qk, ov = self.within_head(i)
                heads.append(HeadMap(hungarian(self.head_scores[i]), qk.clone(), ov.clone()))
            neurons = [NeuronMap(hungarian(z)) for z in self.neuron_scores]
            return GroupElement(self.residual_map().clone(), heads, neurons)

    def transform(self, state: dict, tau: float, hard: bool = False) -> dict:
        """Differentiable ``g_Δ · state`` (permutations as matrices so gradients reach the scores)."""
        out = dict(state)
        for i, a in enumerate(self.spec.attention):
            p = project_permutation(self.head_scores[i], self.permutations, tau, hard)
            qk, ov = self.within_head(i)
            H, dh = a.num_heads, a.head_dim
            for lin, m in ((a.q, qk), (a.k, qk), (a.v, ov)):
                w = torch.einsum("hg,gjd->hjd", p, out[lin.weight].reshape(H, dh, -1))
                out[lin.weight] = torch.einsum("hji,hjd->hid", m, w).reshape(H * dh, -1)
                if lin.bias:
                    b = p @ out[lin.bias].reshape(H, dh)
                    out[lin.bias] = torch.einsum("hj,hji->hi", b, m).reshape(H * dh)
            w = out[a.o.weight].reshape(-1, H, dh)
            w = torch.einsum("hg,dgj->dhj", p, w)
            out[a.o.weight] = torch.einsum("dhj,hji->dhi", w, ov).reshape(w.shape[0], H * dh)
        for m, z in zip(self.spec.mlp, self.neuron_scores):
            p = project_permutation(z, self.permutations, tau, hard)
            for lin in (m.up, m.gate):
                if lin is not None:
                    out[lin.weight] = p @ out[lin.weight]
                    if lin.bias:
                        out[lin.bias] = p @ out[lin.bias]
            out[m.down.weight] = out[m.down.weight] @ p.T
        o = self.residual_map()
        for key, axis in self.spec.residual:
            out[key] = (out[key].movedim(axis, -1) @ o).movedim(-1, axis)
        return out


def _plane_rotation(angles: torch.Tensor, head_dim: int, layout: str) -> torch.Tensor:
    """Differentiable per-plane rotations (H, d_h, d_h) from angles (H, d_h/2)."""
    planes = rotary_planes(head_dim, layout).to(angles.device)
    c, s = torch.cos(angles), torch.sin(angles)
    a, b = planes[:, 0], planes[:, 1]
    eye_a = torch.zeros(head_dim // 2, head_dim, dtype=angles.dtype, device=angles.device)
    eye_a[torch.arange(head_dim // 2), a] = 1.0
    eye_b = torch.zeros_like(eye_a)
    eye_b[torch.arange(head_dim // 2), b] = 1.0
    # Σ_planes c (e_a e_aᵀ + e_b e_bᵀ) + s (e_b e_aᵀ − e_a e_bᵀ)
    diag = torch.einsum("hp,pi,pj->hij", c, eye_a, eye_a) + torch.einsum("hp,pi,pj->hij", c, eye_b, eye_b)
    off = torch.einsum("hp,pi,pj->hij", s, eye_b, eye_a) - torch.einsum("hp,pi,pj->hij", s, eye_a, eye_b)
    return diag + off


Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass
class RefineResult:
    """states: refined candidates (reference's gauge, same functions as the inputs);
    canonical: the same in canonical form; transforms: g_k with canonical_k = g_k · canon(θ_k);
    history: (step, selection-split loss at the centroid of the hard alignment); best_step: the
    step whose alignment is returned (0 = the weight-matching start, i.e. no improvement).
    initial_loss / best_loss: selection-split loss of the start / of the returned alignment;
    evaluation_initial_loss / evaluation_loss: the same on the evaluation split (NaN without one),
    which no decision ever looked at. reference_canonical / reference_transform: the canonical
    reference the candidates are aligned to and g_ref with it = g_ref · canon(θ_ref) (the identity
    unless universe matching re-aligned the reference)."""

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

    @property
    def improved(self) -> bool:
        """Whether any refined alignment beat the weight-matching start on the selection split."""
        return self.best_step > 0

    def summary(self) -> dict:
        """JSON-ready record; says plainly when refinement returned its start unchanged."""
        out = {"selection_loss_start": self.initial_loss, "selection_loss_best": self.best_loss,
               "best_step": self.best_step, "improved": self.improved, "seconds": round(self.seconds, 3)}
        if not np.isnan(self.evaluation_loss):
            out.update(evaluation_loss_start=self.evaluation_initial_loss, evaluation_loss=self.evaluation_loss)
        if not self.improved:
            out["note"] = ("refinement could not improve on the weight-matching start (best_step 0): "
                           "the start is returned unchanged")
        return out


@dataclass
class ProxyStreams:
    """Disjoint proxy data for :func:`learned_refine`: an endless shuffled training stream, and the
    selection and evaluation splits as lists of batches."""

    batches: Iterable[Batch]
    selection: list[Batch]
    evaluation: list[Batch] | None


def proxy_streams(proxy, batch_size: int, seed: int = 0, selection_fraction: float = 0.2,
                  evaluation_fraction: float = 0.2, eval_batch_size: int = 256) -> ProxyStreams:
    """Split ``proxy`` (anything with ``split(fraction, seed)`` and ``batches(size, generator=)``,
    e.g. :class:`fedbasin.data.Split`) into training / selection / evaluation parts (evaluation
    may be 0: then ``evaluation`` is None)."""
    rest, selection = proxy.split(selection_fraction, seed=seed)
    evaluation = None
    if evaluation_fraction > 0:
        share = evaluation_fraction / (1.0 - selection_fraction)
        rest, evaluation = rest.split(share, seed=seed + 1)
        evaluation = list(evaluation.batches(eval_batch_size))

    def stream():
        generator = torch.Generator().manual_seed(seed)
        while True:
            yield from rest.batches(batch_size, generator=generator)

    return ProxyStreams(stream(), list(selection.batches(eval_batch_size)), evaluation)


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
) -> RefineResult:
    """Refine the alignment of ``candidates`` to ``reference`` on proxy data.

    model: any module of the architecture (its parameters are not used or changed);
    loss_fn(outputs, targets): scalar (mean) loss; batches: an (endless or long enough) iterable of
    ``(inputs, targets)`` training batches; selection: a batch or list of batches, disjoint from
    the training ones, on which keep-best chooses; evaluation: optional batches disjoint from
    both, only reported (see :func:`proxy_streams`). ``mode``, ``match_iterations`` and
    ``match_tol`` apply to the weight-matching start; ``permutations``: ``"ste"`` or ``"sinkhorn"``.
    ``include_reference=False`` leaves the reference out of the mixture and the scored centroid
    (it is then only the alignment target, like the previous global model in a federated round).
    ``to_module_state`` maps a standard-layout state to the module's own keys (an adapter's
    ``from_standard``; it must be differentiable). Outputs with a ``.logits`` field are unwrapped.
    """
    if permutations not in ("ste", "sinkhorn"):
        raise ValueError(f"permutations must be 'ste' or 'sinkhorn', got {permutations!r}")
    if not candidates:
        raise ValueError("learned refinement needs at least one candidate")
    for name, value in (("steps", steps), ("eval_every", eval_every)):
        if isinstance(value, bool) or not isinstance(value, int) or value < (name == "eval_every"):
            raise ValueError(f"{name} must be an integer >= {int(name == 'eval_every')}, got {value!r}")
    for name, value in (("lr", lr), ("alpha", alpha), ("tau", tau)):
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
            raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    if not _as_batches(selection):
        raise ValueError("learned refinement: the selection split is empty (keep-best needs data to choose on)")
    t0 = time.perf_counter()
    for i, c in enumerate(candidates):
        check_compatible(spec, reference, c, ("reference", f"candidate {i}"))
    ref_c = canonicalize(spec, reference, "reference", validate=False)
    ref_start = None
    if universe_iterations > 1:
        universe = merge(spec, [reference, *candidates], [float(include_reference)] + [1.0] * len(candidates),
                         0, mode, match_iterations, match_tol, universe_iterations=universe_iterations,
                         weighting=weighting, token_rows=token_rows)
        starts = universe.matches
        if len(starts) > len(candidates):  # the reference was re-aligned to the universe too
            ref_start, starts = starts[0], starts[1:]
    else:
        starts = [weight_match(spec, reference, c, mode=mode, iterations=match_iterations, tol=match_tol,
                               weighting=weighting, token_rows=token_rows) for c in candidates]
    base = [s.canonical for s in starts]
    device = next(iter(base[0].values())).device
    frozen = copy.deepcopy(model).to(device).eval()  # buffers (e.g. RoPE tables) follow the weights
    for p in frozen.parameters():
        p.requires_grad_(False)
    deltas = nn.ModuleList(_Delta(spec, b, permutations, init_scale=1.0) for b in base).to(device)
    optimiser = torch.optim.Adam(deltas.parameters(), lr=lr)
    rng = np.random.default_rng(seed)  # private: the caller's torch RNG stream is left alone
    ref_state = {k: v.detach() for k, v in (ref_start.canonical if ref_start else ref_c.state).items()}
    members = len(candidates) + int(include_reference)
    selection = [(x.to(device), y.to(device)) for x, y in _as_batches(selection)]
    evaluation = None if evaluation is None else [(x.to(device), y.to(device)) for x, y in _as_batches(evaluation)]

    def mixture(lam, states) -> dict:
        """``Σ_i λ_i θ_i`` over the mixed models (the reference first when it takes part)."""
        models = ([ref_state] if include_reference else []) + list(states)
        return {k: sum(w * m[k] for w, m in zip(lam, models)) if v.is_floating_point() else v
                for k, v in ref_state.items()}

    module_state = to_module_state or (lambda state: state)

    def forward(state: dict, x: torch.Tensor) -> torch.Tensor:
        out = torch.func.functional_call(frozen, module_state(state), (x,))
        return out if isinstance(out, torch.Tensor) else out.logits

    def centroid_loss(states, split: list[Batch]) -> float:
        """Example-weighted mean loss of the centroid over a split's batches."""
        state = mixture([1.0 / members] * members, states)
        with torch.no_grad():
            total = sum(float(loss_fn(forward(state, x), y)) * len(y) for x, y in split)
        return total / sum(len(y) for _, y in split)

    best_states, best_elements = base, [GroupElement.identity(spec) for _ in base]
    initial = best = centroid_loss(base, selection)
    result = RefineResult([], [], [], initial_loss=initial)
    if evaluation is not None:
        result.evaluation_initial_loss = centroid_loss(base, evaluation)
    result.history.append((0, initial))
    iterator = iter(batches)
    bar = progress_bar(steps, progress, "learned refinement", "step")
    # a single model's loss does not depend on its alignment: nothing to refine
    for step in range(1, steps + 1 if members > 1 else 1):
        x, y = (t.to(device) for t in next(iterator))
        if members == 2:
            first = rng.uniform(0.4, 0.6)
            lam = [first, 1.0 - first]
        else:
            lam = rng.dirichlet([alpha] * members).tolist()
        moved = [d.transform(b, tau) for d, b in zip(deltas, base)]
        loss = loss_fn(forward(mixture(lam, moved), x), y)
        optimiser.zero_grad(set_to_none=True)
        loss.backward()
        optimiser.step()
        bar.update(1)
        if progress:  # loss.item() synchronises with the device: only when shown
            bar.set_postfix(loss=f"{loss.item():.4f}", best=f"{best:.4f}")
        if step % eval_every == 0 or step == steps:
            elements = [d.hard_element() for d in deltas]
            hard = [apply_group(spec, b, g) for b, g in zip(base, elements)]
            value = centroid_loss(hard, selection)
            result.history.append((step, value))
            if value < best:
                best, best_states, best_elements, result.best_step = value, hard, elements, step
    bar.close()
    result.canonical = best_states
    result.states = [to_gauge(spec, s, ref_c.gains) for s in best_states]
    result.transforms = [compose(s.transform, g) for s, g in zip(starts, best_elements)]
    result.best_loss = best
    result.reference_canonical = ref_state
    result.reference_transform = ref_start.transform if ref_start else GroupElement.identity(spec)
    if evaluation is not None:
        result.evaluation_loss = (result.evaluation_initial_loss if result.best_step == 0
                                  else centroid_loss(best_states, evaluation))
    result.seconds = time.perf_counter() - t0
    return result


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
