"""The mutation check itself (scripts/mutations.py, tests/mutants.py): a failed assertion catches a
mutant, a crash does not; every mutant still fits the code it replaces."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _mutations_script():
    from tests.helpers import load_script

    return load_script("mutations")


def test_a_crash_is_told_from_a_failed_assertion():
    script = _mutations_script()
    asserted, crashed = script.split_failures({
        "tests/a.py::t1": "assert 2.3 < 2.3",
        "tests/a.py::t2": "AssertionError: the weights differ",
        "tests/a.py::t3": "Failed: DID NOT RAISE <class 'ValueError'>",
        "tests/b.py::t4": "TypeError: mutant() got an unexpected keyword argument 'release'",
        "tests/b.py::t5": "AttributeError: 'NoneType' object has no attribute 'scale'",
    })
    assert asserted == ["tests/a.py::t1", "tests/a.py::t2", "tests/a.py::t3"]
    assert crashed == ["tests/b.py::t4: TypeError", "tests/b.py::t5: AttributeError"]


@pytest.mark.parametrize("name", ["head_step", "mlp_step", "residual_step"])
def test_matching_mutants_return_identity_elements_of_the_right_shape(monkeypatch, name):
    """Each step mutant keeps the step's signature and result type, so weight matching runs to
    the end under it (a crash would hide whether the tests check values)."""
    from fedbasin.alignment import matching, weight_match
    from tests.helpers import VIT, spec_of, trained_like
    from tests.mutants import MUTATIONS

    for method in ("head_step", "head_maps", "neuron_step", "residual_step"):  # undone after the test
        monkeypatch.setattr(matching._Matcher, method, getattr(matching._Matcher, method))
    MUTATIONS[name]()
    spec = spec_of("vit", VIT)
    a, b = (trained_like("vit", VIT, seed=s).state_dict() for s in (0, 1))
    result = weight_match(spec, a, b, iterations=2)
    g = result.transform
    if name == "residual_step":
        assert torch.equal(g.residual, torch.eye(spec.width, dtype=g.residual.dtype))
    if name == "head_step":
        assert all(h is None or (torch.equal(h.perm, torch.arange(h.perm.numel())) and h.qk is None) for h in g.heads)
    if name == "mlp_step":
        assert all(n is None or torch.equal(n.perm, torch.arange(n.perm.numel())) for n in g.neurons)
