"""Alignment from activation statistics on proxy data (a start for learned refinement).

Every group element acts on a model's internal activations in a known way, whatever the
residual map: with candidate θ_B transformed by g = (O, heads π/A/B, neurons p),

* residual stream (every norm's input, normalised per token: LayerNorm ``(x − μ)/σ``, RMSNorm
  ``x / rms``): ``x' = x O``;
* head h's queries, keys and outputs (the o-projection's input block): ``q'_h = q_{π[h]} A_h``,
  ``k'_h = k_{π[h]} A_h`` (orthogonal A), ``z'_h = z_{π[h]} B_h``;
* MLP hidden unit i (the down-projection's input): ``h'_i = h_{p[i]}``.

So one forward pass of each model over the same proxy tokens fixes every factor independently,
by least squares against the reference's activations (no iteration):

* ``O = argmax tr(Oᵀ M)``, ``M = Σ_sites X̂_Bᵀ X̂_A`` (Procrustes; LayerNorm: O·1 = 1);
* heads: Hungarian on ``C[h, j] = ‖Z_A,hᵀ Z_B,j‖_* / (‖Z_A,h‖ ‖Z_B,j‖) + the same for the
  stacked queries and keys``, then ``B_h`` = Procrustes of ``Z_B,π[h]ᵀ Z_A,h`` and ``A_h`` of the
  query/key analogue (RoPE: one rotation per rotary plane);
* neurons: Hungarian on the correlation of the hidden activations (Git Re-Basin's activation
  matching); units the data cannot tell apart (constant on the proxy data, e.g. dead ReLUs) are
  matched by the cosine similarity of their weights, a term 10⁻³ times smaller.

The result is an exact group element (function preserved), returned like :func:`weight_match`'s.
Activations are read with forward hooks on the modules that hold the spec's norms, o-projections
and down-projections (found through the adapter's ``from_standard`` key translation).
"""

from __future__ import annotations

import time
from typing import Callable, Iterable

import torch
from torch import nn

from fedbasin.weights import weightless_copy

from .canonical import canonicalize, fold_tiny, to_gauge
from .group import GroupElement, HeadMap, NeuronMap, apply_group
from .matching import MatchResult, hungarian, nuclear_norms, plane_procrustes, procrustes, residual_procrustes
from .spec import SymmetrySpec, check_compatible


def _module_name(key: str, to_module_state: Callable[[dict], dict], modules: dict) -> str:
    """The module holding the standard-layout parameter ``key`` (e.g. GPT-2's ``attn.o.weight``
    lives in ``attn.c_proj``)."""
    try:
        mapped = list(to_module_state({key: torch.zeros(1, 1)}))
    except (ValueError, KeyError):
        mapped = []
    name = mapped[0].rsplit(".", 1)[0] if len(mapped) == 1 else None
    if name not in modules:
        raise ValueError(f"activation start: no module of the model holds {key} (found {mapped})")
    return name


def _normalised(x: torch.Tensor, layernorm: bool) -> torch.Tensor:
    """Per-token LayerNorm ``(x − μ)/σ`` or RMSNorm ``x/rms`` without gain or bias, as (N, d)."""
    x = x.reshape(-1, x.shape[-1]).double()
    if layernorm:
        x = x - x.mean(-1, keepdim=True)
    return x / x.pow(2).mean(-1, keepdim=True).add(1e-12).sqrt()


class _Recorder:
    """Forward hooks that keep, for one forward pass, every activation the matching needs."""

    def __init__(self, spec: SymmetrySpec, model: nn.Module, to_module_state: Callable[[dict], dict]):
        modules = dict(model.named_modules())
        self.acts: dict = {}
        self.handles = []
        sites = [n for n in spec.norms if n.weight is not None]
        if not sites:
            raise ValueError("activation start: the spec has no norm with a weight (no residual site to read)")
        for i, norm in enumerate(sites):
            module = modules[_module_name(norm.weight, to_module_state, modules)]
            self.handles.append(module.register_forward_hook(self._keep(("norm", i), both=True)))
        self.qk_norm = []  # per attention layer: index of the norm feeding its queries
        for i, a in enumerate(spec.attention):
            feeding = [j for j, n in enumerate(sites) if (a.q.weight, 1) in n.readers]
            if not feeding:
                raise ValueError(f"activation start: no norm feeds {a.q.weight}")
            self.qk_norm.append(feeding[0])
            module = modules[_module_name(a.o.weight, to_module_state, modules)]
            self.handles.append(module.register_forward_hook(self._keep(("heads", i))))
        for i, m in enumerate(spec.mlp):
            module = modules[_module_name(m.down.weight, to_module_state, modules)]
            self.handles.append(module.register_forward_hook(self._keep(("hidden", i))))

    def _keep(self, name, both: bool = False):
        def hook(module, inputs, output):
            self.acts[name] = (inputs[0].detach(), output.detach()) if both else inputs[0].detach()
        return hook

    def close(self) -> None:
        for h in self.handles:
            h.remove()


class _Statistics:
    """Running cross-products of the reference's (A) and the candidate's (B) activations."""

    def __init__(self):
        self.sums: dict = {}

    def add(self, name, value: torch.Tensor) -> None:
        self.sums[name] = value if name not in self.sums else self.sums[name] + value

    def cross(self, name, a: torch.Tensor, b: torch.Tensor) -> None:
        """``Bᵀ A``, ``ΣA``, ``ΣB``, ``ΣA²``, ``ΣB²`` (per column) and N of two (N, n) activations."""
        self.add((name, "n"), float(a.shape[0]))
        self.add((name, "BA"), b.T @ a)
        self.add((name, "a"), a.sum(0))
        self.add((name, "b"), b.sum(0))
        self.add((name, "aa"), a.pow(2).sum(0))
        self.add((name, "bb"), b.pow(2).sum(0))


def _rows(t: torch.Tensor) -> torch.Tensor:
    """Activations (..., n) as float64 rows (N, n), one per token."""
    return t.reshape(-1, t.shape[-1]).double()


def _block_values(ba: torch.Tensor, aa: torch.Tensor, bb: torch.Tensor, heads: int) -> torch.Tensor:
    """``C[h, j] = ‖(Bᵀ A)_{j,h}‖_* / √(‖A_h‖² ‖B_j‖²)`` from the full cross-product ``Bᵀ A``."""
    dh = ba.shape[0] // heads
    blocks = ba.reshape(heads, dh, heads, dh).permute(2, 0, 1, 3)  # [h, j] = (B_jᵀ A_h)
    energy_a = aa.reshape(heads, dh).sum(-1)
    energy_b = bb.reshape(heads, dh).sum(-1)
    return nuclear_norms(blocks) / (energy_a[:, None] * energy_b[None, :]).sqrt().clamp_min(1e-30)


TIE_BREAK = 1e-3  # weight of the weight-similarity term in the neuron score (correlations lie in [−1, 1])


def _unit_similarity(m, ref: dict, cand: dict, residual: torch.Tensor) -> torch.Tensor:
    """Cosine similarity (n, n) of hidden units' weights — up (and gate) rows with bias, down
    column — of the reference (rows) and of the candidate in the reference's residual basis."""
    def features(state, o):
        parts = []
        for lin in (m.up, m.gate):
            if lin is not None:
                parts.append(state[lin.weight].double() @ o)
                if lin.bias:
                    parts.append(state[lin.bias].double()[:, None])
        parts.append(state[m.down.weight].double().T @ o)
        f = torch.cat(parts, 1)
        return f / f.norm(dim=1, keepdim=True).clamp_min(1e-300)

    eye = torch.eye(residual.shape[0], dtype=torch.float64, device=residual.device)
    return features(ref, eye) @ features(cand, residual.double()).T


def activation_match(
    spec: SymmetrySpec,
    model: nn.Module,
    reference: dict,
    candidate: dict,
    batches: Iterable,
    to_module_state: Callable[[dict], dict] | None = None,
) -> MatchResult:
    """Align ``candidate`` to ``reference`` (standard-layout states) from their activations on
    ``batches`` (``(inputs, targets)`` pairs or inputs; only the inputs are used): residual
    Procrustes, head and neuron Hungarian matching as in the module docstring.

    ``model``: a module of the architecture (its own parameters are not used); ``to_module_state``
    maps a standard-layout state to the module's keys (an adapter's ``from_standard``). Models
    with grouped-query attention or partial rotary are refused. Returns a :class:`MatchResult`
    (``objective``: the normalised residual fit ``tr(Oᵀ M) / Σ‖X̂‖²`` before and after)."""
    t0 = time.perf_counter()
    for a in spec.attention:
        if not a.is_plain:
            raise ValueError(f"activation start: {a.q.weight} uses grouped-query attention or partial rotary "
                             "(not supported; use the weight-matching start)")
    check_compatible(spec, reference, candidate)
    module_state = to_module_state or (lambda state: state)
    ref_c = canonicalize(spec, reference, "reference", validate=False)
    cand_c = canonicalize(spec, candidate, "candidate", validate=False, like=ref_c.gains)
    device = next(iter(ref_c.state.values())).device
    frozen = weightless_copy(model, device).eval()  # the states bring the weights
    recorder = _Recorder(spec, frozen, module_state)
    layernorm = spec.norm_kind == "layernorm"
    stats = _Statistics()

    def run(state: dict, x: torch.Tensor) -> dict:
        recorder.acts = {}
        with torch.no_grad():
            torch.func.functional_call(frozen, module_state(state), (x,), tie_weights=False)
        return recorder.acts

    seen = 0
    try:
        for batch in batches:
            x = batch[0] if isinstance(batch, (tuple, list)) else batch
            x = x.to(device)
            acts_a, acts_b = run(ref_c.state, x), run(cand_c.state, x)
            for key in (k for k in acts_a if k[0] == "norm"):  # residual stream at each norm's input
                x_a, x_b = (_normalised(acts[key][0], layernorm) for acts in (acts_a, acts_b))
                stats.add("residual", x_b.T @ x_a)
                stats.add("residual_energy", x_a.pow(2).sum())
            for i, a in enumerate(spec.attention):
                site = ("norm", recorder.qk_norm[i])  # queries and keys from the norm output feeding them

                def project(acts, state, lin):
                    out = _rows(acts[site][1]) @ state[lin.weight].double().T
                    return out + state[lin.bias].double() if lin.bias else out

                qk_a = torch.cat([project(acts_a, ref_c.state, lin) for lin in (a.q, a.k)])
                qk_b = torch.cat([project(acts_b, cand_c.state, lin) for lin in (a.q, a.k)])
                stats.cross(("qk", i), qk_a, qk_b)
                stats.cross(("heads", i), _rows(acts_a[("heads", i)]), _rows(acts_b[("heads", i)]))
            for i in range(len(spec.mlp)):
                stats.cross(("hidden", i), _rows(acts_a[("hidden", i)]), _rows(acts_b[("hidden", i)]))
            seen += 1
    finally:
        recorder.close()
    if seen == 0:
        raise ValueError("activation start: no proxy batches to compute activations on")
    s = stats.sums
    residual = residual_procrustes(s["residual"], layernorm).to(next(iter(cand_c.state.values())).dtype)
    heads = []
    for i, a in enumerate(spec.attention):
        H = a.num_heads
        values = sum(_block_values(s[(name, i), "BA"], s[(name, i), "aa"], s[(name, i), "bb"], H)
                     for name in ("qk", "heads"))
        perm = hungarian(values)
        dh = a.head_dim

        def within(name):  # (H, d_h, d_h): block (B_π[h]ᵀ A_h) of Bᵀ A
            blocks = s[(name, i), "BA"].reshape(H, dh, H, dh).permute(0, 2, 1, 3)  # [j, h]
            return blocks[perm, torch.arange(H)]

        qk = plane_procrustes(within("qk"), a.rotary)[0] if a.rotary else procrustes(within("qk"))
        heads.append(HeadMap(perm, qk.float(), procrustes(within("heads")).float()))
    neurons = []
    for i, m in enumerate(spec.mlp):
        n = s[("hidden", i), "n"]
        mean_a, mean_b = s[("hidden", i), "a"] / n, s[("hidden", i), "b"] / n
        std_a = (s[("hidden", i), "aa"] / n - mean_a**2).clamp_min(0).sqrt()
        std_b = (s[("hidden", i), "bb"] / n - mean_b**2).clamp_min(0).sqrt()
        scale = std_a[:, None] * std_b[None, :]
        cov = s[("hidden", i), "BA"].T / n - mean_a[:, None] * mean_b[None, :]
        corr = torch.where(scale > 1e-12 * float(scale.max()), cov / scale.clamp_min(1e-300), 0.0)
        # units the data never separates (e.g. dead ReLUs) are told apart by their weights
        neurons.append(NeuronMap(hungarian(corr + TIE_BREAK * _unit_similarity(m, ref_c.state, cand_c.state, residual))))
    transform = GroupElement(residual, heads, neurons)
    dtypes = {k: v.dtype for k, v in candidate.items()}
    aligned = fold_tiny(spec, apply_group(spec, cand_c.state, transform), ref_c.gains)
    canonical = {k: v.to(dtypes[k]) for k, v in aligned.items()}
    state = to_gauge(spec, canonical, ref_c.gains)
    energy = float(s["residual_energy"])
    fit = [float(torch.trace(s["residual"])) / energy,
           float(torch.trace(residual.double().T @ s["residual"])) / energy]
    return MatchResult(state, canonical, transform, fit, fit[0], time.perf_counter() - t0, 1, "activations")

