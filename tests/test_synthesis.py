"""Transfer inputs synthesised from the clients' models (fedbasin.server.synthesis): the ensemble gives
each input its drawn class, the classes are balanced, the priors act, and a seed repeats the inputs."""

from __future__ import annotations

import pytest
import torch

from fedbasin.models import build_model, make_config
from fedbasin.server.distill import StateEnsemble
from fedbasin.server.synthesis import synthesize_inputs, total_variation

CONFIG = {"dim": 16, "depth": 1, "heads": 2, "mlp_dim": 32, "image_size": 8, "patch_size": 2, "channels": 1,
          "num_classes": 10}


@pytest.fixture(scope="module")
def clients():
    """Three small digits ViTs trained for 10 epochs (test accuracy 0.40-0.75: an untrained ViT's
    logits barely depend on its input, so there would be nothing to invert)."""
    from fedbasin.data import load_task
    from fedbasin.training import train

    task, config = load_task("digits"), make_config("vit", CONFIG)
    states = []
    for seed in (1, 2, 3):
        member = build_model("vit", config, seed=seed)
        train(member, task.train, epochs=10, lr=5e-3, seed=seed)
        states.append(member.state_dict())
    return build_model("vit", config, seed=0), states


def agreement(model, states, split) -> float:
    with torch.no_grad():
        return float((StateEnsemble(model, states)(split.inputs).argmax(-1) == split.targets).float().mean())


def test_the_ensemble_gives_each_synthetic_input_its_drawn_class(clients):
    model, states = clients
    made = synthesize_inputs(model, states, 40, (1, 8, 8), 10, steps=100, seed=0)
    assert made.inputs.shape == (40, 1, 8, 8) and sorted(made.targets.bincount().tolist()) == [4] * 10
    start = synthesize_inputs(model, states, 40, (1, 8, 8), 10, steps=0, seed=0)  # noise: no inversion
    assert agreement(model, states, made) >= 0.9 > 0.5 >= agreement(model, states, start)
    again = synthesize_inputs(model, states, 40, (1, 8, 8), 10, steps=100, seed=0)
    assert torch.equal(again.inputs, made.inputs) and torch.equal(again.targets, made.targets)
    assert not torch.equal(synthesize_inputs(model, states, 40, (1, 8, 8), 10, steps=100, seed=1).inputs, made.inputs)


def test_the_image_priors_smooth_and_shrink_the_inputs(clients):
    model, states = clients
    free = synthesize_inputs(model, states, 20, (1, 8, 8), 10, steps=100, tv=0.0, l2=0.0, seed=0)
    smooth = synthesize_inputs(model, states, 20, (1, 8, 8), 10, steps=100, tv=1.0, l2=0.0, seed=0)
    small = synthesize_inputs(model, states, 20, (1, 8, 8), 10, steps=100, tv=0.0, l2=1.0, seed=0)
    assert total_variation(smooth.inputs) < 0.7 * total_variation(free.inputs)
    assert small.inputs.pow(2).mean() < 0.7 * free.inputs.pow(2).mean()
    with pytest.raises(ValueError, match="count"):
        synthesize_inputs(model, states, 0, (1, 8, 8), 10)


def test_the_data_free_arm_refines_and_distils_on_the_synthesised_inputs_only(monkeypatch):
    """one_shot(synthetic=N): the refiner and distiller of the data-free arm get a proxy of N synthesised
    inputs (not the server's real proxy split), and the arm's figures are in the row."""
    from fedbasin.benchmarks import oneshot
    from fedbasin.config import resolve_run_config

    seen = []
    for name in ("make_refiner", "make_distiller"):
        real = getattr(oneshot, name)

        def spy(*args, real=real, name=name):
            task = args[2] if name == "make_refiner" else args[1]
            seen.append((name, len(task.proxy), task.proxy.transform is None))
            return real(*args)

        monkeypatch.setattr(oneshot, name, spy)
    config = resolve_run_config({**oneshot.ONESHOT_DEFAULTS, "local-epochs": 2, "max-train-examples": 300,
                                 "align-iterations": 2, "proxy-size": 60, "refine-steps": 3, "distill-steps": 4})
    row = oneshot.one_shot(config, 2, progress=False, synthetic=30)
    assert ("make_refiner", 30, True) in seen and ("make_distiller", 30, True) in seen
    assert ("make_distiller", 60, True) in seen  # the real proxy split, for the arms with data
    assert row["synthetic_examples"] == 30 and 0 <= row["synthetic_agreement"] <= 1
    assert all(0 <= row[k] <= 1 for k in ("synthetic_learned", "synthetic_distilled", "synthetic_fedavg_distilled"))
