"""One builder for the symmetry spec of a pre-norm decoder/encoder described by a name table."""

from __future__ import annotations

from dataclasses import dataclass

from ..spec import AttentionSpec, Linear, MLPSpec, Norm, SymmetrySpec


@dataclass(frozen=True)
class Table:
    """Standard-layout names of a pre-norm Transformer (``{i}``: layer index).

    Linear modules are named without ``.weight``/``.bias``; norms by module name.
    ``writers``: (key, residual axis) of the embeddings; ``head`` reads ``final_norm`` (axis 1).
    ``gate``: the gate projection of a gated (SwiGLU) MLP, else None.
    ``norm2`` None: one norm per block feeds attention and MLP alike (Phi's parallel block
    ``h + Attn(N h) + MLP(N h)``); its readers are q/k/v and up (gate).
    Biases: ``qkv_bias``, ``o_bias``, ``mlp_bias``, ``norm_bias`` say which exist.
    """

    name: str
    layer: str
    q: str
    k: str
    v: str
    o: str
    up: str
    down: str
    norm1: str
    norm2: str | None
    final_norm: str
    head: str
    writers: tuple[tuple[str, int], ...]
    embedding: str | None = None  # token embedding (indexed by token id), may be tied to the head
    head_bias: str | None = None  # the head's bias over the vocabulary (Phi), indexed by token id
    gate: str | None = None
    norm: str = "layernorm"


def prenorm_spec(
    t: Table,
    *,
    layers: int,
    width: int,
    heads: int,
    hidden: int,
    activation: str,
    qkv_bias: bool,
    o_bias: bool = True,
    mlp_bias: bool = True,
    norm_bias: bool = True,
    head_dim: int | None = None,
    kv_heads: int | None = None,
    rotary: str | None = None,
    rotary_dims: int | None = None,
    tied: bool = False,
) -> SymmetrySpec:
    """Spec of ``layers`` pre-norm blocks named by ``t``: each norm feeds the q/k/v resp.
    up/gate readers; o/down (and their biases) write to the residual stream."""
    if head_dim is None:
        if width % heads:
            raise ValueError(f"{t.name}: width {width} is not divisible by {heads} heads")
        head_dim = width // heads
    if kv_heads and heads % kv_heads:
        raise ValueError(f"{t.name}: {heads} query heads do not split into {kv_heads} key/value groups")
    if rotary_dims is not None and (rotary_dims % 2 or not 0 < rotary_dims <= head_dim):
        raise ValueError(f"{t.name}: {rotary_dims} rotary dims per head of width {head_dim} (need even, ≥ 2)")
    norms, attention, mlp, residual = [], [], [], []
    for i in range(layers):
        p = t.layer.format(i=i)
        lin = lambda name, bias: Linear(f"{p}{name}.weight", f"{p}{name}.bias" if bias else None)  # noqa: E731
        q, k, v = (lin(n, qkv_bias) for n in (t.q, t.k, t.v))
        o = lin(t.o, o_bias)
        up, down = lin(t.up, mlp_bias), lin(t.down, mlp_bias)
        gate = lin(t.gate, mlp_bias) if t.gate else None
        attention.append(AttentionSpec(q, k, v, o, heads, head_dim, rotary,
                                       kv_heads if kv_heads != heads else None,
                                       rotary_dims if rotary_dims != head_dim else None))
        mlp.append(MLPSpec(up, down, gate, "gated" if gate else activation, hidden))
        readers1 = ((q.weight, 1), (k.weight, 1), (v.weight, 1))
        readers2 = ((up.weight, 1),) + (((gate.weight, 1),) if gate else ())
        fed = ((t.norm1, readers1), (t.norm2, readers2)) if t.norm2 else ((t.norm1, readers1 + readers2),)
        norm_biases = []
        for name, readers in fed:
            n = f"{p}{name}"
            norm_biases.append(f"{n}.bias" if norm_bias else None)
            norms.append(Norm(t.norm, f"{n}.weight", norm_biases[-1], readers))
        writers = [(o.weight, 0), (down.weight, 0)] + [(b, 0) for b in (o.bias, down.bias, *norm_biases) if b]
        residual += [*readers1, *readers2, *writers]
    nf = t.final_norm
    bf = f"{nf}.bias" if norm_bias else None
    norms.append(Norm(t.norm, f"{nf}.weight", bf, ((t.head, 1),)))
    residual += [*t.writers, (t.head, 1)] + ([(bf, 0)] if bf else [])
    return SymmetrySpec(
        width=width,
        residual=tuple(residual),
        norms=tuple(norms),
        attention=tuple(attention),
        mlp=tuple(mlp),
        tied=((t.embedding, t.head),) if tied and t.embedding else (),
        name=t.name,
        embedding_keys=(t.embedding,) if t.embedding else (),
        token_biases=(t.head_bias,) if t.head_bias and t.embedding else (),
    )
