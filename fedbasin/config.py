"""The run configuration of the Flower apps: one defaults table, shared by every entry point.

``flwr run .`` reads ``[tool.flwr.app.config]`` from ``pyproject.toml``; ``fedbasin simulate``
resolves :data:`DEFAULT_RUN_CONFIG` plus its overrides and passes every key to ``flwr run``.
The ServerApp and the ClientApp fall back to :data:`DEFAULT_RUN_CONFIG`, which a test keeps
equal to the pyproject table.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping
from dataclasses import fields

from torch import nn

from fedbasin import causal_lm
from fedbasin.alignment.adapters import Adapter, fedbasin_adapter
from fedbasin.alignment.proxy import split_share_problem
from fedbasin.data import Task, load_task
from fedbasin.models import FAMILIES, build_model, family_of
from fedbasin.options import (AUTO, IMAGE, RUN, convert, from_run_config, resolve_refine, run_config_choices,
                              run_config_fields, toml_value)
from fedbasin.options import problems as option_problems
from fedbasin.run_defaults import DEFAULT_RUN_CONFIG
from fedbasin.training import OUTPUT_BUDGET, device_name_problem

# the run-level keys' checks; the schema's keys (fedbasin.options) carry their own
RUN_CHOICES = {"partitioner": ("iid", "dirichlet"), "init": ("server", "client")}
CHOICES = {**RUN_CHOICES, **run_config_choices()}  # every key with choices (simulate --help lists them)

# (keys, lower bound, lower bound included): numeric keys outside their range are refused
RANGES = (
    (("num-server-rounds", "local-epochs", "batch-size", "block-size", "min-nodes"), 1, True),
    (("seed", "proxy-size", "max-train-examples", "model.dim", "model.depth", "model.heads", "model.mlp-dim",
      "model.patch-size", "model.kv-heads", "weight-decay", "lr", "fraction-train", "fraction-evaluate"), 0, True),
    (("dirichlet-alpha",), 0, False),
)
UPPER = {"fraction-train": 1.0, "fraction-evaluate": 1.0}
MIN_PROXY = 10  # examples: a proxy split of fewer leaves its selection and evaluation parts one or two each


class RunConfigError(ValueError):
    """A refused run config: ``problems`` holds one line per key at fault (the message joins them)."""

    def __init__(self, problems: list[str]):
        super().__init__("\n".join(problems))
        self.problems = list(problems)


def resolve_run_config(run_config: Mapping[str, object] | None = None) -> dict:
    """``DEFAULT_RUN_CONFIG`` updated by ``run_config``. Every bad key (unknown, wrong type, bad
    choice, out of range, contradicting another key) is reported, one line per key, in one
    :class:`RunConfigError` (a ``ValueError``). Ints are accepted where floats are expected."""
    config, problems, schema = dict(DEFAULT_RUN_CONFIG), [], run_config_fields()
    for key, value in (run_config or {}).items():
        if key not in DEFAULT_RUN_CONFIG:
            close = difflib.get_close_matches(key, DEFAULT_RUN_CONFIG, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            problems.append(f"unknown run-config key {key!r}{hint}; known: {sorted(DEFAULT_RUN_CONFIG)}")
            continue
        if key in schema:
            _, f, opt = schema[key]
            try:
                config[key] = convert(f, opt, value, typed=True)
            except ValueError as error:
                problems.append(f"run-config {key}={value!r}: {error}")
            continue
        expected = type(DEFAULT_RUN_CONFIG[key])
        if expected is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if type(value) is not expected:
            problems.append(f"run-config {key}={value!r} has type {type(value).__name__}; "
                            f"expected {expected.__name__}")
            continue
        config[key] = value
    problems += _value_problems(config)
    if problems:
        raise RunConfigError(problems)
    return config


def _value_problems(config: dict) -> list[str]:
    """One line per key of a well-typed config whose value is refused."""
    problems = []
    for key, allowed in RUN_CHOICES.items():
        if config[key] not in allowed:
            problems.append(f"run-config {key}={config[key]!r}; expected one of {allowed}")
    problems += _option_problems(config)
    if 0 < config["proxy-size"] < MIN_PROXY:  # auto refinement and distillation would run on it, to no avail
        problems.append(f"run-config proxy-size={config['proxy-size']} is too small: the server's proxy split needs "
                        f"at least {MIN_PROXY} examples (0 holds none back)")
    for key, verb in (("refine-steps", "refines"), ("distill-steps", "distils"), ("proxy-screening", "scores replies")):
        if config[key] != AUTO and config[key] > 0 and config["proxy-size"] == 0:
            problems.append(f"run-config {key}={config[key]} needs proxy-size >= {MIN_PROXY} "
                            f"(got 0): the server {verb} on its proxy split")
    for keys, low, inclusive in RANGES:
        for key in keys:
            value = config[key]
            if isinstance(value, float) and not math.isfinite(value):
                problems.append(f"run-config {key}={value!r} must be finite")
            elif value < low or (value == low and not inclusive):
                bound = f"at least {low}" if inclusive else f"greater than {low}"
                problems.append(f"run-config {key}={value!r} must be {bound}")
    for key, high in UPPER.items():
        if config[key] > high or (key == "trim-fraction" and config[key] == high):
            problems.append(f"run-config {key}={config[key]!r} must be "
                            f"{'below' if key == 'trim-fraction' else 'at most'} {high}")
    selection, evaluation = config["proxy-selection-fraction"], config["proxy-evaluation-fraction"]
    if problem := split_share_problem(selection, evaluation):
        problems.append(f"run-config proxy-selection-fraction={selection!r} proxy-evaluation-fraction={evaluation!r}: "
                        f"{problem}")
    if config["refine-steps"] not in (AUTO, 0) and not config["alignment"]:
        problems.append(f"run-config refine-steps={config['refine-steps']} refines the alignment: "
                        "it needs alignment=true")
    if problem := device_name_problem(config["device"]):
        problems.append(f"run-config {problem}")
    if config["resume"] and config["overwrite"]:
        problems.append("run-config resume=true and overwrite=true contradict each other")
    return problems


def _option_problems(config: dict) -> list[str]:
    """The schema's refusals of the run config's options on its ``data``; for image data also with every ``auto``
    resolved (the CLI checks the resolved options on the data it reads: an option that the resolved ones make
    meaningless, e.g. a sampled vocabulary with the full softmax of images, is refused, not ignored every round)."""
    options = from_run_config(config)
    found = option_problems(options, RUN, data=config["data"])
    if not found and not str(config["data"]).startswith("text:"):
        match, refine, *_ = options
        resolved = resolve_refine(refine, IMAGE).options
        found = [f"{line} (with the auto values of an image classifier)"
                 for line in option_problems([resolved, match], RUN, data=config["data"])]
    return found


def model_config(
    family: str, data_overrides: Mapping[str, object], config: Mapping[str, object]
) -> dict:
    """Model config dict: the data's implied fields (``Task.model_overrides``), then every
    non-empty ``model.<field>`` run-config key (dashes become underscores). A non-empty key that
    the family's config lacks raises ``ValueError`` naming it."""
    known = {f.name for f in fields(FAMILIES[family][1])}
    values = dict(data_overrides)
    for key, value in config.items():
        if (
            not key.startswith("model.")
            or value == ""
            or (value == 0 and not isinstance(value, bool))
        ):
            continue
        name = key.removeprefix("model.").replace("-", "_")
        if name not in known:
            raise ValueError(f"run-config {key}={value!r} does not apply to {family} models")
        values[name] = value
    return values


def task_from_config(config: Mapping[str, object]) -> Task:
    """The run's data (cached per process, so every round of a node reuses it)."""
    return load_task(
        config["data"],
        seed=config["seed"],
        proxy_size=config["proxy-size"],
        max_train_examples=config["max-train-examples"],
        block_size=config["block-size"],
        tokenizer=causal_lm.tokenizer_source(config),
    )


def model_from_config(
    task: Task, config: Mapping[str, object], seed: int, load_weights: bool = True
) -> nn.Module:
    """A freshly initialised model of the task's family, shaped by the data and ``model.*``;
    or the Hugging Face causal LM of ``hf-config`` / ``hf-pretrained`` (its pretrained weights
    loaded when ``load_weights``; see :mod:`fedbasin.causal_lm`)."""
    if causal_lm.selected(config):
        return causal_lm.build(task, config, seed, load_weights)
    values = model_config(task.family, task.model_overrides, config)
    try:
        return build_model(task.family, values, seed=seed)
    except ValueError as error:  # e.g. a width the heads do not divide: name the keys that shaped the model
        given = " ".join(f"{key}={toml_value(value)}" for key, value in config.items()
                         if key.startswith("model.") and value != DEFAULT_RUN_CONFIG[key])
        raise ValueError(f"run-config {given or 'model.* (the defaults)'}: {error}") from None


def model_adapter(task: Task, model: nn.Module) -> tuple[str, Adapter]:
    """``(family, adapter)`` of a model from :func:`model_from_config`: the fedbasin family or the
    Hugging Face ``model_type``; the adapter's ``to_standard`` gives the layout the strategy's
    spec describes (what the Flower messages carry), ``from_standard`` the model's own keys."""
    if family_of(model.config) is not None:  # a fedbasin model (a registered family's config)
        return task.family, fedbasin_adapter(task.family, model.config)
    from fedbasin.alignment.hf import hf_adapter

    return model.config.model_type, hf_adapter(model)


def eval_batch_size(task: Task, model: nn.Module, budget: int = OUTPUT_BUDGET, most: int = 512) -> int:
    """Evaluation batch size keeping one batch's logits under ``budget`` values (a 50k-token
    vocabulary makes 512 blocks of 64 tokens 6.6 GB), at most ``most``; the examples' size is read
    from ``task``'s test split (or from ``task`` itself when it is a split)."""
    vocab = getattr(model.config, "vocab_size", 1)
    per_example = max(1, getattr(task, "test", task).targets[0].numel() * vocab)
    return max(1, min(most, budget // per_example))
