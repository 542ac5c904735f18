"""Property-based tests (hypothesis): malformed client replies never reach the global model.

Replies are fabricated Flower Messages fed to ``AlignedFedAvg.aggregate_train`` directly (no
simulation). Properties: every malformed reply is excluded with a reason naming its node, the
round completes, the aggregate of honest + malformed replies equals the aggregate of the honest
ones alone, and with only malformed replies the round fails and keeps the previous model.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Error,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers import VIT, spec_of
from tests.test_strategy import (  # noqa: F401
    base_state,
    reply,
    serverapp_identity,
    strategy_for,
    transformed_copies,
)

HONEST = [11, 22, 33]
PROPERTY = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@functools.cache
def world():
    spec = spec_of("vit", VIT)
    base = base_state()
    return spec, base, transformed_copies(spec, base, len(HONEST), noise=1e-3)


def honest_replies() -> list[Message]:
    _, _, copies = world()
    return [reply(n, ArrayRecord(s), num_examples=100 + 10 * i) for i, (n, s) in enumerate(zip(HONEST, copies))]


def raw_reply(node: int, content: RecordDict) -> Message:
    instruction = Message(RecordDict({"config": ConfigRecord()}), dst_node_id=node, message_type=MessageType.TRAIN)
    return Message(content, reply_to=instruction)


# -- malformed replies: (kind, reply, words one of which the exclusion reason must contain) ---------

@st.composite
def malformed(draw, node: int):
    _, base, _ = world()
    state = {k: v.clone() for k, v in base.items()}
    keys = sorted(state)
    key = draw(st.sampled_from(keys))
    kind = draw(st.sampled_from(["scale", "nonfinite", "shape", "dtype", "missing", "extra", "bytes",
                                 "num-examples", "records", "error"]))
    num_examples = 100
    expect = ()
    if kind == "scale":  # finite but huge: screened before any arithmetic
        factor = 10.0 ** draw(st.integers(8, 37))
        for k in draw(st.lists(st.sampled_from(keys), min_size=1, max_size=4, unique=True)) + ["head.weight"]:
            state[k] = state[k] * factor
        expect = ("max_abs_weight", "infinite")
    elif kind == "nonfinite":
        flat = state[key].flatten().clone()
        flat[draw(st.integers(0, flat.numel() - 1))] = draw(st.sampled_from([float("nan"), float("inf"), -float("inf")]))
        state[key] = flat.reshape(state[key].shape)
        expect = ("NaN or infinite",)
    elif kind == "shape":
        extra = draw(st.integers(1, 3))
        state[key] = torch.zeros(*state[key].shape[:-1], state[key].shape[-1] + extra)
        expect = ("shape",)
    elif kind == "dtype":
        state[key] = state[key].to(draw(st.sampled_from([torch.float64, torch.float16, torch.int32])))
        expect = ("dtype",)
    elif kind == "missing":
        for k in draw(st.lists(st.sampled_from(keys), min_size=1, max_size=len(keys), unique=True)):
            del state[k]
        expect = ("missing",)
    elif kind == "extra":
        name = draw(st.text("abcxyz._", min_size=1, max_size=12).filter(lambda s: s not in base))
        state[name] = torch.zeros(draw(st.integers(1, 4)))
        expect = ("unexpected",)
    elif kind == "num-examples":
        num_examples = draw(st.one_of(
            st.integers(-10**6, 0), st.floats(max_value=0.0), st.sampled_from([float("nan"), float("inf")]),
            st.lists(st.integers(1, 5), min_size=1, max_size=3), st.none(),
        ))
        expect = ("num-examples",)
    arrays = ArrayRecord(state)
    if kind == "bytes":
        junk = draw(st.binary(max_size=64))
        arrays[key] = Array(dtype="float32", shape=tuple(base[key].shape), stype="numpy.ndarray", data=junk)
        expect = ("cannot decode",)
    if kind == "error":
        reason = draw(st.text(min_size=1, max_size=30))
        return kind, reply(node, error=reason), ("client error",)
    if kind == "records":
        metrics = MetricRecord({"num-examples": 100})
        content = draw(st.sampled_from([
            RecordDict({"a": arrays, "b": arrays, "m": metrics}),
            RecordDict({"m": metrics}),
            RecordDict({"a": arrays, "m": metrics, "n": metrics}),
            RecordDict({"a": arrays}),
        ]))
        return kind, raw_reply(node, content), ("ArrayRecord", "MetricRecord")
    if num_examples is None:
        return kind, raw_reply(node, RecordDict({"a": arrays, "m": MetricRecord({"loss": 1.0})})), ("lacks",)
    return kind, reply(node, arrays, num_examples=num_examples), expect


@st.composite
def malformed_batch(draw):
    count = draw(st.integers(1, 4))
    return [draw(malformed(100 + i)) for i in range(count)]


def assert_excluded_with_reasons(strategy, server_round: int, batch):
    excluded = {e["node"]: e["reason"] for e in strategy.screening[server_round]["excluded"]}
    for i, (kind, _, words) in enumerate(batch):
        node = 100 + i
        assert node in excluded, f"{kind} reply from node {node} was not excluded"
        assert any(w in excluded[node] for w in words), f"{kind}: reason {excluded[node]!r} lacks {words}"


@functools.cache
def honest_aggregate(alignment: bool) -> dict:
    spec, base, _ = world()
    arrays, metrics = strategy_for(spec, base, alignment=alignment).aggregate_train(2, honest_replies())
    assert metrics["num_excluded"] == 0
    return arrays.to_torch_state_dict()


@PROPERTY
@given(batch=malformed_batch(), alignment=st.booleans(), position=st.integers(0, 3))
def test_malformed_replies_are_excluded_and_do_not_change_the_aggregate(batch, alignment, position):
    spec, base, _ = world()
    replies = honest_replies()
    replies[position:position] = [message for _, message, _ in batch]
    strategy = strategy_for(spec, base, alignment=alignment)
    arrays, metrics = strategy.aggregate_train(2, replies)
    assert metrics["round_failed"] == 0 and metrics["num_excluded"] == len(batch)
    assert_excluded_with_reasons(strategy, 2, batch)
    merged = arrays.to_torch_state_dict()
    for key, value in honest_aggregate(alignment).items():
        torch.testing.assert_close(merged[key], value, rtol=1e-6, atol=1e-7)


@PROPERTY
@given(batch=malformed_batch())
def test_only_malformed_replies_fail_the_round_and_keep_the_model(batch):
    spec, base, _ = world()
    strategy = strategy_for(spec, base)
    arrays, metrics = strategy.aggregate_train(3, [message for _, message, _ in batch])
    assert arrays is None and metrics["round_failed"] == 1
    assert sorted(metrics["excluded_nodes"]) == [100 + i for i in range(len(batch))]
    assert_excluded_with_reasons(strategy, 3, batch)
    assert strategy.screening[3]["failed"] == "no valid replies"


@PROPERTY
@given(repeats=st.lists(st.integers(0, len(HONEST) - 1), min_size=1, max_size=4), scale=st.floats(0.5, 4.0))
def test_a_node_counts_once_per_round(repeats, scale):
    """Later replies of a node that already replied are excluded, whatever they carry."""
    spec, base, copies = world()
    replies = honest_replies()
    for i in repeats:
        replies.append(reply(HONEST[i], ArrayRecord({k: v * scale for k, v in copies[i].items()}), num_examples=10**5))
    strategy = strategy_for(spec, base, alignment=False)
    arrays, metrics = strategy.aggregate_train(2, replies)
    reasons = [e["reason"] for e in strategy.screening[2]["excluded"]]
    assert metrics["excluded_nodes"] == [HONEST[i] for i in repeats] and len(reasons) == len(repeats) and all("duplicate reply" in r and "first reply" in r for r in reasons)
    for key, value in honest_aggregate(False).items():
        torch.testing.assert_close(arrays.to_torch_state_dict()[key], value)


def test_a_node_whose_first_reply_is_bad_gets_no_second_try():
    """The first reply is the node's, usable or not: a later variant from the same node is excluded as well,
    so a node cannot probe the screening within a round. The round equals one without that node."""
    spec, base, copies = world()
    broken = {k: v.clone() for k, v in copies[0].items()}
    broken["head.weight"][0, 0] = float("nan")
    replies = honest_replies()
    retried = [reply(HONEST[0], ArrayRecord(broken), num_examples=100), *replies]
    strategy = strategy_for(spec, base, alignment=False)
    arrays, metrics = strategy.aggregate_train(2, retried)
    assert metrics["excluded_nodes"] == [HONEST[0], HONEST[0]]
    without, _ = strategy_for(spec, base, alignment=False).aggregate_train(2, replies[1:])
    for key, value in without.to_torch_state_dict().items():
        torch.testing.assert_close(arrays.to_torch_state_dict()[key], value)


def test_issue_examples_huge_finite_weights_and_example_counts(caplog):
    """The reported attacks: a reply ×1e30 (finite) and example counts 1e12 / 1e308."""
    spec, base, copies = world()
    scaled = {k: v * 1e30 for k, v in copies[0].items()}
    assert all(torch.isfinite(v).all() for v in scaled.values())
    replies = [*honest_replies(), reply(44, ArrayRecord(scaled))]
    strategy = strategy_for(spec, base)
    with caplog.at_level("WARNING", logger="flwr"):
        arrays, metrics = strategy.aggregate_train(2, replies)
    assert metrics["excluded_nodes"] == [44] and "node 44:" in caplog.text and "max_abs_weight" in caplog.text
    torch.testing.assert_close(arrays.to_torch_state_dict()["head.weight"], honest_aggregate(True)["head.weight"])

    # two nodes claim 1e308 examples: capped at max_examples_ratio (1) × the lower median count
    # (the 2nd smallest of four: 100), the mean stays finite and exact
    states = [{k: v + i for k, v in base.items()} for i in range(4)]
    counts = [100, 100, 1e308, 1e308]
    strategy = strategy_for(spec, base, alignment=False, outlier_threshold=0.0)
    arrays, metrics = strategy.aggregate_train(2, [reply(n, ArrayRecord(s), c) for n, s, c in zip((1, 2, 3, 4), states, counts)])
    assert metrics["capped_nodes"] == [3, 4]
    expected = (0 + 1 + 2 + 3) / 4
    for key, value in base.items():
        torch.testing.assert_close(arrays.to_torch_state_dict()[key], value + expected)


def test_a_failing_or_non_finite_merge_keeps_the_previous_model(monkeypatch, caplog):
    spec, base, _ = world()
    import fedbasin.strategies.aligned_fedavg as module

    real_merge = module.merge

    def nan_merge(*args, **kwargs):
        result = real_merge(*args, **kwargs)
        result.state["head.bias"] = result.state["head.bias"] * float("nan")
        return result

    for broken, words in ((nan_merge, "non-finite values in ['head.bias']"),
                          (lambda *a, **k: np.linalg.svd(np.full((2, 2), np.nan)), "LinAlgError")):
        monkeypatch.setattr(module, "merge", broken)
        strategy = strategy_for(spec, base)
        with caplog.at_level("WARNING", logger="flwr"):
            arrays, metrics = strategy.aggregate_train(2, honest_replies())
        assert arrays is None and metrics["round_failed"] == 1
        assert words in strategy.screening[2]["failed"] and "keeping the previous global model" in caplog.text


@pytest.mark.parametrize("bad", [float("nan"), [1.0, float("inf")], [0.1, 0.2], None])
def test_a_clients_bad_or_missing_metric_leaves_the_others_mean(bad):
    """A non-finite, odd-shaped or missing value of one client is left out of that metric's mean, whose weights
    are renormalised over the clients that report it: the metric is neither diluted nor lost for everyone."""
    spec, base, _ = world()
    replies = honest_replies()
    for i, message in enumerate(replies):
        message.content["metrics"]["train_loss"] = float(i + 1)  # 1, 2, 3 weighted 100, 110, 110 (120 capped)
    if bad is None:
        del replies[0].content["metrics"]["train_loss"]
    else:
        replies[0].content["metrics"]["train_loss"] = bad
    arrays, metrics = strategy_for(spec, base, alignment=False).aggregate_train(2, replies)
    assert arrays is not None and metrics["train_loss"] == pytest.approx((110 * 2 + 110 * 3) / 220)


def test_clients_cannot_report_the_servers_round_metrics_nor_flood_the_log(caplog):
    spec, base, _ = world()
    replies = honest_replies()
    for message in replies:
        message.content["metrics"].update({"already_aligned": 4.0, "num_clipped": 40.0, "refine_diverged_step": 4.0})
    instruction = Message(RecordDict({"config": ConfigRecord()}), dst_node_id=99, message_type=MessageType.TRAIN)
    replies.append(Message(Error(code=0, reason="x" * 100_000), reply_to=instruction))
    strategy = strategy_for(spec, base)
    with caplog.at_level("WARNING", logger="flwr"):
        arrays, metrics = strategy.aggregate_train(2, replies)
    assert arrays is not None and metrics["excluded_nodes"] == [99]
    assert {"already_aligned", "num_clipped", "refine_diverged_step"}.isdisjoint(metrics)
    reason = strategy.screening[2]["excluded"][0]["reason"]
    assert len(reason) < 400 and "100014 characters" in reason and len(caplog.text) < 5_000


def test_evaluation_counts_are_capped_and_deduplicated():
    spec, base, _ = world()
    strategy = strategy_for(spec, base)

    def evaluation(node, loss, n):
        instruction = Message(RecordDict(), dst_node_id=node, message_type=MessageType.EVALUATE)
        return Message(RecordDict({"m": MetricRecord({"eval_loss": loss, "num-examples": n})}), reply_to=instruction)

    metrics = strategy.aggregate_evaluate(
        1, [evaluation(1, 1.0, 10), evaluation(2, 1.0, 10), evaluation(3, 7.0, 10**12), evaluation(1, 99.0, 10)]
    )
    # node 3: 1e12 → 1e6 (absolute cap) → 1 × the lower median of (10, 10, 1e6) = 10; node 1's second
    # reply is dropped
    assert metrics["eval_loss"] == pytest.approx((10 + 10 + 70) / 30)
    # the cap is recorded once, as the evaluation's (a round's train and evaluate caps are told apart)
    assert strategy.screening[1]["capped"] == [{"node": 3, "stage": "evaluate", "num_examples": 10**12, "weight": 10}]


@pytest.mark.parametrize("gain, bias", [(1e-39, 1.0), (1e-30, 1e6)])
def test_norm_gains_too_small_for_their_biases_are_refused_before_the_merge(gain, bias):
    """A final norm with gains γ ~ 0 and biases β passes the raw checks, but folding it (β/γ) gives inf (the
    cohort's statistics turn NaN) or 1e36 (finite: averaged in, it would lock every later round out of
    max_abs_weight). The canonical form is held to the same bounds: the reply is excluded, the rest merge."""
    spec, base, copies = world()
    hostile = {k: v.clone() for k, v in copies[0].items()}
    hostile["norm_f.weight"][:] = gain
    hostile["norm_f.bias"][:] = bias
    for honest in (honest_replies(), honest_replies()[:1]):  # the cohort rule on (K = 4) and off (K = 2)
        strategy = strategy_for(spec, base)
        arrays, metrics = strategy.aggregate_train(2, [*honest, reply(44, ArrayRecord(hostile))])
        assert metrics["excluded_nodes"] == [44] and metrics["round_failed"] == 0
        assert "folding the norm gains" in strategy.screening[2]["excluded"][0]["reason"]
        expected, _ = strategy_for(spec, base).aggregate_train(2, honest)
        for key, value in expected.to_torch_state_dict().items():
            torch.testing.assert_close(arrays.to_torch_state_dict()[key], value)


def test_a_distance_that_is_not_finite_is_an_outlier():
    from fedbasin.strategies.robust import mad_outliers

    assert mad_outliers([1.0, 1.1, float("nan"), 0.9], 3.5) == [2]
    assert mad_outliers([1.0, float("inf"), 0.9, 1.05], 3.5) == [1]



@pytest.mark.parametrize("alignment", [False, True])
def test_replies_the_cohort_rule_excludes_do_not_move_the_count_cap(alignment):
    """Two far-off replies reporting n = 1 each would pull the lower-median cap of (1, 1, 100, 200, 300)
    to 100 and the honest weights to equal; the cap is taken over the replies the cohort rule keeps, so
    the aggregate and the recorded caps are those of the honest replies alone (cap 200)."""
    spec, base, copies = world()
    honest = [reply(n, ArrayRecord(s), num_examples=100 * (i + 1)) for i, (n, s) in enumerate(zip(HONEST, copies))]
    generator = torch.Generator().manual_seed(5)
    far = [reply(node, ArrayRecord({k: v + torch.randn(v.shape, generator=generator, dtype=v.dtype)
                                    for k, v in base.items()}), num_examples=1) for node in (44, 55)]
    strategy = strategy_for(spec, base, alignment=alignment)
    arrays, metrics = strategy.aggregate_train(2, [*honest, *far])
    assert sorted(metrics["excluded_nodes"]) == [44, 55] and metrics["round_failed"] == 0
    alone = strategy_for(spec, base, alignment=alignment)
    expected, expected_metrics = alone.aggregate_train(2, honest)
    assert strategy.screening[2]["capped"] == alone.screening[2]["capped"] == [
        {"node": 33, "stage": "train", "num_examples": 300, "weight": 200}]
    assert metrics["capped_nodes"] == expected_metrics["capped_nodes"] == [33]
    for key, value in expected.to_torch_state_dict().items():
        torch.testing.assert_close(arrays.to_torch_state_dict()[key], value)


def test_a_lone_reply_s_cap_is_recorded():
    """Round 1 of independently initialised clients with one usable reply: no cohort to screen, the
    model is that reply, and its capped count is still recorded."""
    spec, base, copies = world()
    strategy = strategy_for(spec, base, independent_init=True, max_num_examples=50)
    arrays, metrics = strategy.aggregate_train(1, [reply(11, ArrayRecord(copies[0]), num_examples=100)])
    assert metrics["capped_nodes"] == [11] and metrics["round_failed"] == 0
    assert strategy.screening[1]["capped"] == [{"node": 11, "stage": "train", "num_examples": 100, "weight": 50}]
