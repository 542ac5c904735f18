"""The one options schema (``fedbasin.options``): the CLI flags, the run-config keys, their checks and
the translation into ``learned_refine`` all come from it; ``auto`` is chosen by what the model is and
sized by a time budget."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import pytest

from fedbasin import options as schema
from fedbasin.cli import build_parser
from fedbasin.config import DEFAULT_RUN_CONFIG, RunConfigError, resolve_run_config
from tests.helpers import DIGITS_VIT, cli_error, expanded, spy_on_cli_refine, trained_digits_vit

ROOT = Path(__file__).resolve().parents[1]
BOTH = [(name, f, opt) for cls in schema.GROUPS for name, f, opt in schema.schema_fields(cls)
        if {schema.CLI, schema.RUN} <= set(opt.surfaces)]


def test_pyproject_carries_the_generated_schema_lines():
    """``[tool.flwr.app.config]`` ends with exactly what ``python -m fedbasin.options`` prints."""
    assert (ROOT / "pyproject.toml").read_text().endswith("\n".join(schema.toml_lines()) + "\n")


def _option_strings(command: str) -> set[str]:
    sub = next(a for a in build_parser()._actions if a.dest == "command").choices[command]
    return {s for a in sub._actions for s in a.option_strings}


@pytest.mark.parametrize("name, f, opt", BOTH, ids=[name for name, _, _ in BOTH])
def test_an_option_on_both_surfaces_has_one_name_default_and_check(name, f, opt, capsys, tmp_path):
    """The flag ``--NAME`` and the run-config key ``NAME`` exist, share the default, and refuse the same
    out-of-range value, each in one line naming the option."""
    if name != "universe-iterations" and not name.startswith("distill-"):  # (align writes no merge to distil)
        assert f"--{name}" in _option_strings("align")
    assert f"--{name}" in _option_strings("merge")
    assert DEFAULT_RUN_CONFIG[name] == f.default
    if opt.choices:
        bad = "bogus"
    elif opt.low is not None:
        bad = opt.low if opt.open_low else opt.low - 1
    else:
        return  # free text (refine-lambda): its own test below
    with pytest.raises(RunConfigError) as refused:
        resolve_run_config({name: bad})
    assert refused.value.problems[0].startswith(f"run-config {name}=")
    line = cli_error(capsys, ["merge", "a", "b", "--out", tmp_path / "o", f"--{name}", bad])
    assert f"--{name}" in line and "\n" not in line


def test_a_run_config_number_or_boolean_in_quotes_is_refused():
    """A TOML value is typed: ``head-weight = "2"`` is a string, refused as the run config's other keys refuse
    ``num-server-rounds = "3"`` (the command line's flags, text by nature, convert)."""
    with pytest.raises(RunConfigError) as refused:
        resolve_run_config({"head-weight": "2", "refine-budget": "60", "distill-teacher": "logits"})
    assert refused.value.problems == [
        "run-config head-weight='2': expected a number or auto (unquoted), got the string '2'",
        "run-config refine-budget='60': expected a number (unquoted), got the string '60'"]
    assert resolve_run_config({"head-weight": "auto", "refine-budget": 60})["refine-budget"] == 60.0
    assert schema.from_values(schema.MatchOptions, {"head-weight": "2"}, schema.CLI).head_weight == 2.0
    with pytest.raises(ValueError, match="head-weight='2': expected a number or auto"):
        schema.from_values(schema.MatchOptions, {"head-weight": "2"})


def test_combinations_are_refused_naming_both_options(capsys, tmp_path):
    """A rule of the schema names both options, on the command line and in the run config alike."""
    with pytest.raises(RunConfigError) as refused:
        resolve_run_config({"refine-vocabulary": "full", "refine-vocabulary-samples": 5})
    assert "refine-vocabulary-samples=5 run-config refine-vocabulary='full'" in refused.value.problems[0]
    models = _digits_pair(tmp_path)
    line = cli_error(capsys, ["align", *models, "--out", tmp_path / "o", "--refine-data", "digits",
                              "--refine-vocabulary", "full", "--refine-vocabulary-samples", "5"])
    assert "--refine-vocabulary-samples 5 --refine-vocabulary full" in line
    line = cli_error(capsys, ["align", *models, "--out", tmp_path / "o", "--refine-data", "digits",
                              "--refine-start", "activations", "--symmetry", "permutation"])
    assert "--refine-start activations --symmetry permutation" in line


def test_the_run_config_refuses_text_options_on_image_data_before_any_round():
    """The run config is checked on its ``data`` and, for images, with the ``auto`` values resolved, as the CLI
    checks what it will run: a sampled vocabulary on digits used to pass here and then fail every round's
    refinement ("aggregation failed"), or be ignored."""
    for extra, expected in (({"refine-vocabulary": "seen"}, "refine-vocabulary='seen' needs text data"),
                            ({"refine-vocabulary-batch-samples": 8},
                             "refine-vocabulary-batch-samples=8 run-config refine-vocabulary='full' samples"),
                            ({"refine-vocabulary-samples": 4, "data": "cifar10"}, "with the auto values of an image")):
        with pytest.raises(RunConfigError) as refused:
            resolve_run_config({"proxy-size": 60, **extra})
        assert expected in refused.value.problems[0]
    # the defaults, and text options on text data, still pass
    for data in ("digits", "cifar10", "text:input.txt"):
        assert resolve_run_config({"data": data, "proxy-size": 60})["data"] == data
    assert resolve_run_config({"data": "text:input.txt", "refine-vocabulary": "seen",
                               "refine-vocabulary-samples": 4})["refine-vocabulary"] == "seen"


def test_options_of_a_switched_off_refinement_or_distillation_are_refused(capsys, tmp_path):
    """``--refine-steps 0`` takes no step, ``--distill-steps 0`` / ``--distill-budget 0`` no distillation: an
    option that only acts there is refused naming both, not ignored; what still acts (the proxy, the mixture) passes."""
    models = _digits_pair(tmp_path)
    merge = ["merge", *models, "--out", tmp_path / "o", "--refine-data", "digits"]
    assert cli_error(capsys, [*merge, "--refine-steps", "0", "--refine-lr", "0.5"]) == \
        "fedbasin merge: --refine-lr has no effect with --refine-steps 0 (no refinement steps)"
    assert "--distill-lr has no effect with --distill-steps 0" in cli_error(
        capsys, [*merge, "--distill-steps", "0", "--distill-lr", "0.5"])
    assert "--distill-temperature has no effect with --distill-budget 0" in cli_error(
        capsys, [*merge, "--distill-budget", "0", "--distill-temperature", "9"])
    from fedbasin.cli import main

    assert main([str(a) for a in [*merge, "--refine-steps", "0", "--refine-examples", "100", "--distill-steps", "0",
                                  "--distill-mixture", "best"]]) == 0


def test_the_summary_records_every_refinement_setting_the_run_used(tmp_path, capsys):
    """Given or chosen by auto, each setting is in ``refinement`` (lambda, group, schedule, batch, the
    keep-best interval of a run with --refine-steps), so the summary repeats the run."""
    from fedbasin.cli import main

    models = _digits_pair(tmp_path)
    assert main([str(a) for a in ["align", *models, "--out", tmp_path / "o", "--refine-data", "digits",
                                  "--refine-steps", "6", "--refine-lambda", "0.3,0.7", "--refine-group", "invertible",
                                  "--refine-examples", "200", "--refine-eval-every", "3"]]) == 0
    summary = json.loads(capsys.readouterr().out)["refinement"]
    assert (summary["lambda"], summary["group"], summary["eval_every"], summary["steps"]) == ("0.3,0.7", "invertible", 3, 6)
    assert (summary["schedule"], summary["batch_size"], summary["permutations"]) == (
        summary["auto"]["schedule"], summary["auto"]["batch_size"], summary["auto"]["permutations"])
    names = {f.name.rstrip("_") for f in dataclasses.fields(schema.RefineOptions)} - {"budget", "workers"}
    assert names <= summary.keys()


def test_older_spellings_still_work():
    """Flags and values of earlier releases are overrides of the same options."""
    args = build_parser().parse_args(["merge", "a", "b", "--out", "o", "--iterations", "3", "--tol", "0.01",
                                      "--refine-lambda", "0.3", "0.7", "--refine-start", "weights"])
    match, refine = schema.from_args(schema.MatchOptions, args), schema.from_args(schema.RefineOptions, args)
    assert (match.align_iterations, match.align_tol) == (3, 0.01)
    assert (refine.lambda_, refine.start) == ("0.3,0.7", "symmetry")
    config = resolve_run_config({"refine-steps": 0, "refine-head-lr": 0.0, "refine-start": "symmetry",
                                 "refine-lambda": "0.4,0.6"})
    assert (config["refine-steps"], config["refine-head-lr"]) == (0, 0.0)


def test_auto_follows_what_the_model_is_and_the_values_given():
    """The kind comes from the model (data it reads, vocabulary size), never from a data set's name; a
    value the user gives wins, and the auto values that depend on it follow it."""
    assert schema.model_kind("images", None) == schema.IMAGE
    assert schema.model_kind("text", 50257) == schema.SUBWORD_LM
    assert schema.model_kind("text", 65) == schema.CHARACTER_LM
    for kind, settings in schema.KIND_SETTINGS.items():
        resolved = schema.resolve_refine(schema.RefineOptions(), kind)
        for name in ("lr", "group", "schedule", "vocabulary", "batch_size", "examples"):
            assert getattr(resolved.options, name) == settings[name]
        assert resolved.steps is None and resolved.evaluations == settings["evaluations"]
    subword = schema.resolve_refine(schema.RefineOptions(vocabulary="full", lr=0.02), schema.SUBWORD_LM).options
    assert (subword.lr, subword.vocabulary, subword.vocabulary_samples, subword.vocabulary_batch_samples) == (
        0.02, "full", 0, 0)
    fixed = schema.resolve_refine(schema.RefineOptions(steps=40), schema.IMAGE)
    assert fixed.steps == 40 and fixed.options.eval_every == math.ceil(40 / fixed.evaluations)
    unigram = schema.resolve_refine(schema.RefineOptions(), schema.SUBWORD_LM, synthetic="unigram").options
    assert (unigram.soft_labels, unigram.soft_label_top_k, unigram.vocabulary_batch_samples) == (0.0, 32, 0)
    assert unigram.examples == schema.SYNTHETIC_EXAMPLES["unigram"] == 512  # fewer blocks to label than real text
    bigram = schema.resolve_refine(schema.RefineOptions(), schema.SUBWORD_LM, synthetic="bigram").options
    assert bigram.examples == schema.SYNTHETIC_EXAMPLES["bigram"] == 1024  # measured per proxy
    assert (bigram.soft_labels, bigram.soft_label_top_k) == (0.0, 32)
    given = schema.resolve_refine(schema.RefineOptions(examples=2048), schema.SUBWORD_LM, synthetic="bigram").options
    assert given.examples == 2048
    assert schema.problems([unigram], schema.CLI, data="unigram:x.txt") == []
    for bad, message in ((dict(kind="vision"), "model kind 'vision'"), (dict(synthetic="trigram"), "'trigram'")):
        with pytest.raises(ValueError, match=message):  # a Python caller's typo: one line, not a bare KeyError
            schema.resolve_refine(schema.RefineOptions(), **{"kind": schema.SUBWORD_LM, **bad})


def test_a_gpu_changes_only_what_was_measured_there_and_what_the_user_left_to_auto():
    """On a GPU a subword LM refines with batch 64 and the reference moving too (measured best there);
    other kinds keep the CPU's settings; a value given (``--no-refine-dual``, a batch size) wins."""
    cpu = schema.resolve_refine(schema.RefineOptions(), schema.SUBWORD_LM).options
    gpu = schema.resolve_refine(schema.RefineOptions(), schema.SUBWORD_LM, gpu=True)
    assert (cpu.batch_size, cpu.dual, cpu.workers) == (8, False, 2)
    assert (gpu.options.batch_size, gpu.options.dual, gpu.options.workers) == (64, True, 1)
    assert gpu.chosen["dual"] is True and gpu.chosen["batch_size"] == 64
    given = schema.resolve_refine(schema.RefineOptions(dual=False, batch_size=16), schema.SUBWORD_LM, gpu=True)
    assert (given.options.batch_size, given.options.dual) == (16, False) and "dual" not in given.chosen
    for kind in (schema.IMAGE, schema.CHARACTER_LM):
        here, there = (schema.resolve_refine(schema.RefineOptions(), kind, gpu=g).options for g in (False, True))
        assert (here.batch_size, here.dual) == (there.batch_size, there.dual) == (
            schema.KIND_SETTINGS[kind]["batch_size"], False)
    parser = build_parser()
    parse = lambda *flags: parser.parse_args(["align", "a", "b", "--out", "c", "--refine-data", "digits", *flags])
    assert schema.from_args(schema.RefineOptions, parse()).dual == schema.AUTO
    assert schema.from_args(schema.RefineOptions, parse("--refine-dual")).dual is True
    assert schema.from_args(schema.RefineOptions, parse("--no-refine-dual")).dual is False


def test_an_auto_dual_yields_to_a_reference_weight_of_zero(tmp_path, monkeypatch, capsys):
    """Where ``auto`` picks the dual refinement (a subword LM on a GPU; here the image kind made to), a
    merge whose reference has weight 0 refines one-sided instead of refusing; a dual the user asked
    for is still refused there."""
    m0, m1 = _digits_pair(tmp_path)
    monkeypatch.setitem(schema.KIND_SETTINGS, schema.IMAGE, {**schema.KIND_SETTINGS[schema.IMAGE], "dual": True})
    from fedbasin.cli import main

    options = ["--refine-data", "digits", "--refine-steps", "4", "--refine-examples", "200", "--weights", "0,1"]
    assert main(["merge", m0, m1, "--out", str(tmp_path / "merged"), *options, "--distill-steps", "0"]) == 0
    assert json.loads(capsys.readouterr().out)["refinement"]["dual"] is False
    assert main(["align", m0, m1, "--out", str(tmp_path / "aligned"), *options[:6]]) == 0
    assert json.loads(capsys.readouterr().out)["refinement"]["dual"] is True
    assert cli_error(capsys, ["merge", m0, m1, "--out", str(tmp_path / "x"), *options, "--refine-dual"]).endswith(
        "its --weights entry must be > 0")

def _digits_pair(tmp_path) -> list[str]:
    from fedbasin.checkpoint import save_checkpoint

    for seed in (0, 1):
        if not (tmp_path / f"m{seed}").exists():
            save_checkpoint(tmp_path / f"m{seed}", "vit", DIGITS_VIT, trained_digits_vit(seed))
    return [str(tmp_path / "m0"), str(tmp_path / "m1")]


OPTION_KEYWORDS = ("steps", "budget", "evaluations", "eval_every", "lr", "head_lr", "mode", "start", "permutations",
                   "group", "lambda_range", "schedule", "match_iterations", "match_tol", "universe_iterations",
                   "head_weight", "soft_labels", "soft_label_top_k", "batch_workers", "vocabulary_samples",
                   "vocabulary_batch_samples")


def test_the_cli_and_the_server_translate_the_same_options_the_same_way(tmp_path, monkeypatch, capsys):
    """One translator: the same options given as flags and as run-config keys reach ``learned_refine`` as
    the same keyword arguments (an image classifier's auto values included)."""
    from fedbasin.cli import main
    from fedbasin.config import model_adapter, model_from_config, task_from_config
    from fedbasin.server.server_app import make_refiner

    seen = {}
    spy_on_cli_refine(monkeypatch, seen.update)
    given = {"refine-steps": 3, "refine-lr": 0.02, "refine-group": "invertible", "align-iterations": 4}
    argv = ["align", *_digits_pair(tmp_path), "--out", tmp_path / "o", "--refine-data", "digits",
            "--refine-examples", "120", "--refine-workers", "1"]
    assert main([str(a) for a in argv + [x for k, v in given.items() for x in (f"--{k}", str(v))]]) == 0
    summary = json.loads(capsys.readouterr().out)["refinement"]
    assert summary["kind"] == schema.IMAGE and summary["auto"]["schedule"] == "cosine"
    config = resolve_run_config({**given, "proxy-size": 120, "refine-workers": 1})
    task = task_from_config(config)
    model = model_from_config(task, config, seed=0)
    server = expanded(make_refiner(model_adapter(task, model)[1].spec, model, task, config).keywords)
    assert {k: seen[k] for k in OPTION_KEYWORDS} == {k: server[k] for k in OPTION_KEYWORDS}
    assert (seen["lr"], seen["group"], seen["steps"], seen["match_iterations"]) == (0.02, "invertible", 3, 4)


def test_a_budget_sizes_the_run_and_the_recorded_steps_repeat_it(monkeypatch):
    """``steps=None``: the run times its first steps, sizes itself to the budget with ``evaluations`` keep-best
    checks, and records its length; that length given as ``steps`` repeats the run exactly. (A clock that
    advances 10 ms per reading makes the sizing the same on any machine.)"""
    from types import SimpleNamespace

    import fedbasin.alignment.refine as refine_module
    from fedbasin.alignment import learned_refine, proxy_streams
    from fedbasin.alignment.refine import PROBE_STEPS
    from fedbasin.training import cross_entropy
    from tests.test_soft_labels import digits_pair

    model, spec, task, a, b = digits_pair()
    calls = [0]

    def clock() -> float:
        calls[0] += 1
        return calls[0] * 0.01

    monkeypatch.setattr(refine_module, "time", SimpleNamespace(perf_counter=clock))

    def refine(**options):
        data = proxy_streams(task.proxy, 32, seed=0)
        return learned_refine(spec, model, a, [b], cross_entropy, data.batches, data.selection, lr=1e-2,
                              batch_workers=1, **options)

    sized = refine(steps=None, budget=2.0, evaluations=2)  # a check (10 ms) is 0.5 % of the budget: more checks
    steps, every = sized.steps, sized.eval_every
    assert steps > PROBE_STEPS + 1 and not sized.stopped_at_budget
    assert every < math.ceil(steps / 2) and sized.summary()["eval_every"] == every
    assert [step for step, _ in sized.history] == [0, *range(every, steps, every), steps]
    again = refine(steps=steps, eval_every=every)
    assert again.history == sized.history and again.steps == steps
    phases = sized.summary()["seconds_by_phase"]  # where the budget went, every phase inside the run's own time
    assert set(phases) == {"start", "labels", "checks", "steps"} and min(phases.values()) >= 0
    assert phases["checks"] > 0 and phases["steps"] > 0 and sum(sized.phases.values()) <= sized.seconds
    monkeypatch.setattr(refine_module, "CHECK_SHARE", 0.0)  # no share of the budget for more checks
    calls[0] = 0
    only_asked = refine(steps=None, budget=2.0, evaluations=2)
    assert [step for step, _ in only_asked.history] == [0, math.ceil(only_asked.steps / 2), only_asked.steps]


def test_a_budget_buys_keep_best_checks_while_they_are_cheap_and_fewer_when_they_are_dear():
    """The kind's checks; more while all of them cost at most 5 % of the budget (at most MAX_CHECKS); fewer,
    down to the last step's one, where the kind's count would cost more than 10 % of it."""
    from fedbasin.alignment.refine import MAX_CHECKS, sized_checks

    assert sized_checks(1, 120.0, 7.4) == 1  # the GPT-2 recipe pair: a check of the 410 selection blocks
    assert sized_checks(1, 120.0, 1.0) == 6 and sized_checks(6, 120.0, 1.0) == 6
    assert sized_checks(1, 120.0, 0.05) == MAX_CHECKS == sized_checks(1, 120.0, 0.0)
    assert sized_checks(6, 120.0, 2.0) == 6  # six checks at 10 % of the budget: all of them
    assert sized_checks(6, 120.0, 4.0) == 3 and sized_checks(6, 120.0, 30.0) == 1
    assert sized_checks(4, 10.0, 5.0) == 1


def test_flower_refines_whenever_the_server_holds_a_proxy_split():
    """The run config's default refines on the proxy split, per-round budget; 0 steps or 0 budget turn it off."""
    from types import SimpleNamespace

    from fedbasin.server.server_app import refines

    proxy, none = SimpleNamespace(proxy=object()), SimpleNamespace(proxy=None)
    assert refines(resolve_run_config({}), proxy) and not refines(resolve_run_config({}), none)
    assert not refines(resolve_run_config({"refine-steps": 0}), proxy)
    assert not refines(resolve_run_config({"refine-budget": 0.0}), proxy)
    assert refines(resolve_run_config({"refine-budget": 0.0, "refine-steps": 5, "proxy-size": 10}), proxy)
    assert not refines(resolve_run_config({"alignment": False}), proxy)


def test_the_docs_carry_the_generated_table_of_auto_values():
    """docs/options.md's table is what ``python -m fedbasin.options --kinds`` prints from the code."""
    assert "\n".join(schema.kind_table()) in (ROOT / "docs" / "options.md").read_text()


def test_the_flower_docs_list_every_run_config_key_and_the_schema_table_from_the_code():
    """docs/flower.md carries ``python -m fedbasin.options --run-table`` verbatim and names every other key."""
    from fedbasin.config import DEFAULT_RUN_CONFIG

    text = (ROOT / "docs" / "flower.md").read_text()
    assert "\n".join(schema.run_table()) in text
    assert [key for key in DEFAULT_RUN_CONFIG if f"`{key}`" not in text] == []


def test_a_budgeted_run_whose_steps_slow_down_stops_within_its_budget(monkeypatch):
    """Steps that run slower than the timed ones (a machine that got busy) do not overrun the budget: the run
    stops once it is spent, with a last keep-best check at that step (a clock that jumps after sizing)."""
    from types import SimpleNamespace

    import fedbasin.alignment.refine as refine_module
    from fedbasin.alignment import learned_refine, proxy_streams
    from fedbasin.training import cross_entropy
    from tests.test_soft_labels import digits_pair

    model, spec, task, a, b = digits_pair()
    calls = [0]

    def clock() -> float:  # 1 ms per reading until the run is sized, then 1 s per reading
        calls[0] += 1
        return calls[0] * (0.001 if calls[0] < 40 else 1.0)

    monkeypatch.setattr(refine_module, "time", SimpleNamespace(perf_counter=clock))
    data = proxy_streams(task.proxy, 32, seed=0)
    result = learned_refine(spec, model, a, [b], cross_entropy, data.batches, data.selection, steps=None,
                            budget=60.0, evaluations=3, lr=1e-2, batch_workers=1)
    assert 0 < result.stopped_at_budget == result.steps and result.history[-1][0] == result.steps
    assert result.summary()["stopped_at_budget"] == result.steps


def test_a_model_dear_for_its_budget_labels_and_scores_fewer_examples(monkeypatch):
    """A budgeted run whose passes are dear (a clock at 1 s per reading: a slow machine or a large model)
    labels only the training examples 30 % of the budget pays for and cuts the selection split so that
    a pass over it costs a tenth of it (the evaluation split a twentieth), never below MIN_EXAMPLES; its
    summary says so, and keep-best scores the examples kept (the start's loss is that of the same start on
    the first kept selection examples)."""
    from types import SimpleNamespace

    import fedbasin.alignment.refine as refine_module
    from fedbasin.alignment import learned_refine, proxy_streams
    from fedbasin.training import cross_entropy
    from tests.test_soft_labels import digits_pair

    model, spec, task, a, b = digits_pair()
    calls, labelled = [0], []
    monkeypatch.setattr(refine_module, "time", SimpleNamespace(perf_counter=lambda: calls.__setitem__(0, calls[0] + 1)
                                                               or float(calls[0])))
    monkeypatch.setattr(refine_module, "MIN_EXAMPLES", 16)
    label = refine_module._soft_labels
    monkeypatch.setattr(refine_module, "_soft_labels",
                        lambda split, *rest: labelled.append(len(split)) or label(split, *rest))
    data = proxy_streams(task.proxy, 32, seed=0, eval_batch_size=32)  # 180 training, 60 selection, 60 evaluation
    result = learned_refine(spec, model, a, [b], cross_entropy, data.batches, data.selection, data.evaluation,
                            steps=None, budget=48.0, evaluations=1, soft_labels=0.5, lr=1e-2, batch_workers=1)
    # a pass timed on a selection batch: 1 s for 32 examples; a tenth of 48 s pays a pass over 153 examples, a
    # twentieth 76 (nothing cut); labels: 1 s for the first 16 (1/16 s each), 30 % of 48 s pays 230 (nothing cut)
    assert "proxy_trimmed_to_budget" not in result.summary() and labelled == [16, 164]
    calls[0], labelled[:] = 0, []
    data = proxy_streams(task.proxy, 32, seed=0, eval_batch_size=32)
    result = learned_refine(spec, model, a, [b], cross_entropy, data.batches, data.selection, data.evaluation,
                            steps=None, budget=12.0, evaluations=1, soft_labels=0.5, lr=1e-2, batch_workers=1)
    # selection: 1.2 s at 1/32 s per example: 38 kept; evaluation: 0.6 s, 19 kept; labels: 3.6 s at 1/16 s: 57
    trimmed = result.summary()["proxy_trimmed_to_budget"]
    assert trimmed == {"selection": [38, 60], "evaluation": [19, 60], "training": [57, 180]} and labelled == [16, 41]
    first_kept = [data.selection[0], tuple(t[:6] for t in data.selection[1])]  # batches of 32 and 28
    start = learned_refine(spec, model, a, [b], cross_entropy, data.batches, first_kept,
                           steps=0, lr=1e-2, batch_workers=1)
    assert result.initial_loss == start.initial_loss


def test_the_strategy_takes_the_option_objects():
    """``AlignedFedAvg(match=..., robust=...)``: the schema's objects set the matching and aggregation it runs."""
    from fedbasin.strategies import AlignedFedAvg
    from tests.helpers import spec_of

    strategy = AlignedFedAvg(spec_of("vit", DIGITS_VIT), min_train_nodes=2,
                             match=schema.MatchOptions(symmetry="permutation", align_iterations=7, universe_iterations=2),
                             robust=schema.RobustOptions(aggregator="median", clip_ratio=2.0, max_examples_ratio=3.0))
    assert (strategy.mode, strategy.iterations, strategy.universe_iterations) == ("permutation", 7, 2)
    assert strategy.head_weight == "auto"  # set for the model by weight_match (1 for an image classifier)
    assert AlignedFedAvg(spec_of("vit", DIGITS_VIT), match=schema.MatchOptions(head_weight=2.0)).head_weight == 2.0
    assert (strategy.aggregator, strategy.clip_ratio, strategy.max_examples_ratio) == ("median", 2.0, 3.0)
    # a keyword that says otherwise than the object is refused naming both, never silently overridden
    with pytest.raises(ValueError, match=r"mode='permutation' contradicts MatchOptions\(symmetry='orthogonal'\)"):
        AlignedFedAvg(spec_of("vit", DIGITS_VIT), mode="permutation", match=schema.MatchOptions())
    with pytest.raises(ValueError, match=r"aggregator='median' contradicts RobustOptions\(aggregator='mean'\)"):
        AlignedFedAvg(spec_of("vit", DIGITS_VIT), aggregator="median", robust=schema.RobustOptions())
    agreeing = AlignedFedAvg(spec_of("vit", DIGITS_VIT), aggregator="median",
                             robust=schema.RobustOptions(aggregator="median"))
    assert agreeing.aggregator == "median"


def test_a_flower_round_refines_by_default_within_its_budget(monkeypatch):
    """The run config's defaults with a proxy split: the round's refiner is the kind's auto setting, sized by
    ``refine-budget`` (``steps`` None), and the round succeeds with the refinement's metrics."""
    from flwr.supercore.task_identity import TaskIdentity

    from fedbasin.server.server_app import make_refiner, refines
    from fedbasin.strategies import AlignedFedAvg
    from tests.test_distill import one_shot_round
    from tests.test_soft_labels import digits_pair

    for name, value in (("_run_id", 7), ("_task_id", 1), ("_node_id", 0)):
        monkeypatch.setattr(TaskIdentity, name, value)
    config = resolve_run_config({"proxy-size": 300, "refine-budget": 4.0, "model.dim": 16, "model.depth": 1,
                                 "model.heads": 2, "model.mlp-dim": 32})
    model, spec, task, _, _ = digits_pair()
    assert refines(config, task)
    refine = make_refiner(spec, model, task, config)
    assert expanded(refine.keywords)["steps"] is None and expanded(refine.keywords)["budget"] == 4.0
    strategy = AlignedFedAvg(spec, refine=refine, independent_init=True, min_train_nodes=3, min_available_nodes=3)
    arrays, metrics = one_shot_round(strategy, [trained_digits_vit(seed) for seed in range(3)])
    assert arrays is not None and metrics["round_failed"] == 0 and "refine_heldout_loss" in metrics
    assert 0 < metrics["refine_seconds"] <= metrics["align_seconds"]  # the merge's time, the refinement's inside it


def test_the_strategy_matches_with_the_head_weight_of_its_options(monkeypatch):
    """The round's merge gets ``MatchOptions.head_weight`` (what the ServerApp resolves for the model's kind)."""
    from flwr.supercore.task_identity import TaskIdentity

    import fedbasin.strategies.aligned_fedavg as strategy_module
    from fedbasin.strategies import AlignedFedAvg
    from tests.helpers import spec_of
    from tests.test_distill import one_shot_round

    for name, value in (("_run_id", 7), ("_task_id", 1), ("_node_id", 0)):
        monkeypatch.setattr(TaskIdentity, name, value)
    seen, merge = [], strategy_module.merge
    monkeypatch.setattr(strategy_module, "merge", lambda *a, **k: seen.append(k["head_weight"]) or merge(*a, **k))
    strategy = AlignedFedAvg(spec_of("vit", DIGITS_VIT), match=schema.MatchOptions(head_weight=3.0),
                             independent_init=True, min_train_nodes=2, min_available_nodes=2)
    arrays, metrics = one_shot_round(strategy, [trained_digits_vit(seed) for seed in range(2)])
    assert arrays is not None and metrics["round_failed"] == 0 and seen == [3.0]


def test_the_library_takes_the_option_objects():
    """``weight_match``, ``merge`` and ``learned_refine`` take the schema's objects: the same result as the
    keywords they stand for (``auto`` set for the model); half a pair of objects is refused."""
    import torch

    from fedbasin.alignment import learned_refine, merge, weight_match
    from fedbasin.models import build_model
    from tests.helpers import spec_of

    spec = spec_of("vit", DIGITS_VIT)
    a, b, c = (trained_digits_vit(seed) for seed in (0, 1, 2))
    match = schema.MatchOptions(symmetry="permutation", align_iterations=3, align_tol=0.0, head_weight=1.0)
    by_object = weight_match(spec, a, b, match=match)
    by_keywords = weight_match(spec, a, b, mode="permutation", iterations=3, tol=0.0)
    assert by_object.objective == by_keywords.objective and len(by_object.objective) == 4
    # auto is the measured best for what the model is (an image classifier: 1), set by weight_match itself
    assert weight_match(spec, a, b, match=schema.MatchOptions(symmetry="permutation", align_iterations=3,
                                                              align_tol=0.0)).objective == by_object.objective
    universe = schema.MatchOptions(align_iterations=2, universe_iterations=3, head_weight=1.0)
    merged = merge(spec, [a, b, c], match=universe)
    assert len(merged.universe_change) == 3
    assert torch.equal(merged.state["head.weight"], merge(spec, [a, b, c], iterations=2, universe_iterations=3
                                                          ).state["head.weight"])

    # a RefineOptions as it is: auto set for what the reference is (an image classifier), the match's defaults
    from fedbasin.alignment import proxy_streams
    from fedbasin.data import load_task
    from fedbasin.training import cross_entropy

    proxy = load_task("digits", seed=0).train.subset(torch.arange(200))

    def refined(**options):
        data = proxy_streams(proxy, 32, seed=0)
        return learned_refine(spec, build_model("vit", DIGITS_VIT), a, [b], cross_entropy, data.batches,
                              data.selection, **options).states[0]
    given = schema.RefineOptions(steps=2, workers=1)
    resolved = schema.resolve_refine(given, schema.IMAGE)
    assert resolved.options != given and resolved.options.lr == schema.KIND_SETTINGS[schema.IMAGE]["lr"]
    by_resolved = refined(options=resolved, match=schema.MatchOptions())
    for key, value in refined(options=given).items():
        assert torch.equal(value, by_resolved[key]), key
    # the objects are checked as the command line checks its flags, in one line naming the field
    for options, message in ((dict(options=schema.RefineOptions(lr=-1.0)), "RefineOptions.lr=-1.0: must be greater"),
                             (dict(match=schema.MatchOptions(align_iterations="3")),
                              "MatchOptions.align_iterations='3': expected an integer, got str"),
                             (dict(options=schema.RefineOptions(lambda_="0.9,0.1")),
                              "RefineOptions.lambda_='0.9,0.1': must be 'LO,HI'")):
        with pytest.raises(ValueError, match="^" + re.escape(message)):
            refined(**options)
    with pytest.raises(ValueError, match=r"^MatchOptions.align_iterations=0: must be at least 1$"):
        weight_match(spec, a, b, match=schema.MatchOptions(align_iterations=0))
    with pytest.raises(ValueError, match=r"^MatchOptions.align_iterations=0: must be at least 1$"):
        weight_match(spec, a, b, iterations=0)
    with pytest.raises(ValueError, match=r"^MatchOptions.universe_iterations=0: must be at least 1$"):
        merge(spec, [a, b], universe_iterations=0)



def test_the_server_refines_one_sided_even_where_auto_would_move_the_reference(monkeypatch):
    """A round's refinement never moves the reference (from round 2 it is the previous global model, an
    alignment target of weight 0, which ``dual`` would need to move): on a GPU, where ``auto`` picks dual
    for subword LMs, the ServerApp still resolves it to one-sided; the GPU's batch size still applies."""
    import types

    from fedbasin.config import model_adapter, model_from_config, task_from_config
    from fedbasin.server import server_app

    monkeypatch.setitem(schema.GPU_SETTINGS, schema.IMAGE, dict(batch_size=48, dual=True))
    monkeypatch.setattr(server_app, "resolve_device", lambda name: types.SimpleNamespace(type="cuda"))
    config = resolve_run_config({"proxy-size": 120, "refine-steps": 2})
    task = task_from_config(config)
    model = model_from_config(task, config, seed=0)
    resolved = server_app.make_refiner(model_adapter(task, model)[1].spec, model, task, config).keywords["options"]
    assert (resolved.options.batch_size, resolved.options.dual) == (48, False)
