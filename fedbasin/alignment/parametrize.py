"""The learned group maps of refinement: free parameters projected onto the symmetry group.

Every map stays an exact group element in each forward pass. Orthogonal maps come from the Cayley
transform ``O = (I − S)(I + S)⁻¹`` of a skew-symmetric S (residual map; LayerNorm models rotate
only the complement of 1; per-head QK/OV maps; under RoPE one angle per rotary plane), invertible
ones from ``A = exp(X)`` with dual ``A⁻ᵀ = exp(−Xᵀ)``. Permutations (heads, MLP neurons) are the
Hungarian projection of a free score matrix Z with a straight-through gradient (forward: the hard
permutation, backward: d/dZ as if P = Z), or the Sinkhorn relaxation ``P = sinkhorn(Z / τ)``
during training, hardened at the end. :class:`_Delta` holds one model's maps g_Δ and applies them
to a state differentiably.
"""

from __future__ import annotations

import torch
from torch import nn

from .group import (
    SCALED_ACTIVATIONS,
    GroupElement,
    HeadMap,
    NeuronMap,
    group_head_perm,
    ones_complement,
    per_query_head,
    plane_rotations,
)
from .matching import hungarian
from .spec import SymmetrySpec


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
        self.scaled_mlps = [i for i, m in enumerate(spec.mlp) if self.invertible and m.activation in SCALED_ACTIVATIONS]
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
                    if scale is not None and lin is m.up:  # W_1[i] *= s_i, b_1[i] *= s_i (gated: up only)
                        out[lin.weight] = out[lin.weight] * scale[:, None]
                        if lin.bias:
                            out[lin.bias] = out[lin.bias] * scale
            down = out[m.down.weight] @ p.T if moves else out[m.down.weight]
            out[m.down.weight] = down if scale is None else down / scale
        o = self.residual_map()
        for key, axis in self.spec.residual:
            out[key] = (out[key].movedim(axis, -1) @ o).movedim(-1, axis)
        return out
