"""ServerApp: reads the run config, builds the model and the aligned strategy, runs the rounds.

Each round the global model is evaluated on the server's test split, checkpointed, and its
metrics are added to ``results.json`` and ``curves.png`` in ``out-dir`` (see ``outputs.py``).
``resume = true`` continues from the newest usable checkpoint in ``out-dir``; a fresh run refuses a
non-empty ``out-dir`` unless ``overwrite = true``. A run whose final model is unusable (non-finite
weights or test loss) raises :class:`UnusableModelError` after recording it in ``results.json``.

A run config that cannot run (bad keys, data or a model that cannot be built, an ``out-dir`` the
run may not use) is refused before round 1: one log line per problem, no traceback, nothing in
``out-dir`` removed or overwritten (the checks of ``fedbasin simulate``:
:func:`~fedbasin.config.resolve_run_config`, then the same data/model construction and ``out-dir``
rules).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import time
from logging import ERROR, INFO, WARNING

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.common.logger import log
from flwr.serverapp import Grid, ServerApp

from fedbasin import causal_lm, heap
from fedbasin.alignment import learned_refine, proxy_streams
from fedbasin.alignment.vocabulary import vocabulary_ids
from fedbasin.checkpoint import load_checkpoint
from fedbasin.config import (
    RunConfigError,
    eval_batch_size,
    model_adapter,
    model_from_config,
    resolve_run_config,
    task_from_config,
)
from fedbasin.options import (
    AUTO,
    distill_call,
    distillation_off,
    from_run_config,
    model_kind,
    resolve_distill,
    resolve_match,
    resolve_refine,
    robust_call,
)
from fedbasin.server.distill import (
    EVAL_EVERY,
    TeacherOutputs,
    cache_teacher_outputs,
    ensemble_distill,
    mean_loss,
    memo_teacher_steps,
    named_augment,
    probe_step,
    teacher_outputs_fit,
    transfer_batches,
)
from fedbasin.server.outputs import RunOutputs
from fedbasin.strategies import AlignedFedAvg
from fedbasin.training import resolve_device
from fedbasin.weights import check_fits, holding_weights, release_weights

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Entry point for ``flwr run``: the run config is ``[tool.flwr.app.config]`` + overrides. A
    refused run config logs one line per problem and ends the run before round 1 (Flower then
    reports the run finished: it ran nothing, and raising would only add a traceback)."""
    heap.fix_mmap_threshold()  # freed model-sized tensors go back to the kernel at once (fedbasin.heap)
    try:
        run_server(grid, resolve_run_config(context.run_config))
    except RunConfigError as refused:
        for problem in refused.problems:
            log(ERROR, "%s", problem)
        log(ERROR, "run config refused (%d problem%s above): the run ends before round 1; nothing in "
            "out-dir was removed or overwritten", len(refused.problems), "s" * (len(refused.problems) > 1))


@contextlib.contextmanager
def refused_as_run_config():
    """While the run is set up, a ``ValueError``, ``OSError`` or ``RuntimeError`` (data or model
    that cannot be built, an ``out-dir`` the run may not use: what ``fedbasin simulate`` reports
    as a one-line error) becomes a :class:`~fedbasin.config.RunConfigError` with one line."""
    try:
        yield
    except RunConfigError:
        raise
    except (ValueError, OSError, RuntimeError) as error:
        raise RunConfigError([" ".join(str(error).split("\n"))]) from None


def server_proxy_streams(task, model, config: dict, batch_size: int | None = None):
    """The proxy split's training stream (``batch_size``, default the run config's, and its seed) and its
    selection and report batches (``proxy-selection-fraction`` / ``proxy-evaluation-fraction`` of it): 256
    examples, fewer where one batch's logits would pass 2^26 values (a large vocabulary)."""
    return proxy_streams(task.proxy, batch_size or config["batch-size"], seed=config["seed"],
                         selection_fraction=config["proxy-selection-fraction"],
                         evaluation_fraction=config["proxy-evaluation-fraction"],
                         eval_batch_size=eval_batch_size(task, model, most=256))


def refines(config: dict, task) -> bool:
    """Whether the run refines its alignment: alignment on, a proxy split, and ``refine-steps`` > 0 or
    ``auto`` with a ``refine-budget`` > 0 (the default whenever the server holds a proxy split)."""
    steps = config["refine-steps"]
    return (config["alignment"] and task.proxy is not None
            and (steps > 0 if steps != AUTO else config["refine-budget"] > 0))


def kind_of(task, model) -> str:
    """What the run's model is (:func:`fedbasin.options.model_kind`): it chooses the ``auto`` values."""
    return model_kind(task.data, getattr(model.config, "vocab_size", None))


def make_refiner(spec, model, task, config: dict, to_module_state=None):
    """``refine(reference, clients)``: learned refinement on the proxy split (by default 20% selects the
    alignment kept, 20% only reports its loss) with the schema's options, ``auto`` resolved for the model's
    kind (:func:`fedbasin.options.resolve_refine`) and sized by ``refine-budget`` per round;
    ``to_module_state``: the adapter's ``from_standard`` when the model's keys differ from the spec's layout."""
    match, refine, _, _ = from_run_config(config)
    kind = kind_of(task, model)
    match = resolve_match(match, kind)
    # the run's seed; one-sided (the previous global model, an alignment target of weight 0, cannot move)
    resolved = resolve_refine(dataclasses.replace(refine, seed=config["seed"], dual=False), kind,
                              gpu=resolve_device(config["device"]).type == "cuda")
    options = resolved.options
    data = server_proxy_streams(task, model, config, options.batch_size)
    vocabulary = vocabulary_ids(options.vocabulary, task.proxy, task.train) if task.data == "text" else None
    return functools.partial(
        learned_refine, spec, model, loss_fn=task.loss_fn, batches=data.batches, selection=data.selection,
        to_module_state=to_module_state, evaluation=data.evaluation, options=resolved, match=match,
        vocabulary=vocabulary)


def distils(config: dict, task) -> bool:
    """Whether the server distils each round's merge: ``distill-steps`` > 0 (a run config without
    a proxy split is refused), or ``auto`` with a ``distill-budget`` > 0 and a proxy split (without
    one: no distillation, and no error)."""
    steps = config["distill-steps"]
    return not distillation_off(steps, config["distill-budget"]) and (steps != AUTO or task.proxy is not None)


def make_distiller(model, task, config: dict, adapter=None, in_place: bool = False):
    """``distill(merged, clients)``: ensemble distillation of the clients' mean logits into the
    merged model on the proxy split (the same training / selection / evaluation parts as
    :func:`make_refiner`; keep-best on the selection split). States come and go in the spec's
    standard layout; ``adapter`` (default: the model's, :func:`~fedbasin.config.model_adapter`)
    translates them to the model's own keys and back. With ``in_place`` the merged state is the
    student, trained in place (no copy of the model: the ServerApp's strategy discards it for the
    result); otherwise it is left as it was. ``model``
    may have released its weights (:func:`~fedbasin.weights.release_weights`): each call
    lends it the states it runs, on the run config's device.

    ``distill-steps = auto``: each round's distillation takes ``distill-budget`` seconds at most,
    ``prepare`` (the teachers' outputs cached before the merge) and ``distill`` together (the merge
    in between is not counted). ``prepare`` sizes the run before caching: it times one step's parts
    on the first transfer batch with the first client's weights standing in for the student (the
    same architecture; :func:`~fedbasin.server.distill.probe_step`), caches that many steps, and
    ``distill`` takes them with the budget left (stopping early should its steps run slower than
    timed). Without ``prepare`` (or when it was not called this round) ``distill`` sizes itself
    the same way with the merge as the student (``ensemble_distill(steps=None)``)."""
    if task.proxy is None:
        raise ValueError(f"run-config distill-steps={config['distill-steps']} needs proxy data: "
                         f"{task.name} has no proxy split (set proxy-size >= 10)")
    adapter = adapter or model_adapter(task, model)[1]
    augment, options = distill_augment(task, config, model), distill_options(task, config, model)
    device = resolve_device(config["device"])
    auto, budget = config["distill-steps"] == AUTO, float(config["distill-budget"])
    if auto and budget <= 0:
        raise ValueError("run-config distill-steps='auto' distill-budget=0.0 distils nothing: a budget > 0 "
                         "sizes the run")
    sized = {}  # this round's run as prepare sized it: steps, and the seconds prepare spent

    def distill(merged: dict, clients: list):
        steps, seconds = config["distill-steps"], None  # a given count: exactly that, unbounded
        if auto:
            steps, spent = sized.pop("steps", None), sized.pop("spent", 0.0)
            seconds = budget - spent if steps is not None else budget
        data = server_proxy_streams(task, model, config)
        teachers = [c if isinstance(c, TeacherOutputs) else adapter.from_standard(c) for c in clients]
        with holding_weights(model, adapter.from_standard(merged), device) as student:
            result = ensemble_distill(model, student, teachers, task.loss_fn,
                                      data.batches, data.selection, data.evaluation,
                                      steps=steps, augment=augment, **distill_call(options),
                                      seed=config["seed"], in_place=in_place, budget=seconds)
        result.state = adapter.to_standard(result.state)
        return result

    def prepare(clients: list[dict]):
        """The clients' outputs on the transfer batches ``distill`` will draw, so that their
        weights can go during the merge; None when that cache would exceed half their weights.
        With ``auto`` steps, the run is sized here first (recorded for ``distill``)."""
        started = time.perf_counter()
        sized.clear()
        data = server_proxy_streams(task, model, config)
        teachers = [adapter.from_standard(c) for c in clients]
        with holding_weights(model, teachers[0], device):
            steps = config["distill-steps"]
            if auto:  # the first transfer batch, drawn from a stream of its own (data's is the cache's)
                first = next(transfer_batches(server_proxy_streams(task, model, config).batches, 1, augment,
                                              config["seed"]))
                call = distill_call(options)
                cost = probe_step(model, teachers, first, data.selection, data.evaluation, task.loss_fn,
                                  temperature=call["temperature"], label_weight=call["label_weight"],
                                  teacher=call["teacher"])
                left = budget - (time.perf_counter() - started)
                steps = sized["steps"] = cost.steps(left, EVAL_EVERY)
                memo = cost.steps(left, EVAL_EVERY, memo_teacher_steps(data.batches, augment, cost.row_bytes))
                if not teacher_outputs_fit(teachers, cost.row_bytes * len(first[1]), memo):
                    sized["steps"], sized["spent"] = memo, time.perf_counter() - started
                    return None  # too large to cache: ``distill`` runs the teachers, once per proxy example
            cached = cache_teacher_outputs(model, teachers, data.batches, steps, augment=augment,
                                           seed=config["seed"])
        if auto:
            sized["spent"] = time.perf_counter() - started
        return cached

    distill.prepare = prepare
    return distill


def distill_options(task, config: dict, model=None):
    """The run config's :class:`~fedbasin.options.DistillOptions` with ``auto`` resolved for what the
    model is (:func:`kind_of`; :func:`~fedbasin.options.resolve_distill`). Without ``model`` (checking a
    run config before any model exists) the kind is read from the data alone: an image classifier, or
    a language model of unknown vocabulary."""
    kind = kind_of(task, model) if model is not None else model_kind(task.data, None)
    return resolve_distill(from_run_config(config)[2], kind)


def distill_augment(task, config: dict, model=None):
    """The run config's ``distill-augment`` as an ``augment`` for :func:`ensemble_distill`
    (:func:`~fedbasin.server.distill.named_augment`); ``auto``: mixup for image classifiers, none for
    language models. A named view is refused for data that are not images. ``model``: as for
    :func:`distill_options`."""
    choice = distill_options(task, config, model).augment
    try:
        return named_augment(choice, tuple(task.train.inputs.shape[1:]))
    except ValueError:
        raise ValueError(f"run-config distill-augment={config['distill-augment']!r} needs image data (C, H, W) at "
                         f"least 8 pixels wide; {task.name} examples have shape "
                         f"{tuple(task.train.inputs.shape[1:])}") from None


def robust_options(config: dict) -> dict:
    """``AlignedFedAvg`` screening/aggregation keyword arguments from the run config (the schema's
    :class:`~fedbasin.options.RobustOptions` through :func:`~fedbasin.options.robust_call`)."""
    return robust_call(from_run_config(config)[3])


def proxy_screen_options(model, task, config: dict, adapter=None) -> dict:
    """``AlignedFedAvg`` keyword arguments of ``proxy-screening``: ``proxy_loss(state)``, the
    example-weighted mean loss of a state (the spec's layout) on the proxy selection split (the
    batches keep-best scores), on the run config's device; empty when the option is off."""
    if config["proxy-screening"] <= 0:
        return {}
    if task.proxy is None:
        raise ValueError(f"run-config proxy-screening={config['proxy-screening']} needs proxy data: "
                         f"{task.name} has no proxy split (set proxy-size >= 10)")
    adapter = adapter or model_adapter(task, model)[1]
    selection = server_proxy_streams(task, model, config).selection
    device = resolve_device(config["device"])

    def proxy_loss(state: dict) -> float:
        with holding_weights(model, adapter.from_standard(state), device):
            model.eval()
            return mean_loss(model, task.loss_fn, selection, device)

    return {"proxy_loss": proxy_loss, "proxy_screening": config["proxy-screening"]}


def time_exchanges(grid: Grid) -> dict:
    """Wrap ``grid.send_and_receive`` to time each exchange: message type (``train``,
    ``evaluate``) → seconds from pushing the messages to holding every reply (the round-time
    breakdown in docs/round_time.md)."""
    seconds: dict = {}
    send_and_receive = grid.send_and_receive

    def timed(messages, *args, **kwargs):
        messages = list(messages)
        kind = messages[0].metadata.message_type.split(".")[0] if messages else "none"
        started = time.perf_counter()
        try:
            return send_and_receive(messages, *args, **kwargs)
        finally:
            seconds[kind] = time.perf_counter() - started

    grid.send_and_receive = timed
    return seconds


def run_server(grid: Grid, config: dict) -> dict:
    """Run ``num-server-rounds`` rounds with a resolved run config; returns the results dict.
    Whatever refuses the run while it is set up raises :class:`~fedbasin.config.RunConfigError`
    (see :func:`refused_as_run_config`) before anything in ``out-dir`` changes."""
    with refused_as_run_config():
        device = resolve_device(config["device"])
        task = task_from_config(config)
        model = model_from_config(task, config, seed=config["seed"])
        family, adapter = model_adapter(task, model)
        outputs = RunOutputs(config["out-dir"], family, model.config, config,
                             extra_files=causal_lm.save_tokenizer(task))
        spec = adapter.spec
        distill = ({"distill": make_distiller(model, task, config, adapter, in_place=True)}
                   if distils(config, task) else {})
        match, _, _, robust = from_run_config(config)
        match = resolve_match(match, kind_of(task, model))
        strategy = AlignedFedAvg(
            spec,
            alignment=config["alignment"],
            match=match,
            robust=robust,
            independent_init=config["init"] == "client",
            refine=make_refiner(spec, model, task, config, adapter.from_standard) if refines(config, task) else None,
            fraction_train=config["fraction-train"],
            fraction_evaluate=config["fraction-evaluate"],
            min_train_nodes=config["min-nodes"],
            min_evaluate_nodes=config["min-nodes"],
            min_available_nodes=config["min-nodes"],
            **proxy_screen_options(model, task, config, adapter),
            **distill,
            device=device,
        )
        resumed = outputs.resume(config["rebuild-results"]) if config["resume"] else None
        removed = None if config["resume"] else outputs.prepare_fresh(config["overwrite"])
    eval_batch = eval_batch_size(task, model)
    num_rounds = config["num-server-rounds"]
    first_round = 1
    initial_state = model.state_dict()
    if resumed is not None:
        last, state = resumed
        check_fits(initial_state, state, f"checkpoint of round {last}")
        for server_round in outputs.unrecorded_rounds(last):
            try:
                saved = load_checkpoint(outputs.checkpoint_dir(server_round)).state
                check_fits(model.state_dict(), saved, f"checkpoint of round {server_round}")
            except (OSError, ValueError, RuntimeError) as error:
                log(WARNING, "resume: round %d has no record and its checkpoint does not load "
                    "(%s); it stays without one", server_round, error)
                continue
            with holding_weights(model, saved, device):
                test = task.evaluate(model, "test", device, eval_batch)
            del saved
            outputs.record(server_round, None, {"test_loss": test["loss"],
                                                "test_accuracy": test["accuracy"], "rebuilt": True})
            log(INFO, "resume: round %d had no record; rebuilt its test metrics from %s",
                server_round, outputs.checkpoint_dir(server_round))
        initial_state, state = state, None
        first_round = last + 1
        log(INFO, "resuming after round %d from %s", last, outputs.checkpoint_dir(last))
        if last >= num_rounds:
            log(INFO, "all %d rounds are already done", num_rounds)
            return outputs.results
    elif removed:
        log(INFO, "fresh run (overwrite=true): removed %s from %s", removed, outputs.dir)
    initial_arrays = ArrayRecord(adapter.to_standard(initial_state))
    del initial_state
    # the module keeps the architecture; every state run through it lends its own tensors
    # (holding_weights): the server holds no model copy of its own between rounds
    release_weights(model)
    exchanges = time_exchanges(grid)
    round_started = time.perf_counter()

    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        """Test-split metrics of the global model; records every round not recorded yet."""
        nonlocal round_started
        seconds, round_started = time.perf_counter() - round_started, time.perf_counter()
        eval_started = time.perf_counter()
        with holding_weights(model, adapter.from_standard(arrays.to_torch_state_dict()), device) as held:
            test = task.evaluate(model, "test", device, eval_batch)
            state = {k: v.detach() for k, v in held.items()}
        del held
        metrics = {"test_loss": test["loss"], "test_accuracy": test["accuracy"]}
        timing = {f"{kind}_exchange_seconds": s for kind, s in exchanges.items()}
        timing["server_eval_seconds"] = time.perf_counter() - eval_started
        exchanges.clear()
        if server_round >= first_round or resumed is None:
            extra = {"round_seconds": seconds, **timing} if server_round else {}
            for record in (strategy.train_metrics, strategy.evaluate_metrics):
                extra.update(record.get(server_round, {}))
            screening = strategy.screening.get(server_round, {})
            for key, name in (("excluded", "excluded"), ("capped", "capped"), ("failed", "failure")):
                if screening.get(key):
                    extra[name] = screening[key]
            outputs.record(server_round, state, {**metrics, **extra})
            log(
                INFO,
                "round %d: test accuracy %.4f, test loss %.4f",
                server_round,
                test["accuracy"],
                test["loss"],
            )
        return MetricRecord(metrics)

    result = strategy.start(
        grid,
        initial_arrays=initial_arrays,
        num_rounds=num_rounds,
        train_config=ConfigRecord(config),
        evaluate_config=ConfigRecord(config),
        evaluate_fn=evaluate,
        first_round=first_round,
    )
    del initial_arrays
    check_final_model(outputs, adapter.from_standard(result.arrays.to_torch_state_dict()))
    return outputs.results


class UnusableModelError(RuntimeError):
    """The run finished but its final global model is unusable (non-finite weights or loss)."""


def check_final_model(outputs: RunOutputs, state: dict[str, torch.Tensor]) -> None:
    """Record ``final = {round, usable, reason}`` in results.json; raise
    :class:`UnusableModelError` if the final model has non-finite weights or test metrics."""
    last = outputs.results["rounds"][-1] if outputs.results["rounds"] else {}
    bad = [k for k, v in state.items() if v.is_floating_point() and not torch.isfinite(v).all()]
    reason = ""
    if bad:
        reason = f"non-finite weights in {bad[:3]}"
    elif not all(math.isfinite(last.get(k, math.nan)) for k in ("test_loss", "test_accuracy")):
        reason = f"test loss {last.get('test_loss')}, accuracy {last.get('test_accuracy')}"
    failed = [r["round"] for r in outputs.results["rounds"] if r.get("round_failed")]
    outputs.results["final"] = {"round": last.get("round"), "usable": not reason,
                                "reason": reason, "failed_rounds": failed}
    outputs.save_results()
    if failed:
        log(WARNING, "rounds %s failed and kept the previous global model", failed)
    if reason:
        raise UnusableModelError(
            f"the final global model of round {last.get('round')} in {outputs.dir} is unusable: "
            f"{reason}"
        )
