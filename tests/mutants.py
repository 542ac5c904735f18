"""Deliberately broken variants of fedbasin features, for mutation checks of the test suite.

``python -m pytest --mutate NAME`` (see tests/conftest.py) applies one of these in the test
process before any test module is imported; nothing on disk changes. A test suite that still
passes under a mutant does not test that feature. ``scripts/mutations.py`` runs them all.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import pkgutil
import sys

import torch


def _import_all_fedbasin() -> None:
    import fedbasin

    for info in pkgutil.walk_packages(fedbasin.__path__, "fedbasin."):
        try:
            importlib.import_module(info.name)
        except Exception:  # an optional dependency missing: that module cannot hold a reference
            pass


def replace_everywhere(original, replacement) -> int:
    """Rebind every module-level name, and every default argument of a module-level function or
    method, bound to ``original`` (in fedbasin and tests) to ``replacement``."""
    _import_all_fedbasin()
    count = 0
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith(("fedbasin", "tests")):
            continue
        for attr, value in list(vars(module).items()):
            if value is original:
                setattr(module, attr, replacement)
                count += 1
            functions = [value] if inspect.isfunction(value) else []
            if inspect.isclass(value):
                functions += [f for f in vars(value).values() if inspect.isfunction(f)]
            for f in functions:
                if f.__defaults__ and any(d is original for d in f.__defaults__):
                    f.__defaults__ = tuple(replacement if d is original else d for d in f.__defaults__)
                    count += 1
                if f.__kwdefaults__ and any(d is original for d in f.__kwdefaults__.values()):
                    f.__kwdefaults__ = {k: replacement if d is original else d for k, d in f.__kwdefaults__.items()}
                    count += 1
    if count == 0:
        raise RuntimeError(f"mutation found no reference to {original!r}")
    return count


def _forcing(function, **forced):
    """``function`` with some arguments forced, however the caller passes them: ``name=value``, or
    ``name=callable`` mapping the given (or default) value to the forced one."""
    signature = inspect.signature(function)

    @functools.wraps(function)
    def mutant(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        for name, value in forced.items():
            bound.arguments[name] = value(bound.arguments[name]) if callable(value) else value
        return function(*bound.args, **bound.kwargs)

    return mutant


def _replace_result(owner, name: str, identity) -> None:
    """``owner.name`` still runs (whatever arguments the code passes) but returns
    ``identity(result)``: the identity element of the result's shape instead of the step found."""
    original = getattr(owner, name)

    @functools.wraps(original)
    def mutant(*args, **kwargs):
        return identity(original(*args, **kwargs))

    setattr(owner, name, mutant)


def weights_ignored() -> None:
    """The aligned average gives every model with a positive weight the same weight."""
    from fedbasin.alignment.merge import average_states

    def mutant(states, weights, *args, **kwargs):  # invalid weights (negative, NaN, inf) reach the real checks
        return average_states(states, [1.0 if 0 < w < float("inf") else w for w in weights], *args, **kwargs)

    replace_everywhere(average_states, mutant)


def universe_off() -> None:
    """Universe matching runs a single pass whatever ``universe_iterations`` asks for."""
    from fedbasin.alignment.merge import merge

    replace_everywhere(merge, _forcing(merge, universe_iterations=lambda n: min(n, 1)))


def refinement_returns_start() -> None:
    """Learned refinement takes no step: it returns the weight-matching start."""
    from fedbasin.alignment.refine import learned_refine

    replace_everywhere(learned_refine, _forcing(learned_refine, steps=lambda steps: min(steps, 0)))


def head_step_identity() -> None:
    """Weight matching never moves heads (no head permutation, no within-head maps)."""
    from fedbasin.alignment.group import HeadMap
    from fedbasin.alignment.matching import _Matcher

    for step in ("head_step", "head_maps"):  # the full step and the maps-only sweeps
        _replace_result(_Matcher, step, lambda found: HeadMap(perm=torch.arange(found.perm.numel())))


def mlp_step_identity() -> None:
    """Weight matching never permutes MLP neurons."""
    from fedbasin.alignment.group import NeuronMap
    from fedbasin.alignment.matching import _Matcher

    _replace_result(_Matcher, "neuron_step", lambda found: NeuronMap(perm=torch.arange(found.perm.numel())))


def residual_step_identity() -> None:
    """Weight matching never rotates the residual stream (identity O, also as the second start)."""
    from fedbasin.alignment.matching import _Matcher

    _replace_result(_Matcher, "residual_step",
                    lambda found: torch.eye(*found.shape, dtype=found.dtype, device=found.device))


def gauge_skipped() -> None:
    """Results stay canonical (unit gains) instead of taking the reference's gains back."""
    from fedbasin.alignment.canonical import to_gauge

    replace_everywhere(to_gauge, lambda spec, state, gains: dict(state))


def auto_ignores_kind() -> None:
    """``auto`` takes the image classifier's settings whatever the model is."""
    from fedbasin import options

    resolve = options.resolve_refine
    replace_everywhere(resolve, _forcing(resolve, kind=options.IMAGE))


def budget_ignored() -> None:
    """A budgeted refinement (``steps=None``) runs a fixed 10 steps, checked once, whatever its budget."""
    from fedbasin.alignment.refine import learned_refine

    def fixed(steps):
        return 10 if steps is None else steps

    replace_everywhere(learned_refine, _forcing(learned_refine, steps=fixed))


def proxy_untrimmed() -> None:
    """A budgeted refinement scores its whole selection and evaluation splits, however dear a pass over them is."""
    from fedbasin.alignment import refine

    refine._first_examples = lambda batches, n: batches


def distill_budget_ignored() -> None:
    """A distillation sized by its budget (``steps=None``; ``distill-steps = auto``) takes a fixed 10 steps,
    whatever its budget and the timed step."""
    from fedbasin.server.distill import StepCost

    StepCost.steps = lambda self, seconds, eval_every=10: 10


def distill_rate_unsized() -> None:
    """An image classifier's distillation takes Adam 0.002 whatever the steps of its run (the rate is not sized
    by them)."""
    from fedbasin import options

    options.DISTILL_SETTINGS[options.IMAGE]["lr"] = 0.002


def mixup_labels_unmixed() -> None:
    """Mixup views keep the first image's label (the labels are not mixed as the images are)."""
    from fedbasin.server import distill

    original = distill.random_mixup

    @functools.wraps(original)
    def mutant(base=None):
        mix = original(base)

        def augment(x, generator, y=None):
            return mix(x, generator)

        return augment

    replace_everywhere(original, mutant)


def translator_drops_head_lr() -> None:
    """The options translator forgets the per-head learning rate (the maps all train at ``lr``)."""
    from fedbasin import options

    original = options.refine_call

    @functools.wraps(original)
    def mutant(*args, **kwargs):
        return {**original(*args, **kwargs), "head_lr": None}

    replace_everywhere(original, mutant)


def phi_unregistered() -> None:
    """The Phi family is not registered (no ``phi`` model type, no ``train --model hf-phi``)."""
    from fedbasin.alignment import hf
    from fedbasin.alignment.families import registry

    del registry._REGISTRY["phi"]
    del hf.SUPPORTED_MODEL_TYPES["phi"]


def shared_norm_feeds_attention_only() -> None:
    """A parallel block's one norm (Phi's) feeds q/k/v only: its gain is not folded into the MLP."""
    import dataclasses

    from fedbasin.alignment.families import table

    original = table.prenorm_spec

    @functools.wraps(original)
    def mutant(t, **kwargs):
        spec = original(t, **kwargs)
        if t.norm2:
            return spec
        mlp = {lin.weight for m in spec.mlp for lin in (m.up, m.gate) if lin}
        norms = tuple(dataclasses.replace(n, readers=tuple(r for r in n.readers if r[0] not in mlp)) for n in spec.norms)
        return dataclasses.replace(spec, norms=norms)

    replace_everywhere(original, mutant)


def token_biases_uncut() -> None:
    """A restricted training vocabulary cuts the head's rows but not its bias (Phi's ``lm_head.bias``)."""
    from fedbasin.alignment.vocabulary import TrainingVocabulary

    original = TrainingVocabulary.__init__

    @functools.wraps(original)
    def mutant(self, spec, *args, **kwargs):
        original(self, spec, *args, **kwargs)
        self.keys = self.keys - set(spec.token_biases)

    TrainingVocabulary.__init__ = mutant


def new_config_ignores_context() -> None:
    """``train --model hf-*`` gives the model its config class's default positions, not the data's context."""
    from fedbasin.alignment.families.registry import Family

    original = Family.new_config

    @functools.wraps(original)
    def mutant(self, model_type, shape, data):
        config = original(self, model_type, shape, data)
        attribute = self.data_fields.get("block_size")
        if attribute:
            setattr(config, attribute, getattr(self.config_class(model_type)(), attribute))
        return config

    Family.new_config = mutant


MUTATIONS = {
    "weights": weights_ignored,
    "universe": universe_off,
    "refinement": refinement_returns_start,
    "head_step": head_step_identity,
    "mlp_step": mlp_step_identity,
    "residual_step": residual_step_identity,
    "gauge": gauge_skipped,
    "auto_kind": auto_ignores_kind,
    "budget": budget_ignored,
    "budget_proxy": proxy_untrimmed,
    "distill_budget": distill_budget_ignored,
    "distill_rate": distill_rate_unsized,
    "mixup_labels": mixup_labels_unmixed,
    "translator": translator_drops_head_lr,
    "phi": phi_unregistered,
    "shared_norm": shared_norm_feeds_attention_only,
    "token_biases": token_biases_uncut,
    "new_config": new_config_ignores_context,
}
