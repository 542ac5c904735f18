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

from fedbasin.alignment.adapters import Adapter, fedbasin_adapter
from fedbasin.alignment.proxy import split_share_problem
from fedbasin.data import Task, load_task
from fedbasin.models import FAMILIES, build_model
from fedbasin.training import device_name_problem

DEFAULT_RUN_CONFIG: dict[str, bool | int | float | str] = {
    # rounds and reproducibility
    "num-server-rounds": 3,
    "seed": 0,
    # data (see fedbasin.data.load_task) and partitioning across nodes
    "data": "digits",
    "partitioner": "iid",  # iid | dirichlet
    "dirichlet-alpha": 0.5,
    "proxy-size": 0,  # examples held back by the server for later refinement
    "proxy-selection-fraction": 0.2,  # share of the proxy split that keep-best scores (refinement, distillation)
    "proxy-evaluation-fraction": 0.2,  # share only reported (0: none; those examples train)
    "max-train-examples": 0,  # 0: the whole training split
    "block-size": 64,  # text sources: tokens per example
    # model: fields of the family's config; 0 or "" keeps the data's/family's default
    "model.dim": 64,
    "model.depth": 2,
    "model.heads": 4,
    "model.mlp-dim": 128,
    "model.norm": "layernorm",
    "model.activation": "gelu",
    "model.bias": True,
    "model.patch-size": 0,  # vit only
    "model.position": "",  # gpt only: learned | rope
    "model.kv-heads": 0,  # hf-config model types with grouped-query attention; 0: as many as heads
    # Hugging Face causal LMs on text data (fedbasin.causal_lm); "" keeps fedbasin's own models
    "hf-config": "",  # a model type (gpt2 | gpt_neox | llama | mistral | qwen2) sized by model.*, or a config.json
    "hf-pretrained": "",  # a saved model directory (or hub id): its weights start the run
    "tokenizer": "",  # Hugging Face tokenizer directory (or hub id) for text data; "": hf-pretrained's
    # local training on each node
    "init": "server",  # server: start from the broadcast model | client: round 1 from a node seed
    "local-epochs": 5,
    "lr": 0.002,
    "batch-size": 16,
    "weight-decay": 0.01,
    "device": "auto",  # auto | cpu | cuda | cuda:N
    # strategy
    "alignment": True,
    "symmetry": "orthogonal",  # orthogonal | permutation
    "align-iterations": 20,
    "universe-iterations": 1,  # >1: re-align every client to the running average (universe matching)
    "refine-steps": 0,  # >0: learned refinement on the server's proxy split (needs proxy-size >= 10)
    "refine-lr": 0.01,
    "refine-head-lr": 0.0,  # >0: Adam's learning rate for the per-head QK/OV maps (0: refine-lr)
    "refine-permutations": "ste",  # ste (straight-through Hungarian) | sinkhorn | fixed (the matching's)
    "refine-group": "orthogonal",  # orthogonal | invertible (per-head QK/OV maps, ReLU neuron scalings)
    "refine-start": "symmetry",  # symmetry (`symmetry`'s mode) | permutation | orthogonal | best (both, the better)
    "refine-lambda": "0.4,0.6",  # LO,HI: two models train at λ ~ U(LO, HI) on their path
    "refine-schedule": "constant",  # constant | cosine (learning rate decays to 0 over refine-steps)
    "refine-soft-labels": 0.0,  # w in [0, 1]: the maps train on (1 - w) labels + w the clients' mean probabilities
    "refine-soft-label-top-k": 0,  # k > 0: soft labels kept as each target's k largest entries (sparse)
    "refine-workers": 0,  # threads sharing each refinement batch (0: one per torch CPU thread; fixed: same result anywhere)
    "distill-steps": 0,  # >0: distil the clients' logit ensemble into the merge on the proxy split
    "distill-lr": 0.002,
    "distill-temperature": 3.0,
    "distill-label-weight": 0.0,  # w in [0, 1]: (1 - w) KL to the ensemble + w CE on the proxy labels
    "distill-augment": "none",  # none | crop | crop-flip: random views of the transfer images (image data)
    "distill-teacher": "logits",  # logits | probabilities: the ensemble averages the clients' logits or probabilities
    "fraction-train": 1.0,
    "fraction-evaluate": 1.0,
    "min-nodes": 2,
    # robust aggregation (server side; see fedbasin.strategies.AlignedFedAvg, docs/robustness.md)
    "max-abs-weight": 1e6,  # a reply holding any |value| above this is excluded
    "max-num-examples": 1000000,  # num-examples cap (0: none)
    "max-examples-ratio": 1.0,  # and at most this × the round's lower-median count (0: none)
    "outlier-threshold": 3.5,  # MAD rule in the aligned basis, and two equal camps fail the round (0: off)
    "proxy-screening": 0.0,  # t > 0: exclude replies whose proxy loss > (1 + t) × the lower median of the cohort's proxy losses
    "clip-ratio": 0.0,  # >0: clip updates to this × the median update norm
    "aggregator": "mean",  # mean | trimmed-mean | median (coordinate-wise, after alignment)
    "trim-fraction": 0.25,  # trimmed-mean: fraction dropped at each end
    # server outputs
    "out-dir": "runs/flower",
    "resume": False,
    "overwrite": False,  # a fresh run may replace the outputs of an earlier run in out-dir
    "rebuild-results": False,  # resume: rebuild a missing/damaged results.json from checkpoints
}

CHOICES = {
    "partitioner": ("iid", "dirichlet"),
    "init": ("server", "client"),
    "symmetry": ("orthogonal", "permutation"),
    "refine-permutations": ("ste", "sinkhorn", "fixed"),
    "refine-group": ("orthogonal", "invertible"),
    "refine-start": ("symmetry", "permutation", "orthogonal", "best"),
    "refine-schedule": ("constant", "cosine"),
    "aggregator": ("mean", "trimmed-mean", "median"),
    "distill-augment": ("none", "crop", "crop-flip"),
    "distill-teacher": ("logits", "probabilities"),
}

# (keys, lower bound, lower bound included): numeric keys outside their range are refused
RANGES = (
    (("num-server-rounds", "local-epochs", "batch-size", "block-size", "align-iterations",
      "universe-iterations", "min-nodes"), 1, True),
    (("seed", "proxy-size", "max-train-examples", "refine-steps", "distill-steps", "max-num-examples",
      "model.dim", "model.depth", "model.heads", "model.mlp-dim", "model.patch-size", "model.kv-heads",
      "weight-decay", "max-examples-ratio", "outlier-threshold", "proxy-screening", "clip-ratio", "trim-fraction",
      "lr", "fraction-train", "fraction-evaluate", "distill-label-weight", "refine-soft-labels", "refine-soft-label-top-k",
      "refine-workers", "refine-head-lr"),
     0, True),
    (("refine-lr", "distill-lr", "distill-temperature", "dirichlet-alpha", "max-abs-weight"), 0, False),
)
UPPER = {"fraction-train": 1.0, "fraction-evaluate": 1.0, "trim-fraction": 0.5, "distill-label-weight": 1.0,
         "refine-soft-labels": 1.0}


class RunConfigError(ValueError):
    """A refused run config: ``problems`` holds one line per key at fault (the message joins them)."""

    def __init__(self, problems: list[str]):
        super().__init__("\n".join(problems))
        self.problems = list(problems)


def resolve_run_config(run_config: Mapping[str, object] | None = None) -> dict:
    """``DEFAULT_RUN_CONFIG`` updated by ``run_config``. Every bad key (unknown, wrong type, bad
    choice, out of range, contradicting another key) is reported, one line per key, in one
    :class:`RunConfigError` (a ``ValueError``). Ints are accepted where floats are expected."""
    config, problems = dict(DEFAULT_RUN_CONFIG), []
    for key, value in (run_config or {}).items():
        if key not in DEFAULT_RUN_CONFIG:
            close = difflib.get_close_matches(key, DEFAULT_RUN_CONFIG, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            problems.append(f"unknown run-config key {key!r}{hint}; known: {sorted(DEFAULT_RUN_CONFIG)}")
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
    for key, allowed in CHOICES.items():
        if config[key] not in allowed:
            problems.append(f"run-config {key}={config[key]!r}; expected one of {allowed}")
    for key, verb in (("refine-steps", "refines"), ("distill-steps", "distils"), ("proxy-screening", "scores replies")):
        if config[key] > 0 and config["proxy-size"] < 10:
            problems.append(f"run-config {key}={config[key]} needs proxy-size >= 10 "
                            f"(got {config['proxy-size']}): the server {verb} on its proxy split")
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
    try:
        refine_lambda(config)
    except ValueError as error:
        problems.append(str(error))
    if config["refine-steps"] > 0 and not config["alignment"]:
        problems.append(f"run-config refine-steps={config['refine-steps']} refines the alignment: "
                        "it needs alignment=true")
    if problem := device_name_problem(config["device"]):
        problems.append(f"run-config {problem}")
    if config["resume"] and config["overwrite"]:
        problems.append("run-config resume=true and overwrite=true contradict each other")
    return problems


def refine_lambda(config: Mapping[str, object]) -> tuple[float, float]:
    """``refine-lambda = "LO,HI"`` as ``(lo, hi)``; ``ValueError`` unless ``0 <= LO <= HI <= 1``."""
    text = config["refine-lambda"]
    try:
        lo, hi = (float(part) for part in text.split(","))
    except ValueError:
        lo = hi = math.nan
    if not 0.0 <= lo <= hi <= 1.0:
        raise ValueError(f"run-config refine-lambda={text!r} must be 'LO,HI' with 0 <= LO <= HI <= 1 "
                         "(two models train at λ ~ U(LO, HI) on their path), e.g. '0.4,0.6'")
    return lo, hi


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
    from fedbasin import causal_lm

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
    from fedbasin import causal_lm

    if causal_lm.selected(config):
        return causal_lm.build(task, config, seed, load_weights)
    return build_model(
        task.family, model_config(task.family, task.model_overrides, config), seed=seed
    )


def model_adapter(task: Task, model: nn.Module) -> tuple[str, Adapter]:
    """``(family, adapter)`` of a model from :func:`model_from_config`: the fedbasin family or the
    Hugging Face ``model_type``; the adapter's ``to_standard`` gives the layout the strategy's
    spec describes (what the Flower messages carry), ``from_standard`` the model's own keys."""
    if isinstance(model.config, tuple(config_cls for _, config_cls in FAMILIES.values())):
        return task.family, fedbasin_adapter(task.family, model.config)
    from fedbasin.alignment.hf import hf_adapter

    return model.config.model_type, hf_adapter(model)


def eval_batch_size(task: Task, model: nn.Module, budget: int = 2**26, most: int = 512) -> int:
    """Evaluation batch size keeping one batch's logits under ``budget`` values (a 50k-token
    vocabulary makes 512 blocks of 64 tokens 6.6 GB), at most ``most``."""
    vocab = getattr(model.config, "vocab_size", 1)
    per_example = max(1, task.test.targets[0].numel() * vocab)
    return max(1, min(most, budget // per_example))
