"""The barrier table's recorded learned-refinement recipes (``barriers.RECORDED_RECIPES``), run through
the driver's own ``refine_pair`` on a really trained digits pair: each keeps both functions, never
returns something worse than its start on the selection split, and honours its batch size and
selection interval."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from fedbasin.alignment import canonicalize, to_gauge
from fedbasin.alignment.proxy import proxy_streams
from fedbasin.data import load_task
from fedbasin.benchmarks import barriers

from .helpers import DIGITS_VIT, rel_err, run, spec_of, trained_digits_vit


@pytest.mark.parametrize("task", sorted(barriers.RECORDED_RECIPES))
def test_barrier_table_settings_keep_function_and_never_raise_the_selection_loss(task, monkeypatch):
    spec = spec_of("vit", DIGITS_VIT)
    a, b = (SimpleNamespace(spec=spec, family="vit", config=DIGITS_VIT, state=trained_digits_vit(seed))
            for seed in (1, 2))
    settings = barriers.refine_settings(task)
    del settings["steps"], settings["proxy_examples"]  # the table's budget; a short run here
    settings.update(steps=12, eval_every=4, batch_size=16)
    sizes = []

    def recording_streams(proxy, batch_size, **kwargs):  # the training batch size the driver asks for
        sizes.append(batch_size)
        return proxy_streams(proxy, batch_size, **kwargs)

    monkeypatch.setattr(barriers, "proxy_streams", recording_streams)
    digits = load_task("digits", seed=0)
    result = barriers.refine_pair(a, b, digits, 400, "rms", **settings)
    assert [step for step, _ in result.history] == [0, 4, 8, 12] and sizes == [16]
    assert result.best_loss <= result.initial_loss
    assert result.best_loss == min(loss for _, loss in result.history)
    x = digits.test.inputs[:32]
    out = lambda s: run("vit", DIGITS_VIT, s, x, torch.float32)  # noqa: E731
    assert rel_err(out(result.states[0]), out(b.state)) < 1e-5
    reference = to_gauge(spec, result.reference_canonical, canonicalize(spec, a.state).gains)
    assert rel_err(out(reference), out(a.state)) < 1e-5
