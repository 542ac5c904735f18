"""Ensemble distillation sized by a time budget (``distill-steps = auto``, ``distill-budget``): the steps
follow from timing one step's parts before the first, the teachers' outputs are cached for exactly the
sized steps, the run stops at its budget should its steps run slower than timed, and an explicit count
runs as before. Timing is never asserted: a fake clock (every reading 1/64 s later) makes the sizing the
same on any machine, and the tests check the sized count and the mechanism."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from fedbasin.config import RunConfigError, resolve_run_config
from fedbasin.models import build_model
from fedbasin.server import distill as distill_module
from fedbasin.server import server_app
from fedbasin.server.distill import StepCost, ensemble_distill
from fedbasin.strategies import AlignedFedAvg
from fedbasin.training import cross_entropy
from tests.helpers import DIGITS_VIT
from tests.test_distill import digits_round, one_shot_round, serverapp_identity  # noqa: F401

TICK = 1 / 64  # seconds between two readings of the fake clock


def fake_clock(monkeypatch, *modules, after=None):
    """Every module's ``time.perf_counter`` reads one clock that moves TICK per reading (``after``:
    (n, seconds): from the n-th reading on, ``seconds`` per reading); Adam's estimate is 0."""
    calls = [0]

    def clock() -> float:
        calls[0] += 1
        if after is not None and calls[0] > after[0]:
            return after[0] * TICK + (calls[0] - after[0]) * after[1]
        return calls[0] * TICK

    for module in modules:
        monkeypatch.setattr(module, "time", SimpleNamespace(perf_counter=clock))
    monkeypatch.setattr(distill_module, "adam_seconds", lambda parameters, device: 0.0)
    return calls


def _tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=40, n_positions=12, n_embd=16, n_layer=1, n_head=2, bos_token_id=0,
                        eos_token_id=0)  # dropout on in train mode: the probe must leave the random state

    def make(seed):
        torch.manual_seed(seed)
        return GPT2LMHeadModel(config)
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, 40, (2, 8), generator=g), torch.randint(0, 40, (2, 8), generator=g))
               for _ in range(6)]
    return make, batches, lambda logits, y: cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def _tiny_vit():
    make = lambda seed: build_model("vit", DIGITS_VIT, seed=seed)  # noqa: E731
    g = torch.Generator().manual_seed(0)
    batches = [(torch.rand(4, 1, 8, 8, generator=g), torch.randint(0, 10, (4,), generator=g)) for _ in range(6)]
    return make, batches, cross_entropy


@pytest.mark.parametrize("kind", ["vit", "gpt2"])
def test_a_budget_sizes_the_steps_before_the_first_and_the_recorded_count_repeats_the_run_bitwise(kind, monkeypatch):
    """``steps=None``: the initial check (1 tick), the teachers' pass and the student's step (1 tick each, the
    mean of 3 passes; Adam 0) are timed after 15 ticks; a step costs 2 ticks + 1/16 of a check, one check is
    reserved: ⌊(1.45 − 16/64) / (33/1024)⌋ = 37 steps. The probe changes nothing (weights, the batch order, the
    random state behind dropout): the same call with ``steps=37`` gives bitwise the same state and history."""
    make, batches, loss_fn = _tiny_gpt2() if kind == "gpt2" else _tiny_vit()
    model, teachers, student = make(0), [make(s).state_dict() for s in (1, 2)], make(3).state_dict()
    fake_clock(monkeypatch, distill_module)

    def run(**options):
        torch.manual_seed(0)  # dropout
        return ensemble_distill(model, student, teachers, loss_fn, (batches[i % 4] for i in range(10**6)),
                                batches[4:], eval_every=16, lr=1e-2, **options)

    sized = run(steps=None, budget=1.45)
    assert sized.steps == math.floor((1.45 - 16 * TICK) / (2 * TICK + TICK / 16)) == 37
    assert not sized.stopped_at_budget and sized.summary()["steps"] == 37
    assert [step for step, _ in sized.history] == [0, 16, 32, 37]
    again = run(steps=37)
    assert again.history == sized.history and again.steps == 37 and again.best_step == sized.best_step
    for key, value in again.state.items():
        assert torch.equal(sized.state[key], value), key


def test_step_cost_counts_the_checks_and_the_reserve():
    cost = StepCost(teachers=0.25, student=0.5, check=1.0, reserve=2.0)
    assert cost.steps(2.0 + 0.85 * 7, eval_every=10) == 7  # each step 0.25 + 0.5 + 1/10 of a check
    assert cost.steps(1.0) == 0 and StepCost(0.0, 0.0, 0.0).steps(5.0) == 0


def test_a_budgeted_run_whose_steps_slow_down_stops_within_its_budget(monkeypatch):
    """Steps slower than timed (the clock jumps to 1 s per reading once the run is sized) stop the run once
    its budget less its last checks is spent, with a last check at that step; so does a run of given steps with a
    budget (the ServerApp's when ``prepare`` sized it); the summary reports it."""
    make, batches, loss_fn = _tiny_vit()
    model, teachers, student = make(0), [make(s).state_dict() for s in (1, 2)], make(3).state_dict()
    fake_clock(monkeypatch, distill_module, after=(16, 1.0))
    result = ensemble_distill(model, student, teachers, loss_fn, (batches[i % 4] for i in range(10**6)),
                              batches[4:], steps=None, budget=4.0, eval_every=16, lr=1e-2)
    # sized after 15 ticks for 116 steps; at step k the clock reads 15 ticks + k s past the start: step 4 passes
    # 4 s less one check
    assert result.steps == result.stopped_at_budget == 4 and result.history[-1][0] == 4
    assert result.summary()["stopped_at_budget"] == 4
    fake_clock(monkeypatch, distill_module, after=(0, 1.0))
    given = ensemble_distill(model, student, teachers, loss_fn, (batches[i % 4] for i in range(10**6)),
                             batches[4:], steps=50, budget=5.0, eval_every=16, lr=1e-2)
    assert given.stopped_at_budget == given.steps == 3 and given.history[-1][0] == 3  # 5 s past the start


def test_budget_arguments_are_checked():
    make, batches, loss_fn = _tiny_vit()
    model, state = make(0), make(1).state_dict()
    with pytest.raises(ValueError, match="give budget"):
        ensemble_distill(model, state, [state], loss_fn, iter(batches), batches[:1], steps=None)
    with pytest.raises(ValueError, match="budget must be a number of seconds > 0, got 0"):
        ensemble_distill(model, state, [state], loss_fn, iter(batches), batches[:1], steps=None, budget=0)
    cached = distill_module.cache_teacher_outputs(model, [state], iter(batches), 2)
    with pytest.raises(ValueError, match="cached teacher outputs fix the run's steps"):
        ensemble_distill(model, state, cached, loss_fn, iter(batches), batches[:1], steps=None, budget=1.0)


def test_the_run_config_takes_auto_and_a_budget_and_refuses_bad_values_in_one_line_each():
    """``distill-steps`` takes an integer >= 0 or auto, ``distill-budget`` seconds >= 0; the default distils
    whenever the server holds a proxy split, 0 turns it off; auto without a proxy split distils nothing and is
    no error, nor is a budget of 0."""
    proxy, none = SimpleNamespace(proxy=object()), SimpleNamespace(proxy=None)
    default = resolve_run_config({})
    assert (default["distill-steps"], default["distill-budget"]) == ("auto", 120.0)
    assert server_app.distils(default, proxy) and not server_app.distils(default, none)
    assert not server_app.distils(resolve_run_config({"distill-steps": 0}), proxy)
    auto = resolve_run_config({"distill-steps": "auto"})  # proxy-size 0: accepted, nothing to distil on
    assert auto["distill-steps"] == "auto" and not server_app.distils(auto, none)
    assert server_app.distils(auto, proxy)
    assert not server_app.distils(resolve_run_config({"distill-steps": "auto", "distill-budget": 0.0}), proxy)
    assert server_app.distils(resolve_run_config({"distill-steps": 5, "proxy-size": 10}), proxy)
    for values, line in (({"distill-budget": -1.0}, "run-config distill-budget=-1.0 must be at least 0"),
                         ({"distill-steps": -1}, "run-config distill-steps=-1 must be at least 0"),
                         ({"distill-steps": "many"}, "run-config distill-steps='many': expected an integer or auto"),
                         ({"distill-budget": "auto"}, "run-config distill-budget='auto': expected a number")):
        with pytest.raises(RunConfigError) as refused:
            resolve_run_config(values)
        assert len(refused.value.problems) == 1 and refused.value.problems[0].startswith(line), refused.value


ROUND = {"proxy-size": 300, "distill-lr": 0.003, "model.dim": 16, "model.depth": 1, "model.heads": 2,
         "model.mlp-dim": 32}


@pytest.mark.usefixtures("serverapp_identity")
def test_a_flower_round_sizes_its_distillation_before_the_merge_and_caches_that_many_steps(monkeypatch):
    """``distill-steps = auto``: ``prepare`` times one step (the first client standing in for the student)
    and the checks, sizes the run to the budget left, caches the clients' outputs for exactly those steps;
    ``distill`` takes them within the budget prepare left; the round's metrics report the sized steps."""
    config = resolve_run_config({**ROUND, "distill-steps": "auto", "distill-budget": 0.45})  # a cache within budget
    task, model, spec, states, options = digits_round()
    costs, given = [], []
    probe, run = server_app.probe_step, server_app.ensemble_distill
    monkeypatch.setattr(server_app, "probe_step", lambda *a, **k: costs.append(probe(*a, **k)) or costs[-1])
    monkeypatch.setattr(server_app, "ensemble_distill",
                        lambda model, student, teachers, *a, **k: given.append((teachers, k)) or run(
                            model, student, teachers, *a, **k))
    fake_clock(monkeypatch, distill_module, server_app)
    arrays, metrics = one_shot_round(AlignedFedAvg(spec, distill=server_app.make_distiller(model, task, config),
                                                   **options), states)
    # prepare: its start, 14 readings of the probe (teachers and student 3 passes each, a check), the sizing: 15
    # ticks spent
    expected = costs[0].steps(0.45 - 15 * TICK)
    assert expected == 4 and metrics["distill_steps"] == expected and metrics["distill_stopped_at_budget"] == 0
    teachers, keywords = given[0]
    assert [type(t).__name__ for t in teachers] == ["TeacherOutputs"] * 3
    assert {len(t) for t in teachers} == {expected} and keywords["steps"] == expected
    assert keywords["budget"] == 0.45 - 16 * TICK  # what prepare left
    assert arrays is not None and metrics["round_failed"] == 0


@pytest.mark.usefixtures("serverapp_identity")
def test_an_explicit_count_runs_unbounded_and_reports_its_steps(monkeypatch):
    """A given ``distill-steps`` is exactly that many steps, no budget (``distill-budget`` ignored)."""
    config = resolve_run_config({**ROUND, "distill-steps": 3, "distill-budget": 0.001})
    task, model, spec, states, options = digits_round()
    given = []
    run = server_app.ensemble_distill
    monkeypatch.setattr(server_app, "ensemble_distill", lambda *a, **k: given.append(k) or run(*a, **k))
    _, metrics = one_shot_round(AlignedFedAvg(spec, distill=server_app.make_distiller(model, task, config), **options),
                                states)
    assert (given[0]["steps"], given[0]["budget"]) == (3, None)
    assert metrics["distill_steps"] == 3 and metrics["distill_stopped_at_budget"] == 0
    assert 0 < metrics["distill_seconds"] <= metrics["align_seconds"]  # the merge's time, the distillation's inside


@pytest.mark.usefixtures("serverapp_identity")
def test_without_prepare_a_flower_distiller_sizes_itself(monkeypatch):
    """Called on its own (no ``prepare`` this round: the teachers' weights), ``distill`` sizes its run with the
    merge as the student, from the whole budget."""
    config = resolve_run_config({**ROUND, "distill-steps": "auto", "distill-budget": 0.5})
    task, model, spec, states, _ = digits_round()
    fake_clock(monkeypatch, distill_module, server_app)
    result = server_app.make_distiller(model, task, config)(states[0], states)
    # the checks (selection, evaluation), teachers and student 1 tick each, 16 ticks spent; 2 checks reserved
    assert result.steps == math.floor((0.5 - 16 * TICK - 2 * TICK) / (2 * TICK + TICK / 10)) > 0
    assert result.summary()["steps"] == result.steps


def _token_stream(n: int = 6, batch_size: int = 2):
    """An epoch-by-epoch stream of ``n`` distinct token blocks (and the tiny GPT-2 of these tests)."""
    from fedbasin.alignment.proxy import TrainingStream
    from fedbasin.data.task import Split

    make, _, loss_fn = _tiny_gpt2()
    g = torch.Generator().manual_seed(1)
    blocks = torch.randint(0, 40, (n, 8), generator=g)
    return make, TrainingStream(Split(blocks, torch.roll(blocks, -1, 1)), batch_size, seed=0), loss_fn


def test_the_ensemble_memo_runs_each_distinct_input_once_and_gives_the_ensemble():
    """Four epochs of 6 distinct blocks: the teachers see each block once (6 rows, not 24) and every
    step's target is the ensemble's output on that batch (float rounding apart); past its byte budget
    the memo keeps what fits and evaluates the rest each time."""
    from fedbasin.server.distill import EnsembleMemo, StateEnsemble

    make, stream, _ = _token_stream()
    model, teachers = make(0), [make(s).state_dict() for s in (1, 2)]
    ensemble = StateEnsemble(model, teachers)
    seen = []

    def counted(x):
        seen.append(len(x))
        return ensemble(x)

    row_bytes = 8 * 40 * 4
    for budget, evaluated in ((2 << 20, 6), (2 * row_bytes, 2 + 4 * 4)):
        memo, seen[:] = EnsembleMemo(counted, budget), []
        with torch.no_grad():
            for _ in range(12):  # 4 epochs of 3 batches
                x, _ = next(stream)
                torch.testing.assert_close(memo(x), ensemble(x), rtol=1e-5, atol=1e-6)
        assert sum(seen) == evaluated and len(memo.rows) == min(6, budget // row_bytes)


def test_memo_steps_count_the_first_epoch_only_when_every_output_fits():
    from fedbasin.server.distill import memo_teacher_steps

    _, stream, _ = _token_stream(n=7, batch_size=2)
    assert memo_teacher_steps(stream, None, row_bytes=100, budget_bytes=700) == 4  # ⌈7 / 2⌉ batches
    assert memo_teacher_steps(stream, None, row_bytes=100, budget_bytes=699) is None  # not all fit
    assert memo_teacher_steps(stream, lambda x, g: x, row_bytes=1, budget_bytes=700) is None  # random views
    assert memo_teacher_steps(iter([]), None, row_bytes=1) is None  # a stream of unknown size
    cost = StepCost(teachers=1.0, student=0.5, check=1.0, reserve=2.0)
    # 4 steps at 1.6 s (teachers, student, a tenth of a check), then 0.6 s each
    assert cost.steps(2.0 + 4 * 1.6 + 0.6 * 10, eval_every=10, teacher_steps=4) == 14
    assert cost.steps(2.0 + 4 * 1.6 + 0.6 * 10, eval_every=10) == 7
    assert cost.steps(2.0 + 3.3, eval_every=10, teacher_steps=4) == 2  # inside the first epoch: every step pays


def test_distillation_with_the_memo_trains_as_without_it_and_sizes_its_run_for_it(monkeypatch):
    """The memo changes the teachers' cost, not the run: the student after 12 steps equals the one
    distilled with the teachers run every step (float rounding apart), from 6 forward passes of the
    teachers instead of 24; a run sized by its budget counts the teachers in the first epoch's 3 steps
    only, so it takes more steps in the same budget."""
    make, stream, loss_fn = _token_stream()
    model, teachers, student = make(0), [make(s).state_dict() for s in (1, 2)], make(3).state_dict()
    selection = [next(_token_stream(n=4)[1])]
    calls = []
    model.register_forward_hook(lambda module, args, out: calls.append(len(args[0])))

    def run(**options):
        calls.clear()
        torch.manual_seed(0)  # dropout
        _, fresh, _ = _token_stream()
        return ensemble_distill(model, student, teachers, loss_fn, fresh, selection, eval_every=4, lr=1e-2, **options)

    with_memo, evaluated = run(steps=12), sum(calls)
    without, evaluated_without = run(steps=12, memo_bytes=0), sum(calls)
    checks = 2 * (12 // 4 + 1)  # the student's selection checks (one batch of 2 blocks); then the teachers' rows
    assert (evaluated - checks - 12 * 2, evaluated_without - checks - 12 * 2) == (2 * 6, 2 * 24)
    assert with_memo.history[0] == without.history[0]
    for (step, loss), (step_without, loss_without) in zip(with_memo.history, without.history):
        assert step == step_without and loss == pytest.approx(loss_without, abs=1e-5)
    for key, value in with_memo.state.items():
        torch.testing.assert_close(value, without.state[key], rtol=1e-4, atol=1e-5)

    fake_clock(monkeypatch, distill_module)
    sized = run(steps=None, budget=1.45)
    fake_clock(monkeypatch, distill_module)
    unmemoised = run(steps=None, budget=1.45, memo_bytes=0)
    per_step = 1 * TICK + TICK / 4  # the student, a quarter of a check: after 3 steps that also ran the teachers
    left = 1.45 - 15 * TICK - TICK  # the probe's 15 ticks, one check reserved
    assert unmemoised.steps == math.floor(left / (per_step + TICK))
    assert sized.steps == 3 + math.floor((left - 3 * (per_step + TICK)) / per_step) > unmemoised.steps
