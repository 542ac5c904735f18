"""FedAvg whose aggregation first maps every client model into one basis (fedbasin.alignment).

Per round, with client states ``θ_k`` and example counts ``n_k``:

* alignment off: ``θ = Σ_k n_k θ_k / Σ_k n_k`` (plain FedAvg);
* alignment on: ``θ = Σ_k n_k g_k·θ_k / Σ_k n_k`` where ``g_k`` is the exact, function-preserving
  group element maximising ``⟨θ_ref, g·θ_k⟩`` (weight matching). The reference ``θ_ref`` is the
  previous global model, present only as the alignment target (weight 0); in round 1 with
  independently initialised clients it is the client with the most examples. The result is in
  the reference's gauge. Clients that trained from the broadcast and kept its basis (a permutation
  matching pass moves no head or neuron) are averaged as plain FedAvg (``already_aligned``).
"""

from __future__ import annotations

import hashlib
import io
import inspect
import math
import time
import warnings
from collections.abc import Callable, Iterable
from logging import INFO, WARNING

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg, Result

from fedbasin.alignment import (
    Combiner,
    SymmetrySpec,
    average_states,
    canonicalize,
    merge,
    refined_merge,
    shares_basis,
)
from fedbasin.options import AUTO, MatchOptions, RobustOptions, checked
from fedbasin.scratch import arrays_on_disk
from fedbasin.strategies.robust import (
    SPLIT_RATIO,
    aggregate,
    capped_counts,
    clip_updates,
    cohort_outliers,
    coordinate_median,
    equal_split,
    proxy_outliers,
)



class ReplyError(ValueError):
    """A client reply that cannot be aggregated; the message says why."""


class CohortSplit(RuntimeError):
    """The cohort is two equal camps that disagree (:func:`~fedbasin.strategies.robust.equal_split`):
    the round fails and keeps the previous global model; the message says why."""


# names (and prefixes) of the round metrics the server sets itself: a client cannot report them
SERVER_METRICS = ("align_", "refine_", "distill_", "proxy_screen", "screen_seconds", "aggregate_seconds",
                  "universe_passes", "num_clipped", "already_aligned", "num_excluded", "excluded_nodes",
                  "capped_nodes", "round_failed")

# the keywords of AlignedFedAvg that the schema's option objects also hold: keyword -> the object's field, in the
# order __init__ unpacks them
_MATCH_KEYWORDS = {"mode": "symmetry", "iterations": "align_iterations", "tol": "align_tol",
                   "universe_iterations": "universe_iterations", "already_aligned": "already_aligned"}
_ROBUST_KEYWORDS = {name: name for name in ("max_abs_weight", "max_num_examples", "max_examples_ratio",
                                            "outlier_threshold", "proxy_screening", "clip_ratio", "aggregator",
                                            "trim_fraction")}


class AlignedFedAvg(FedAvg):
    """Flower ``FedAvg`` (Message API) that aligns client models before averaging them.

    Parameters
    ----------
    spec : SymmetrySpec
        Symmetry spec of the global model (``fedbasin.alignment.fedbasin_adapter(...).spec``).
    alignment : bool
        False: plain example-weighted averaging (FedAvg) through the same validation path.
    mode : str
        ``"orthogonal"`` (residual rotations, per-head maps) or ``"permutation"``.
    iterations, tol : int, float
        Weight-matching coordinate-ascent limits.
    independent_init : bool
        Clients start round 1 from their own initialisations (the one-shot setting): align
        round 1 to the client with the most examples instead of the broadcast model.
    universe_iterations : int
        Re-align every client to the running average this many times (universe matching).
    already_aligned : str
        A round whose clients all trained from the broadcast model (every round but round 1 of
        ``independent_init``), without ``refine``: ``"average"`` checks first whether one
        permutation matching pass leaves every client's heads and neurons in place
        (:func:`~fedbasin.alignment.shares_basis`) and, if so, averages them as plain FedAvg does
        (metric ``already_aligned`` = 1); ``"align"`` always aligns.
    refine : callable, optional
        Server-side learned refinement, ``refine(reference_state, other_states,
        include_reference=...)`` returning a
        :class:`~fedbasin.alignment.RefineResult` (the ServerApp binds the model and its proxy
        split into it, e.g. ``functools.partial(learned_refine, spec, model, ...)``). The
        refined, canonical client models are averaged instead of the weight-matched ones.
    distill : callable, optional
        Run after every merge: ``distill(merged_state, client_states)`` with the clients the
        cohort screening kept (when ``distill.prepare(client_states)`` exists it runs before the
        merge, and what it returns, one teacher per client, replaces the states unless None),
        returning a result with ``state`` (the new global model),
        ``initial_loss``, ``best_loss`` and ``best_step``, optionally ``diverged_step`` (> 0: the
        step where training diverged and stopped; reported and logged) (the ServerApp binds the model and its
        proxy split into it: ensemble distillation, ``fedbasin.server.distill``).
    max_abs_weight : float
        A reply holding any value with ``|x|`` above this is excluded before any arithmetic
        (no overflow downstream).
    max_num_examples, max_examples_ratio : float
        Averaging weights are ``num-examples`` capped at ``max_num_examples`` and at
        ``max_examples_ratio`` × the round's lower-median count (0 disables a cap); up to half
        the cohort cannot raise that cap above an honest count
        (:func:`~fedbasin.strategies.robust.capped_counts` states the weight share they can get).
    outlier_threshold : float
        MAD rule in the aligned basis (``fedbasin.strategies.robust``): a model whose distance
        to the other models' coordinate median, or whose update norm, is above
        ``med + t·max(1.4826·MAD, 0.15·med)`` is excluded (needs 3 or more replies; 0: off).
        With the rule on, a cohort of an even number ``K ≥ 4`` of models that falls into two
        equal camps far apart (:func:`~fedbasin.strategies.robust.equal_split`) fails the round:
        at 50 % no rule can decide, so the previous global model is kept.
    proxy_loss, proxy_screening : callable, float
        ``proxy_loss(state) -> float``: a model's loss on the server's proxy split (the ServerApp
        binds it). ``proxy_screening = t > 0``: before alignment, replies whose proxy loss is
        above ``(1 + t)`` × the lower median of the cohort's losses are excluded (:func:`~fedbasin.strategies.robust.proxy_outliers`); 0: off.
    clip_ratio : float
        > 0: clip every aligned update to ``clip_ratio`` × the median update norm.
    aggregator, trim_fraction : str, float
        ``"mean"`` (example-weighted), ``"trimmed-mean"`` (drop the ``⌊f·K⌋`` largest and
        smallest values of every coordinate) or ``"median"`` (coordinate-wise), after alignment.
    device : str or torch.device, optional
        Where the round's matching, screening, refinement and merge run: the client models are
        moved there once decoded, and the global model comes back as CPU arrays. None: where
        they arrive (the CPU).
    match, robust : fedbasin.options.MatchOptions, fedbasin.options.RobustOptions, optional
        The schema's option objects (what the CLI and the run config build); given, they replace the
        matching keywords (``mode``, ``iterations``, ``tol``, ``universe_iterations``; ``head_weight``, the
        head's weight in the objective, comes only from here: ``auto`` without it, the measured best for
        what the model is, :func:`~fedbasin.alignment.matching.auto_head_weight`) or the
        screening and aggregation keywords above.
    **kwargs
        ``FedAvg`` options (``fraction_train``, ``min_train_nodes``, ...).

    Screening, in order: every reply is checked on its own against the broadcast model (no
    client error, one reply per node, one MetricRecord with a positive finite ``num-examples``,
    one ArrayRecord with the same keys, shapes and dtypes, finite values within
    ``max_abs_weight``, foldable norm gains); with ``proxy_screening``, replies far worse on the
    proxy split than the cohort's lower median are excluded; counts are capped; after alignment
    the cohort is screened (and an even cohort split into two equal camps fails the round); then
    the models are clipped and aggregated. The replies are taken in the order of their content
    (:func:`reply_order_key`) and client metrics are averaged with exact sums
    (:func:`weighted_metric_mean`, the default ``*_metrics_aggr_fn``): the aggregate and its
    metrics depend neither on node ids nor on arrival order. Every exclusion is logged and kept in
    ``screening[round] = {"excluded": [{"node", "stage", "reason"}], "capped": [{"node", "stage",
    "num_examples", "weight"}], "failed": reason or ""}``; nothing a client sends raises out of
    ``aggregate_train``. If no reply is left or the aggregate is not finite, the round fails: ``(None, metrics)`` keeps the
    previous global model. The metrics are the clients' weighted train metrics plus
    ``align_gain`` (mean increase of the matching objective), ``align_seconds`` (the whole merge:
    alignment, refinement and distillation; with them ``refine_seconds`` and ``distill_seconds``),
    ``screen_seconds``, ``aggregate_seconds``, ``num_excluded``, ``excluded_nodes``,
    ``capped_nodes`` and ``round_failed``. ``train_metrics`` and ``evaluate_metrics`` keep the
    aggregated metrics by round as they arrive (for per-round records while ``start`` runs).

    Memory: with ``consume_replies`` true — always while :meth:`start` runs, since Flower drops
    each round's replies once they are aggregated — every accepted reply's ArrayRecord is taken
    out of its message when it is decoded, so each client model's bytes are freed as soon as it
    is aligned and the server holds about one model per client through the round. A direct
    ``aggregate_train`` call leaves the messages untouched unless ``consume_replies`` is set.
    """

    def __init__(
        self,
        spec: SymmetrySpec,
        *,
        alignment: bool = True,
        mode: str = "orthogonal",
        iterations: int = 20,
        tol: float = 1e-4,
        independent_init: bool = False,
        universe_iterations: int = 1,
        already_aligned: str = "average",
        refine=None,
        distill=None,
        max_abs_weight: float = 1e6,
        max_num_examples: float = 1_000_000,
        max_examples_ratio: float = 1.0,
        outlier_threshold: float = 3.5,
        proxy_loss=None,
        proxy_screening: float = 0.0,
        clip_ratio: float = 0.0,
        aggregator: str = "mean",
        trim_fraction: float = 0.25,
        device: str | torch.device | None = None,
        match: MatchOptions | None = None,
        robust: RobustOptions | None = None,
        **kwargs,
    ) -> None:
        checked(*(group for group in (match, robust) if group is not None))
        given = locals()  # a keyword set away from its default must not be overridden unseen by an option object
        for group, names in ((match, _MATCH_KEYWORDS), (robust, _ROBUST_KEYWORDS)):
            if group is None:
                continue
            for keyword, field_name in names.items():
                value, default = given[keyword], _KEYWORD_DEFAULTS[keyword]
                if value != default and value != getattr(group, field_name):
                    raise ValueError(f"{keyword}={value!r} contradicts {type(group).__name__}({field_name}="
                                     f"{getattr(group, field_name)!r}); pass the setting once, as a keyword or "
                                     "in the option object")
        # the plain keywords are the same options: as option objects, checked by the schema's rules (one place)
        keywords = {name: given[name] for name in (*_MATCH_KEYWORDS, *_ROBUST_KEYWORDS)}
        if isinstance(count := keywords["max_num_examples"], float) and count.is_integer():
            keywords["max_num_examples"] = int(count)  # (documented as a number: 1e6 is a count)
        if match is None:
            match = MatchOptions(**{f: keywords[k] for k, f in _MATCH_KEYWORDS.items()})
            checked(match, names={f: k for k, f in _MATCH_KEYWORDS.items()})
        if robust is None:
            robust = RobustOptions(**{f: keywords[k] for k, f in _ROBUST_KEYWORDS.items()})
            checked(robust, names={f: k for k, f in _ROBUST_KEYWORDS.items()})
        mode, iterations, tol, universe_iterations, already_aligned = (
            getattr(match, field_name) for field_name in _MATCH_KEYWORDS.values())
        head_weight = match.head_weight if match.head_weight == AUTO else float(match.head_weight)
        (max_abs_weight, max_num_examples, max_examples_ratio, outlier_threshold, proxy_screening, clip_ratio,
         aggregator, trim_fraction) = (getattr(robust, field_name) for field_name in _ROBUST_KEYWORDS.values())
        kwargs.setdefault("train_metrics_aggr_fn", weighted_metric_mean)
        kwargs.setdefault("evaluate_metrics_aggr_fn", weighted_metric_mean)
        super().__init__(**kwargs)
        try:
            self.device = None if device is None else torch.device(device)
        except (RuntimeError, TypeError):
            raise ValueError(f"device must be a torch device such as cpu, cuda or cuda:N, got {device!r}") from None
        if spec.tied and alignment:
            log(WARNING, "%s: alignment unties %s (the final norm's gain is folded into the head, "
                "which an orthogonal residual map cannot keep equal to the embedding); from round 2 "
                "the global model carries both tensors, so clients must build untied models "
                "(tie_word_embeddings=False / tie_embeddings=False) - replies from tied models "
                "are excluded", spec.name, ", ".join(f"{b} = {a}" for a, b in spec.tied))
        if refine is not None and not callable(refine):
            raise ValueError(f"refine must be callable (e.g. a partial of learned_refine), got {refine!r}")
        if refine is not None and not alignment:
            raise ValueError("refine needs alignment: plain FedAvg (alignment=False) would ignore it")
        if distill is not None and not callable(distill):
            raise ValueError(f"distill must be callable, got {distill!r}")
        if proxy_screening > 0 and not callable(proxy_loss):
            raise ValueError("proxy_screening needs proxy_loss (a model's loss on the server's proxy split)")
        self.spec = spec
        self.alignment = alignment
        self.mode = mode
        self.iterations = iterations
        self.tol = tol
        self.independent_init = independent_init
        self.universe_iterations = universe_iterations
        self.already_aligned = already_aligned
        self.head_weight = head_weight
        self.refine = refine
        self.distill = distill
        self.max_abs_weight = max_abs_weight
        self.max_num_examples = max_num_examples
        self.max_examples_ratio = max_examples_ratio
        self.outlier_threshold = outlier_threshold
        self.proxy_loss = proxy_loss
        self.proxy_screening = proxy_screening
        self.clip_ratio = clip_ratio
        self.aggregator = aggregator
        self.trim_fraction = trim_fraction
        self.screening: dict[int, dict] = {}
        self.train_metrics: dict[int, MetricRecord] = {}
        self.evaluate_metrics: dict[int, MetricRecord] = {}
        self._global: ArrayRecord | None = None
        self._round_offset = 0
        self.consume_replies = False

    def summary(self) -> None:
        super().summary()
        how = (
            f"{self.mode}, {self.iterations} iterations" if self.alignment else "off (plain FedAvg)"
        )
        log(
            INFO,
            "\t└──> Alignment: %s%s",
            how,
            ", independent round-1 inits" if self.independent_init else "",
        )

    # -- rounds -------------------------------------------------------------------------------

    def start(
        self,
        grid: Grid,
        initial_arrays: ArrayRecord,
        num_rounds: int = 3,
        timeout: float = 3600,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn=None,
        first_round: int = 1,
    ) -> Result:
        """``FedAvg.start`` running rounds ``first_round..num_rounds`` (``first_round > 1``
        resumes after round ``first_round - 1`` from ``initial_arrays``). Round numbers seen by
        clients (``server-round``), ``evaluate_fn`` and the result are the true ones."""
        if not 1 <= first_round <= num_rounds:
            raise ValueError(f"first_round {first_round} is outside 1..{num_rounds}")
        offset = self._round_offset = first_round - 1
        shifted = (
            None if evaluate_fn is None else (lambda rnd, arrays: evaluate_fn(rnd + offset, arrays))
        )
        consume, self.consume_replies = self.consume_replies, True
        try:
            result = super().start(
                grid,
                initial_arrays,
                num_rounds - offset,
                timeout,
                train_config,
                evaluate_config,
                shifted,
            )
        finally:
            self._round_offset = 0
            self.consume_replies = consume
        for name in (
            "train_metrics_clientapp",
            "evaluate_metrics_clientapp",
            "evaluate_metrics_serverapp",
        ):
            setattr(result, name, {rnd + offset: m for rnd, m in getattr(result, name).items()})
        return result

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        self._global = arrays
        return super().configure_train(server_round + self._round_offset, arrays, config, grid)

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        return super().configure_evaluate(server_round + self._round_offset, arrays, config, grid)

    # -- aggregation --------------------------------------------------------------------------

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Screen every reply, align to the reference, screen the cohort, aggregate.

        Nothing a client sends can raise out of here: a reply that fails a check is excluded
        (log line and ``self.screening[round]`` name the node and the reason); if no reply is
        left, or merging fails or gives a non-finite model, the round is recorded as failed and
        ``(None, metrics)`` keeps the previous global model.
        """
        t0 = time.perf_counter()
        server_round += self._round_offset
        if self._global is None:
            raise RuntimeError(
                "aggregate_train needs the broadcast model: call configure_train first"
            )
        template = self._global
        record = self.screening[server_round] = {"excluded": [], "capped": [], "failed": ""}
        accepted: dict[int, tuple] = {}  # node -> (num-examples, content)
        decoded: dict[int, dict] = {}  # node -> state (views of the reply's bytes)
        order: dict[int, bytes] = {}  # node -> content key (reply_order_key)
        first: dict[int, str] = {}  # node -> its first reply's message id: the one that counts, usable or not
        for msg in replies:
            node = msg.metadata.src_node_id
            try:
                if node in first:
                    raise ReplyError(
                        f"duplicate reply {msg.metadata.message_id[:12]}: a node counts once per "
                        f"round (its first reply {first[node][:12]} counts)"
                    )
                first[node] = msg.metadata.message_id
                weight = self._num_examples(msg)
                state = self._checked_state(msg, template)
                order[node] = reply_order_key(weight, msg.content, template)
                decoded[node] = state
            except Exception as error:  # noqa: BLE001 - no client content may stop the round
                self._exclude(server_round, node, _reason(error))
                continue
            accepted[node] = (weight, msg.content)
            if self.consume_replies:  # the state's views now hold the bytes: freed once aligned
                for name in _array_record_names(msg.content):
                    del msg.content[name]
        # the aggregate depends on neither the replies' arrival order nor the node ids (random per run)
        nodes = sorted(accepted, key=lambda n: (order[n], n))
        states = [decoded.pop(n) for n in nodes]
        proxy_metrics = MetricRecord()
        if self.proxy_screening > 0 and states:
            nodes, states = self._proxy_screen(server_round, nodes, states, proxy_metrics)
        counts = {n: accepted[n][0] for n in nodes}
        # provisional weights (the reference among the replies); the averaging weights are capped again over the
        # replies the cohort rule keeps (a reply it excludes must not move the cap: _capped_weights via reweigh)
        weights = capped_counts(list(counts.values()), self.max_num_examples, self.max_examples_ratio)[0]
        used: dict[int, float] = {}  # node -> the weight it was averaged with

        def reweigh(kept: list) -> list[float]:
            final = self._capped_weights(server_round, kept, [counts[n] for n in kept], "train")
            used.update(zip(kept, final))
            return final

        log(INFO, "round %d: %d valid replies, %d excluded", server_round, len(states),
            len(record["excluded"]))

        metrics = MetricRecord()
        merged = None
        if not states:
            record["failed"] = "no valid replies"
        else:
            t_align = time.perf_counter()
            try:
                merged, align_metrics = self._merge(server_round, template, nodes, states, weights, reweigh)
                if bad := _non_finite_keys(merged):
                    raise ValueError(f"the aggregate has non-finite values in {bad[:5]}")
            except CohortSplit as split:
                record["failed"] = str(split)
                merged = None
            except Exception as error:  # noqa: BLE001 - a failed merge keeps the previous model
                record["failed"] = f"aggregation failed: {_reason(error)}"
                merged = None
            else:
                metrics = self._client_metrics(
                    server_round,
                    [_with_weight(accepted[n][1], used.get(n, w), self.weighted_by_key)
                     for n, w in zip(nodes, weights) if n not in self._cohort_excluded(server_round)],
                    self.train_metrics_aggr_fn,
                )
                metrics.update(align_metrics)
                metrics.update(proxy_metrics)
                metrics["align_seconds"] = time.perf_counter() - t_align
        if record["failed"]:
            log(WARNING, "round %d failed (%s); keeping the previous global model",
                server_round, record["failed"])
        excluded = [e["node"] for e in record["excluded"]]
        metrics["aggregate_seconds"] = time.perf_counter() - t0
        metrics["num_excluded"] = len(excluded)
        metrics["excluded_nodes"] = excluded
        metrics["capped_nodes"] = sorted(c["node"] for c in record["capped"] if c["stage"] == "train")
        metrics["round_failed"] = int(bool(record["failed"]))
        self.train_metrics[server_round] = metrics
        if merged is None:
            return None, metrics
        arrays = ArrayRecord()
        for key in template:  # each merged tensor goes once it is serialised
            arrays[key] = Array(merged.pop(key).cpu().numpy().astype(template[key].dtype, copy=False))
        return arrays, metrics

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        """Example-weighted mean of the clients' evaluation metrics (counts capped as in
        training, one reply per node); bad replies are excluded."""
        server_round += self._round_offset
        counts: dict[int, tuple[float, RecordDict]] = {}
        seen: set[int] = set()  # a node's first reply counts, usable or not
        for msg in replies:
            node = msg.metadata.src_node_id
            try:
                if node in seen:
                    raise ReplyError("duplicate reply: a node counts once per round (its first reply counts)")
                seen.add(node)
                counts[node] = (self._num_examples(msg), msg.content)
            except Exception as error:  # noqa: BLE001 - no client content may stop the round
                log(WARNING, "round %d: excluding evaluation reply from node %d: %s",
                    server_round, node, _reason(error))
        if not counts:
            return None
        self.screening.setdefault(server_round, {"excluded": [], "capped": [], "failed": ""})
        nodes = list(counts)
        weights = self._capped_weights(server_round, nodes, [counts[n][0] for n in nodes], "evaluate")
        contents = [_with_weight(counts[n][1], w, self.weighted_by_key)
                    for n, w in zip(nodes, weights)]
        metrics = self._client_metrics(server_round, contents, self.evaluate_metrics_aggr_fn)
        self.evaluate_metrics[server_round] = metrics
        return metrics

    def _merge(
        self, server_round: int, previous: ArrayRecord, nodes: list, states: list, weights: list, reweigh=None
    ) -> tuple[dict, dict]:
        """The aligned merge, then ``distill`` (when given) from the clients the screening kept."""
        # the merge empties states and their dicts: the teachers are the clients' outputs cached
        # before it (distill.prepare, when there is one and the cache is small enough), so that
        # their weights go during the merge, else their own dicts of the tensors, kept through it
        teachers, started = [], time.perf_counter()
        if self.distill is not None:
            prepare = getattr(self.distill, "prepare", None)
            cached = prepare(states) if prepare is not None else None
            teachers = list(zip(nodes, cached if cached is not None else [dict(s) for s in states]))
            del cached
        prepared = time.perf_counter() - started
        merged, metrics = self._aligned_merge(server_round, previous, nodes, states, weights, reweigh)
        if self.distill is None:
            return merged, metrics
        started = time.perf_counter()
        excluded = self._cohort_excluded(server_round)
        # the broadcast model (Flower's loop holds it for this round) waits on disk while the
        # student trains, and comes back whatever happens (server memory: one model fewer)
        with arrays_on_disk(previous):
            result = self.distill(merged, [state for node, state in teachers if node not in excluded])
        _log_keep_best(server_round, "ensemble distillation", "selection", result)
        return result.state, {**metrics, "distill_seconds": prepared + time.perf_counter() - started,
                              "distill_selection_loss_start": result.initial_loss,
                              "distill_selection_loss": result.best_loss, "distill_best_step": result.best_step,
                              "distill_diverged_step": getattr(result, "diverged_step", 0),
                              # the steps it was given (sized by distill-budget with auto), where the budget stopped it
                              **({"distill_steps": result.steps,
                                  "distill_stopped_at_budget": getattr(result, "stopped_at_budget", 0)}
                                 if hasattr(result, "steps") else {}),
                              **({"distill_lr": result.lr} if hasattr(result, "lr") else {})}  # (sized by the steps)

    def _aligned_merge(
        self, server_round: int, previous: ArrayRecord, nodes: list, states: list, weights: list, reweigh=None
    ) -> tuple[dict, dict]:
        """Merged state (cohort screened and aggregated in the aligned basis) and metrics.

        The client models are taken out of ``states`` (the list is emptied), so that the merge
        can let each go once it is aligned. ``weights`` choose the reference; ``reweigh(nodes)``, when
        given, gives the averaging weights of the nodes the cohort rule keeps (else ``weights``)."""
        owners = list(nodes)  # node id per entry; None: the previous global model (weight 0)
        models, weights = list(states), list(weights)
        states.clear()
        if not (self.independent_init and server_round == 1):
            models, weights = [_tensor_views(previous), *models], [0.0, *weights]
            owners = [None, *owners]
        if self.device is not None:  # the round's matching, screening and merge run there
            models = [{k: v.to(self.device) for k, v in m.items()} for m in models]
        states = models
        combiner = self._combiner(server_round, owners, release=self.refine is None, reweigh=reweigh)
        if not self.alignment:
            return combiner.combine(states, weights), {"align_gain": 0.0, **combiner.metrics}
        if len(states) == 1:
            if reweigh is not None:  # no cohort to screen: the cap is still recorded
                reweigh([owner for owner in owners if owner is not None])
            return states[0], {"align_gain": 0.0}
        if owners[0] is None and self.refine is None and self.already_aligned == "average":
            # the replies the cohort rule excludes do not decide (one garbage reply would force alignment);
            # if the rest kept the broadcast's basis the combiner uses the same screening, else it screens again
            combiner.outliers = (cohort_outliers(states[1:], states[0], self.outlier_threshold)
                                 if self.outlier_threshold > 0 else {})
            if all(shares_basis(self.spec, states[0], s, self.head_weight)
                   for i, s in enumerate(states[1:]) if i not in combiner.outliers):
                # every client trained from the broadcast and kept its basis: alignment would only fit noise
                return combiner.combine(states, weights), {"align_gain": 0.0, "already_aligned": 1,
                                                           "universe_passes": 0, **combiner.metrics}
            combiner.outliers = None
        reference = 0 if owners[0] is None else max(range(len(weights)), key=weights.__getitem__)
        if self.refine is not None:
            merged, refined = refined_merge(self.spec, states, weights, reference, self.refine,
                                            combine=combiner)
            _log_keep_best(server_round, "learned refinement", "held-out", refined)
            return merged, {"align_gain": refined.initial_loss - refined.best_loss,
                            "refine_heldout_loss": refined.best_loss, "refine_diverged_step": refined.diverged_step,
                            "refine_seconds": refined.seconds,
                            **combiner.metrics}
        result = merge(self.spec, states, weights, reference, self.mode, self.iterations, self.tol,
                       universe_iterations=self.universe_iterations, combine=combiner, release=True,
                       head_weight=self.head_weight)
        gains = [m.objective[-1] - m.initial_objective for m in result.matches]
        return result.state, {"align_gain": float(sum(gains) / len(gains)) if gains else 0.0,
                              "universe_passes": len(result.universe_change), **combiner.metrics}

    def _combiner(self, server_round: int, owners: list, release: bool, reweigh=None) -> _ScreeningCombiner:
        """The round's :class:`_ScreeningCombiner` (``owners``: node id per merged model, None for
        the previous global model; ``release``: the merge hands the client models over; ``reweigh``:
        the averaging weights of the kept nodes)."""
        return _ScreeningCombiner(
            owners, release, self.outlier_threshold, self.clip_ratio, self.aggregator, self.trim_fraction,
            exclude=lambda node, reason: self._exclude(server_round, node, reason, stage="cohort"), reweigh=reweigh)

    def _exclude(self, server_round: int, node: int, reason: str, stage: str = "reply") -> None:
        log(WARNING, "round %d: excluding reply from node %d: %s", server_round, node, reason)
        self.screening[server_round]["excluded"].append(
            {"node": node, "stage": stage, "reason": reason}
        )

    def _cohort_excluded(self, server_round: int) -> set[int]:
        return {e["node"] for e in self.screening[server_round]["excluded"]
                if e["stage"] == "cohort"}

    def _capped_weights(self, server_round: int, nodes: list, counts: list, stage: str) -> list[float]:
        """Averaging weights: ``num-examples`` capped at ``max_num_examples`` and at
        ``max_examples_ratio`` × the cohort's lower-median count
        (:func:`~fedbasin.strategies.robust.capped_counts`; 0 disables either cap); each cap is
        recorded with its ``stage`` (``"train"`` or ``"evaluate"``)."""
        weights, limit = capped_counts(counts, self.max_num_examples, self.max_examples_ratio)
        for node, n in zip(nodes, counts):
            if n > limit:
                log(WARNING, "round %d: node %d reports %s=%.4g; capped at %.4g", server_round,
                    node, self.weighted_by_key, n, limit)
                self.screening[server_round]["capped"].append(
                    {"node": node, "stage": stage, "num_examples": n, "weight": limit}
                )
        return weights

    def _proxy_screen(self, server_round: int, nodes: list, states: list, metrics: MetricRecord) -> tuple[list, list]:
        """The replies whose proxy loss is not an outlier (:func:`~fedbasin.strategies.robust.proxy_outliers`);
        the others are excluded (stage ``"proxy"``). A loss that cannot be computed counts as
        infinite."""
        t0 = time.perf_counter()

        def loss(state: dict) -> float:
            try:
                return float(self.proxy_loss(state))
            except Exception as error:  # noqa: BLE001 - a client model the proxy cannot run is excluded
                log(WARNING, "round %d: proxy loss failed (%s)", server_round, _reason(error))
                return math.inf

        losses = [loss(s) for s in states]
        bad = set(proxy_outliers(losses, self.proxy_screening))
        for k in sorted(bad):
            self._exclude(server_round, nodes[k], f"proxy loss {losses[k]:.4g} is above (1 + {self.proxy_screening:g}) "
                          f"× the cohort's lower median", stage="proxy")
        metrics["proxy_screen_seconds"] = time.perf_counter() - t0
        return [n for k, n in enumerate(nodes) if k not in bad], [s for k, s in enumerate(states) if k not in bad]

    # -- reply checks -------------------------------------------------------------------------

    def _num_examples(self, msg: Message) -> float:
        """The reply's positive, finite example count (its averaging weight)."""
        if msg.has_error():
            raise ReplyError(f"client error: {msg.error.reason}")
        records = msg.content.metric_records
        if len(records) != 1:
            raise ReplyError(f"expected exactly one MetricRecord, got {len(records)}")
        metrics = next(iter(records.values()))
        n = metrics.get(self.weighted_by_key)
        if n is None:
            raise ReplyError(f"MetricRecord lacks {self.weighted_by_key!r}")
        if isinstance(n, bool) or not isinstance(n, (int, float)) or not math.isfinite(n) or n <= 0:
            raise ReplyError(f"{self.weighted_by_key}={n!r} is not a positive number")
        return float(n)

    def _check_untied(self, state: dict, template: ArrayRecord) -> None:
        """A reply whose tied pair is bitwise equal although the broadcast's differs came from a
        tied client model: loading the global model into it kept only one of the two tensors."""
        for source, alias in self.spec.tied:
            if source in state and alias in state and torch.equal(state[source], state[alias]) and not \
                    np.array_equal(template[source].numpy(), template[alias].numpy()):
                raise ReplyError(f"{alias} equals {source} but the global model unties them: the client "
                                 "model ties them (build it with tie_word_embeddings=False)")

    def _checked_state(self, msg: Message, template: ArrayRecord) -> dict[str, torch.Tensor]:
        """The reply's arrays as tensors, after checking them against the broadcast model."""
        names = _array_record_names(msg.content)
        if len(names) != 1:
            raise ReplyError(f"expected exactly one ArrayRecord, got {len(names)}")
        arrays = msg.content[names[0]]
        missing = [k for k in template if k not in arrays]
        if missing:
            raise ReplyError(f"missing array(s) {missing[:5]}")
        unexpected = [k for k in arrays if k not in template]
        if unexpected:
            raise ReplyError(f"unexpected array(s) {unexpected[:5]}")
        state = {}
        for key, expected in template.items():
            try:
                value = _array_view(arrays[key])
            except Exception as error:  # undecodable bytes, unknown serialisation type
                raise ReplyError(f"{key}: cannot decode array ({error})") from error
            if value.shape != tuple(expected.shape):
                raise ReplyError(f"{key}: shape {value.shape}, expected {tuple(expected.shape)}")
            if str(value.dtype) != expected.dtype:
                raise ReplyError(f"{key}: dtype {value.dtype}, expected {expected.dtype}")
            if value.dtype.kind in "fc" and value.size:
                if not np.isfinite(value).all():
                    raise ReplyError(f"{key}: contains NaN or infinite values")
                largest = float(np.abs(value).max())
                if largest > self.max_abs_weight:
                    raise ReplyError(f"{key}: largest magnitude {largest:.3g} exceeds "
                                     f"max_abs_weight={self.max_abs_weight:g}")
            state[key] = _as_tensor(value)
        self._check_untied(state, template)
        if self.alignment:  # e.g. a zero norm gain over a non-zero bias cannot be folded
            try:
                canonical = canonicalize(self.spec, state, validate=False).state
            except ValueError as error:
                raise ReplyError(str(error)) from error
            for key, value in canonical.items():  # β/γ of a tiny gain γ: the bounds hold where the merge works too
                if value is state[key] or not value.is_floating_point():
                    continue
                largest = float(value.abs().max()) if value.numel() else 0.0
                if not math.isfinite(largest) or largest > self.max_abs_weight:
                    raise ReplyError(f"{key}: folding the norm gains gives magnitude {largest:.3g} (above "
                                     f"max_abs_weight={self.max_abs_weight:g}): gains too small for their biases")
        return state

    def _client_metrics(self, server_round: int, contents: list, aggregate) -> MetricRecord:
        """The clients' metrics, combined by ``aggregate`` (``FedAvg``'s weighted mean by default)."""
        try:
            metrics = aggregate(contents, self.weighted_by_key)
        except Exception as error:  # noqa: BLE001 - e.g. a metric that is a list on one client only
            log(
                WARNING,
                "round %d: cannot aggregate client metrics (%s); skipping them",
                server_round,
                error,
            )
            return MetricRecord()
        for key, value in list(metrics.items()):
            if key.startswith(SERVER_METRICS):
                log(WARNING, "round %d: client metric %s has the name of one of the server's round "
                    "metrics; dropped", server_round, key)
                del metrics[key]
            elif not np.isfinite(np.asarray(value, dtype=float)).all():
                log(WARNING, "round %d: client metric %s=%s is not finite; dropped",
                    server_round, key, value)
                del metrics[key]
        return metrics


class _ScreeningCombiner(Combiner):
    """One round's :class:`~fedbasin.alignment.merge.Combiner`, called on aligned models: the
    weight-0 entry (previous global model) is only the centre; the first call excludes cohort
    outliers (``exclude(node, reason)``; the decision, :attr:`kept`, holds for later universe
    passes, and an even split raises :class:`CohortSplit`), then updates are clipped and the rest
    aggregated (``release``: emptying the client models' dicts key by key) with the weights
    ``reweigh(kept nodes)`` gives, once, when given (counts capped over the kept cohort only), else
    the weights each call passes. After the first call
    the centre is read only to clip (:attr:`reads_unweighted`). :attr:`metrics` holds
    ``screen_seconds`` (summed over the calls) and ``num_clipped`` (the last call's)."""

    def __init__(self, owners: list, release: bool, outlier_threshold: float, clip_ratio: float,
                 aggregator: str, trim_fraction: float, exclude: Callable[[int, str], None],
                 reweigh: Callable[[list], list[float]] | None = None):
        self.owners, self.release, self.exclude, self.reweigh = owners, release, exclude, reweigh
        self.kept_weights: list[float] | None = None
        self.outlier_threshold, self.clip_ratio = outlier_threshold, clip_ratio
        self.aggregator, self.trim_fraction = aggregator, trim_fraction
        self.kept: list[int] | None = None  # the clients the first call kept (indices into owners)
        self.outliers: dict | None = None  # the cohort rule's verdict on the first call's states, if known already
        self.metrics: dict = {"screen_seconds": 0.0}
        self.reads_unweighted = True

    def combine(self, states: list, weights: list, on_key=None) -> dict:
        t0 = time.perf_counter()
        owners = self.owners
        center = states[0] if owners[0] is None and states[0] else None
        clients = [k for k, owner in enumerate(owners) if owner is not None]
        if self.kept is None:
            outliers = self.outliers if self.outliers is not None else {}
            if self.outliers is None and self.outlier_threshold > 0:
                outliers = cohort_outliers([states[k] for k in clients], center, self.outlier_threshold)
            for i, reason in sorted(outliers.items()):
                self.exclude(owners[clients[i]], reason)
            kept = self.kept = [k for i, k in enumerate(clients) if i not in outliers]
            if self.outlier_threshold > 0 and (split := equal_split([states[k] for k in kept])):
                camps = sorted(sorted(owners[kept[i]] for i in camp) for camp in split[:2])  # a stable message
                raise CohortSplit(
                    f"no majority: the {len(kept)} replies split into two equal camps, nodes "
                    f"{camps[0]} and {camps[1]} (closest across {split[2]:.4g} > {SPLIT_RATIO:g} × "
                    f"widest within {split[3]:.4g}); no rule can tell which camp is honest")
            self.reads_unweighted = self.clip_ratio > 0  # later calls need the centre only to clip
            if self.reweigh is not None:
                self.kept_weights = self.reweigh([owners[k] for k in kept])
        group = [states[k] for k in self.kept]
        group_weights = self.kept_weights if self.kept_weights is not None else [weights[k] for k in self.kept]
        if self.clip_ratio > 0:
            group, clipped = clip_updates(
                group, coordinate_median(group) if center is None else center, self.clip_ratio
            )
            self.metrics["num_clipped"] = len(clipped)
        self.metrics["screen_seconds"] += time.perf_counter() - t0
        return aggregate(group, group_weights, self.aggregator, self.trim_fraction,
                         average_states, release=self.release, on_key=on_key)


ORDER_KEY_BYTES = 1 << 16  # of each array, read by reply_order_key


def reply_order_key(weight: float, content: RecordDict, template: ArrayRecord) -> bytes:
    """The order of a checked reply among the round's replies: a digest of its weight (example
    count) and of the first :data:`ORDER_KEY_BYTES` of each array (the broadcast's keys). Flower's
    node ids are drawn at random per run and replies arrive in any order; sorting by content
    makes the aggregate (float sums, the round-1 reference among equal counts, universe passes)
    a function of the set of replies, so a seeded run repeats bit for bit. Replies whose keys
    tie (equal counts and equal leading bytes of every array) fall back to node-id order."""
    digest = hashlib.sha1(repr(float(weight)).encode())
    arrays = content[_array_record_names(content)[0]]
    for key in template:
        digest.update(arrays[key].data[:ORDER_KEY_BYTES])
    return digest.digest()


def weighted_metric_mean(records: list[RecordDict], weighting_key: str) -> MetricRecord:
    """The ``weighting_key``-weighted mean of every other metric (element-wise for lists) with
    exactly rounded sums (``math.fsum``): the result does not depend on the order of ``records``,
    i.e. on the replies' arrival order. Each metric is averaged over the clients that report it
    finite and in its usual shape (a number, or a list of the length most clients send; ties: the
    first in sorted order), its weights renormalised over them: one client's missing, non-finite or
    odd-shaped value neither dilutes the mean nor drops the metric for everyone."""
    metrics = [next(iter(r.metric_records.values())) for r in records]
    by_key: dict[str, list[tuple[float, object]]] = {}
    for m in metrics:
        weight = float(m[weighting_key])
        for key, value in m.items():
            if key != weighting_key and _finite_metric(value):
                by_key.setdefault(key, []).append((weight, value))
    out = MetricRecord()
    for key, entries in sorted(by_key.items()):
        shapes = [len(v) if isinstance(v, list) else -1 for _, v in entries]
        shape = max(sorted(set(shapes)), key=shapes.count)
        kept = [(w, v) for (w, v), n in zip(entries, shapes) if n == shape]
        total = math.fsum(w for w, _ in kept)
        if total <= 0:
            continue
        if shape < 0:
            out[key] = math.fsum(w / total * float(v) for w, v in kept)
        else:
            out[key] = [math.fsum(w / total * float(v[i]) for w, v in kept) for i in range(shape)]
    return out


def _finite_metric(value) -> bool:
    """A finite number, or a non-empty list of them (not a bool: a flag is no quantity to average)."""
    values = value if isinstance(value, list) else [value]
    return bool(values) and all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                                for v in values)


def _array_view(array: Array) -> np.ndarray:
    """The values of a reply's ``Array``, read-only and sharing the message's bytes: no second
    copy of every client model while the round is aggregated (``Array.numpy()`` copies). The
    ``.npy`` header is read and checked as ``np.load`` does; Fortran-ordered or object arrays
    and other encodings fall back to ``Array.numpy()``."""
    data = array.data
    if array.stype != "numpy.ndarray" or not isinstance(data, bytes):
        return array.numpy()
    stream = io.BytesIO(data)
    version = np.lib.format.read_magic(stream)
    readers = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}
    if version not in readers:
        return array.numpy()
    shape, fortran_order, dtype = readers[version](stream)
    if fortran_order or dtype.hasobject:
        return array.numpy()
    count = math.prod(shape)
    offset = stream.tell()
    if len(data) - offset != count * dtype.itemsize:
        raise ValueError(f"{len(data) - offset} data bytes for shape {shape} of {dtype}")
    return np.frombuffer(data, dtype=dtype, count=count, offset=offset).reshape(shape)


def _as_tensor(value: np.ndarray) -> torch.Tensor:
    """``torch.from_numpy`` of a read-only view (aggregation never writes into its inputs)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "The given NumPy array is not writable"
        return torch.from_numpy(value)


def _tensor_views(arrays: ArrayRecord) -> dict[str, torch.Tensor]:
    """``arrays.to_torch_state_dict()`` without copying the bytes (see :func:`_array_view`)."""
    return {key: _as_tensor(_array_view(array)) for key, array in arrays.items()}


def _array_record_names(content: RecordDict) -> list[str]:
    """Names of the ArrayRecords in ``content``. Not ``content.array_records``: that view is a
    reference cycle, so it would keep the reply's bytes alive until the next garbage collection."""
    return [name for name, record in content.items() if isinstance(record, ArrayRecord)]


REASON_CHARS = 300  # of a reason logged and recorded: a client's error text cannot flood the log


def _reason(error: Exception) -> str:
    text = str(error) if isinstance(error, ReplyError) else f"{type(error).__name__}: {error}"
    return text if len(text) <= REASON_CHARS else text[:REASON_CHARS] + f"… ({len(text)} characters)"


def _non_finite_keys(state: dict) -> list[str]:
    return [k for k, v in state.items() if v.is_floating_point() and not torch.isfinite(v).all()]


def _with_weight(content: RecordDict, weight: float, key: str) -> RecordDict:
    """``content`` whose single MetricRecord carries ``key = weight`` (the capped count)."""
    name, metrics = next(iter(content.metric_records.items()))
    return RecordDict({name: MetricRecord({**metrics, key: weight})})


def _log_keep_best(server_round: int, what: str, split: str, result) -> None:
    """One log line for a keep-best server step (refinement, distillation) scored on ``split``; a
    warning when it diverged."""
    log(INFO, "round %d: %s, %s proxy loss %.4f -> %.4f (step %d)", server_round, what, split,
        result.initial_loss, result.best_loss, result.best_step)
    diverged = getattr(result, "diverged_step", 0)  # a user's own distill result may not carry it
    if diverged:
        log(WARNING, "round %d: %s diverged at step %d (non-finite loss); the best state before it is kept",
            server_round, what, diverged)


_KEYWORD_DEFAULTS = {name: p.default for name, p in inspect.signature(AlignedFedAvg.__init__).parameters.items()}
