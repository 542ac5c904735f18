"""Learned refinement on several CPU threads (``batch_workers``): each training batch is cut into
slices whose passes run side by side, and the gradient summed over the slices is the whole batch's
(fedbasin.alignment.workers._Workers)."""

from __future__ import annotations

import pytest
import torch

from fedbasin.alignment import learned_refine, proxy_streams
from fedbasin.alignment.workers import _Workers
from fedbasin.models import build_model
from fedbasin.training import cross_entropy
from tests.helpers import GPT, VIT, inputs, trained_like
from tests.test_soft_labels import assert_same_function, digits_pair


def forward(state, x, module):
    return torch.func.functional_call(module, state, (x,))


@pytest.mark.parametrize("family, config, batch", [("vit", VIT, 7), ("gpt", GPT, 5)])
def test_sliced_backward_gives_the_whole_batch_loss_and_gradient(family, config, batch):
    """Three slices of an uneven batch (images; token blocks) back-propagate the same loss and
    gradient, into the tensors the state was computed from, as the whole batch does."""
    model = trained_like(family, config, seed=0)
    x, y = inputs(family, config, seed=1)
    x, y = x.repeat(2, *[1] * (x.dim() - 1))[:batch], y.repeat(2, *[1] * (y.dim() - 1))[:batch]
    weights = model.state_dict()
    results = []
    for count in (1, 3):
        scale = torch.ones((), dtype=torch.float64, requires_grad=True)
        shift = torch.zeros_like(weights[next(k for k in weights if k.endswith("weight"))], requires_grad=True)
        state = {k: v * scale for k, v in weights.items()}
        first = next(k for k in state if k.endswith("weight"))
        state[first] = state[first] + shift
        workers = _Workers(model, torch.device("cpu"), count)
        loss = workers.backward(cross_entropy, lambda s, inp, module=workers.modules[0]: forward(s, inp, module),
                                state, x, y)
        workers.close()
        results.append((float(loss), scale.grad.clone(), shift.grad.clone()))
    (loss1, scale1, shift1), (loss3, scale3, shift3) = results
    assert loss3 == pytest.approx(loss1, rel=1e-12)
    torch.testing.assert_close(scale3, scale1, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(shift3, shift1, rtol=1e-10, atol=1e-12)
    assert float(shift1.abs().max()) > 0


def test_workers_map_keeps_the_order_and_gives_each_thread_its_own_module():
    workers = _Workers(build_model("vit", VIT), torch.device("cpu"), 3)
    seen = workers.map(lambda module, item: (item, id(module)), range(8))
    workers.close()
    assert [item for item, _ in seen] == list(range(8))
    modules = [module for _, module in seen]
    assert modules[:3] == [id(m) for m in workers.modules] and len(set(modules)) == 3
    assert all(modules[i] == modules[i % 3] for i in range(8))  # item i on thread i mod 3


def refine(batch_workers: int, steps: int = 20):
    model, spec, task, a, b = digits_pair()
    data = proxy_streams(task.proxy, 32, seed=0)
    result = learned_refine(spec, model, a, [b], cross_entropy, data.batches, data.selection, data.evaluation,
                            steps=steps, lr=1e-2, eval_every=5, soft_labels=0.5, batch_workers=batch_workers)
    return model, b, result


def test_refinement_on_two_workers_follows_the_one_worker_run_and_keeps_the_function():
    model, b, two = refine(2)
    _, _, one = refine(1)
    assert (one.workers, two.workers) == (1, 2) and two.summary()["batch_workers"] == 2
    assert two.best_step > 0 and two.best_loss < two.initial_loss
    # the same selection and evaluation scores (exact, batch by batch), the same path up to rounding
    assert two.initial_loss == one.initial_loss and two.evaluation_initial_loss == one.evaluation_initial_loss
    assert [s for s, _ in two.history] == [s for s, _ in one.history]
    for (_, loss2), (_, loss1) in zip(two.history, one.history):
        assert loss2 == pytest.approx(loss1, rel=1e-4)
    assert_same_function(model, b, two.states[0])


@pytest.mark.parametrize("value", [-1, 1.5, True])
def test_batch_workers_refusal(value):
    model, spec, task, a, b = digits_pair()
    data = proxy_streams(task.proxy, 32, seed=0)
    with pytest.raises(ValueError, match=r"batch_workers must be an integer >= 0 \(0: one per CPU thread\)"):
        learned_refine(spec, model, a, [b], cross_entropy, data.batches, data.selection, steps=2,
                       batch_workers=value)


def test_two_workers_give_the_same_refinement_on_any_thread_count():
    """Each slice runs single-threaded, so ``batch_workers=2`` gives the same figures whether torch
    has one thread or several (the barrier table's settings fix it at 2)."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        _, _, one_thread = refine(2, steps=10)
        torch.set_num_threads(3)
        _, _, three_threads = refine(2, steps=10)
    finally:
        torch.set_num_threads(threads)
    assert one_thread.history == three_threads.history
    assert all(torch.equal(one_thread.states[0][k], three_threads.states[0][k]) for k in one_thread.states[0])


def test_cli_refine_workers(tmp_path, capsys):
    """``--refine-workers`` reaches the refinement (its summary reports the threads); it is refused
    below 0 and without ``--refine-data``."""
    import json

    from fedbasin.checkpoint import save_checkpoint
    from fedbasin.cli import main
    from tests.helpers import DIGITS_VIT, cli_error, trained_digits_vit

    for seed in (0, 1):
        save_checkpoint(tmp_path / f"m{seed}", "vit", DIGITS_VIT, trained_digits_vit(seed))
    m0, m1, out = (str(tmp_path / n) for n in ("m0", "m1", "out"))
    assert main(["merge", m0, m1, "--out", out, "--refine-data", "digits", "--refine-steps", "4",
                 "--refine-examples", "120", "--refine-workers", "3", "--distill-steps", "0"]) == 0
    assert json.loads(capsys.readouterr().out)["refinement"]["batch_workers"] == 3
    assert "-1" in cli_error(capsys, ["merge", m0, m1, "--out", out + "2", "--refine-data", "digits",
                                      "--refine-workers", "-1"])
    assert cli_error(capsys, ["merge", m0, m1, "--out", out + "2", "--refine-workers", "2"]).endswith(
        "--refine-workers has no effect without --refine-data")


def test_the_server_refiner_passes_refine_workers():
    from fedbasin.config import RunConfigError, resolve_run_config
    from fedbasin.server.server_app import make_refiner

    model, spec, task, a, b = digits_pair()
    config = resolve_run_config({"proxy-size": 300, "refine-steps": 3, "refine-workers": 2})
    result = make_refiner(spec, model, task, config)(a, [b])
    assert result.workers == 2 and result.best_loss <= result.initial_loss
    with pytest.raises(RunConfigError, match="run-config refine-workers=-1 must be at least 0"):
        resolve_run_config({"refine-workers": -1})


def test_the_workers_benchmark_runs_and_reports_every_timing(capsys):
    from fedbasin.benchmarks import bench_workers

    result = bench_workers.main(["--batch", "4", "--repeats", "1"])
    timings = [k for k in result if k.endswith("_s")]
    assert len(timings) == 5 and all(result[k] > 0 for k in timings)
    assert torch.get_num_threads() == result["threads"]  # the benchmark puts the thread count back
