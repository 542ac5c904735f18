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
The hard alignment is scored on a held-out proxy batch at the centroid every ``eval_every``
steps and the best one seen (the start included) is returned, so refinement never returns
something worse than its start.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable

import numpy as np
import torch
from torch import nn

from .canonical import canonicalize, to_gauge
from .group import GroupElement, HeadMap, NeuronMap, apply_group, compose, ones_complement, rotary_planes
from .matching import hungarian, progress_bar, weight_match
from .merge import average_states
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


@dataclass
class RefineResult:
    """states: refined candidates (reference's gauge, same functions as the inputs);
    canonical: the same in canonical form; transforms: g_k with canonical_k = g_k · canon(θ_k);
    history: (step, held-out proxy loss at the centroid of the hard alignment); best_step: the
    step whose alignment is returned (0 = the weight-matching start)."""

    states: list[dict]
    canonical: list[dict]
    transforms: list[GroupElement]
    history: list[tuple[int, float]] = field(default_factory=list)
    initial_loss: float = float("nan")
    best_loss: float = float("nan")
    best_step: int = 0
    seconds: float = 0.0


def learned_refine(
    spec: SymmetrySpec,
    model: nn.Module,
    reference: dict,
    candidates: list[dict],
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    heldout: tuple[torch.Tensor, torch.Tensor],
    steps: int = 100,
    lr: float = 1e-2,
    mode: str = "orthogonal",
    permutations: str = "ste",
    alpha: float = 1.0,
    tau: float = 0.1,
    eval_every: int = 10,
    seed: int = 0,
    match_iterations: int = 20,
    weighting: str = "rms",
    include_reference: bool = True,
    to_module_state: Callable[[dict], dict] | None = None,
    progress: bool = False,
) -> RefineResult:
    """Refine the alignment of ``candidates`` to ``reference`` on proxy data.

    model: any module of the architecture (its parameters are not used or changed);
    loss_fn(outputs, targets): scalar loss; batches: an (endless or long enough) iterable of
    ``(inputs, targets)`` proxy batches; heldout: one held-out proxy batch for keep-best.
    ``mode`` applies to the weight-matching start; ``permutations``: ``"ste"`` or ``"sinkhorn"``.
    ``include_reference=False`` leaves the reference out of the mixture and the held-out centroid
    (it is then only the alignment target, like the previous global model in a federated round).
    ``to_module_state`` maps a standard-layout state to the module's own keys (an adapter's
    ``from_standard``; it must be differentiable). Outputs with a ``.logits`` field are unwrapped.
    """
    if permutations not in ("ste", "sinkhorn"):
        raise ValueError(f"permutations must be 'ste' or 'sinkhorn', got {permutations!r}")
    if not candidates:
        raise ValueError("learned refinement needs at least one candidate")
    t0 = time.perf_counter()
    for i, c in enumerate(candidates):
        check_compatible(spec, reference, c, ("reference", f"candidate {i}"))
    ref_c = canonicalize(spec, reference, "reference", validate=False)
    starts = [weight_match(spec, reference, c, mode=mode, iterations=match_iterations, weighting=weighting)
              for c in candidates]
    base = [s.canonical for s in starts]
    device = next(iter(base[0].values())).device
    frozen = copy.deepcopy(model).to(device).eval()  # buffers (e.g. RoPE tables) follow the weights
    for p in frozen.parameters():
        p.requires_grad_(False)
    deltas = nn.ModuleList(_Delta(spec, b, permutations, init_scale=1.0) for b in base).to(device)
    optimiser = torch.optim.Adam(deltas.parameters(), lr=lr)
    rng = np.random.default_rng(seed)  # private: the caller's torch RNG stream is left alone
    ref_state = {k: v.detach() for k, v in ref_c.state.items()}
    members = len(candidates) + int(include_reference)
    heldout = (heldout[0].to(device), heldout[1].to(device))

    def mixture(lam, states) -> dict:
        """``Σ_i λ_i θ_i`` over the mixed models (the reference first when it takes part)."""
        models = ([ref_state] if include_reference else []) + list(states)
        return {k: sum(w * m[k] for w, m in zip(lam, models)) if v.is_floating_point() else v
                for k, v in ref_state.items()}

    module_state = to_module_state or (lambda state: state)

    def forward(state: dict, x: torch.Tensor) -> torch.Tensor:
        out = torch.func.functional_call(frozen, module_state(state), (x,))
        return out if isinstance(out, torch.Tensor) else out.logits

    def heldout_loss(states) -> float:
        with torch.no_grad():
            return float(loss_fn(forward(mixture([1.0 / members] * members, states), heldout[0]), heldout[1]))

    best_states, best_elements = base, [GroupElement.identity(spec) for _ in base]
    initial = best = heldout_loss(base)
    result = RefineResult([], [], [], initial_loss=initial)
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
            value = heldout_loss(hard)
            result.history.append((step, value))
            if value < best:
                best, best_states, best_elements, result.best_step = value, hard, elements, step
    bar.close()
    result.canonical = best_states
    result.states = [to_gauge(spec, s, ref_c.gains) for s in best_states]
    result.transforms = [compose(s.transform, g) for s, g in zip(starts, best_elements)]
    result.best_loss = best
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
    aligned.insert(reference, ref.state)
    return to_gauge(spec, combine(aligned, weights), ref.gains), result
