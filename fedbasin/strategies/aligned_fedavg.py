"""FedAvg whose aggregation first maps every client model into one basis (fedbasin.alignment).

Per round, with client states ``θ_k`` and example counts ``n_k``:

* alignment off: ``θ = Σ_k n_k θ_k / Σ_k n_k`` (plain FedAvg);
* alignment on: ``θ = Σ_k n_k g_k·θ_k / Σ_k n_k`` where ``g_k`` is the exact, function-preserving
  group element maximising ``⟨θ_ref, g·θ_k⟩`` (weight matching). The reference ``θ_ref`` is the
  previous global model, present only as the alignment target (weight 0); in round 1 with
  independently initialised clients it is the client with the most examples. The result is in
  the reference's gauge.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from logging import INFO, WARNING

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg, Result

from fedbasin.alignment import SymmetrySpec, average_states, canonicalize, merge, refined_merge

MODES = ("orthogonal", "permutation")


class ReplyError(ValueError):
    """A client reply that cannot be aggregated; the message says why."""


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
    refine : callable, optional
        Server-side learned refinement, ``refine(reference_state, other_states,
        include_reference=...)`` returning a
        :class:`~fedbasin.alignment.RefineResult` (the ServerApp binds the model and its proxy
        split into it, e.g. ``functools.partial(learned_refine, spec, model, ...)``). The
        refined, canonical client models are averaged instead of the weight-matched ones.
    **kwargs
        ``FedAvg`` options (``fraction_train``, ``min_train_nodes``, ...).

    Every reply is checked against the broadcast model (same keys, shapes and dtypes, finite
    values, one MetricRecord with a positive ``num-examples``); a failing reply is excluded with
    a log line naming the node and the reason, and the round goes on. ``aggregate_train``
    returns the merged arrays and metrics: the clients' weighted train metrics plus
    ``align_gain`` (mean increase of the matching objective), ``align_seconds``,
    ``aggregate_seconds``, ``num_excluded`` and ``excluded_nodes``. ``train_metrics`` and
    ``evaluate_metrics`` keep the aggregated metrics by round as they arrive (for per-round
    records while ``start`` runs).
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
        refine=None,
        **kwargs,
    ) -> None:
        super().__init__(**kwargs)
        if mode not in MODES:
            raise ValueError(f"symmetry mode must be one of {MODES}, got {mode!r}")
        if spec.tied and alignment:
            log(WARNING, "%s: alignment unties %s (the final norm's gain is folded into the head, "
                "which an orthogonal residual map cannot keep equal to the embedding); from round 2 "
                "the global model carries both tensors, so clients must build untied models "
                "(tie_word_embeddings=False / tie_embeddings=False) - replies from tied models "
                "are excluded", spec.name, ", ".join(f"{b} = {a}" for a, b in spec.tied))
        for name, value in (("iterations", iterations), ("universe_iterations", universe_iterations)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if not (isinstance(tol, (int, float)) and math.isfinite(tol) and tol >= 0):
            raise ValueError(f"tol must be a finite number >= 0, got {tol!r}")
        if refine is not None and not callable(refine):
            raise ValueError(f"refine must be callable (e.g. a partial of learned_refine), got {refine!r}")
        if refine is not None and not alignment:
            raise ValueError("refine needs alignment: plain FedAvg (alignment=False) would ignore it")
        self.spec = spec
        self.alignment = alignment
        self.mode = mode
        self.iterations = iterations
        self.tol = tol
        self.independent_init = independent_init
        self.universe_iterations = universe_iterations
        self.refine = refine
        self.train_metrics: dict[int, MetricRecord] = {}
        self.evaluate_metrics: dict[int, MetricRecord] = {}
        self._global: ArrayRecord | None = None
        self._round_offset = 0

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
        """Validate, align to the reference, and average weighted by ``num-examples``."""
        t0 = time.perf_counter()
        server_round += self._round_offset
        if self._global is None:
            raise RuntimeError(
                "aggregate_train needs the broadcast model: call configure_train first"
            )
        template = self._global
        states, weights, contents, excluded = [], [], [], []
        for msg in replies:
            node = msg.metadata.src_node_id
            try:
                weight = self._num_examples(msg)
                state = self._checked_state(msg, template)
            except ReplyError as error:
                log(
                    WARNING, "round %d: excluding reply from node %d: %s", server_round, node, error
                )
                excluded.append(node)
                continue
            states.append(state)
            weights.append(weight)
            contents.append(msg.content)
        log(
            INFO,
            "round %d: aggregating %d replies, %d excluded",
            server_round,
            len(states),
            len(excluded),
        )
        if not states:
            log(
                WARNING,
                "round %d: no valid replies; keeping the previous global model",
                server_round,
            )
            return None, None

        t_align = time.perf_counter()
        merged, align_metrics = self._merge(server_round, template, states, weights)
        align_seconds = time.perf_counter() - t_align
        arrays = ArrayRecord(
            {
                key: Array(merged[key].numpy().astype(template[key].dtype, copy=False))
                for key in template
            }
        )
        metrics = self._client_metrics(server_round, contents, self.train_metrics_aggr_fn)
        metrics.update(align_metrics)
        metrics["align_seconds"] = align_seconds
        metrics["aggregate_seconds"] = time.perf_counter() - t0
        metrics["num_excluded"] = len(excluded)
        metrics["excluded_nodes"] = excluded
        self.train_metrics[server_round] = metrics
        return arrays, metrics

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        """Example-weighted mean of the clients' evaluation metrics; bad replies are excluded."""
        server_round += self._round_offset
        contents = []
        for msg in replies:
            try:
                self._num_examples(msg)
            except ReplyError as error:
                log(
                    WARNING,
                    "round %d: excluding evaluation reply from node %d: %s",
                    server_round,
                    msg.metadata.src_node_id,
                    error,
                )
                continue
            contents.append(msg.content)
        if not contents:
            return None
        metrics = self._client_metrics(server_round, contents, self.evaluate_metrics_aggr_fn)
        self.evaluate_metrics[server_round] = metrics
        return metrics

    def _merge(
        self, server_round: int, previous: ArrayRecord, states: list, weights: list
    ) -> tuple[dict, dict]:
        """Merged state and alignment metrics (objective gain, universe passes run)."""
        if not self.alignment:
            return average_states(states, weights), {"align_gain": 0.0}
        if self.independent_init and server_round == 1:
            if len(states) == 1:
                return states[0], {"align_gain": 0.0}
            reference = max(range(len(weights)), key=weights.__getitem__)
        else:  # previous global model: alignment target only
            states, weights = [previous.to_torch_state_dict(), *states], [0.0, *weights]
            reference = 0
        if self.refine is not None:
            merged, refined = refined_merge(self.spec, states, weights, reference, self.refine)
            log(INFO, "round %d: learned refinement, held-out proxy loss %.4f -> %.4f (step %d)",
                server_round, refined.initial_loss, refined.best_loss, refined.best_step)
            return merged, {"align_gain": refined.initial_loss - refined.best_loss,
                            "refine_heldout_loss": refined.best_loss}
        result = merge(self.spec, states, weights, reference, self.mode, self.iterations, self.tol,
                       universe_iterations=self.universe_iterations)
        gains = [m.objective[-1] - m.initial_objective for m in result.matches]
        return result.state, {"align_gain": float(sum(gains) / len(gains)) if gains else 0.0,
                              "universe_passes": len(result.universe_change)}

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
        records = msg.content.array_records
        if len(records) != 1:
            raise ReplyError(f"expected exactly one ArrayRecord, got {len(records)}")
        arrays = next(iter(records.values()))
        missing = [k for k in template if k not in arrays]
        if missing:
            raise ReplyError(f"missing array(s) {missing[:5]}")
        unexpected = [k for k in arrays if k not in template]
        if unexpected:
            raise ReplyError(f"unexpected array(s) {unexpected[:5]}")
        state = {}
        for key, expected in template.items():
            try:
                value = arrays[key].numpy()
            except Exception as error:  # undecodable bytes, unknown serialisation type
                raise ReplyError(f"{key}: cannot decode array ({error})") from error
            if value.shape != tuple(expected.shape):
                raise ReplyError(f"{key}: shape {value.shape}, expected {tuple(expected.shape)}")
            if str(value.dtype) != expected.dtype:
                raise ReplyError(f"{key}: dtype {value.dtype}, expected {expected.dtype}")
            if value.dtype.kind in "fc" and not np.isfinite(value).all():
                raise ReplyError(f"{key}: contains NaN or infinite values")
            state[key] = torch.from_numpy(value)
        self._check_untied(state, template)
        if self.alignment:  # e.g. a zero norm gain over a non-zero bias cannot be folded
            try:
                canonicalize(self.spec, state, validate=False)
            except ValueError as error:
                raise ReplyError(str(error)) from error
        return state

    def _client_metrics(self, server_round: int, contents: list, aggregate) -> MetricRecord:
        """The clients' metrics, combined by ``aggregate`` (``FedAvg``'s weighted mean by default)."""
        try:
            return aggregate(contents, self.weighted_by_key)
        except (TypeError, ValueError) as error:  # e.g. a metric that is a list on one client only
            log(
                WARNING,
                "round %d: cannot aggregate client metrics (%s); skipping them",
                server_round,
                error,
            )
            return MetricRecord()
