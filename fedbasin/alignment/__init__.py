"""Exact Transformer symmetries, canonical forms and model alignment (no Flower imports here)."""

from .adapters import Adapter, fedbasin_adapter
from .canonical import Canonical, canonicalize, is_canonical, to_gauge
from .group import (
    GroupElement,
    HeadMap,
    NeuronMap,
    apply_group,
    compose,
    inverse,
    random_group_element,
    random_orthogonal,
)
from .interpolation import Curve, interpolate, interpolation_curve, lambda_grid, loss_barrier
from .matching import MatchResult, weight_match
from .merge import Combiner, MergeResult, WeightedAverage, as_combiner, average_states, merge, shares_basis
from .proxy import ProxyStreams, proxy_streams
from .refine import RefineResult, learned_refine, refined_merge
from .spec import AttentionSpec, Linear, MLPSpec, Norm, SymmetrySpec, check_compatible
from .width import embed, merge_heterogeneous, restrict

__all__ = [
    "Adapter", "AttentionSpec", "Canonical", "Combiner", "Curve", "GroupElement", "HeadMap", "Linear", "MLPSpec",
    "MatchResult", "MergeResult", "NeuronMap", "Norm", "SymmetrySpec", "apply_group", "average_states",
    "canonicalize", "check_compatible", "compose", "fedbasin_adapter", "inverse", "interpolate", "interpolation_curve",
    "is_canonical", "lambda_grid", "loss_barrier", "merge", "shares_basis", "random_group_element", "random_orthogonal",
    "to_gauge", "weight_match", "ProxyStreams", "RefineResult", "learned_refine", "proxy_streams", "refined_merge", "embed", "merge_heterogeneous", "restrict",
    "WeightedAverage", "as_combiner",
]
