"""Adapters: build the :class:`SymmetrySpec` of a concrete architecture.

An adapter knows (1) the spec over the *standard layout* (separate q/k/v, torch ``nn.Linear``
layout) and (2) how to translate a checkpoint's state dict to and from that layout. fedbasin
models are stored in the standard layout already (each registers the input side of its spec with
:func:`register_native`); Hugging Face adapters live in ``hf.py``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable

from .spec import AttentionSpec, Linear, MLPSpec, Norm, SymmetrySpec

StateDict = dict


def _identity(state: StateDict) -> StateDict:
    return dict(state)


@dataclass
class Adapter:
    """A spec plus layout translation; ``to_standard``/``from_standard`` are inverse maps."""

    spec: SymmetrySpec
    to_standard: Callable[[StateDict], StateDict] = _identity
    from_standard: Callable[[StateDict], StateDict] = _identity
    notes: dict = field(default_factory=dict)


_ACTIVATION_KIND = {"gelu": "elementwise", "relu": "relu", "swiglu": "gated"}


def block_specs(prefix, dim, heads, mlp_dim, norm, activation, bias, rotary=None):
    """Norms, attention and MLP spec of one fedbasin pre-norm block at ``prefix``."""
    b = (lambda name: f"{prefix}{name}.bias") if bias else (lambda name: None)
    lin = lambda name: Linear(f"{prefix}{name}.weight", b(name))  # noqa: E731
    norm_bias = (lambda name: f"{prefix}{name}.bias") if (bias and norm == "layernorm") else (lambda n: None)
    gated = activation == "swiglu"
    attention = AttentionSpec(lin("attn.q"), lin("attn.k"), lin("attn.v"), lin("attn.o"), heads, dim // heads, rotary)
    mlp = MLPSpec(lin("mlp.up"), lin("mlp.down"), lin("mlp.gate") if gated else None, _ACTIVATION_KIND[activation], mlp_dim)
    readers1 = tuple((f"{prefix}attn.{p}.weight", 1) for p in "qkv")
    readers2 = tuple((f"{prefix}mlp.{p}.weight", 1) for p in (("up", "gate") if gated else ("up",)))
    norms = (
        Norm(norm, f"{prefix}norm1.weight", norm_bias("norm1"), readers1),
        Norm(norm, f"{prefix}norm2.weight", norm_bias("norm2"), readers2),
    )
    residual = list(readers1 + readers2) + [(f"{prefix}attn.o.weight", 0), (f"{prefix}mlp.down.weight", 0)]
    residual += [(k, 0) for k in (attention.o.bias, mlp.down.bias, norms[0].bias, norms[1].bias) if k]
    return norms, attention, mlp, residual


@dataclass(frozen=True)
class Inputs:
    """The family-specific part of a fedbasin model's spec (the blocks and the final norm are shared):
    ``residual`` entries (key, axis) of its embeddings, the ``tied`` (embedding, head) pairs and the
    ``embedding_keys`` (token embeddings: rows are tokens)."""

    residual: tuple = ()
    tied: tuple = ()
    embedding_keys: tuple = ()


#: fedbasin family → ``config → Inputs``; each model module registers its own (``fedbasin.models``,
#: through ``fedbasin.models.registry.register``), so this layer names no model family
_NATIVE_INPUTS: dict[str, Callable[[object], Inputs]] = {}


def register_native(family: str, inputs: Callable[[object], Inputs]) -> None:
    """Record how to build the input side of the spec of fedbasin family ``family``."""
    if _NATIVE_INPUTS.get(family, inputs) is not inputs:
        raise ValueError(f"fedbasin family {family!r} is registered twice")
    _NATIVE_INPUTS[family] = inputs


def fedbasin_adapter(family: str, config) -> Adapter:
    """Spec of a fedbasin model (``ViT``, ``GPT``, ...: a registered family) with the given config (dataclass)."""
    if family not in _NATIVE_INPUTS:
        raise ValueError(f"no symmetry spec for model family {family!r}")
    if not dataclasses.is_dataclass(config):
        raise ValueError(f"config must be the {family} family's config dataclass (e.g. "
                         f"fedbasin.models.make_config({family!r}, values)), got {type(config).__name__}")
    c = config
    norm_bias = "norm_f.bias" if (c.bias and c.norm == "layernorm") else None
    rotary = "half" if getattr(c, "position", "learned") == "rope" else None
    norms, attention, mlp, residual = [], [], [], []
    for i in range(c.depth):
        n, a, m, r = block_specs(f"blocks.{i}.", c.dim, c.heads, c.mlp_dim, c.norm, c.activation, c.bias, rotary)
        norms += n
        attention.append(a)
        mlp.append(m)
        residual += r
    norms.append(Norm(c.norm, "norm_f.weight", norm_bias, (("head.weight", 1),)))
    residual += [("head.weight", 1)] + ([(norm_bias, 0)] if norm_bias else [])
    inputs = _NATIVE_INPUTS[family](c)
    residual += list(inputs.residual)
    spec = SymmetrySpec(
        width=c.dim,
        residual=tuple(residual),
        norms=tuple(norms),
        attention=tuple(attention),
        mlp=tuple(mlp),
        tied=tuple(inputs.tied),
        name=f"fedbasin-{family}",
        embedding_keys=tuple(inputs.embedding_keys),
    )
    return Adapter(spec)
