"""Width-heterogeneous models: embed a narrow Transformer exactly into a wider one, merge, give back.

Row-vector math (``y = x W``), DESIGN §6 last bullet. A *narrow* model (residual width d_s,
H_s heads of width d_h, MLP widths n_s) becomes a model of a *wide* architecture (d_b ≥ d_s,
H_b ≥ H_s heads of the **same** d_h, n_b ≥ n_s, same depth and options) as follows, starting
from its canonical form (unit norm gains, ``canonical.py``):

* **residual map** ``O ∈ R^{d_s×d_b}`` with orthonormal rows (``O Oᵀ = I``): the wide residual
  stream is ``h O``. Every residual axis ``X ← X ×_axis O`` (writers ``W O``, ``b O``; readers
  ``Oᵀ W``, so ``(h O) Oᵀ W = h W``).
* **norms**, with ``c = sqrt(d_s / d_b)``: ``‖h O‖ = ‖h‖`` but the mean runs over d_b entries,
  so ``RMS_b(h O) = RMS_s(h) O / c`` for every such O. LayerNorm also centres; if
  ``1_s O = c 1_b`` (O maps the unit ones vector onto the unit ones vector, hence the complement
  of 1 into the complement of 1) then ``mean_b(hO) 1_b = mean_s(h) 1_s O`` and
  ``LN_b(h O) = LN_s(h) O / c``. The norm bias is part of the norm output (``β ← β O / c``) and
  the norm's readers take the factor back (``W ← c Oᵀ W``).
  **This is exact for norm eps = 0 only**: ``sqrt(c² var + eps) ≠ c sqrt(var + eps)``, a relative
  error of about ``eps (1 − c²) / (2 c² var)`` per norm (exact again if the wide eps were c²·eps).
  Build models with ``norm_eps=0`` (a ``ViTConfig``/``GPTConfig`` field) where exactness matters.
* **heads**: heads H_s..H_b−1 are zero (Q/K/V rows and biases, O columns): they add exactly 0.
  The attention scale 1/sqrt(d_h) is unchanged because d_h is. Grouped-query attention (G
  key/value heads, r = H/G query heads each): narrow group g, its key/value head and its r_s
  query heads, fills the first r_s query slots of wide group g, so every query head keeps its
  key/value head; this needs ``G_s ≤ G_b`` and ``r_s ≤ r_b`` (a narrow group is never split
  over several wide ones: refused). Partial rotary: equal rotating dims r_d (heads embed whole).
* **MLP**: units n_s..n_b−1 are zero (up/gate rows and biases, down columns): exactly 0 for any
  activation (``down`` columns are 0; also act(0)·0 = 0 for SwiGLU).

``embed`` is this map ``E_O``. Its left inverse ``restrict`` (``P_O``: residual axes ``×_axis Oᵀ``,
readers ``/ c``, norm biases ``· c``, keep the first H_s heads and n_s units) gives
``P_O(E_O(θ)) = θ`` exactly; ``E_O ∘ P_O`` is a projection, so restricting a model that is not in
the image of E_O loses whatever lies outside the client's subspace and slots.

**Alignment.** An embedded model is an ordinary wide model, so the wide group acts on it
exactly: ``g · E_O(θ)`` is again an embedding, with residual map ``O R`` (orthonormal rows; for
LayerNorm ``R·1 = 1`` keeps ``1_s O R = c 1_b``) and heads/units moved to the slots g's
permutations send them to. Aligning a narrow model to a wide reference is therefore: embed with
the default O, then ``weight_match`` in the wide group. What the client receives back is
``P_O(g⁻¹ · θ_global)``: the global model read in exactly the slots (residual subspace, heads,
units) that the client's own weights were matched to and averaged into.

**Scope.** fedbasin specs of one family and options differ across widths only in their shapes
(state-dict keys do not depend on width), so the narrow and wide specs are paired entry by entry.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .canonical import canonicalize, to_gauge
from .group import (
    GroupElement,
    apply_group,
    apply_residual_map,
    inverse,
    ones_complement,
)
from .matching import MatchResult, weight_match
from .merge import MergeResult, merge
from .spec import AttentionSpec, SymmetrySpec

__all__ = [
    "Embedded", "Member", "WidthMerge", "check_embeddable", "default_residual_map", "embed",
    "embed_and_align", "inverse", "merge_heterogeneous", "restrict", "width_factor",
]


def width_factor(d_small: int, d_big: int) -> float:
    """``c = sqrt(d_s / d_b)``: ``N_b(h O) = N_s(h) O / c`` for LayerNorm and RMSNorm (eps = 0)."""
    return math.sqrt(d_small / d_big)


def default_residual_map(d_small: int, d_big: int, dtype=torch.float64) -> torch.Tensor:
    """A deterministic ``O ∈ R^{d_s×d_b}`` with ``O Oᵀ = I`` and ``1_s O = c 1_b``.

    ``O = u_s u_bᵀ + Q_s [I 0] Q_bᵀ`` with ``u = 1/‖1‖`` and Q an orthonormal basis of the
    complement of 1 (``group.ones_complement``): the unit ones vector goes to the unit ones
    vector, the complement into the complement. Valid for LayerNorm and RMSNorm; the identity
    when ``d_s = d_b``.
    """
    if not 1 <= d_small <= d_big:
        raise ValueError(f"cannot embed residual width {d_small} into width {d_big}")
    u_s = torch.full((d_small, 1), d_small**-0.5, dtype=torch.float64)
    u_b = torch.full((d_big, 1), d_big**-0.5, dtype=torch.float64)
    q_s, q_b = ones_complement(d_small), ones_complement(d_big)
    return (u_s @ u_b.T + q_s @ q_b[:, : d_small - 1].T).to(dtype)


def _check_residual_map(o: torch.Tensor, spec_small: SymmetrySpec, spec_big: SymmetrySpec) -> torch.Tensor:
    d_s, d_b = spec_small.width, spec_big.width
    if tuple(o.shape) != (d_s, d_b):
        raise ValueError(f"residual map has shape {tuple(o.shape)}; expected ({d_s}, {d_b})")
    o64 = o.double()
    tol = 1e-10 if o.dtype == torch.float64 else 1e-5
    err = float((o64 @ o64.T - torch.eye(d_s, dtype=torch.float64, device=o.device)).abs().max())
    if err > tol:
        raise ValueError(f"residual map rows are not orthonormal (max |O Oᵀ − I| = {err:.2e})")
    if spec_big.norm_kind == "layernorm":
        err = float((o64.sum(0) - width_factor(d_s, d_b)).abs().max())
        if err > tol:
            raise ValueError(
                f"LayerNorm models need 1_s O = sqrt(d_s/d_b)·1_b; the residual map misses it by {err:.2e}"
            )
    return o


def check_embeddable(spec_small: SymmetrySpec, spec_big: SymmetrySpec) -> None:
    """Raise ``ValueError`` unless the narrow spec can be embedded into the wide one.

    Same keys, norm kinds, depth, head width, rotary layout and rotating dims, and MLP kind;
    ``d_s ≤ d_b``, ``H_s ≤ H_b``, ``G_s ≤ G_b`` and ``r_s ≤ r_b`` (key/value heads and query heads
    per key/value head) and ``n_s ≤ n_b`` (when the specs record n). Shapes that do not involve the
    width (vocabulary, classes, patches) are checked by :func:`embed` against the wide shapes.
    """
    if spec_small.width > spec_big.width:
        raise ValueError(f"the narrow model is wider ({spec_small.width}) than the wide one ({spec_big.width})")
    for what, s, b in (("attention blocks", spec_small.attention, spec_big.attention),
                       ("MLP blocks", spec_small.mlp, spec_big.mlp), ("norms", spec_small.norms, spec_big.norms)):
        if len(s) != len(b):
            raise ValueError(f"different depth: {len(s)} vs {len(b)} {what}")
    for ns, nb in zip(spec_small.norms, spec_big.norms):
        if ns.kind != nb.kind:
            raise ValueError(f"{ns.weight}: norm kind {ns.kind} vs {nb.kind}")
    if spec_small.keys() != spec_big.keys() or [k for k, _ in spec_small.residual] != [k for k, _ in spec_big.residual]:
        diff = sorted(spec_small.keys() ^ spec_big.keys())
        raise ValueError(f"different architectures: the specs name different tensors {diff[:6]}")
    for a_s, a_b in zip(spec_small.attention, spec_big.attention):
        if a_s.head_dim != a_b.head_dim:
            raise ValueError(
                f"{a_s.q.weight}: head width {a_s.head_dim} vs {a_b.head_dim}; heads embed only at equal head width"
            )
        if a_s.num_heads > a_b.num_heads:
            raise ValueError(f"{a_s.q.weight}: the narrow model has more heads ({a_s.num_heads} > {a_b.num_heads})")
        if a_s.kv_heads > a_b.kv_heads:
            raise ValueError(f"{a_s.q.weight}: the narrow model has more key/value heads "
                             f"({a_s.kv_heads} > {a_b.kv_heads})")
        if a_s.group_size > a_b.group_size:
            raise ValueError(
                f"{a_s.q.weight}: the narrow model has more query heads per key/value head ({a_s.group_size} > "
                f"{a_b.group_size}); a key/value group embeds only into a group at least as large"
            )
        if a_s.rotary != a_b.rotary or a_s.rotated != a_b.rotated:
            raise ValueError(f"{a_s.q.weight}: position kind {a_s.rotary} with {a_s.rotated} rotating dims vs "
                             f"{a_b.rotary} with {a_b.rotated}")
    for m_s, m_b in zip(spec_small.mlp, spec_big.mlp):
        if m_s.activation != m_b.activation or (m_s.gate is None) != (m_b.gate is None):
            raise ValueError(f"{m_s.up.weight}: MLP kind {m_s.activation} vs {m_b.activation}")
        if m_s.hidden and m_b.hidden and m_s.hidden > m_b.hidden:
            raise ValueError(f"{m_s.up.weight}: the narrow model has more MLP units ({m_s.hidden} > {m_b.hidden})")


# ---------------------------------------------------------------------------------------------
# the maps E_O and P_O


def _fit(x: torch.Tensor, axis: int, size: int) -> torch.Tensor:
    """Zero-pad ``x`` along ``axis`` to ``size`` entries, or keep its first ``size`` entries."""
    n = x.shape[axis]
    if size <= n:
        return x.narrow(axis, 0, size)
    shape = list(x.shape)
    shape[axis] = size - n
    return torch.cat([x, x.new_zeros(shape)], axis)


def _fit_heads(x: torch.Tensor, axis: int, a_from: AttentionSpec, a_to: AttentionSpec, query: bool) -> torch.Tensor:
    """Pad or cut the head axis of ``x``: key/value heads (G·d_h) to ``a_to``'s G; query heads
    (G·r·d_h) per group, so query head i of group g keeps slot (g, i) and belongs to the same
    key/value head (a narrow group sits in the first r_s slots of a wide group)."""
    if not query:
        return _fit(x, axis, a_to.kv_heads * a_to.head_dim)
    shape = x.shape
    x = x.reshape(*shape[:axis], a_from.kv_heads, a_from.group_size, a_from.head_dim, *shape[axis + 1:])
    x = _fit(_fit(x, axis, a_to.kv_heads), axis + 1, a_to.group_size)
    return x.reshape(*shape[:axis], a_to.num_heads * a_to.head_dim, *shape[axis + 1:])


def _fit_blocks(spec_from: SymmetrySpec, spec_to: SymmetrySpec, state: dict, mlp_widths: list[int]) -> None:
    """In place: heads from ``spec_from``'s to ``spec_to``'s (key/value groups, query heads per
    group) and MLP hidden axes to ``mlp_widths`` (pad or cut)."""
    for a_from, a in zip(spec_from.attention, spec_to.attention):
        for lin, query in ((a.q, True), (a.k, False), (a.v, False)):
            state[lin.weight] = _fit_heads(state[lin.weight], 0, a_from, a, query)
            if lin.bias:
                state[lin.bias] = _fit_heads(state[lin.bias], 0, a_from, a, query)
        state[a.o.weight] = _fit_heads(state[a.o.weight], 1, a_from, a, True)
    for m, n in zip(spec_to.mlp, mlp_widths):
        for lin in (m.up, m.gate):
            if lin is not None:
                state[lin.weight] = _fit(state[lin.weight], 0, n)
                if lin.bias:
                    state[lin.bias] = _fit(state[lin.bias], 0, n)
        state[m.down.weight] = _fit(state[m.down.weight], 1, n)


def _scale_norm_outputs(spec: SymmetrySpec, state: dict, factor: float) -> None:
    """In place: norm biases ``β ← β / factor``, their readers ``W ← factor · W``."""
    for norm in spec.norms:
        for key, axis in norm.readers:
            state[key] = state[key] * factor
        if norm.bias is not None:
            state[norm.bias] = state[norm.bias] / factor


def _shape(x) -> tuple:
    return tuple(x.shape) if isinstance(x, torch.Tensor) else tuple(x)


def _mlp_widths(spec: SymmetrySpec, shapes: dict | None, what: str) -> list[int]:
    widths = []
    for m in spec.mlp:
        if m.hidden:
            widths.append(m.hidden)
        elif shapes is not None and m.up.weight in shapes:
            widths.append(_shape(shapes[m.up.weight])[0])
        else:
            raise ValueError(f"the {what} spec does not record the width of {m.up.weight}: pass its state or shapes")
    return widths


def embed(
    spec_small: SymmetrySpec,
    state_small: dict,
    spec_big: SymmetrySpec,
    big: dict | None = None,
    residual_map: torch.Tensor | None = None,
) -> dict:
    """The narrow model as a canonical state dict of the wide architecture (``E_O``, module doc).

    big: a state dict of the wide architecture, or ``{key: shape}``; when given, every output
        shape is checked against it (vocabulary, classes, ... must agree) and it supplies MLP
        widths the spec does not record.
    residual_map: ``O`` (d_s, d_b) with orthonormal rows (LayerNorm: ``1_s O = c 1_b``); default
        :func:`default_residual_map`.

    The function is unchanged when the norms have eps = 0 (otherwise up to O(eps / variance)).
    Tied tensors come back untied (the head carries the factor c, the embedding does not).
    """
    check_embeddable(spec_small, spec_big)
    widths_b = _mlp_widths(spec_big, big, "wide")
    widths_s = [state_small[m.up.weight].shape[0] for m in spec_small.mlp]
    for m, n_s, n_b in zip(spec_small.mlp, widths_s, widths_b):
        if n_s > n_b:
            raise ValueError(f"{m.up.weight}: the narrow model has more MLP units ({n_s} > {n_b})")
    d_s, d_b = spec_small.width, spec_big.width
    state = canonicalize(spec_small, state_small, "narrow model").state
    o = default_residual_map(d_s, d_b) if residual_map is None else residual_map
    _check_residual_map(o, spec_small, spec_big)
    if d_s != d_b or residual_map is not None:
        apply_residual_map(spec_small, state, o)
        _scale_norm_outputs(spec_small, state, width_factor(d_s, d_b))
    _fit_blocks(spec_small, spec_big, state, widths_b)
    if big is not None:
        for key in sorted(set(big) | set(state)):
            if key not in state or key not in big:
                raise ValueError(f"{key} is only in the {'wide' if key in big else 'narrow'} model")
            if tuple(state[key].shape) != _shape(big[key]):
                raise ValueError(
                    f"{key}: the embedded narrow model has shape {tuple(state[key].shape)} but the wide model "
                    f"{_shape(big[key])} (different vocabulary, classes or input shape?)"
                )
    return state


def restrict(
    spec_big: SymmetrySpec,
    state_big: dict,
    spec_small: SymmetrySpec,
    residual_map: torch.Tensor | None = None,
    transform: GroupElement | None = None,
    gains: dict | None = None,
    small: dict | None = None,
) -> dict:
    """What a narrow client receives: ``P_O(g⁻¹ · canon(θ_big))`` (module doc), lossy in general.

    transform: the wide group element g its embedding was aligned by (``Member.transform``,
        ``MatchResult.transform``); its inverse first brings the client's slots back to the first
        H_s heads / n_s units and the residual subspace of O. Choice: the client gets the heads,
        units and residual directions *its own* weights were matched to and averaged into, so
        ``restrict(embed(θ)) = θ`` and the client's own contribution is kept where it was.
    residual_map: the O the client was embedded with (default :func:`default_residual_map`).
    gains: the client's norm gains (``canonicalize(spec_small, θ_small).gains``) to return the
        model in the client's gauge; None returns the canonical form (unit gains). Dims where
        they are tiny keep ``γ_i = 1`` (:func:`~fedbasin.alignment.canonical.to_gauge`), so
        ``restrict(embed(θ))`` is then θ's gauged form: the same function, not θ's weights.
    small: a narrow state or shapes, only needed when ``spec_small`` does not record MLP widths.
    """
    check_embeddable(spec_small, spec_big)
    d_s, d_b = spec_small.width, spec_big.width
    state = canonicalize(spec_big, state_big, "wide model").state
    if transform is not None:
        state = apply_group(spec_big, state, inverse(transform))
    o = default_residual_map(d_s, d_b) if residual_map is None else residual_map
    _check_residual_map(o, spec_small, spec_big)
    if d_s != d_b or residual_map is not None:
        apply_residual_map(spec_big, state, o.T)
        _scale_norm_outputs(spec_big, state, 1.0 / width_factor(d_s, d_b))
    _fit_blocks(spec_big, spec_small, state, _mlp_widths(spec_small, small, "narrow"))
    for key in sorted(set(small or ()) & set(state)):
        if tuple(state[key].shape) != _shape(small[key]):
            raise ValueError(f"{key}: the restriction has shape {tuple(state[key].shape)} but the narrow model "
                             f"{_shape(small[key])} (different vocabulary, classes or input shape?)")
    return state if gains is None else to_gauge(spec_small, state, gains)



# ---------------------------------------------------------------------------------------------
# alignment and merging


@dataclass
class Embedded:
    """A narrow model embedded into the wide architecture and aligned to a wide reference.

    state/canonical: the aligned embedded model (reference's gauge / unit gains), same function
    as the narrow model (eps = 0); residual_map: the O used to embed; transform: the wide group
    element g found by weight matching (``canonical = g · embed(θ, O)``); match: its record.
    """

    state: dict
    canonical: dict
    residual_map: torch.Tensor
    transform: GroupElement
    match: MatchResult

    @property
    def effective_map(self) -> torch.Tensor:
        """``O R`` (d_s, d_b): where the narrow residual stream sits in the reference's stream."""
        r = self.transform.residual
        return self.residual_map if r is None else self.residual_map.to(r) @ r


def embed_and_align(
    spec_small: SymmetrySpec,
    state_small: dict,
    spec_big: SymmetrySpec,
    reference: dict,
    mode: str = "orthogonal",
    iterations: int = 20,
    tol: float = 1e-4,
    residual_map: torch.Tensor | None = None,
    weighting: str = "rms",
) -> Embedded:
    """Embed the narrow model (default O), then ``weight_match`` it to the wide ``reference``.

    The wide group acts exactly on the embedded model and composes O into ``O R``, another valid
    residual map (module doc), so the aligned model computes the narrow model's function.
    """
    o = default_residual_map(spec_small.width, spec_big.width) if residual_map is None else residual_map
    embedded = embed(spec_small, state_small, spec_big, reference, o)
    match = weight_match(spec_big, reference, embedded, mode=mode, iterations=iterations, tol=tol,
                         weighting=weighting)
    return Embedded(match.state, match.canonical, o, match.transform, match)


@dataclass
class Member:
    """One merged model: its spec, the O it was embedded with (identity for the widest), the wide
    group element that aligned it (None: not moved), its own norm gains and tensor shapes."""

    spec: SymmetrySpec
    residual_map: torch.Tensor
    transform: GroupElement | None
    gains: dict
    shapes: dict
    embedded: bool

    @property
    def width(self) -> int:
        return self.spec.width


@dataclass
class WidthMerge:
    """state: the merged wide model in the widest model's gauge; canonical: with unit gains;
    widest: its index; spec: its spec; members: per input model; merge: the underlying result."""

    state: dict
    canonical: dict
    widest: int
    spec: SymmetrySpec
    members: list[Member] = field(default_factory=list)
    merge: MergeResult | None = None

    def restricted(self, k: int, gauge: bool = True) -> dict:
        """What model k receives back: the merged model restricted to its width (its own gauge)."""
        m = self.members[k]
        return restrict(self.spec, self.state, m.spec, m.residual_map, m.transform, m.gains if gauge else None,
                        m.shapes)


def merge_heterogeneous(
    specs: list[SymmetrySpec],
    states: list[dict],
    weights: list[float] | None = None,
    mode: str = "orthogonal",
    iterations: int = 20,
    tol: float = 1e-4,
    universe_iterations: int = 1,
    universe_tol: float = 1e-4,
    align: bool = True,
    weighting: str = "rms",
    progress: bool = False,
) -> WidthMerge:
    """Merge models of different widths into the widest (largest d; ties: the first).

    Every other model is embedded with the default O (exact for eps = 0), then
    :func:`fedbasin.alignment.merge` aligns them all to the widest (``align=False``: plain
    weighted average of the embeddings) and averages. The embedded narrow model is 0 on its padded
    heads/units and outside its residual subspace, so it shrinks the average there by
    ``Σ_wide w / Σ w`` (unlike HeteroFL, which averages each coordinate only over the clients that
    hold it). ``WidthMerge.restricted(k)`` is what model k receives back (see :func:`restrict`).
    """
    if len(specs) != len(states):
        raise ValueError(f"got {len(specs)} specs for {len(states)} models")
    if len(states) < 2:
        raise ValueError(f"merging needs at least 2 models, got {len(states)}")
    widest = max(range(len(specs)), key=lambda k: (specs[k].width, -k))
    big_spec, big = specs[widest], states[widest]
    members, inputs = [], []
    for k, (spec, state) in enumerate(zip(specs, states)):
        gains = canonicalize(spec, state, f"model {k}").gains
        shapes = {key: tuple(v.shape) for key, v in state.items()}
        if k == widest:
            members.append(Member(spec, torch.eye(spec.width, dtype=torch.float64), None, gains, shapes, False))
            inputs.append(state)
            continue
        o = default_residual_map(spec.width, big_spec.width)
        try:
            inputs.append(embed(spec, state, big_spec, big, o))
        except ValueError as e:
            raise ValueError(f"model {k} cannot be embedded into model {widest}: {e}") from None
        members.append(Member(spec, o, None, gains, shapes, True))
    result = merge(big_spec, inputs, weights, reference=widest, mode=mode, iterations=iterations, tol=tol,
                   universe_iterations=universe_iterations, universe_tol=universe_tol, align=align, weighting=weighting,
                   progress=progress)
    matches = list(result.matches)
    if align and len(matches) == len(states) - 1:  # the reference was not matched (one universe round)
        matches.insert(widest, None)
    for member, match in zip(members, matches if align else [None] * len(members)):
        member.transform = None if match is None else match.transform
    return WidthMerge(result.state, result.canonical, widest, big_spec, members, result)
