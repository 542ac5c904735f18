"""Elements of an architecture's symmetry group and their (exact) action on a state dict.

Row-vector math (``y = x W``), torch layout for storage. With residual map O (d×d'), head
permutation π, per-head maps A_h (QK) and B_h (OV), neuron permutation p and scales s:

* residual:  every residual axis ``X ← X ×_axis O`` (writers ``W O``, readers ``Oᵀ W``);
* heads:     head h of the result is head π[h] of the input, then
             ``W_Q,h ← W_Q,h A_h``, ``W_K,h ← W_K,h A_h⁻ᵀ``, ``W_V,h ← W_V,h B_h``,
             ``W_O,h ← B_h⁻¹ W_O,h`` (biases alike);
* neurons:   unit i of the result is unit p[i] of the input, ``W_1[:, i] *= s_i``,
             ``W_2[i, :] /= s_i`` (s only for ReLU).

Orthogonal A, B need no separate inverse; non-orthogonal maps (RoPE plane scalings) carry
their dual ``A⁻ᵀ`` explicitly. The residual map needs a canonical state (norm gains 1,
see ``canonical.py``): ``LN(x O) = LN(x) O`` only holds for unit gains and ``O·1 = 1``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from .spec import AttentionSpec, MLPSpec, SymmetrySpec

SCALED_ACTIVATIONS = ("relu", "gated")  # MLPs whose hidden units admit exact positive scalings


@dataclass
class HeadMap:
    """Per-layer head symmetry: ``perm`` (H,), ``qk``/``ov`` (H, d_h, d_h) or None (identity).

    ``qk_dual``/``ov_dual`` are ``A⁻ᵀ``/``B⁻ᵀ``; None means the map is orthogonal (dual = map).
    """

    perm: torch.Tensor
    qk: torch.Tensor | None = None
    ov: torch.Tensor | None = None
    qk_dual: torch.Tensor | None = None
    ov_dual: torch.Tensor | None = None


@dataclass
class NeuronMap:
    """Per-layer MLP symmetry: ``perm`` (n,), optional positive ``scale`` (n,) (ReLU and gated MLPs)."""

    perm: torch.Tensor
    scale: torch.Tensor | None = None


@dataclass
class GroupElement:
    """One element of the group; None entries are identities."""

    residual: torch.Tensor | None = None
    heads: list[HeadMap | None] = field(default_factory=list)
    neurons: list[NeuronMap | None] = field(default_factory=list)

    @classmethod
    def identity(cls, spec: SymmetrySpec) -> "GroupElement":
        return cls(None, [None] * len(spec.attention), [None] * len(spec.mlp))


# ---------------------------------------------------------------------------------------------
# random elements


def random_orthogonal(d: int, generator: torch.Generator, dtype=torch.float64, fix_ones: bool = False):
    """Haar-random orthogonal d×d matrix; with ``fix_ones`` it satisfies ``O·1 = 1``."""
    if fix_ones:
        basis = ones_complement(d, dtype)
        inner = random_orthogonal(d - 1, generator, dtype) if d > 1 else torch.ones(0, 0, dtype=dtype)
        return torch.full((d, d), 1.0 / d, dtype=dtype) + basis @ inner @ basis.T
    q, r = torch.linalg.qr(torch.randn(d, d, generator=generator, dtype=torch.float64))
    return (q * torch.sign(torch.diagonal(r))).to(dtype)


def ones_complement(d: int, dtype=torch.float64) -> torch.Tensor:
    """Orthonormal basis (d, d−1) of the complement of the all-ones vector."""
    return _ones_complement(d).to(dtype)


@functools.lru_cache(maxsize=8)
def _ones_complement(d: int) -> torch.Tensor:
    m = torch.eye(d, dtype=torch.float64)
    m[:, 0] = 1.0
    q, _ = torch.linalg.qr(m)
    return q[:, 1:]


def random_invertible(d: int, generator: torch.Generator, spread: float = 0.5) -> torch.Tensor:
    """Random well-conditioned invertible d×d matrix (float64) ``U diag(e^z) V``, z ~ N(0, spread²)."""
    u, v = random_orthogonal(d, generator), random_orthogonal(d, generator)
    return u @ torch.diag(torch.exp(spread * torch.randn(d, generator=generator, dtype=torch.float64))) @ v


def random_permutation_matrix(d: int, generator: torch.Generator, dtype=torch.float64) -> torch.Tensor:
    return torch.eye(d, dtype=dtype)[torch.randperm(d, generator=generator)]


def rotary_planes(head_dim: int, layout: str, rotary_dims: int | None = None) -> torch.Tensor:
    """(r_d/2, 2) index pairs of the rotary planes among the first r_d = ``rotary_dims`` dims
    (default d_h): (j, j+r_d/2) for "half", (2j, 2j+1) otherwise."""
    rd = rotary_dims or head_dim
    half = rd // 2
    j = torch.arange(half)
    return torch.stack([j, j + half], 1) if layout == "half" else torch.stack([2 * j, 2 * j + 1], 1)


def plane_rotations(angles: torch.Tensor, head_dim: int, layout: str, scales: torch.Tensor | None = None,
                    passthrough: torch.Tensor | None = None):
    """Block matrices (..., d_h, d_h) acting on each rotary plane as ``s·[[cos, −sin], [sin, cos]]``.

    ``angles`` (..., r_d/2) sets r_d; with partial rotary (r_d < d_h) ``passthrough``
    (..., d_h−r_d, d_h−r_d) acts on the dims that carry no position (identity if None).
    Every such block commutes with the position rotations, so QK stays exact under RoPE.
    """
    rd = 2 * angles.shape[-1]
    planes = rotary_planes(head_dim, layout, rd).to(angles.device)
    a, b = planes[:, 0], planes[:, 1]
    c, s = torch.cos(angles), torch.sin(angles)
    if scales is not None:
        c, s = c * scales, s * scales
    out = torch.zeros(*angles.shape[:-1], head_dim, head_dim, dtype=angles.dtype, device=angles.device)
    out[..., a, a], out[..., a, b], out[..., b, a], out[..., b, b] = c, -s, s, c
    if rd < head_dim:
        eye = torch.eye(head_dim - rd, dtype=angles.dtype, device=angles.device)
        out[..., rd:, rd:] = eye if passthrough is None else passthrough.to(out)
    return out


def kv_perm(perm: torch.Tensor, groups: int) -> torch.Tensor:
    """Key/value head permutation (G,) implied by a group-consistent query-head permutation (H,)."""
    r = perm.numel() // groups
    return perm.reshape(groups, r)[:, 0] // r


def check_group_perm(a: AttentionSpec, perm: torch.Tensor) -> None:
    """``perm`` moves query heads only together with their key/value group (else ``ValueError``)."""
    if a.group_size == 1:
        return
    blocks = perm.reshape(a.kv_heads, a.group_size) // a.group_size
    if not bool((blocks == blocks[:, :1]).all()):
        raise ValueError(f"{a.q.weight}: head permutation splits a key/value group (grouped-query attention)")


def random_group_element(
    spec: SymmetrySpec,
    generator: torch.Generator | int = 0,
    mode: str = "orthogonal",
    dtype: torch.dtype = torch.float64,
    scales: bool = False,
    state: dict | None = None,
) -> GroupElement:
    """A random element: ``orthogonal`` (Haar maps), ``permutation`` (permutation matrices only) or
    ``invertible`` (orthogonal residual map, random invertible per-head QK and OV maps — under RoPE
    scaled plane rotations, the maps commuting with every position rotation — and, for ReLU and
    gated MLPs, positive neuron scalings: the largest exact group, GLMC's).

    ``scales=True`` adds the optional non-orthogonal freedoms: positive neuron scalings (ReLU)
    and per-plane scalings of the QK map (RoPE). MLP widths come from the spec or ``state``.
    """
    if isinstance(generator, int):
        generator = torch.Generator().manual_seed(generator)
    d = spec.width
    if mode == "invertible":
        scales = True
    if mode in ("orthogonal", "invertible"):
        residual = random_orthogonal(d, generator, dtype, fix_ones=spec.norm_kind == "layernorm")
    elif mode == "permutation":
        residual = random_permutation_matrix(d, generator, dtype)
    else:
        raise ValueError(f"mode must be 'orthogonal', 'permutation' or 'invertible', got {mode!r}")
    heads = [_random_head_map(a, generator, mode, dtype, scales) for a in spec.attention]
    neurons = []
    for m in spec.mlp:
        n = _mlp_width(m, state)
        scale = None
        if scales and (m.activation == "relu" or (mode == "invertible" and m.activation == "gated")):
            scale = torch.exp(0.5 * torch.randn(n, generator=generator, dtype=torch.float64)).to(dtype)
        neurons.append(NeuronMap(torch.randperm(n, generator=generator), scale))
    return GroupElement(residual, heads, neurons)


def _mlp_width(m: MLPSpec, state: dict | None) -> int:
    if m.hidden:
        return m.hidden
    if state is None:
        raise ValueError(f"the spec does not record the width of {m.up.weight}: pass state=")
    return state[m.up.weight].shape[0]


def group_head_perm(groups: torch.Tensor, within: torch.Tensor) -> torch.Tensor:
    """Query-head permutation (H,) from a key/value-group permutation ``groups`` (G,) and the
    within-group orders ``within`` (G, r) of the groups' new slots: query head j of new group g is
    query head ``within[g, j]`` of old group ``groups[g]``."""
    r = within.shape[1]
    return (groups[:, None] * r + within).reshape(-1)


def per_query_head(maps: torch.Tensor | None, a: AttentionSpec) -> torch.Tensor | None:
    """Per-group maps (G, ...) repeated for the r query heads (or output blocks) of each group."""
    return maps if maps is None or a.group_size == 1 else maps.repeat_interleave(a.group_size, 0)


def random_head_perm(a: AttentionSpec, generator) -> torch.Tensor:
    """Random group-consistent query-head permutation: groups permute, heads permute within a group."""
    G, r = a.kv_heads, a.group_size
    groups = torch.randperm(G, generator=generator)
    return group_head_perm(groups, torch.stack([torch.randperm(r, generator=generator) for _ in range(G)]))


def _random_head_map(a: AttentionSpec, generator, mode: str, dtype, scales: bool) -> HeadMap:
    """One random map per key/value group (G of them): query heads share their group's maps."""
    G, dh = a.kv_heads, a.head_dim
    perm = random_head_perm(a, generator)
    if mode == "permutation":
        ov = torch.stack([random_permutation_matrix(dh, generator, dtype) for _ in range(G)])
        qk = None if a.rotary else torch.stack([random_permutation_matrix(dh, generator, dtype) for _ in range(G)])
        return HeadMap(perm, qk, ov)
    invertible = mode == "invertible"
    ov = torch.stack([(random_invertible if invertible else random_orthogonal)(dh, generator) for _ in range(G)])
    ov_dual = torch.linalg.inv(ov).transpose(1, 2).to(dtype) if invertible else None
    if not a.rotary:
        qk = torch.stack([(random_invertible if invertible else random_orthogonal)(dh, generator) for _ in range(G)])
        qk_dual = torch.linalg.inv(qk).transpose(1, 2).to(dtype) if invertible else None
        return HeadMap(perm, qk.to(dtype), ov.to(dtype), qk_dual, ov_dual)
    qk, qk_dual = _random_rotary_maps(a, generator, scales or invertible, invertible)
    return HeadMap(perm, qk.to(dtype), ov.to(dtype), None if qk_dual is None else qk_dual.to(dtype), ov_dual)


def _random_rotary_maps(a: AttentionSpec, generator, scales: bool, invertible: bool):
    """(A, A⁻ᵀ or None if orthogonal), each (G, d_h, d_h), commuting with the position rotations:
    random (scaled) rotations of the rotary planes and, with partial rotary, a random orthogonal
    (``invertible``: invertible) block on the position-free dims."""
    G, dh, rd = a.kv_heads, a.head_dim, a.rotated
    angles = (torch.rand(G, rd // 2, generator=generator, dtype=torch.float64) * 2 - 1) * torch.pi
    plane_scales = torch.exp(0.5 * torch.randn(G, rd // 2, generator=generator, dtype=torch.float64)) if scales else None
    passthrough = passthrough_dual = None
    if rd < dh:
        make = random_invertible if invertible else random_orthogonal
        passthrough = torch.stack([make(dh - rd, generator) for _ in range(G)])
        passthrough_dual = torch.linalg.inv(passthrough).transpose(1, 2) if invertible else passthrough
    qk = plane_rotations(angles, dh, a.rotary, plane_scales, passthrough)
    if not (scales or invertible):
        return qk, None
    dual_scales = None if plane_scales is None else 1.0 / plane_scales
    return qk, plane_rotations(angles, dh, a.rotary, dual_scales, passthrough_dual)


# ---------------------------------------------------------------------------------------------
# action on state dicts


def contract_axis(x: torch.Tensor, axis: int, m: torch.Tensor) -> torch.Tensor:
    """``x ×_axis m``: index i along ``axis`` becomes j with weight m[i, j]."""
    moved = x.movedim(axis, -1)
    return (moved @ m.to(x.dtype)).movedim(-1, axis)


def scale_axis(x: torch.Tensor, axis: int, s: torch.Tensor) -> torch.Tensor:
    """Multiply ``x`` by the vector ``s`` along ``axis``."""
    shape = [1] * x.dim()
    shape[axis] = -1
    return x * s.to(x).reshape(shape)


def _dual(m: torch.Tensor | None, dual: torch.Tensor | None) -> torch.Tensor | None:
    return m if dual is None else dual


def apply_head_map(a: AttentionSpec, state: dict, hm: HeadMap) -> None:
    """In place on the dict (new tensors): permute heads, then apply A_g to Q/K, B_g to V/O.

    ``hm.perm`` permutes the H query heads (group-consistent under grouped-query attention);
    key/value heads follow with :func:`kv_perm`. The maps (G, d_h, d_h) belong to key/value
    groups: query head h and output block h use the map of group h // r.
    """
    H, G, dh = a.num_heads, a.kv_heads, a.head_dim
    check_group_perm(a, hm.perm)
    perm = hm.perm.to(state[a.q.weight].device)
    kv = kv_perm(perm, G)
    for lin, heads, p, m in ((a.q, H, perm, per_query_head(hm.qk, a)), (a.k, G, kv, _dual(hm.qk, hm.qk_dual)),
                             (a.v, G, kv, hm.ov)):
        w = state[lin.weight]
        w = w.reshape(heads, dh, -1)[p]
        if m is not None:  # torch layout of W_h m is mᵀ W_hᵀ... rows: new[h] = m_hᵀ @ w[h]
            w = torch.einsum("hij,hjd->hid", m.to(w).transpose(1, 2), w)
        state[lin.weight] = w.reshape(heads * dh, -1)
        if lin.bias:
            b = state[lin.bias].reshape(heads, dh)[p]
            if m is not None:
                b = torch.einsum("hi,hij->hj", b, m.to(b))
            state[lin.bias] = b.reshape(heads * dh)
    w = state[a.o.weight]
    w = w.reshape(w.shape[0], H, dh)[:, perm]
    dual = per_query_head(_dual(hm.ov, hm.ov_dual), a)
    if dual is not None:  # W_O,h ← B⁻¹ W_O,h, i.e. torch columns: o[:, h] @ B⁻ᵀ
        w = torch.einsum("dhi,hij->dhj", w, dual.to(w))
    state[a.o.weight] = w.reshape(w.shape[0], H * dh)


def apply_neuron_map(m: MLPSpec, state: dict, nm: NeuronMap) -> None:
    """In place on the dict (new tensors): permute hidden units, scale W_1 columns by s, W_2 rows by 1/s.
    ReLU: ``relu(s·z) = s·relu(z)`` for s > 0; gated: ``act(gate·x) ⊙ (s·up·x)``, only ``up`` scales."""
    perm = nm.perm.to(state[m.up.weight].device)
    if nm.scale is not None and m.activation not in SCALED_ACTIVATIONS:
        raise ValueError(f"{m.up.weight}: neuron scaling is only exact for ReLU and gated MLPs")
    for lin in (m.up, m.gate):
        if lin is None:
            continue
        state[lin.weight] = state[lin.weight][perm]
        if lin.bias:
            state[lin.bias] = state[lin.bias][perm]
        if nm.scale is not None and lin is m.up:
            state[lin.weight] = scale_axis(state[lin.weight], 0, nm.scale)
            if lin.bias:
                state[lin.bias] = state[lin.bias] * nm.scale.to(state[lin.bias])
    down = state[m.down.weight][:, perm]
    state[m.down.weight] = down if nm.scale is None else scale_axis(down, 1, 1.0 / nm.scale)


def apply_residual_map(spec: SymmetrySpec, state: dict, o: torch.Tensor) -> None:
    """In place on the dict (new tensors): ``X ← X ×_axis O`` on every residual axis."""
    for norm in spec.norms:
        if norm.weight is not None and not torch.all(state[norm.weight] == 1):
            raise ValueError(
                f"{norm.weight}: residual maps need a canonical model (unit norm gains); "
                "call canonicalize() first"
            )
    for key, axis in spec.residual:
        state[key] = contract_axis(state[key], axis, o.to(state[key].device))
    if o.shape[0] != o.shape[1]:  # width change: unit gains of the new width
        for norm in spec.norms:
            if norm.weight is not None:
                state[norm.weight] = torch.ones(o.shape[1], dtype=state[norm.weight].dtype,
                                                device=state[norm.weight].device)


def apply_group(spec: SymmetrySpec, state: dict, g: GroupElement, in_place: bool = False) -> dict:
    """Return a new state dict transformed by ``g`` (the input is not modified); ``in_place``:
    transform ``state`` itself (each replaced tensor goes as soon as nothing else holds it)."""
    out = state if in_place else dict(state)
    for a, hm in zip(spec.attention, g.heads):
        if hm is not None:
            apply_head_map(a, out, hm)
    for m, nm in zip(spec.mlp, g.neurons):
        if nm is not None:
            apply_neuron_map(m, out, nm)
    if g.residual is not None:
        apply_residual_map(spec, out, g.residual)
    return out


# ---------------------------------------------------------------------------------------------
# composition


def permuted_maps(maps: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """Per-group maps (G, ...) reordered by a query-head permutation (H,): ``maps[kv_perm(perm)]``."""
    return maps[perm if maps.shape[0] == perm.numel() else kv_perm(perm, maps.shape[0])]


def _compose_maps(m1, m2, perm2):
    """Map of ``first m1 then m2`` on group g: ``m1[kv(perm2)[g]] @ m2[g]`` (None = identity)."""
    if m1 is None:
        return m2
    m1 = permuted_maps(m1, perm2)
    return m1 if m2 is None else m1 @ m2.to(m1)


def compose(first: GroupElement, then: GroupElement) -> GroupElement:
    """The element acting as ``first`` followed by ``then``."""
    if first.residual is None or then.residual is None:
        residual = then.residual if first.residual is None else first.residual
    else:
        residual = first.residual @ then.residual.to(first.residual)
    heads = []
    for h1, h2 in zip(first.heads, then.heads):
        if h1 is None or h2 is None:
            heads.append(h2 if h1 is None else h1)
            continue
        p2 = h2.perm.to(h1.perm.device)
        qk_dual = ov_dual = None
        if h1.qk_dual is not None or h2.qk_dual is not None:
            qk_dual = _compose_maps(_dual(h1.qk, h1.qk_dual), _dual(h2.qk, h2.qk_dual), p2)
        if h1.ov_dual is not None or h2.ov_dual is not None:
            ov_dual = _compose_maps(_dual(h1.ov, h1.ov_dual), _dual(h2.ov, h2.ov_dual), p2)
        heads.append(HeadMap(h1.perm[p2], _compose_maps(h1.qk, h2.qk, p2), _compose_maps(h1.ov, h2.ov, p2),
                             qk_dual, ov_dual))
    neurons = []
    for n1, n2 in zip(first.neurons, then.neurons):
        if n1 is None or n2 is None:
            neurons.append(n2 if n1 is None else n1)
            continue
        p2 = n2.perm.to(n1.perm.device)
        s1 = None if n1.scale is None else n1.scale[p2]
        scale = s1 if n2.scale is None else (n2.scale if s1 is None else s1 * n2.scale)
        neurons.append(NeuronMap(n1.perm[p2], scale))
    return GroupElement(residual, heads, neurons)


def inverse(g: GroupElement) -> GroupElement:
    """``g⁻¹`` for an element with orthogonal residual map (``compose(g, inverse(g))`` = identity).

    Head h of ``g·θ`` is ``M_h`` applied to head ``perm[h]``, so ``g⁻¹`` has ``perm⁻¹`` and maps
    ``M⁻¹[perm⁻¹]`` with ``M⁻¹ = (dual)ᵀ`` and dual ``Mᵀ`` (grouped-query attention: maps per
    key/value group, reordered by the groups' permutation); neurons ``perm⁻¹`` and scales
    ``1 / s[perm⁻¹]``; residual ``Rᵀ``.
    """
    def moved(m: torch.Tensor | None, ip: torch.Tensor) -> torch.Tensor | None:  # m[ip]ᵀ per head (group)
        return None if m is None else permuted_maps(m, ip).transpose(-1, -2)

    heads = []
    for hm in g.heads:
        if hm is None:
            heads.append(None)
            continue
        ip = torch.argsort(hm.perm)
        heads.append(HeadMap(
            ip,
            moved(hm.qk if hm.qk_dual is None else hm.qk_dual, ip),
            moved(hm.ov if hm.ov_dual is None else hm.ov_dual, ip),
            None if hm.qk_dual is None else moved(hm.qk, ip),
            None if hm.ov_dual is None else moved(hm.ov, ip),
        ))
    neurons = []
    for nm in g.neurons:
        if nm is None:
            neurons.append(None)
            continue
        ip = torch.argsort(nm.perm)
        neurons.append(NeuronMap(ip, None if nm.scale is None else 1.0 / nm.scale[ip]))
    return GroupElement(None if g.residual is None else g.residual.T, heads, neurons)
