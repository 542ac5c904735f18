"""Learned refinement of an alignment on proxy data (DESIGN §8): the training loop and keep-best.

Starting from the weight-matching solution, every candidate k gets free maps g_Δ that are exact
group elements in every forward pass (:mod:`.parametrize`), so the merged model is always an
element of the symmetry orbit. The loss is taken at ``θ(λ) = λ₀ θ_ref + Σ_k λ_k T_k(θ_k)`` with
``λ ~ Dirichlet(α·1)`` (two models: ``λ₀ ~ U(0.4, 0.6)``) through ``torch.func.functional_call`` —
the models stay frozen. Three disjoint proxy splits (:mod:`.proxy`) keep the result honest: the
optimiser sees only the *training* batches; the hard alignment is scored at the centroid on a
*selection* split every ``eval_every`` steps and the best one seen (the start included) is
returned (:mod:`.keep_best`), so refinement never returns something worse than its start on that
split; an optional *evaluation* split, never used for any decision, reports the loss of the start
and of the returned alignment.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from fedbasin.options import (
    MatchOptions,
    RefineOptions,
    ResolvedRefine,
    refine_call,
    resolve_refine,
)

from .canonical import canonicalize, to_gauge
from .group import GroupElement, apply_group, compose
from .keep_best import all_finite, check_step_options, keep_best_record
from .matching import MODES, kind_of_state, weight_match
from .merge import Combiner, as_combiner, average_states, merge
from .parametrize import GROUPS, _Delta
from .progress import progress_bar
from .proxy import Batch, TrainingStream, _as_batches, examples_between
from .soft_labels import _relabelled, _soft_labels
from .spec import SymmetrySpec, check_compatible
from .vocabulary import TrainingVocabulary
from .workers import _Workers

PROBE_STEPS = 5  # a budgeted run times these steps (after the first) to size itself
SIZING_STEPS = 10**6  # its provisional length: the cosine schedule stays at the full rate until sized
CHECK_SHARE, MAX_CHECKS = 0.05, 12  # a budgeted run adds keep-best checks while they cost at most this share
CHECK_CAP = 0.1  # ... and drops below the kind's count where its checks would cost more than this share
RELAPSE = 0.1  # a check this share worse than the start: back to the best maps, at half the learning rate
# a budgeted run keeps its proxy within the budget: it labels at most the training examples LABEL_SHARE of the
# budget pays for (timed on the first MIN_EXAMPLES per worker thread); one pass over the selection split (every
# run makes two: its start's check and its last) costs at most CHECK_CAP of it, and one over the evaluation split
# (only reported) half that; it never cuts a split below MIN_EXAMPLES
LABEL_SHARE, MIN_EXAMPLES = 0.3, 256


def _seconds_per_example(workers: _Workers, forward, state: dict, batch: torch.Tensor) -> float:
    """Wall seconds per example of a no-grad forward pass of ``state``: the faster of two passes over ``batch``
    cut among the workers (the first pays one-off costs)."""
    parts = batch.tensor_split(min(workers.count, len(batch)))
    timings = []
    with torch.no_grad():
        for _ in range(2):
            started = time.perf_counter()
            workers.map(lambda module, x: forward(state, x, module), parts)
            timings.append(time.perf_counter() - started)
    return min(timings) / len(batch)


def _first_examples(batches: list[Batch], n: int) -> list[Batch]:
    """The first ``n`` examples of a list of batches, in their batches (the last one cut)."""
    kept, left = [], n
    for x, y in batches:
        if left <= 0:
            break
        kept.append((x[:left], y[:left]))
        left -= len(y)
    return kept


def sized_checks(evaluations: int, budget: float, check_seconds: float) -> int:
    """Keep-best checks of a budgeted run: ``evaluations``, and more (up to :data:`MAX_CHECKS`) while all
    of them together cost at most ``CHECK_SHARE · budget`` — on a small proxy a check is nearly free, and a
    run of many passes over it can leave its best point long before its last step — but fewer (at least
    the last step's) where ``evaluations`` checks would cost more than ``CHECK_CAP · budget``: a large model's
    checks would otherwise take the steps' time."""
    if check_seconds <= 0:
        return max(evaluations, MAX_CHECKS)
    wanted = max(evaluations, min(MAX_CHECKS, int(CHECK_SHARE * budget / check_seconds)))
    return max(1, min(wanted, int(CHECK_CAP * budget / check_seconds)))


@dataclass
class RefineResult:
    """states: refined candidates (reference's gauge, same functions as the inputs);
    canonical: the same in canonical form; transforms: g_k with canonical_k = g_k · canon(θ_k);
    history: (step, selection-split score of the hard alignment: its loss at the centroid, or for two
    models averaged over ``selection_lambdas``); best_step: the step whose alignment is returned (0 = the weight-matching start, i.e. no improvement).
    initial_loss / best_loss: selection-split loss of the start / of the returned alignment;
    evaluation_initial_loss / evaluation_loss: the same on the evaluation split (NaN without one),
    which no decision ever looked at. reference_canonical / reference_transform: the canonical
    reference the candidates are aligned to and g_ref with it = g_ref · canon(θ_ref) (the identity
    unless universe matching or ``dual`` moved the reference); start_mode: the weight-matching mode the
    refinement started from; workers: the threads that shared each batch (``batch_workers``)."""

    states: list[dict]
    canonical: list[dict]
    transforms: list[GroupElement]
    history: list[tuple[int, float]] = field(default_factory=list)
    initial_loss: float = float("nan")
    best_loss: float = float("nan")
    best_step: int = 0
    seconds: float = 0.0
    evaluation_initial_loss: float = float("nan")
    evaluation_loss: float = float("nan")
    reference_canonical: dict | None = None
    reference_transform: GroupElement | None = None
    start_mode: str = ""
    workers: int = 1
    diverged_step: int = 0  # the step whose loss or maps became non-finite (training stopped there); 0: none
    steps: int = 0  # the training steps the run was given (sized from the budget when steps=None)
    stopped_at_budget: int = 0  # a budgeted run whose later steps ran slower than timed stopped at this step
    eval_every: int = 0  # the keep-best check interval (a budgeted run's, with ``steps``, repeats the run)
    relapses: list[int] = field(default_factory=list)  # checks that sent training back to the best maps
    # wall seconds by phase: "start" (weight matching), "labels" (soft labels), "checks" (every pass over the
    # selection and evaluation splits, the start's included) and "steps" (training); with "seconds", where a budget went
    phases: dict[str, float] = field(default_factory=dict)
    # a budgeted run's splits it cut to fit the budget: {split: [examples kept, examples given]}
    trimmed: dict[str, list[int]] = field(default_factory=dict)

    @property
    def improved(self) -> bool:
        """Whether any refined alignment beat the weight-matching start on the selection split."""
        return self.best_step > 0

    def summary(self) -> dict:
        """JSON-ready record; says plainly when refinement returned its start unchanged."""
        out = keep_best_record(self, "refinement", "the weight-matching start", "maps")
        if self.start_mode:
            out["start"] = self.start_mode
        out["batch_workers"] = self.workers
        if self.eval_every:
            out["eval_every"] = self.eval_every
        if self.relapses:
            out["relapses"] = self.relapses
        if self.phases:
            out["seconds_by_phase"] = {k: round(v, 3) for k, v in self.phases.items()}
        if self.trimmed:
            out["proxy_trimmed_to_budget"] = self.trimmed
        return out


def learned_refine(
    spec: SymmetrySpec,
    model: nn.Module,
    reference: dict,
    candidates: list[dict],
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    batches: Iterable[Batch],
    selection: Batch | list[Batch],
    evaluation: Batch | list[Batch] | None = None,
    steps: int | None = 100,
    lr: float = 1e-2,
    mode: str = "orthogonal",
    permutations: str = "ste",
    alpha: float = 1.0,
    tau: float = 0.1,
    eval_every: int = 10,
    seed: int = 0,
    match_iterations: int = 20,
    match_tol: float = 1e-4,
    weighting: str = "rms",
    include_reference: bool = True,
    universe_iterations: int = 1,
    token_rows: torch.Tensor | str | None = None,
    to_module_state: Callable[[dict], dict] | None = None,
    progress: bool = False,
    group: str = "orthogonal",
    lambda_range: tuple[float, float] = (0.4, 0.6),
    schedule: str = "constant",
    dual: bool = False,
    selection_lambdas: tuple[float, ...] = (0.5,),
    head_weight: float = 1.0,
    start: str = "weights",
    start_batches: int = 4,
    vocabulary: torch.Tensor | None = None,
    vocabulary_samples: int = 0,
    vocabulary_batch_samples: int = 0,
    soft_labels: float = 0.0,
    soft_label_top_k: int = 0,
    batch_workers: int = 0,
    head_lr: float | None = None,
    model_labels: bool = False,
    budget: float | None = None,
    evaluations: int = 1,
    options: ResolvedRefine | None = None,
    match: MatchOptions | None = None,
) -> RefineResult:
    """Refine the alignment of ``candidates`` to ``reference`` on proxy data.

    model: any module of the architecture (its parameters are not used or changed);
    loss_fn(outputs, targets): scalar (mean) loss; batches: an (endless or long enough) iterable of
    ``(inputs, targets)`` training batches; selection: a batch or list of batches, disjoint from
    the training ones, on which keep-best chooses; evaluation: optional batches disjoint from
    both, only reported (see :func:`proxy_streams`). ``mode`` (``"permutation"``, ``"orthogonal"``
    or ``"best"``: both, keeping the one with the lower selection loss), ``match_iterations`` and
    ``match_tol`` apply to the weight-matching start; ``permutations``: ``"ste"``, ``"sinkhorn"`` or
    ``"fixed"`` (the start's permutations are kept; only the continuous maps learn).
    ``group``: ``"orthogonal"`` or ``"invertible"`` (per-head invertible QK/OV maps and ReLU neuron
    scalings, see :class:`_Delta`). ``lambda_range``: two models train at ``λ₀ ~ U(lo, hi)``.
    ``schedule``: ``"constant"`` or ``"cosine"`` (learning rate decays to 0 over ``steps``).
    ``selection_lambdas``: two models are scored (selection and evaluation splits) by the mean loss
    at ``λ₀`` in this tuple (default the midpoint); more models at their centroid.
    ``dual=True`` lets the reference carry a learned transform as well (both endpoints move toward
    a shared path; the moved reference is ``reference_canonical``; the same path from the unmoved
    reference has the candidate ``apply_group(spec, canonical[0], inverse(reference_transform))``,
    as ``fedbasin align --refine-dual`` writes it).
    ``start``: ``"weights"`` (weight matching in ``mode``) or ``"activations"``
    (:func:`~fedbasin.alignment.activations.activation_match` on the first ``start_batches`` training
    batches, which are trained on as well; with ``mode="best"`` it competes with both weight-matching
    starts on the selection split).
    ``vocabulary``: token ids (language models); the *training* loss is computed as if the model's
    vocabulary were only these tokens — embedding and output-head rows of the others are left out
    before the transform, inputs and targets are renumbered — so the softmax costs |vocabulary|
    instead of V per token. Keep-best and the reported losses stay exact (full vocabulary). A
    training token outside it is refused. With every token it is the full loss.
    ``vocabulary_samples`` = k: each step the softmax also covers k tokens drawn from outside the
    vocabulary, their logits raised by ``log(m/k)`` (m outside tokens): a sampled estimate of the
    probability mass the restricted softmax would otherwise drop (:class:`TrainingVocabulary`).
    ``vocabulary_batch_samples`` = k: each step the vocabulary itself is sampled the same way — the
    step's own tokens exactly (inputs, targets, the tokens sparse soft targets list), and k of the
    vocabulary's other tokens with their logits raised by
    ``log(m'/k)`` — so a step's softmax costs |batch tokens| + k (+ ``vocabulary_samples``) rows.
    ``soft_labels`` = w > 0: the maps train on ``(1 − w)·one-hot(y) + w·p̄(x)`` instead of the
    labels, p̄ the mixed models' mean predicted probabilities (their ensemble; each endpoint keeps
    its function, so p̄ is computed once, on the training part of ``batches``, which must then be
    a :class:`TrainingStream`; ``loss_fn`` must accept probability targets, as
    :func:`fedbasin.training.cross_entropy` does). Keep-best and the reported losses use the labels.
    ``soft_label_top_k`` = k > 0 keeps each target's k largest entries as sparse (id, weight) pairs,
    the mass they leave trained as one bucket of the unlisted tokens (``cross_entropy``): the targets
    then take N·k·8 bytes instead of N·C·4 (a GPT-2's 50,257-way probabilities on 1,000 blocks of 128
    tokens would take 24 GiB; k = 32 takes 31 MiB), and they
    combine with a training ``vocabulary``: p̄ is then the softmax over its tokens (computed on their
    rows only), and a step's weight on tokens outside its rows joins that bucket.
    ``batch_workers`` = n > 1 (0: one per torch CPU thread; always 1 on a GPU): each training
    batch is cut into n slices whose forward and backward passes run at once on n threads, and the
    selection, evaluation and labelling batches are shared among them (:class:`_Workers`); the
    gradient is ``Σ_i (n_i/n)·∇L_i`` (``loss_fn`` is a mean over the batch's examples), equal to the
    whole batch's up to rounding.
    ``head_lr``: Adam's learning rate for the per-head maps (:meth:`_Delta.head_parameters`); the
    residual map, neuron scalings and permutation scores keep ``lr`` (None: ``lr`` for all).
    ``model_labels``: the proxy's own targets are not used: training, keep-best and the report all
    score p̄, the mixed models' mean predictions (soft labels of weight 1, sparse with
    ``soft_label_top_k``; ``soft_labels`` stays 0). For inputs without labels, e.g. the synthetic
    token streams of :func:`fedbasin.data.unigram_blocks` (data-free alignment).
    ``steps=None``: as many steps as ``budget`` seconds allow (the whole call: start, labelling, steps and
    keep-best checks): after :data:`PROBE_STEPS` steps at the full learning rate the mean time of a step and
    of one selection check size the run, the checks become ``evaluations`` or more while they cost at most
    5 % of the budget (:func:`sized_checks`), ``eval_every`` becomes ``⌈steps / checks⌉`` and the schedule
    spans the sized run (``RefineResult.steps`` and ``eval_every`` record it: pass them to repeat the run exactly).
    Should later steps run slower than timed (a loaded machine), the run stops once the budget less one
    check is spent, with a last check (``RefineResult.stopped_at_budget``): the budget holds.
    Passes over the proxy are timed first, so that a model dear for its budget (a large model, a slow or busy
    machine) does not spend it before its first step: the run labels at most the training examples
    :data:`LABEL_SHARE` of the budget pays for, and cuts the selection split so that a pass over it costs at
    most :data:`CHECK_CAP` of it (the evaluation split half that), never below :data:`MIN_EXAMPLES`
    (``RefineResult.trimmed`` records what it cut).
    A check more than ``RELAPSE`` (10 %) worse than the start (training blew up: many passes over a small
    proxy at a high learning rate) sends training back to the best maps so far with fresh Adam moments and
    half the learning rate (``RefineResult.relapses``: the steps where it did).
    ``include_reference=False`` leaves the reference out of the mixture and the scored centroid
    (it is then only the alignment target, like the previous global model in a federated round).
    ``to_module_state`` maps a standard-layout state to the module's own keys (an adapter's
    ``from_standard``; it must be differentiable). Outputs with a ``.logits`` field are unwrapped.

    ``options`` and ``match``: the options schema's refinement options (a :class:`~fedbasin.options.RefineOptions`,
    whose ``auto`` values are set for what ``reference`` is and where it lies, or one resolved by
    :func:`fedbasin.options.resolve_refine`) and the matching options of the start
    (:class:`~fedbasin.options.MatchOptions`); either given (the other then takes its defaults), their values
    (:func:`fedbasin.options.refine_call`, which checks them) replace the keyword arguments they name — the one
    translation from the schema, for the CLI and the ServerApp alike.
    """
    if options is not None or match is not None:
        if options is None or isinstance(options, RefineOptions):
            options = resolve_refine(options or RefineOptions(), kind_of_state(spec, reference),
                                     gpu=next(iter(reference.values())).is_cuda)
        if not isinstance(options, ResolvedRefine):
            raise ValueError(f"options must be a fedbasin.options.RefineOptions, got {type(options).__name__}")
        given = {k: v for k, v in locals().items() if k not in ("options", "match")}
        return learned_refine(**{**given, **refine_call(options, match or MatchOptions())})
    if permutations not in ("ste", "sinkhorn", "fixed"):
        raise ValueError(f"permutations must be 'ste', 'sinkhorn' or 'fixed', got {permutations!r}")
    if group not in GROUPS:
        raise ValueError(f"group must be one of {GROUPS}, got {group!r}")
    if schedule not in ("constant", "cosine"):
        raise ValueError(f"schedule must be 'constant' or 'cosine', got {schedule!r}")
    if mode not in (*MODES, "best"):
        raise ValueError(f"symmetry mode must be one of {(*MODES, 'best')}, got {mode!r}")
    lo, hi = (float(v) for v in lambda_range)
    if not 0.0 <= lo <= hi <= 1.0:
        raise ValueError(f"lambda_range must satisfy 0 <= lo <= hi <= 1, got {lambda_range!r}")
    if not selection_lambdas or not all(0.0 <= float(v) <= 1.0 for v in selection_lambdas):
        raise ValueError(f"selection_lambdas must be a non-empty tuple of values in [0, 1], got {selection_lambdas!r}")
    if start not in ("weights", "activations"):
        raise ValueError(f"start must be 'weights' or 'activations', got {start!r}")
    if start == "activations" and mode == "permutation":
        raise ValueError("start='activations' finds an orthogonal residual map: use mode 'orthogonal' or 'best'")
    if start == "activations" and universe_iterations > 1:
        raise ValueError("start='activations' aligns each candidate to the reference: universe_iterations must be 1")
    if isinstance(start_batches, bool) or not isinstance(start_batches, int) or start_batches < 1:
        raise ValueError(f"start_batches must be an integer >= 1, got {start_batches!r}")
    if not (isinstance(soft_labels, (int, float)) and 0.0 <= soft_labels <= 1.0):
        raise ValueError(f"soft_labels must be a number in [0, 1], got {soft_labels!r}")
    if model_labels:
        if soft_labels:
            raise ValueError("model_labels already trains on the models' predictions alone: leave soft_labels at 0")
        soft_labels = 1.0
    if vocabulary_batch_samples and vocabulary is None:
        raise ValueError("vocabulary_batch_samples samples a training vocabulary: give vocabulary")
    if soft_labels and not isinstance(batches, TrainingStream):
        raise ValueError("soft_labels needs the training stream of proxy_streams (a TrainingStream): its "
                         "examples are labelled once, before training")
    if isinstance(soft_label_top_k, bool) or not isinstance(soft_label_top_k, int) or soft_label_top_k < 0:
        raise ValueError(f"soft_label_top_k must be an integer >= 0 (0: every class), got {soft_label_top_k!r}")
    if soft_labels and vocabulary is not None and not soft_label_top_k:
        raise ValueError("soft_labels over every class cannot be combined with a training vocabulary: "
                         "give soft_label_top_k (sparse targets)")
    if isinstance(batch_workers, bool) or not isinstance(batch_workers, int) or batch_workers < 0:
        raise ValueError(f"batch_workers must be an integer >= 0 (0: one per CPU thread), got {batch_workers!r}")
    if dual and not include_reference:
        raise ValueError("dual=True moves the reference along the path: it needs include_reference=True")
    if not candidates:
        raise ValueError("learned refinement needs at least one candidate")
    sized = budgeted = steps is None
    if sized:
        if not (isinstance(budget, (int, float)) and math.isfinite(budget) and budget > 0):
            raise ValueError(f"steps=None sizes the run by its budget: budget must be a number of seconds > 0, got {budget!r}")
        if isinstance(evaluations, bool) or not isinstance(evaluations, int) or evaluations < 1:
            raise ValueError(f"evaluations must be an integer >= 1, got {evaluations!r}")
        steps, eval_every = SIZING_STEPS, SIZING_STEPS + 1  # provisional: no check, full learning rate, until sized
    check_step_options(steps, eval_every, lr=lr, alpha=alpha, tau=tau, **({} if head_lr is None else {"head_lr": head_lr}))
    if not _as_batches(selection):
        raise ValueError("learned refinement: the selection split is empty (keep-best needs data to choose on)")
    t0 = time.perf_counter()
    for i, c in enumerate(candidates):
        check_compatible(spec, reference, c, ("reference", f"candidate {i}"))
    ref_c = canonicalize(spec, reference, "reference", validate=False)
    device = next(iter(ref_c.state.values())).device
    workers = _Workers(model, device, batch_workers)
    frozen = workers.modules[0]
    members = len(candidates) + int(include_reference)
    selection = [(x.to(device), y.to(device)) for x, y in _as_batches(selection)]
    evaluation = None if evaluation is None else [(x.to(device), y.to(device)) for x, y in _as_batches(evaluation)]
    module_state = to_module_state or (lambda state: state)

    def mixture(lam, ref_state, states) -> dict:
        """``Σ_i λ_i θ_i`` over the mixed models (the reference first when it takes part)."""
        models = ([ref_state] if include_reference else []) + list(states)
        return {k: sum(w * m[k] for w, m in zip(lam, models)) if v.is_floating_point() else v
                for k, v in ref_state.items()}

    def forward(state: dict, x: torch.Tensor, module: nn.Module = frozen) -> torch.Tensor:
        out = torch.func.functional_call(module, module_state(state), (x,), tie_weights=False)  # aligned: untied
        return out if isinstance(out, torch.Tensor) else out.logits

    # two models are scored along the path at selection_lambdas; more at their centroid
    score_weights = [[lam, 1.0 - lam] for lam in selection_lambdas] if members == 2 else [[1.0 / members] * members]

    check_seconds = [0.0]  # the last selection check's duration (sizes a budgeted run)
    phases = dict.fromkeys(("start", "labels", "checks", "steps"), 0.0)

    def centroid_loss(ref_state, states, split: list[Batch]) -> float:
        """Example-weighted mean loss over a split's batches, averaged over the scored mixtures."""
        started, total = time.perf_counter(), 0.0
        for lam in score_weights:
            state = mixture(lam, ref_state, states)
            with torch.no_grad():
                total += sum(workers.map(lambda module, b, state=state: float(loss_fn(forward(state, b[0], module), b[1])) * len(b[1]),
                                         split))
        check_seconds[0] = time.perf_counter() - started
        phases["checks"] += check_seconds[0]
        return total / sum(len(y) for _, y in split) / len(score_weights)

    def outside_checks(since: float, checks_before: float) -> float:
        """Wall seconds since ``since`` less the checks run meanwhile (``checks_before``: their total then)."""
        return time.perf_counter() - since - (phases["checks"] - checks_before)

    def matched(match_mode: str):
        """(re-aligned reference match or None, candidate matches) of the weight-matching start."""
        if universe_iterations > 1:
            universe = merge(spec, [reference, *candidates], [float(include_reference)] + [1.0] * len(candidates),
                             0, match_mode, match_iterations, match_tol, universe_iterations=universe_iterations,
                             weighting=weighting, token_rows=token_rows, head_weight=head_weight)
            found = universe.matches
            # the reference is re-aligned to the universe too when the merge returns its match
            return (found[0], found[1:]) if len(found) > len(candidates) else (None, found)
        return None, [weight_match(spec, reference, c, mode=match_mode, iterations=match_iterations, tol=match_tol,
                                   weighting=weighting, token_rows=token_rows, head_weight=head_weight) for c in candidates]

    def reference_of(ref_start) -> dict:
        return {k: v.detach() for k, v in (ref_start.canonical if ref_start else ref_c.state).items()}

    # with worker threads everything from here runs single-threaded, so a given batch_workers gives the
    # same figures on any thread count
    with workers.serial():
        vocab = None if vocabulary is None else TrainingVocabulary(spec, ref_c.state, vocabulary, vocabulary_samples,
                                                                     seed + 1, vocabulary_batch_samples)
        mixed = [reference] * include_reference + list(candidates)
        labelling, trimmed = time.perf_counter(), {}
        if budgeted:  # a model dear for the budget gets fewer labelled, selection and evaluation examples
            per_example = _seconds_per_example(workers, forward, ref_c.state, selection[0][0][:64])

            def affordable(share: float, passes: int) -> int:
                return max(MIN_EXAMPLES, int(share * budget / (per_example * passes)))

            def trim(name: str, split: list[Batch], keep: int) -> list[Batch]:
                given = sum(len(y) for _, y in split)
                if keep >= given:
                    return split
                trimmed[name] = [keep, given]
                return _first_examples(split, keep)

            selection = trim("selection", selection, affordable(CHECK_CAP, len(score_weights)))
            if evaluation is not None:
                evaluation = trim("evaluation", evaluation, affordable(CHECK_CAP / 2, len(score_weights)))
        if soft_labels:
            def label(split):
                return _soft_labels(split, mixed, workers, soft_labels, device, forward, soft_label_top_k, vocab)

            split, targets = batches.split, []
            first = MIN_EXAMPLES * workers.count  # a labelling batch per worker, at least: all of them busy
            if budgeted and len(split) > first:  # label a first part, then what the budget's share pays for
                started = time.perf_counter()
                targets.append(label(examples_between(split, 0, first)))
                per_example = (time.perf_counter() - started) / first
                keep = min(len(split), max(first, int(LABEL_SHARE * budget / per_example)))
                if keep < len(split):
                    trimmed["training"] = [keep, len(split)]
                    batches = batches.first(keep)
                split = examples_between(split, first, keep)
            if len(split):
                targets.append(label(split))
            batches = batches.relabelled(torch.cat(targets))
            if model_labels:  # keep-best and the report score the models' predictions too
                selection = _relabelled(selection, label)
                evaluation = None if evaluation is None else _relabelled(evaluation, label)
        phases["labels"] = time.perf_counter() - labelling
        iterator = iter(batches)
        options = []
        matching, checked = time.perf_counter(), phases["checks"]
        if start == "activations":
            from .activations import activation_match

            first = list(itertools.islice(iterator, start_batches))
            iterator = itertools.chain(first, iterator)  # the start's batches are training batches too
            found = [activation_match(spec, frozen, reference, c, first, to_module_state) for c in candidates]
            options.append((centroid_loss(ref_c.state, [s.canonical for s in found], selection), "activations", None, found))
        for match_mode in (("permutation", "orthogonal") if mode == "best" else (mode,) if start == "weights" else ()):
            ref_start, starts = matched(match_mode)
            loss = centroid_loss(reference_of(ref_start), [s.canonical for s in starts], selection)
            options.append((loss, match_mode, ref_start, starts))
        initial, start_mode, ref_start, starts = min(options, key=lambda o: o[0])
        phases["start"] = outside_checks(matching, checked)
        ref_state = reference_of(ref_start)
        base = [s.canonical for s in starts]
        movers = [ref_state] * dual + base  # the models that carry a learned transform
        deltas = nn.ModuleList(_Delta(spec, b, permutations, init_scale=1.0, group=group) for b in movers).to(device)
        optimiser = torch.optim.Adam(_parameter_groups(deltas, lr, head_lr), lr=lr)
        lr_scale = [1.0]  # halved at each relapse
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimiser, (lambda i: lr_scale[0]) if schedule == "constant"
            else (lambda i: lr_scale[0] * 0.5 * (1 + math.cos(math.pi * i / max(steps, 1)))))
        def maps_now() -> dict:
            """A copy of the learned maps' parameters (what a relapse returns to)."""
            return {k: v.detach().clone() for k, v in deltas.state_dict().items()}

        best_maps = maps_now()
        rng = np.random.default_rng(seed)  # private: the caller's torch RNG stream is left alone

        def split_members(states, reference_state=ref_state):
            """(reference state, candidate states) from the moved models."""
            return (states[0], states[1:]) if dual else (reference_state, states)

        fixed_rows = vocab is not None and vocab.fixed  # the restricted rows never change: cut them once
        if fixed_rows:
            cut_movers, cut_ref = [vocab.cut(b) for b in movers], vocab.cut(ref_state)

        best_states, best_elements = movers, [GroupElement.identity(spec) for _ in movers]
        best = initial
        result = RefineResult([], [], [], initial_loss=initial, start_mode=start_mode, trimmed=trimmed,
                              eval_every=0 if sized else eval_every)  # a sized run sets it once sized
        if evaluation is not None:
            result.evaluation_initial_loss = centroid_loss(ref_state, base, evaluation)
        result.history.append((0, initial))
        bar = progress_bar(None if sized else steps, progress, "learned refinement", "step")
        training, checked = time.perf_counter(), phases["checks"]
        probe_started = 0.0
        # a single model's loss does not depend on its alignment: nothing to refine
        for step in itertools.count(1) if members > 1 else ():
            if step > steps:
                break
            if sized and step == 2:
                probe_started = time.perf_counter()  # the first step pays one-off costs: time the next ones
            if sized and step == PROBE_STEPS + 2:
                per_step = (time.perf_counter() - probe_started) / PROBE_STEPS
                evaluations = sized_checks(evaluations, budget, check_seconds[0])
                left = budget - (time.perf_counter() - t0) - evaluations * check_seconds[0]
                steps = max(step, step - 1 + int(max(left, 0.0) / per_step))
                eval_every, sized = max(1, -(-steps // evaluations)), False
                result.eval_every = eval_every
                bar.total = steps
                bar.refresh()
            x, y = next(iterator)
            x, y, train_movers, train_ref, correction = x.to(device), y.to(device), movers, ref_state, None
            if fixed_rows:
                x, y = vocab.renumber(x), vocab.renumber(y)
                train_movers, train_ref = cut_movers, cut_ref
            elif vocab is not None:
                rows, correction, x, y = vocab.draw(x, y)
                train_movers, train_ref = [vocab.restrict(b, rows) for b in movers], vocab.restrict(ref_state, rows)
            if members == 2:
                first = rng.uniform(lo, hi)
                lam = [first, 1.0 - first]
            else:
                lam = rng.dirichlet([alpha] * members).tolist()
            moved_ref, moved = split_members([d.transform(b, tau) for d, b in zip(deltas, train_movers)], train_ref)
            optimiser.zero_grad(set_to_none=True)
            loss = workers.backward(lambda logits, y, c=correction: loss_fn(logits if c is None else logits + c.to(logits), y),
                                    forward, mixture(lam, moved_ref, moved), x, y)
            optimiser.step()
            scheduler.step()
            if not all_finite(loss, deltas.parameters()):  # diverged: keep the best alignment scored so far
                result.diverged_step = step
                break
            bar.update(1)
            if progress:  # loss.item() synchronises with the device: only when shown
                bar.set_postfix(loss=f"{loss.item():.4f}", best=f"{best:.4f}")
            if budgeted and step < steps and time.perf_counter() - t0 > budget - check_seconds[0]:
                steps = result.stopped_at_budget = step  # slower steps than timed: the budget holds, a last check
            if step % eval_every == 0 or step == steps:
                elements = [d.hard_element() for d in deltas]
                hard = [apply_group(spec, b, g) for b, g in zip(movers, elements)]
                value = centroid_loss(*split_members(hard), selection)
                result.history.append((step, value))
                if value < best:
                    best, best_states, best_elements, result.best_step = value, hard, elements, step
                    best_maps = maps_now()
                elif value > initial + RELAPSE * abs(initial) and step < steps:
                    deltas.load_state_dict(best_maps)  # blew up: resume from the best maps, more gently
                    optimiser.state.clear()
                    lr_scale[0] *= 0.5
                    result.relapses.append(step)
        phases["steps"] = outside_checks(training, checked)
    bar.close()
    best_ref, result.canonical = split_members(best_states)
    result.states = [to_gauge(spec, s, ref_c.gains) for s in result.canonical]
    ref_element, cand_elements = (best_elements[0], best_elements[1:]) if dual else (None, best_elements)
    result.transforms = [compose(s.transform, g) for s, g in zip(starts, cand_elements)]
    result.best_loss = best
    result.reference_canonical = best_ref
    ref_transform = ref_start.transform if ref_start else GroupElement.identity(spec)
    result.reference_transform = ref_transform if ref_element is None else compose(ref_transform, ref_element)
    if evaluation is not None:
        result.evaluation_loss = (result.evaluation_initial_loss if result.best_step == 0
                                  else centroid_loss(best_ref, result.canonical, evaluation))
    result.seconds = time.perf_counter() - t0
    result.phases = phases
    result.steps = steps if members > 1 else 0
    result.workers = workers.count
    workers.close()
    return result


def _parameter_groups(deltas: nn.ModuleList, lr: float, head_lr: float | None) -> list:
    """Adam's parameter groups: the per-head maps at ``head_lr``, everything else at ``lr``."""
    if head_lr is None:
        return [{"params": list(deltas.parameters())}]
    heads = [p for d in deltas for p in d.head_parameters()]
    chosen = {id(p) for p in heads}
    return [{"params": [p for p in deltas.parameters() if id(p) not in chosen]}, {"params": heads, "lr": head_lr}]


def refined_merge(
    spec: SymmetrySpec,
    states: list[dict],
    weights: list[float],
    reference: int,
    refine: Callable[..., RefineResult],
    combine: Combiner | Callable[[list, list], dict] | None = None,
    mix: Callable[[list[float], Callable[[list[float]], dict]], list[float]] | None = None,
) -> tuple[dict, RefineResult]:
    """``Σ_k w_k g_k·θ_k / Σ_k w_k`` with every g_k from ``refine(θ_ref, others, include_reference=
    w_ref > 0)`` (e.g. a partial of :func:`learned_refine`), in the reference's gauge; returns
    (merged state, refine result). ``combine`` replaces the weighted mean (a
    :class:`~fedbasin.alignment.merge.Combiner`, called once, or a plain ``(states, weights)`` callable).
    ``mix(weights, merge_of) -> weights`` chooses the weights first, ``merge_of(w)`` being the weighted mean
    of the aligned models in the reference's gauge (e.g. :func:`~fedbasin.alignment.merge.best_mixture`
    scored on proxy data)."""
    combine = as_combiner(combine)
    others = [s for k, s in enumerate(states) if k != reference]
    result = refine(states[reference], others, include_reference=weights[reference] > 0)
    ref = canonicalize(spec, states[reference])
    aligned = list(result.canonical)
    aligned.insert(reference, ref.state if result.reference_canonical is None else result.reference_canonical)
    if mix is not None:
        weights = mix(weights, lambda w: to_gauge(spec, average_states(aligned, w), ref.gains))
    return to_gauge(spec, combine.combine(aligned, weights), ref.gains), result
