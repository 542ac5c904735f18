"""Deliberately broken variants of fedbasin features, for mutation checks of the test suite.

``python -m pytest --mutate NAME`` (see tests/conftest.py) applies one of these in the test
process before any test module is imported; nothing on disk changes. A test suite that still
passes under a mutant does not test that feature. ``scripts/mutations.py`` runs them all.
"""

from __future__ import annotations

import importlib
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
    """Rebind every module-level name bound to ``original`` (in fedbasin and tests) to ``replacement``."""
    _import_all_fedbasin()
    count = 0
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith(("fedbasin", "tests")):
            continue
        for attr, value in list(vars(module).items()):
            if value is original:
                setattr(module, attr, replacement)
                count += 1
    if count == 0:
        raise RuntimeError(f"mutation found no reference to {original!r}")
    return count


def weights_ignored() -> None:
    """The aligned average gives every model with a positive weight the same weight."""
    from fedbasin.alignment.merge import average_states

    def mutant(states, weights):
        return average_states(states, [1.0 if w > 0 else 0.0 for w in weights])

    replace_everywhere(average_states, mutant)


def universe_off() -> None:
    """Universe matching runs a single pass whatever ``universe_iterations`` asks for."""
    from fedbasin.alignment.merge import merge

    def mutant(*args, **kwargs):
        if len(args) > 7:
            args = args[:7] + (1,) + args[8:]
        else:
            kwargs["universe_iterations"] = 1
        return merge(*args, **kwargs)

    replace_everywhere(merge, mutant)


def refinement_returns_start() -> None:
    """Learned refinement takes no step: it returns the weight-matching start."""
    from fedbasin.alignment.refine import learned_refine

    def mutant(*args, **kwargs):
        if len(args) > 7:
            args = args[:7] + (0,) + args[8:]
        else:
            kwargs["steps"] = 0
        return learned_refine(*args, **kwargs)

    replace_everywhere(learned_refine, mutant)


def head_step_identity() -> None:
    """Weight matching never moves heads (no head permutation, no within-head maps)."""
    from fedbasin.alignment.matching import _Matcher

    _Matcher.head_step = lambda self, a, state: None


def mlp_step_identity() -> None:
    """Weight matching never permutes MLP neurons."""
    from fedbasin.alignment.matching import _Matcher

    _Matcher.neuron_step = lambda self, m, state: None


def residual_step_identity() -> None:
    """Weight matching never rotates the residual stream (identity O, also as the second start)."""
    from fedbasin.alignment.matching import _Matcher

    def mutant(self, state, axes=None):
        first = state[self.spec.residual[0][0]]
        return torch.eye(self.spec.width, dtype=first.dtype, device=first.device)

    _Matcher.residual_step = mutant


def gauge_skipped() -> None:
    """Results stay canonical (unit gains) instead of taking the reference's gains back."""
    from fedbasin.alignment.canonical import to_gauge

    replace_everywhere(to_gauge, lambda spec, state, gains: dict(state))


MUTATIONS = {
    "weights": weights_ignored,
    "universe": universe_off,
    "refinement": refinement_returns_start,
    "head_step": head_step_identity,
    "mlp_step": mlp_step_identity,
    "residual_step": residual_step_identity,
    "gauge": gauge_skipped,
}
