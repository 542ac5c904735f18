"""One typed schema for the alignment options: weight matching, learned refinement, distillation
and robust aggregation, each declared once.

Every option is a dataclass field carrying an :class:`Option` (type, default, allowed values or
range, help, the surfaces it appears on). From the schema come the ``fedbasin`` command line's
flags (:func:`add_arguments`), the Flower run-config keys and their defaults (:func:`run_config_defaults`,
kept equal to ``pyproject.toml`` by a test), their validation (:func:`problems`, one line per
option at fault, naming both options of a refused combination) and the translation into the
library's calls (:func:`refine_call`). A flag and a run-config key share one name and meaning:
``--refine-steps`` is ``refine-steps``.

``"auto"`` values are resolved by :func:`resolve_refine` from what the model is (:func:`model_kind`:
an image classifier, a causal LM with a subword tokenizer, a character-level LM) and the time
budget, never from a data set's name. The settings per kind are the ones measured best
(docs/merging.md, the method; docs/journal/merging-notes.md, the measurements; the suite of pairs in docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

AUTO = "auto"
CLI, RUN = "cli", "run"  # the surfaces an option appears on
INT64 = 2**63  # integers are int64 to torch and numpy: larger ones are refused (int64_problem), not overflowed
MAX_BUDGET = 1e7  # seconds (about 116 days): a budget beyond it is a typo, and its step count would overflow
PYTHON = "python"  # the Python API's option objects (every option; named by class and field in messages)


@dataclass(frozen=True)
class Option:
    """What a field accepts. ``low``/``high`` bound numbers (``open_low``: strictly above ``low``);
    ``auto``: the value may be ``"auto"`` (chosen by :func:`resolve_refine`); ``legacy``: older
    values still accepted, mapped to their current spelling; ``aliases``: older flag names."""

    help: str
    choices: tuple = ()
    low: float | None = None
    open_low: bool = False
    high: float | None = None
    open_high: bool = False
    auto: bool = False
    surfaces: tuple[str, ...] = (CLI, RUN)
    aliases: tuple[str, ...] = ()
    legacy: Mapping[Any, Any] = field(default_factory=dict)
    metavar: str | None = None

    @property
    def allowed(self) -> tuple:
        """The choices, with ``"auto"`` when the option takes it."""
        return self.choices + ((AUTO,) if self.auto else ())


def option(default, help: str, **spec) -> Any:
    """A schema field: ``default`` plus its :class:`Option` (keyword arguments)."""
    return field(default=default, metadata={"option": Option(help, **spec)})


# ---------------------------------------------------------------------------------------------
# the schema


@dataclass
class MatchOptions:
    """Data-free weight matching (:func:`fedbasin.alignment.weight_match`, ``merge``)."""

    PREFIX = ""
    symmetry: str = option("orthogonal", "group searched: orthogonal residual/head maps with head and neuron "
                           "permutations, or permutations only", choices=("orthogonal", "permutation"))
    align_iterations: int = option(20, "at most this many coordinate-ascent passes", low=1,
                                   aliases=("--iterations",))
    align_tol: float = option(1e-4, "stop once a pass improves the objective by less than this fraction", low=0,
                              aliases=("--tol",))
    universe_iterations: int = option(1, "passes re-aligning every model to the running average (1: align to the "
                                      "reference only; >1: universe matching)", low=1)
    head_weight: float | str = option(AUTO, "factor on the output head's rows in the matching objective (models "
                                      "with a token embedding; auto: 2 for subword LMs, else 1)", low=0,
                                      open_low=True, auto=True)
    already_aligned: str = option("average", "Flower rounds whose clients all trained from the broadcast model: "
                                  "when a permutation matching pass leaves every client's heads and neurons in "
                                  "place (they share the broadcast's basis), average them as FedAvg does (average) "
                                  "or align them anyway (align)", choices=("average", "align"), surfaces=(RUN,))


@dataclass
class RefineOptions:
    """Learned refinement on proxy data (:func:`fedbasin.alignment.learned_refine`); auto: by model kind and budget.

    ``auto``: the measured best for the model's kind, sized by ``budget`` (:func:`resolve_refine`)."""

    PREFIX = "refine-"
    budget: float = option(120.0, "seconds the refinement may take (start, labelling, steps and keep-best "
                           "checks; in Flower, per round); the steps follow from timing the first ones (a GPU buys "
                           "more in the same time); 0 with steps auto: no refinement", low=0, high=MAX_BUDGET,
                           metavar="SECONDS")
    steps: int | str = option(AUTO, "optimiser steps (auto: as many as the budget allows; 0: no refinement)", low=0,
                              auto=True)
    examples: int | str = option(AUTO, "proxy examples taken from the data's training split (by default 60%% "
                                 "train the maps, 20%% select the alignment kept, 20%% only report its loss; at "
                                 "least 2: one trains, one selects)", low=2, auto=True, surfaces=(CLI,))
    selection_fraction: float = option(0.2, "share of the proxy examples keep-best scores (exactly) to choose the "
                                       "alignment kept; must be > 0", low=0, high=1.0, surfaces=(CLI,), metavar="F")
    evaluation_fraction: float | str = option(AUTO, "share of the proxy examples whose loss is only reported; 0: "
                                              "none (those examples train)", low=0, high=1.0, auto=True,
                                              surfaces=(CLI,), metavar="F")
    lr: float | str = option(AUTO, "Adam learning rate of the residual maps, neuron scalings and permutation "
                             "scores", low=0, open_low=True, auto=True)
    head_lr: float | str = option(AUTO, "Adam learning rate of the per-head QK/OV maps (0: the same as lr)", low=0,
                                  auto=True, metavar="LR")
    permutations: str = option(AUTO, "straight-through Hungarian, Sinkhorn relaxation, or keep the matching's "
                               "permutations", choices=("ste", "sinkhorn", "fixed"), auto=True)
    group: str = option(AUTO, "maps learned: orthogonal, or invertible per-head QK/OV maps and ReLU / gated "
                        "neuron scalings (the larger exact group)", choices=("orthogonal", "invertible"), auto=True)
    start: str = option(AUTO, "the start: weight matching in the symmetry's mode, in a given mode, both modes "
                        "(the better on the selection split), or the models' activations on the proxy data",
                        choices=("symmetry", "permutation", "orthogonal", "best", "activations"), auto=True,
                        legacy={"weights": "symmetry"})
    lambda_: str = option(AUTO, "LO,HI: two models train at λ ~ U(LO, HI) on their path", auto=True,
                          metavar="LO,HI")
    schedule: str = option(AUTO, "learning-rate schedule over the steps", choices=("constant", "cosine"), auto=True)
    batch_size: int | str = option(AUTO, "proxy examples per step", low=1, auto=True)
    soft_labels: float | str = option(AUTO, "train on (1 − W)·labels + W·the models' mean predicted probabilities; "
                                      "0: labels only", low=0, high=1.0, auto=True, metavar="W")
    soft_label_top_k: int | str = option(AUTO, "soft labels kept as each target's K largest entries (sparse); "
                                         "0: every class", low=0, auto=True, metavar="K")
    dual: bool | str = option(AUTO, "the reference carries a learned transform too (align writes the candidate "
                              "mapped back into the reference's basis: the same path); --no-refine-dual: never",
                              auto=True, surfaces=(CLI,))
    workers: int | str = option(AUTO, "threads that share each training batch (0: one per torch CPU thread; 1 on "
                                "a GPU); a fixed N gives the same result on any thread count", low=0, auto=True,
                                metavar="N")
    vocabulary: str = option(AUTO, "text data: the training softmax covers every token (full), the proxy's "
                             "tokens (proxy) or the training split's (seen); keep-best always uses every token",
                             choices=("full", "proxy", "seen"), auto=True)
    vocabulary_samples: int | str = option(AUTO, "with vocabulary proxy|seen: K tokens from outside it join each "
                                           "step's softmax, logits raised by log(m/K)", low=0, auto=True,
                                           metavar="K")
    vocabulary_batch_samples: int | str = option(AUTO, "with vocabulary proxy|seen: each step's softmax covers "
                                                 "its own tokens (and those its sparse soft labels list) and K others "
                                                 "of the vocabulary", low=0, auto=True,
                                                 metavar="K")
    seed: int = option(0, "seed of the refinement's randomness (proxy split, batch order, λ draws, sampled "
                       "tokens)", low=0, surfaces=(CLI,), metavar="S")
    eval_every: int | str = option(AUTO, "score the alignment on the selection split every N steps (keep-best)",
                                   low=1, auto=True, metavar="N")


AUGMENTS = ("none", "crop", "crop-flip", "mixup", "crop-mixup", "crop-flip-mixup")


@dataclass
class DistillOptions:
    """Ensemble distillation of the models' outputs into the merge, on proxy data (Flower: the proxy split; merge: --refine-data).

    In Flower each round's merge is distilled; ``fedbasin merge`` distils after the learned refinement."""

    PREFIX = "distill-"
    # the default distils, sized by ``budget``, whenever there is real proxy data (measured: docs/options.md,
    # "Distillation by a time budget"; for fedbasin merge, docs/benchmarks.md "The distilled merge"); 0 turns it off
    steps: int | str = option(AUTO, ">0: distil the models' ensemble into the merge on the proxy data for this "
                              "many steps; auto: as many as distill-budget allows (no proxy data or the "
                              "synthetic unigram proxy: no distillation); 0: no distillation",
                              low=0, auto=True)
    budget: float = option(120.0, "with distill-steps auto: seconds one distillation may take (per round in Flower; "
                           "caching the models' outputs, the steps and keep-best checks); the steps follow from timing "
                           "one step before the first; 0: no distillation", low=0, high=MAX_BUDGET,
                           metavar="SECONDS")
    lr: float | str = option(AUTO, "Adam learning rate of the student; auto: for image classifiers sized by the "
                             "run's steps (0.0005 up to 250, rising to 0.002 at 1500 and beyond), 0.001 for language "
                             "models (0.0001 in fedbasin merge of subword LMs)", low=0, open_low=True, auto=True)
    temperature: float | str = option(AUTO, "softmax temperature of teacher and student; auto: 3 for image "
                                      "classifiers, 1 for language models", low=0, open_low=True, auto=True)
    label_weight: float | str = option(AUTO, "w: (1 − w) KL to the ensemble + w cross-entropy on the proxy labels; "
                                       "auto: 0.5 for image classifiers, 0 for language models", low=0, high=1.0,
                                       auto=True)
    augment: str = option(AUTO, "random views of the transfer images (image data): crops, left-right flips, "
                          "mixup (convex mixes of two proxy images and of their labels); auto: mixup for image "
                          "classifiers, else none",
                          choices=AUGMENTS, auto=True)
    teacher: str = option("logits", "the ensemble averages the models' logits or probabilities",
                          choices=("logits", "probabilities"))
    # "best" is not the default: on gpt2-s01 the selection split (training text) chose the better model alone, which
    # distillation then could not improve (docs/journal/merging-notes.md §34)
    mixture: str = option("given", "the merge's weights before distillation: given (--weights, else equal) or best "
                          "(the lowest selection-split loss on the line from the given weights to the best model "
                          "alone, shares 0, ¼, ½, ¾, 1 of the way: never worse there than the best model)",
                          choices=("given", "best"), surfaces=(CLI,))


@dataclass
class RobustOptions:
    """Screening and robust aggregation of client replies (:class:`fedbasin.strategies.AlignedFedAvg`)."""

    PREFIX = ""
    max_abs_weight: float = option(1e6, "a reply holding any |value| above this is excluded", low=0, open_low=True,
                                   surfaces=(RUN,))
    max_num_examples: int = option(1_000_000, "num-examples cap (0: none)", low=0, surfaces=(RUN,))
    max_examples_ratio: float = option(1.0, "and at most this × the round's lower-median count (0: none)", low=0,
                                       surfaces=(RUN,))
    outlier_threshold: float = option(3.5, "MAD rule in the aligned basis; two equal camps fail the round (0: off)",
                                      low=0, surfaces=(RUN,))
    proxy_screening: float = option(0.0, "t > 0: exclude replies whose proxy loss > (1 + t) × the cohort's "
                                    "lower-median proxy loss", low=0, surfaces=(RUN,))
    clip_ratio: float = option(0.0, ">0: clip updates to this × the median update norm", low=0, surfaces=(RUN,))
    aggregator: str = option("mean", "coordinate-wise, after alignment", choices=("mean", "trimmed-mean", "median"),
                             surfaces=(RUN,))
    trim_fraction: float = option(0.25, "trimmed-mean: fraction dropped at each end", low=0, high=0.5,
                                  open_high=True, surfaces=(RUN,))


GROUPS = (MatchOptions, RefineOptions, DistillOptions, RobustOptions)


def key(cls, f: dataclasses.Field) -> str:
    """The option's name: its flag without ``--`` and its run-config key (``refine-steps``)."""
    return cls.PREFIX + f.name.rstrip("_").replace("_", "-")


def schema_fields(cls, surface: str | None = None) -> list[tuple[str, dataclasses.Field, Option]]:
    """``(key, field, Option)`` of a group's options (on ``surface`` when given)."""
    return [(key(cls, f), f, f.metadata["option"]) for f in fields(cls)
            if surface is None or surface in f.metadata["option"].surfaces]


# ---------------------------------------------------------------------------------------------
# values and their checks


def _type_of(f: dataclasses.Field) -> type:
    default = f.default
    if default == AUTO:  # "int | str" annotations name the type first
        return {"int | str": int, "float | str": float, "bool | str": bool}.get(f.type, str)
    return type(default)


def convert(f: dataclasses.Field, opt: Option, value, typed: bool = False):
    """``value`` (a string from the command line, or with ``typed`` a TOML value, whose numbers and booleans
    are not strings: ``'3'`` is refused as a run-config number) as the field's type, ``"auto"`` kept;
    ``ValueError`` with what was expected."""
    if value in opt.legacy:
        return opt.legacy[value]
    if opt.auto and value == AUTO:
        return AUTO
    kind = _type_of(f)
    if typed and kind is not str and isinstance(value, str):
        raise ValueError(f"expected {({bool: 'true or false', int: 'an integer'}).get(kind, 'a number')}"
                         f"{' or auto' * opt.auto} (unquoted), got the string {value!r}")
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        raise ValueError(f"expected true or false, got {value!r}")
    if kind in (int, float):
        if isinstance(value, bool) or (kind is int and isinstance(value, float)):
            raise ValueError(f"expected {'an integer' if kind is int else 'a number'}{' or auto' * opt.auto}, "
                             f"got {value!r}")
        try:
            return kind(value)
        except (TypeError, ValueError):
            raise ValueError(f"expected {'an integer' if kind is int else 'a number'}{' or auto' * opt.auto}, "
                             f"got {value!r}") from None
    if not isinstance(value, str):
        raise ValueError(f"expected a string, got {value!r}")
    return value


def type_problem(f: dataclasses.Field, opt: Option, value) -> str | None:
    """Why ``value`` is not of the field's type (None when it is; ``"auto"`` where allowed): what the
    command line and the run config convert (:func:`convert`), an option object built in Python may hold."""
    if opt.auto and value == AUTO:
        return None
    kind = _type_of(f)
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    rule = isinstance(value, StepsSizedRate)  # a resolved rate that follows the run's steps (resolve_distill)
    fits = {bool: isinstance(value, bool), int: number and isinstance(value, int), float: number or rule}.get(
        kind, isinstance(value, str))
    if fits:
        return None
    expected = {bool: "True or False", int: "an integer", float: "a number"}.get(kind, "a string")
    return f"expected {expected}{' or auto' * opt.auto}, got {type(value).__name__}"


def int64_problem(value: int) -> str | None:
    """Why the integer ``value`` is refused (None when it fits): torch and numpy take int64 seeds and sizes."""
    return None if -INT64 <= value < INT64 else "must be below 2**63"


def value_problem(opt: Option, value, surface: str = CLI) -> str | None:
    """Why ``value`` is outside the option's choices or range (None when it is allowed), worded for
    ``surface`` (the run config's wording is the one its keys always had)."""
    if value == AUTO and opt.auto:
        return None
    if opt.choices and value not in opt.choices:
        return f"expected one of {opt.allowed!r}" if surface == RUN else f"expected one of {' | '.join(opt.allowed)}"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if not math.isfinite(value):
        return "must be finite"
    if isinstance(value, int) and (why := int64_problem(value)):
        return why
    if opt.low is not None and (value < opt.low or (opt.open_low and value == opt.low)):
        return f"must be {'greater than' if opt.open_low else 'at least'} {opt.low}"
    if opt.high is not None and (value > opt.high or (opt.open_high and value == opt.high)):
        return f"must be {'below' if opt.open_high else 'at most'} {opt.high}"
    return None


def parse_lambda(text: str) -> tuple[float, float]:
    """``"LO,HI"`` as ``(lo, hi)``; ``ValueError`` unless ``0 <= LO <= HI <= 1``."""
    try:
        lo, hi = (float(part) for part in str(text).replace(" ", ",").split(",") if part)
    except ValueError:
        lo = hi = math.nan
    if not 0.0 <= lo <= hi <= 1.0:
        raise ValueError("must be 'LO,HI' with 0 <= LO <= HI <= 1 (two models train at λ ~ U(LO, HI) on their path), "
                         "e.g. '0.4,0.6'")
    return lo, hi


def render(name: str, value, surface: str) -> str:
    """An option as the user wrote it: ``--refine-lr 0.01``, ``refine-lr=0.01`` or (the Python API,
    ``name`` its class and field) ``RefineOptions.lr=0.01``."""
    if surface == PYTHON:
        return f"{name}={value!r}"
    return f"--{name} {value}" if surface == CLI else f"run-config {name}={value!r}"


def _name(cls, f: dataclasses.Field, surface: str, names: Mapping[str, str] | None = None) -> str:
    if surface != PYTHON:
        return key(cls, f)
    return (names or {}).get(f.name, f"{cls.__name__}.{f.name}")


def problems(options: Iterable, surface: str, data: str | None = None, combinations: bool = True,
             names: Mapping[str, str] | None = None) -> list[str]:
    """One line per refused value or (with ``combinations``) combination of the option objects ``options``
    (any of the groups), as ``surface`` names them; ``data``: the refinement data spec when known (text rules);
    ``names``: the Python API's own names of fields (a function's keywords, ``{"align_iterations": "iterations"}``)."""
    by_type = {type(o): o for o in options}
    found, typed = [], True
    for cls, obj in by_type.items():
        for _, f, opt in schema_fields(cls):
            value = getattr(obj, f.name)
            wrong_type = type_problem(f, opt, value)
            typed = typed and wrong_type is None
            if (why := wrong_type or value_problem(opt, value, surface)) is not None:
                separator = ("; " if why.startswith("expected") else " ") if surface == RUN else ": "
                found.append(f"{render(_name(cls, f, surface, names), value, surface)}{separator}{why}")
    refine, match = by_type.get(RefineOptions), by_type.get(MatchOptions)
    if refine is not None and typed:  # (the rules read well-typed values; a rule of one option is its value's)
        found += [_joined(keys, refine, match, surface, why, names) for keys, why in _refine_rules(refine, match, data)
                  if combinations or len(keys) == 1]
    return found


def checked(*options, combinations: bool = True, names: Mapping[str, str] | None = None) -> None:
    """The Python API's check of option objects (any of the groups): ``ValueError`` naming the first
    refused value or (with ``combinations``) combination, as :func:`problems` finds them for the command line
    and the run config (``names``: fields a function takes as keywords of other names)."""
    if found := problems(options, PYTHON, combinations=combinations, names=names):
        raise ValueError(found[0])


def _joined(keys, refine, match, surface, why, names=None) -> str:
    def rendered(name):
        for obj in (refine, match):
            if obj is not None:
                for k, f, _ in schema_fields(type(obj)):
                    if k == name:
                        return render(_name(type(obj), f, surface, names), getattr(obj, f.name), surface)
        return render(name, None, surface)

    return " ".join(rendered(k) for k in keys) + (" " if surface == RUN else ": ") + why


def _refine_rules(r: RefineOptions, m: MatchOptions | None, data: str | None) -> list[tuple[tuple[str, ...], str]]:
    """``(options at fault, why)`` of every refused combination: the one place for each rule."""
    rules = []
    if r.lambda_ != AUTO:
        try:
            parse_lambda(r.lambda_)
        except ValueError as error:
            rules.append((("refine-lambda",), str(error)))
    from fedbasin.alignment.proxy import split_share_problem  # the library's own rule

    evaluation = 0.0 if r.evaluation_fraction == AUTO else r.evaluation_fraction
    if problem := split_share_problem(r.selection_fraction, evaluation):
        rules.append((("refine-selection-fraction", "refine-evaluation-fraction"), problem))
    restricted = r.vocabulary in ("proxy", "seen")
    for name, value in (("refine-vocabulary-samples", r.vocabulary_samples),
                        ("refine-vocabulary-batch-samples", r.vocabulary_batch_samples)):
        if value not in (AUTO, 0) and r.vocabulary == "full":
            rules.append(((name, "refine-vocabulary"), "samples a restricted softmax: needs vocabulary proxy|seen"))
    unigram = is_unigram(data)
    soft = r.soft_labels not in (AUTO, 0) or unigram
    if soft and restricted and r.soft_label_top_k == 0:
        rules.append((("refine-vocabulary", "refine-soft-label-top-k"),
                      "soft labels over every token cannot be combined with a restricted vocabulary: give K > 0"))
    if restricted and data is not None and not (data.startswith("text:") or unigram):
        rules.append((("refine-vocabulary",), f"needs text data (text:FILE, unigram or unigram:FILE), not {data}"))
    if r.soft_label_top_k not in (AUTO, 0) and r.soft_labels == 0 and not unigram:
        rules.append((("refine-soft-label-top-k", "refine-soft-labels"),
                      "sparse soft labels have no effect without soft labels (> 0, or unigram: data)"))
    if unigram and r.soft_labels not in (AUTO, 0):
        rules.append((("refine-soft-labels",), f"{data} is labelled by the models' predictions alone"))
    if m is not None and r.start == "activations" and m.symmetry == "permutation":
        rules.append((("refine-start", "symmetry"), "the activation start finds an orthogonal residual map: it needs "
                      "symmetry orthogonal"))
    if m is not None and r.start == "activations" and m.universe_iterations > 1:
        rules.append((("refine-start", "universe-iterations"), "the activation start aligns each model to the "
                      "reference: it needs universe-iterations 1"))
    return rules


# ---------------------------------------------------------------------------------------------
# surfaces


def from_values(cls, values: Mapping[str, Any], surface: str = RUN):
    """The group ``cls`` from ``{key: value}`` (keys of other groups are ignored): values converted to
    the field types; a value of the wrong type raises ``ValueError`` naming the option."""
    kwargs, wrong = {}, []
    for name, f, opt in schema_fields(cls):
        if name in values:
            try:
                kwargs[f.name] = convert(f, opt, values[name], typed=surface == RUN)
            except ValueError as error:
                wrong.append(f"{render(name, values[name], surface)}: {error}")
    if wrong:
        raise ValueError("\n".join(wrong))
    return cls(**kwargs)


def run_config_defaults() -> dict[str, Any]:
    """Every run-config key of the schema with its default (the pyproject table carries them)."""
    return {name: f.default for cls in GROUPS for name, f, _ in schema_fields(cls, RUN)}


def run_config_fields() -> dict[str, tuple]:
    """run-config key → ``(group, field, Option)`` of every schema option on the run config."""
    return {name: (cls, f, opt) for cls in GROUPS for name, f, opt in schema_fields(cls, RUN)}


def from_run_config(config: Mapping[str, Any]) -> tuple:
    """``(MatchOptions, RefineOptions, DistillOptions, RobustOptions)`` of a resolved run config."""
    return tuple(from_values(cls, config, RUN) for cls in GROUPS)


def run_config_choices() -> dict[str, tuple]:
    """The allowed values of the run-config keys that have a list of them."""
    return {name: opt.allowed for cls in GROUPS for name, _, opt in schema_fields(cls, RUN) if opt.choices}


def _argument_type(f: dataclasses.Field, opt: Option):
    """An argparse ``type``: the schema's own conversion and range check (:func:`convert`,
    :func:`value_problem`), so a bad value is a one-line usage error naming the flag."""

    def parse(text: str):
        try:
            value = convert(f, opt, text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None
        if (why := value_problem(opt, value)) is not None:
            raise argparse.ArgumentTypeError(f"{why}, got {text}")
        return value

    parse.__name__ = _type_of(f).__name__
    return parse


def add_arguments(group, cls, skip: Iterable[str] = ()) -> None:
    """One argparse option per CLI field of ``cls`` into ``group`` (an argparse parser or group), typed and
    range-checked by the schema; options not given are None (their default applies in :func:`from_args`)."""
    for name, f, opt in schema_fields(cls, CLI):
        if name in skip:
            continue
        dest = name.replace("-", "_")
        text = opt.help
        if opt.choices:
            text += f" ({' | '.join(opt.allowed)})"
        text += f" (default: {f.default})" if f.default != AUTO else " (default: auto, by model kind and budget)"
        if _type_of(f) is bool:  # --X (true) and, where auto is the default, --no-X (false)
            action = argparse.BooleanOptionalAction if opt.auto else "store_true"
            group.add_argument(f"--{name}", *opt.aliases, dest=dest, action=action, default=None, help=text)
        elif name == "refine-lambda":  # "LO,HI", and the older two numbers
            group.add_argument(f"--{name}", *opt.aliases, dest=dest, nargs="+", metavar="LO,HI", help=text)
        else:
            group.add_argument(f"--{name}", *opt.aliases, dest=dest, type=_argument_type(f, opt),
                               metavar=opt.metavar or ("{" + ",".join(opt.choices) + "}" if opt.choices else
                                                       {int: "N", float: "X"}.get(_type_of(f))),
                               help=text)


def from_args(cls, args) -> Any:
    """The group ``cls`` from parsed arguments (options not given keep their defaults); ``ValueError``
    naming the flag of a value of the wrong type."""
    values = {}
    for name, _, _ in schema_fields(cls, CLI):
        value = getattr(args, name.replace("-", "_"), None)
        if value is not None:
            values[name] = ",".join(value) if isinstance(value, list) else value
    return from_values(cls, values, CLI)


# ---------------------------------------------------------------------------------------------
# synthetic proxies drawn from the models' weights alone: independent tokens, or a chain of one-token predictions
WEIGHTS_PROXIES = ("unigram", "bigram")
# the one plain align / merge of subword LMs refines on (cli._default_data_free). Over the suite's three text pairs,
# refinement seeds 0-1 and two sessions (docs/benchmarks.md, "Data-free by default"): gpt2-s01 0.0536 ± 0.0019
# (unigram, 4 runs) against 0.0536 ± 0.0006 (bigram, 3), gpt2-s23 0.0491 ± 0.0007 against 0.0498 ± 0.0009,
# llama-s01 0.114 ± 0.004 against 0.105 ± 0.003: level on GPT-2, 8 % lower on Llama, the mean 0.0722 → 0.0695
DATA_FREE_PROXY = "bigram"


def synthetic_proxy(data: str | None) -> str | None:
    """The synthetic proxy that proxy data ``data`` names, token blocks labelled by the models: ``unigram`` (token
    frequencies judged from the models' weights, or ``unigram:FILE``: the counts of FILE's training split) or
    ``bigram`` (a chain of the models' one-token predictions from there); None for real data."""
    if data in WEIGHTS_PROXIES:
        return data
    return "unigram" if (data or "").startswith("unigram:") else None


def is_unigram(data: str | None) -> bool:
    """Whether proxy data ``data`` is synthetic token blocks labelled by the models (:func:`synthetic_proxy`)."""
    return synthetic_proxy(data) is not None


# "auto": what the model is, and the budget

IMAGE, SUBWORD_LM, CHARACTER_LM = "image classifier", "causal LM (subword tokenizer)", "causal LM (characters)"
SUBWORD_VOCABULARY = 1024  # a causal LM with more tokens than this reads subword (BPE) tokens


def model_kind(data: str, vocab_size: int | None) -> str:
    """What the model is: an image classifier, or a causal LM of subword or character tokens."""
    if data != "text":
        return IMAGE
    return SUBWORD_LM if (vocab_size or 0) > SUBWORD_VOCABULARY else CHARACTER_LM


# The measured best per kind (2-core AMD EPYC, ~2 minutes): image classifiers from the CIFAR-10 ViT
# pairs (docs/journal/merging-notes.md §7, 0.017 ± 0.001 over refinement seeds), subword LMs from the GPT-2 recipe
# pairs (docs/journal/merging-notes.md §13-§15, the README's learned row), character LMs from the character GPT (§13).
# The image λ range 0.2,0.8 (was 0.4,0.6): over the four image pairs × 4 runs (refinement seeds), barrier 0.016 ± 0.014
# against 0.029 ± 0.023, midpoint accuracy −0.003 ± 0.008 (docs/benchmarks.md, "The image λ range").
# ``evaluations``: keep-best checks over the run; ``examples``: proxy examples (at most the training split).
KIND_SETTINGS: dict[str, dict[str, Any]] = {
    IMAGE: dict(examples=12000, batch_size=64, lr=5e-3, head_lr=0.0, permutations="ste", group="orthogonal",
                start="symmetry", lambda_="0.2,0.8", schedule="cosine", soft_labels=0.5, soft_label_top_k=0,
                vocabulary="full", vocabulary_samples=0, vocabulary_batch_samples=0, evaluation_fraction=0.2,
                dual=False, evaluations=6),
    SUBWORD_LM: dict(examples=2048, batch_size=8, lr=3e-3, head_lr=4e-2, permutations="fixed", group="invertible",
                     start="symmetry", lambda_="0.2,0.6", schedule="cosine", soft_labels=0.0, soft_label_top_k=0,
                     vocabulary="seen", vocabulary_samples=512, vocabulary_batch_samples=512,
                     evaluation_fraction=0.0, dual=False, evaluations=1),
    CHARACTER_LM: dict(examples=4000, batch_size=32, lr=5e-3, head_lr=4e-2, permutations="ste", group="invertible",
                       start="symmetry", lambda_="0.2,0.6", schedule="cosine", soft_labels=0.5, soft_label_top_k=0,
                       vocabulary="full", vocabulary_samples=0, vocabulary_batch_samples=0, evaluation_fraction=0.2,
                       dual=False, evaluations=4),
}

# What a GPU changes (it is launch-bound on these small models: a larger batch is nearly free there).
# Subword LMs, measured on an H200 with the 120 s budget (docs/benchmarks.md, "On a GPU"): the CPU's
# settings reach 0.0155 on the GPT-2 recipe pair (1,627 steps of 8 blocks), batch 64 with the reference
# moving too 0.0094 (970 steps). Image and character models: not measured on a GPU (the CPU's settings).
GPU_SETTINGS: dict[str, dict[str, Any]] = {SUBWORD_LM: dict(batch_size=64, dual=True)}


# A synthetic proxy of subword LMs: fewer blocks than the 2,048 of real text, since the models label them all before
# the first step. unigram: on the suite's gpt2-s23 (120 s, one core) 2,048 blocks left 131 steps (barrier 0.051), or
# under more load none, 512 left 395 (0.049): docs/benchmarks.md, "Data-free by default"; on the Llama pair 256 / 512 /
# 1,024 blocks read 0.116 / 0.116 / 0.122 (journal/merging-notes.md §19). bigram (the default): 1,024, over refinement
# seeds on the suite's text pairs 0.0502 / 0.0468 / 0.1028 against 512's 0.0536 / 0.0497 / 0.1047 (gpt2-s01 /
# gpt2-s23 / llama-s01); 2,048 left gpt2-s01 222-253 steps and read 0.0517 (docs/benchmarks.md, "1,024 bigram blocks")
SYNTHETIC_EXAMPLES = {"unigram": 512, "bigram": 1024}

HEAD_WEIGHT = {IMAGE: 1.0, SUBWORD_LM: 2.0, CHARACTER_LM: 1.0}  # measured: docs/journal/merging-notes.md §2 (GPT-2 recipe pair)


def resolve_match(match: MatchOptions, kind: str) -> MatchOptions:
    """``match`` with ``auto`` set for ``kind`` (the head's weight in the objective, :data:`HEAD_WEIGHT`)."""
    return dataclasses.replace(match, head_weight=HEAD_WEIGHT[kind] if match.head_weight == AUTO else match.head_weight)


# distillation per kind. Image classifiers, measured on the one-shot digits grid (docs/results.md, "One-shot at
# the ensemble"): mixup views with their mixed labels at weight 0.5, temperature 3, Adam 0.002. Language models,
# measured on the federated LM benchmark's GPT-2 and Llama clients (docs/options.md, "Distillation's defaults by
# model kind"): no views, no labels, temperature 1 (at 3 the student matches softened 50k-token distributions
# and its loss at temperature 1 does not move), Adam 0.001; character LMs take the language-model settings
# (not measured on their own)
LM_DISTILL = dict(augment="none", label_weight=0.0, temperature=1.0, lr=0.001)


@dataclass(frozen=True)
class StepsSizedRate:
    """An Adam rate sized by the steps a run takes (known once a budget sized it): ``few_lr`` up to ``few``
    steps, ``many_lr`` from ``many`` on, geometric in between,
    lr(T) = few_lr · (many_lr / few_lr)^(log(T / few) / log(many / few))."""

    few: int
    few_lr: float
    many: int
    many_lr: float

    def __call__(self, steps: int) -> float:
        if steps <= self.few:
            return self.few_lr
        if steps >= self.many:
            return self.many_lr
        return self.few_lr * (self.many_lr / self.few_lr) ** (math.log(steps / self.few) / math.log(self.many / self.few))


# An image classifier's distillation in a 2-minute budget: at Adam 0.002 (chosen on the digits grid, thousands of
# steps) the runs of a few hundred steps or fewer mostly kept their start (CIFAR-10 ViTs at d = 64 / 96 and the HF ViT
# at d = 128: 73-237 steps, best step 0 in 4 of 5 runs), at 0.0005 all five improved and the merge's test loss fell
# by 0.011-0.019; the digits pairs (1,560-2,320 steps) read 0.002 as well or better on one pair of two
# (docs/journal/merging-notes.md §31)
IMAGE_DISTILL_RATE = StepsSizedRate(few=250, few_lr=5e-4, many=1500, many_lr=2e-3)
DISTILL_SETTINGS = {IMAGE: dict(augment="mixup", label_weight=0.5, temperature=3.0, lr=IMAGE_DISTILL_RATE),
                    SUBWORD_LM: LM_DISTILL, CHARACTER_LM: LM_DISTILL}


# ``fedbasin merge`` of subword LMs: the refinement leaves the merge a few hundredths of a nat from its models, and
# at Adam 0.001 (the federated setting, whose merges start far from their ensemble) no distillation of the GPT-2 and
# Llama pairs ever lowered its selection loss (31-178 steps); 0.0003 and 0.0001 both do (gpt2-s01, one run each:
# test loss 5.5150 / 5.5186 from 5.527), 0.0001 on all three text pairs. A keep-best check is a pass over the
# selection split, so the run checks its start and its end only. Its softmax covers the refinement's vocabulary
# (the text's tokens), 4.5 times fewer rows than GPT-2's (docs/benchmarks.md, "Language-model merges distil again")
MERGE_DISTILL_SETTINGS = {SUBWORD_LM: dict(lr=1e-4)}
MERGE_DISTILL_CHECKS_AT_END = {SUBWORD_LM}


def distillation_off(steps: int | str, budget: float) -> bool:
    """Whether the distillation options turn it off: ``steps`` 0, or ``auto`` with a ``budget`` of 0."""
    return budget <= 0 if steps == AUTO else steps == 0


def resolve_distill(distill: DistillOptions, kind: str, merge: bool = False) -> DistillOptions:
    """``distill`` with every ``auto`` set for ``kind`` (:data:`DISTILL_SETTINGS`; for ``fedbasin merge``,
    ``merge``, :data:`MERGE_DISTILL_SETTINGS` first)."""
    settings = {**DISTILL_SETTINGS[kind], **(MERGE_DISTILL_SETTINGS.get(kind, {}) if merge else {})}
    chosen = {name: value for name, value in settings.items() if getattr(distill, name) == AUTO}
    return dataclasses.replace(distill, **chosen)


@dataclass
class ResolvedRefine:
    """Concrete refinement settings: every ``auto`` of a :class:`RefineOptions` replaced (``options``).
    ``steps`` None: sized from ``budget`` by timing the first steps (``evaluations`` keep-best checks)."""

    options: RefineOptions
    steps: int | None
    evaluations: int
    chosen: dict  # the values "auto" chose


def resolve_refine(options: RefineOptions, kind: str, *, synthetic: str | None = None,
                   gpu: bool = False) -> ResolvedRefine:
    """``options`` with every ``auto`` set from :data:`KIND_SETTINGS` for ``kind`` (and, with ``gpu``,
    :data:`GPU_SETTINGS`). ``synthetic``: the proxy is synthetic blocks the models label (``unigram`` or
    ``bigram``, :data:`SYNTHETIC_EXAMPLES` of them; no label-based tricks), None for real data. ``workers`` auto: 2 slices per
    batch on a CPU (the same figures on any thread count), 1 on a GPU."""
    if kind not in KIND_SETTINGS:
        raise ValueError(f"model kind {kind!r}: expected one of {', '.join(KIND_SETTINGS)}")
    if synthetic is not None and synthetic not in SYNTHETIC_EXAMPLES:
        raise ValueError(f"synthetic proxy {synthetic!r}: expected one of {', '.join(SYNTHETIC_EXAMPLES)}")
    settings = {**KIND_SETTINGS[kind], **(GPU_SETTINGS.get(kind, {}) if gpu else {})}
    settings["workers"] = 1 if gpu else 2
    given = {f.name: getattr(options, f.name) for f in fields(RefineOptions) if getattr(options, f.name) != AUTO}
    # auto values that depend on values the user gave follow them, so the combination stays valid
    if synthetic is not None:  # the models label every block before the first step: fewer, reused
        settings.update(soft_labels=0.0, examples=SYNTHETIC_EXAMPLES[synthetic])
    vocabulary = given.get("vocabulary", settings["vocabulary"])
    soft = given.get("soft_labels", settings["soft_labels"]) or synthetic is not None
    if vocabulary == "full":
        settings.update(vocabulary_samples=0, vocabulary_batch_samples=0)
    # batch-sampled rows work with sparse soft labels, but on the synthetic proxy (gpt2-s01) they bought 1.35× the
    # steps and the same barrier (docs/journal/merging-notes.md §24): soft labels keep the whole vocabulary
    if soft:
        settings.update(vocabulary_batch_samples=0)
        if vocabulary != "full":
            settings["soft_label_top_k"] = settings["soft_label_top_k"] or 32
    chosen, values = {}, {}
    for f in fields(RefineOptions):
        value = getattr(options, f.name)
        if value == AUTO and f.name in settings:
            value = chosen[f.name.rstrip("_")] = settings[f.name]
        values[f.name] = value
    steps = None if values["steps"] == AUTO else values["steps"]
    evaluations = settings["evaluations"]
    if values["eval_every"] == AUTO:
        values["eval_every"] = max(1, -(-steps // evaluations)) if steps else AUTO
    return ResolvedRefine(RefineOptions(**values), steps, evaluations, chosen)


# ---------------------------------------------------------------------------------------------
# the one translator into the library's calls


def robust_call(robust: RobustOptions) -> dict:
    """:class:`~fedbasin.strategies.AlignedFedAvg` screening/aggregation keyword arguments (``proxy_screening``
    needs the server's proxy loss as well: the ServerApp adds it)."""
    checked(robust)
    return {f.name: getattr(robust, f.name) for f in fields(RobustOptions) if f.name != "proxy_screening"}


def distill_call(distill: DistillOptions) -> dict:
    """``ensemble_distill`` keyword arguments of resolved distillation options (:func:`resolve_distill`): the
    student's learning rate, the temperature, the labels' weight and how the ensemble combines its teachers
    (the steps, the budget and the ``augment`` views, which need the data's shape, are the caller's)."""
    checked(distill)
    if AUTO in (distill.lr, distill.temperature, distill.label_weight):
        raise ValueError("distillation options 'auto': resolve them for the model first (fedbasin.options.resolve_distill)")
    return dict(lr=distill.lr, temperature=distill.temperature, label_weight=distill.label_weight,
                teacher=distill.teacher)


def match_call(match: MatchOptions) -> dict:
    """``weight_match`` / ``merge`` keyword arguments of ``match`` (``universe_iterations`` is the merge's own;
    ``head_weight`` ``auto`` is set for the model by ``weight_match``)."""
    checked(match)
    return dict(mode=match.symmetry, iterations=match.align_iterations, tol=match.align_tol,
                head_weight=match.head_weight)


def refine_call(resolved: ResolvedRefine, match: MatchOptions) -> dict:
    """``learned_refine`` keyword arguments of resolved refinement options and the matching options of its
    start (data, vocabulary ids and the model are the caller's). ``steps`` None: sized by the budget."""
    r = resolved.options
    # each value; the combinations depend on the data (unigram: soft labels of the models), which the callers
    # check with it before resolving, and learned_refine refuses what it cannot run
    checked(r, match, combinations=False)
    start = r.start
    return dict(
        steps=resolved.steps, budget=r.budget, evaluations=resolved.evaluations,
        eval_every=r.eval_every if r.eval_every != AUTO else 1, lr=r.lr, head_lr=r.head_lr or None,
        mode=match.symmetry if start in ("symmetry", "activations") else start,
        start="activations" if start == "activations" else "weights",
        permutations=r.permutations, group=r.group, lambda_range=parse_lambda(r.lambda_), schedule=r.schedule,
        match_iterations=match.align_iterations, match_tol=match.align_tol,
        universe_iterations=match.universe_iterations, head_weight=match.head_weight,
        soft_labels=r.soft_labels, soft_label_top_k=r.soft_label_top_k, dual=r.dual, batch_workers=r.workers,
        vocabulary_samples=r.vocabulary_samples, vocabulary_batch_samples=r.vocabulary_batch_samples, seed=r.seed)


# ---------------------------------------------------------------------------------------------
# the pyproject table

PYPROJECT_MARKER = "# ---- the options schema (fedbasin.options), generated by `python -m fedbasin.options`: do not edit"


def toml_value(value) -> str:
    """A run-config value as TOML (what ``pyproject.toml`` and ``flwr run --run-config`` parse)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)  # a TOML basic string
    return repr(value)


def toml_lines() -> list[str]:
    """The schema's run-config keys as ``pyproject.toml`` lines (``key = default  # help``)."""
    lines = [PYPROJECT_MARKER]
    for cls in GROUPS:
        lines.append(f"# {cls.__doc__.splitlines()[0]}")
        for name, f, opt in schema_fields(cls, RUN):
            choices = f" ({' | '.join(opt.allowed)})" if opt.choices else ""
            lines.append(f"{name} = {toml_value(f.default)}  # {opt.help.replace('%%', '%')}{choices}")
    return lines


def run_table() -> list[str]:
    """The schema's run-config keys as a Markdown table (``key | default | meaning``; docs/flower.md carries it)."""
    lines = ["| key | default | meaning |", "|---|---|---|"]
    for cls in GROUPS:
        for name, f, opt in schema_fields(cls, RUN):
            choices = f" ({' | '.join(opt.allowed)})" if opt.choices else ""
            meaning = (opt.help.replace("%%", "%") + choices).replace("|", "\\|")  # a cell holds no bare bar
            lines.append(f"| `{name}` | `{toml_value(f.default)}` | {meaning} |")
    return lines


def kind_table() -> list[str]:
    """The ``auto`` values per model kind as a Markdown table (docs/options.md carries it)."""
    names = list(KIND_SETTINGS[IMAGE])
    lines = ["| option | " + " | ".join(KIND_SETTINGS) + " |", "|---|" + "---|" * len(KIND_SETTINGS)]
    for name in names:
        key = "keep-best checks" if name == "evaluations" else "refine-" + name.rstrip("_").replace("_", "-")
        cells = [str(KIND_SETTINGS[k][name]) + (f" (GPU: {GPU_SETTINGS[k][name]})" if name in GPU_SETTINGS.get(k, {})
                                                 else "") for k in KIND_SETTINGS]
        lines.append(f"| {key} | " + " | ".join(cells) + " |")
    return lines


if __name__ == "__main__":  # the pyproject lines; --kinds: the auto values per model kind; --run-table: the keys
    import sys

    print("\n".join(kind_table() if "--kinds" in sys.argv else run_table() if "--run-table" in sys.argv
                    else toml_lines()))
