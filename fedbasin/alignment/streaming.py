"""Streamed weight matching for checkpoints larger than memory allows to hold twice in float32.

The objective of :func:`~fedbasin.alignment.weight_match` splits into units — one per layer
(its attention, MLP and norms) plus one global unit (embeddings, final norm, head) — and every
group factor except the residual map O acts inside one unit. So one iteration is one pass over
the layers: load a layer of both models (stored dtype → float32), canonicalise it, apply the
current transform, take the head and MLP steps, add its residual cross-covariance to C, drop it.
The residual step then needs only the d×d matrix C: every residual tensor is linear in O, so
``J(O_step) = tr(O_stepᵀ C)/P`` — no second pass. The global unit is moved only by O, so its
cross-covariance K₀ is computed once (``C_global = O_totᵀ K₀``). A final pass writes the aligned
candidate unit by unit in its stored dtype. Peak memory: one layer of each model in float32
plus the transform, independent of depth.

Sources are callables ``load(keys) -> {key: tensor}`` (e.g. :class:`fedbasin.checkpoint.LazyWeights`);
the sink is ``write({key: tensor})``, called once per unit.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from .canonical import canonicalize, fold_tiny, to_gauge
from .group import GroupElement, apply_group, compose
from .matching import MODES, _Matcher, _Objective
from .progress import progress_bar
from .spec import SymmetrySpec


@dataclass
class Unit:
    """A slice of a spec: one layer (index ``layer``) or the global tensors (``layer`` None)."""

    spec: SymmetrySpec
    keys: list[str]
    layer: int | None


def units_of(spec: SymmetrySpec) -> list[Unit]:
    """Per-layer sub-specs (attention i, MLP i, the norms feeding them) and the global rest."""
    layers = max(len(spec.attention), len(spec.mlp))
    owner: dict[str, int] = {}
    for i, a in enumerate(spec.attention):
        for lin in (a.q, a.k, a.v, a.o):
            owner.update({k: i for k in (lin.weight, lin.bias) if k})
    for i, m in enumerate(spec.mlp):
        for lin in (m.up, m.gate, m.down):
            if lin:
                owner.update({k: i for k in (lin.weight, lin.bias) if k})
    norm_owner = {}
    for n in spec.norms:
        layer = {owner.get(k) for k, _ in n.readers}
        if len(layer) == 1 and None not in layer:
            norm_owner[n.weight] = layer.pop()
            owner.update({k: norm_owner[n.weight] for k in (n.weight, n.bias) if k})
    units = []
    for i in [*range(layers), None]:
        keys = sorted(k for k in spec.keys() if owner.get(k) == i)
        sub = dataclasses.replace(
            spec,
            residual=tuple(ax for ax in spec.residual if owner.get(ax[0]) == i),
            norms=tuple(n for n in spec.norms if owner.get(n.weight if n.weight else n.readers[0][0]) == i),
            attention=tuple(spec.attention[i:i + 1]) if i is not None and i < len(spec.attention) else (),
            mlp=tuple(spec.mlp[i:i + 1]) if i is not None and i < len(spec.mlp) else (),
            tied=spec.tied if i is None else (),
            embedding_keys=spec.embedding_keys if i is None else (),
            token_biases=spec.token_biases if i is None else (),
        )
        units.append(Unit(sub, keys, i))
    return units


@dataclass
class StreamResult:
    """Objective per iteration (J, as in ``weight_match``), the transform, timings, and the
    reference's norm gains (norm weight key → γ: the gauge the candidate is written in)."""

    objective: list[float]
    transform: GroupElement
    iterations: int
    seconds: float
    phases: dict = field(default_factory=dict)
    gains: dict = field(default_factory=dict)


def _float32(state: dict) -> dict:
    return {k: v.float() if v.is_floating_point() and v.element_size() < 4 else v for k, v in state.items()}


def stream_match(
    spec: SymmetrySpec,
    load_reference: Callable[[list[str]], dict],
    load_candidate: Callable[[list[str]], dict],
    write: Callable[[dict], None] | None = None,
    mode: str = "orthogonal",
    iterations: int = 2,
    tol: float = 1e-4,
    weighting: str = "rms",
    device: str | torch.device = "cpu",
    progress: bool = False,
) -> StreamResult:
    """Align the candidate to the reference one layer at a time (see the module docstring).

    The same coordinate ascent as :func:`~fedbasin.alignment.weight_match` (heads and MLP of
    each layer, then the residual map), started at the identity; J never decreases. ``write``
    receives the aligned candidate (reference gauge, the candidate's stored dtypes) unit by unit.
    Work is done in float32 on ``device``.
    """
    if mode not in MODES:
        raise ValueError(f"symmetry mode must be one of {MODES}, got {mode!r}")
    t0 = time.perf_counter()
    device = torch.device(device)
    units = units_of(spec)
    g = GroupElement.identity(spec)
    phases = dict.fromkeys(("setup", "layers", "residual", "write"), 0.0)

    def canonical_pair(unit: Unit):
        ref = _float32({k: v.to(device) for k, v in load_reference(unit.keys).items()})
        cand = _float32({k: v.to(device) for k, v in load_candidate(unit.keys).items()})
        unit.spec.validate(ref, "reference")
        unit.spec.validate(cand, "candidate")
        ref_c = canonicalize(unit.spec, ref, validate=False)  # the candidate folds the reference's tiny dims alike
        return ref_c, canonicalize(unit.spec, cand, validate=False, like=ref_c.gains)

    # pass 0: weights, normaliser, reference gains, K0 of the global unit
    norm = 0.0
    ref_gains: dict = {}
    free = None
    initial = 0.0
    bar = progress_bar(len(units), progress, "streamed matching: setup", "layer")
    for unit in units:
        ref_c, cand_c = canonical_pair(unit)
        ref_gains.update(ref_c.gains)
        J = _Objective(unit.spec, ref_c.state, cand_c.state, weighting)
        norm += J.norm if weighting != "uniform" else 0.0
        initial += J(cand_c.state)[0] * J.norm
        if unit.layer is None:
            matcher = _Matcher(unit.spec, ref_c.state, J, mode)
            free = matcher.covariance(cand_c.state, unit.spec.residual)
        bar.update(1)
    bar.close()
    norm = norm or 1.0
    d = spec.width
    free = torch.zeros(d, d, device=device) if free is None else free
    objective = [initial / norm]
    phases["setup"] = time.perf_counter() - t0

    def layer_element(i: int) -> GroupElement:
        """g restricted to layer i (heads, neurons) without the residual map."""
        e = GroupElement(None, [None] * len(spec.attention), [None] * len(spec.mlp))
        if i < len(spec.attention):
            e.heads[i] = g.heads[i]
        if i < len(spec.mlp):
            e.neurons[i] = g.neurons[i]
        return e

    def sliced(e: GroupElement, i: int) -> GroupElement:
        return GroupElement(e.residual, e.heads[i:i + 1], e.neurons[i:i + 1])

    done = 0
    bar = progress_bar(iterations, progress, "streamed matching", "it")
    while done < iterations:
        clock = time.perf_counter()
        c = g.residual.to(free).T @ free if g.residual is not None else free.clone()
        total = 0.0
        layer_bar = progress_bar(len(units) - 1, progress, f"streamed matching: pass {done + 1}", "layer")
        for unit in units:
            if unit.layer is None:
                continue
            layer_bar.update(1)
            i = unit.layer
            ref_c, cand_c = canonical_pair(unit)
            current = sliced(layer_element(i), i)
            current.residual = g.residual
            state = apply_group(unit.spec, cand_c.state, current)
            J = _Objective(unit.spec, ref_c.state, cand_c.state, weighting)
            matcher = _Matcher(unit.spec, ref_c.state, J, mode)
            value, terms = J(state)
            local = GroupElement(None, [None] * len(unit.spec.attention), [None] * len(unit.spec.mlp))
            for kind, blocks in (("heads", unit.spec.attention), ("neurons", unit.spec.mlp)):
                if not blocks:
                    continue
                step = GroupElement(None, [None] * len(unit.spec.attention), [None] * len(unit.spec.mlp))
                step_fn = matcher.head_step if kind == "heads" else matcher.neuron_step
                getattr(step, kind)[0] = step_fn(blocks[0], state)
                moved = apply_group(unit.spec, state, step)
                new_value, new_terms = J(moved, (state, terms))
                if new_value >= value:
                    state, value, terms, local = moved, new_value, new_terms, compose(local, step)
            # fold the accepted layer steps into g (they act before the residual map)
            before = sliced(layer_element(i), i)
            merged = compose(before, local)
            if i < len(spec.attention):
                g.heads[i] = merged.heads[0]
            if i < len(spec.mlp):
                g.neurons[i] = merged.neurons[0]
            cov = matcher.covariance(state, unit.spec.residual)
            if cov is not None:
                c += cov
            total += value * J.norm
        layer_bar.close()
        phases["layers"] += time.perf_counter() - clock
        clock = time.perf_counter()
        # residual step from C alone: J is linear in the step O_s, J(O_s) = const + tr(O_sᵀ C)
        const = total - float(torch.trace(c)) + float(torch.trace(g.residual.to(free).T @ free if g.residual is not None else free))
        before_value = (const + float(torch.trace(c))) / norm
        step_o = matcher.orthogonal_map(c, {"x": c})
        after_value = (const + float((step_o.to(c) * c).sum())) / norm
        if after_value >= before_value:
            g.residual = step_o if g.residual is None else g.residual @ step_o.to(g.residual)
            value = after_value
        else:
            value = before_value
        phases["residual"] += time.perf_counter() - clock
        previous = objective[-1]
        objective.append(value)
        done += 1
        bar.update(1)
        if value - previous <= tol * max(abs(previous), 1e-12):
            break
    bar.close()

    if write is not None:
        clock = time.perf_counter()
        bar = progress_bar(len(units), progress, "streamed matching: write", "layer")
        for unit in units:
            raw = {k: v for k, v in load_candidate(unit.keys).items()}
            dtypes = {k: v.dtype for k, v in raw.items()}
            cand_c = canonicalize(unit.spec, _float32({k: v.to(device) for k, v in raw.items()}), validate=False,
                                  like=ref_gains)
            del raw
            if unit.layer is None:
                element = GroupElement(g.residual, [], [])
            else:
                element = sliced(layer_element(unit.layer), unit.layer)
                element.residual = g.residual
            state = fold_tiny(unit.spec, apply_group(unit.spec, cand_c.state, element), ref_gains)
            state = to_gauge(unit.spec, state, {k: v for k, v in ref_gains.items() if k in state})
            write({k: v.to(dtypes[k]).cpu() for k, v in state.items()})
            bar.update(1)
        bar.close()
        phases["write"] = time.perf_counter() - clock
    return StreamResult(objective, g, done, time.perf_counter() - t0, phases, ref_gains)
