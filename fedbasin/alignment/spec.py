"""Symmetry specs: which state-dict entries play which role, declared as data.

Every algorithm (canonicalise, transform, match, merge, refine) reads a :class:`SymmetrySpec`
and nothing else about the architecture. Tensors follow the torch ``nn.Linear`` layout
(``weight`` is (out, in)); the spec names the axis of each tensor that lives in the residual
stream, so any layout can be described. Adapters (see ``adapters.py``) build specs and, when a
checkpoint stores attention fused or transposed (GPT-2's ``Conv1D``), translate it to and from
this standard layout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import torch

Axis = tuple[str, int]  # (state-dict key, axis of that tensor that indexes the residual stream)


@dataclass(frozen=True)
class Linear:
    """A linear map in torch layout: ``weight`` (out, in), optional ``bias`` (out,)."""

    weight: str
    bias: str | None = None


@dataclass(frozen=True)
class Norm:
    """A LayerNorm/RMSNorm with gain ``weight`` and bias ``bias`` feeding ``readers``.

    ``readers`` are the residual axes of the tensors that consume this norm's output; folding
    the gain γ multiplies them by γ along that axis (row-vector math: ``W ← diag(γ) W``).
    """

    kind: Literal["layernorm", "rmsnorm"]
    weight: str | None
    bias: str | None
    readers: tuple[Axis, ...]


@dataclass(frozen=True)
class AttentionSpec:
    """Multi-head attention: q (H·d_h, d), k/v (G·d_h, d) and o (d, H·d_h) in torch layout.

    ``num_kv_heads`` G (grouped-query attention; None: G = H): query heads h·r … h·r+r−1
    (r = H/G) share key/value head h, so heads permute only together with their group and the
    within-head maps are shared by a group.
    ``rotary``: None for absolute positions, ``"half"`` when rotary plane j pairs dims
    (j, j + r_d/2) (HF Llama/NeoX, fedbasin GPT), ``"interleaved"`` when it pairs (2j, 2j+1).
    ``rotary_dims`` r_d: the first r_d dims of a head rotate (None: all, d_h); the other
    d_h − r_d dims carry no position and admit any orthogonal map (GPT-NeoX ``rotary_pct``).
    """

    q: Linear
    k: Linear
    v: Linear
    o: Linear
    num_heads: int
    head_dim: int
    rotary: Literal["half", "interleaved"] | None = None
    num_kv_heads: int | None = None
    rotary_dims: int | None = None

    @property
    def kv_heads(self) -> int:
        """G: number of key/value heads (= H without grouped-query attention)."""
        return self.num_kv_heads or self.num_heads

    @property
    def group_size(self) -> int:
        """r = H/G query heads per key/value head."""
        return self.num_heads // self.kv_heads

    @property
    def rotated(self) -> int:
        """Number of rotating dims per head (0 without rotary positions)."""
        return 0 if not self.rotary else (self.rotary_dims or self.head_dim)

    @property
    def is_plain(self) -> bool:
        """No grouped-query attention and no partial rotary (what every algorithm supports)."""
        return self.kv_heads == self.num_heads and self.rotated in (0, self.head_dim)


@dataclass(frozen=True)
class MLPSpec:
    """MLP ``down(act(up(x)) [* gate])``: up/gate (n, d), down (d, n) in torch layout.

    ``activation``: ``"elementwise"`` (GELU, ...: permutations only), ``"relu"`` (positively
    homogeneous: permutations and positive scalings) or ``"gated"`` (SwiGLU: gate and up share
    the permutation; ``up``, outside the activation, scales too).
    """

    up: Linear
    down: Linear
    gate: Linear | None = None
    activation: Literal["elementwise", "relu", "gated"] = "elementwise"
    hidden: int | None = None  # hidden width n, when known from the config


@dataclass(frozen=True)
class SymmetrySpec:
    """The symmetry group of one architecture, as a table over state-dict keys.

    width: residual width d.
    residual: every tensor axis indexing the residual stream (writers, readers, norm biases); the
        residual map O acts on all of them alike, ``X ← X ×_axis O`` (writers ``W O``, readers
        ``Oᵀ W`` in row-vector math — the same contraction for orthogonal O).
    norms: the norms with their readers (for gain folding).
    attention, mlp: the per-layer blocks carrying head and neuron symmetries.
    tied: pairs (source, alias) of keys that share storage; canonicalisation unties them.
    token_biases: an output head's bias over the vocabulary (Phi): indexed by token id like the
        head's rows, acted on by no group element.
    """

    width: int
    residual: tuple[Axis, ...]
    norms: tuple[Norm, ...]
    attention: tuple[AttentionSpec, ...] = ()
    mlp: tuple[MLPSpec, ...] = ()
    tied: tuple[tuple[str, str], ...] = ()
    name: str = "model"
    embedding_keys: tuple[str, ...] = field(default=())  # residual writers indexed by token id
    token_biases: tuple[str, ...] = field(default=())  # a head's bias over the vocabulary (see above)

    @property
    def norm_kind(self) -> str:
        """``layernorm`` if any norm centres (then O must fix the all-ones vector)."""
        return "layernorm" if any(n.kind == "layernorm" for n in self.norms) else "rmsnorm"

    def keys(self) -> set[str]:
        """Every key the spec mentions."""
        out = {k for k, _ in self.residual}
        for n in self.norms:
            out |= {k for k in (n.weight, n.bias) if k} | {k for k, _ in n.readers}
        for a in self.attention:
            out |= {k for lin in (a.q, a.k, a.v, a.o) for k in (lin.weight, lin.bias) if k}
        for m in self.mlp:
            out |= {k for lin in (m.up, m.down, m.gate) if lin for k in (lin.weight, lin.bias) if k}
        return out

    def validate(self, state: dict[str, torch.Tensor], what: str = "model") -> None:
        """Raise ``ValueError`` naming the offending key if ``state`` does not fit this spec."""
        missing = sorted(k for k in self.keys() if k not in state)
        if missing:
            raise ValueError(f"{what}: missing key(s) required by the {self.name} spec: {missing[:8]}")
        for key, axis in self.residual:
            shape = tuple(state[key].shape)
            if len(shape) <= axis or shape[axis] != self.width:
                raise ValueError(
                    f"{what}: {key} has shape {shape}; expected residual width {self.width} on axis {axis}"
                )
        for a in self.attention:
            for lin, ax, heads in ((a.q, 0, a.num_heads), (a.k, 0, a.kv_heads), (a.v, 0, a.kv_heads),
                                   (a.o, 1, a.num_heads)):
                if state[lin.weight].shape[ax] != heads * a.head_dim:
                    raise ValueError(
                        f"{what}: {lin.weight} has shape {tuple(state[lin.weight].shape)}; expected "
                        f"{heads} heads x {a.head_dim} = {heads * a.head_dim} on axis {ax}"
                    )
        for m in self.mlp:
            n = state[m.up.weight].shape[0]
            if m.hidden and n != m.hidden:
                raise ValueError(f"{what}: {m.up.weight} has {n} hidden units; the config says {m.hidden}")
            for lin, ax in ((m.gate, 0), (m.down, 1)):
                if lin is not None and state[lin.weight].shape[ax] != n:
                    raise ValueError(
                        f"{what}: {lin.weight} has shape {tuple(state[lin.weight].shape)}; "
                        f"expected MLP width {n} on axis {ax}"
                    )
        for key in sorted(k for k, t in state.items() if isinstance(t, torch.Tensor)):  # the spec's and the rest
            t = state[key]
            if t.is_floating_point() and t.numel() and not all(map(math.isfinite, map(float, t.aminmax()))):
                raise ValueError(f"{what}: {key} contains NaN or infinite values")


def check_compatible(spec: SymmetrySpec, reference: dict, candidate: dict, names=("reference", "candidate")):
    """Both states fit ``spec``, hold the same keys and every tensor has the same shape in both (a model with
    another depth, norm or position scheme differs in its keys; one with another head count of the same width
    does not: that the spec's config is the models' is the caller's to know)."""
    spec.validate(reference, names[0])
    spec.validate(candidate, names[1])
    if only := sorted(set(reference) ^ set(candidate)):
        side = names[1] if only[0] in candidate else names[0]
        raise ValueError(f"{names[1]}: {len(only)} key(s) in one of the two models only, e.g. {only[0]} (in the "
                         f"{side}); different architectures?")
    for key in sorted(reference):
        if isinstance(reference[key], torch.Tensor) and reference[key].shape != getattr(candidate[key], "shape", None):
            raise ValueError(
                f"{names[1]}: {key} has shape {tuple(getattr(candidate[key], 'shape', ()))} but the {names[0]} has "
                f"{tuple(reference[key].shape)} (different architectures?)"
            )


def token_indexed_keys(spec: SymmetrySpec, state: dict) -> set[str]:
    """Tensors whose rows are indexed by token id: the token embeddings and every residual reader
    with as many rows as the (first) embedding, i.e. an output head over the vocabulary."""
    if not spec.embedding_keys:
        return set()
    vocab = state[spec.embedding_keys[0]].shape[0]
    readers = {k for k, axis in spec.residual if axis == 1 and state[k].ndim == 2 and state[k].shape[0] == vocab}
    return set(spec.embedding_keys) | readers
