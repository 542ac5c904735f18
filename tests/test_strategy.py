"""AlignedFedAvg on fabricated Flower 1.41 replies (no simulation, no network)."""

from __future__ import annotations

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
from flwr.supercore.task_identity import TaskIdentity

from fedbasin.alignment import (
    apply_group,
    canonicalize,
    random_group_element,
    shares_basis,
    to_gauge,
)
from fedbasin.strategies import AlignedFedAvg
from tests.helpers import GPT, VIT, inputs, rel_err, run, spec_of, trained_like

NODES = [11, 22, 33]


@pytest.fixture(autouse=True)
def serverapp_identity(monkeypatch):
    """Flower 1.41 creates instruction messages only inside a run: a ServerApp process sets
    ``TaskIdentity`` (run, task, node ids) first; do the same here."""
    for name, value in (("_run_id", 7), ("_task_id", 1), ("_node_id", 0)):
        monkeypatch.setattr(TaskIdentity, name, value)


class StubGrid:
    """The part of ``flwr.serverapp.Grid`` that ``FedAvg.configure_train`` uses."""

    def __init__(self, node_ids):
        self.node_ids = list(node_ids)

    def get_node_ids(self):
        return self.node_ids


def reply(
    node_id: int, arrays: ArrayRecord | None = None, num_examples=100, error: str | None = None
) -> Message:
    """A reply as a ClientApp's ``Message(content, reply_to=instruction)`` arrives at the server."""
    instruction = Message(
        RecordDict({"config": ConfigRecord()}), dst_node_id=node_id, message_type=MessageType.TRAIN
    )
    if error is not None:
        return Message(Error(code=0, reason=error), reply_to=instruction)
    metrics = MetricRecord({"train_loss": 0.5, "num-examples": num_examples})
    return Message(RecordDict({"arrays": arrays, "metrics": metrics}), reply_to=instruction)


def base_state() -> dict:
    return {
        k: v.detach().clone()
        for k, v in trained_like("vit", VIT, seed=0, dtype=torch.float32).state_dict().items()
    }


def transformed_copies(
    spec, state: dict, count: int, mode: str = "orthogonal", noise: float = 1e-5
) -> list[dict]:
    """Function-equivalent copies of ``state`` (random exact group elements) plus tiny noise."""
    g = torch.Generator().manual_seed(1)
    canonical = canonicalize(spec, state).state
    copies = []
    for _ in range(count):
        element = random_group_element(spec, g, mode=mode, dtype=torch.float32)
        copy = apply_group(spec, canonical, element)
        copies.append({k: v + noise * torch.randn(v.shape, generator=g) for k, v in copy.items()})
    return copies


def strategy_for(spec, global_state: dict, **options) -> AlignedFedAvg:
    strategy = AlignedFedAvg(
        spec, min_train_nodes=len(NODES), min_available_nodes=len(NODES), **options
    )
    messages = list(
        strategy.configure_train(1, ArrayRecord(global_state), ConfigRecord(), StubGrid(NODES))
    )
    assert sorted(m.metadata.dst_node_id for m in messages) == NODES
    assert messages[0].content["config"]["server-round"] == 1
    return strategy


@pytest.mark.parametrize("mode", ["orthogonal", "permutation"])
def test_transformed_copies_merge_to_the_original_function(mode):
    spec = spec_of("vit", VIT)
    base = base_state()
    copies = transformed_copies(spec, base, len(NODES), mode)
    x, _ = inputs("vit", VIT, dtype=torch.float32)
    expected = run("vit", VIT, base, x, torch.float32)
    replies = [
        reply(n, ArrayRecord(s), num_examples=100 + i)
        for i, (n, s) in enumerate(zip(NODES, copies))
    ]

    # round 2: the previous global model (here: the original) is the alignment target
    aligned = strategy_for(spec, base, mode=mode)
    arrays, metrics = aligned.aggregate_train(2, replies)
    merged = arrays.to_torch_state_dict()
    assert rel_err(run("vit", VIT, merged, x, torch.float32), expected) < 1e-3
    assert metrics["num_excluded"] == 0 and metrics["align_gain"] > 0
    assert {"train_loss", "align_seconds", "aggregate_seconds"} <= set(metrics)
    assert all(
        merged[k].dtype == torch.float32 and merged[k].shape == v.shape for k, v in base.items()
    )

    # round 1 with independent inits: aligned to the client with the most examples
    oneshot = strategy_for(spec, base_state(), mode=mode, independent_init=True)
    arrays, _ = oneshot.aggregate_train(1, replies)
    assert rel_err(run("vit", VIT, arrays.to_torch_state_dict(), x, torch.float32), expected) < 1e-3

    # plain FedAvg through the same path averages incompatible bases
    fedavg = strategy_for(spec, base, alignment=False)
    arrays, metrics = fedavg.aggregate_train(2, replies)
    assert rel_err(run("vit", VIT, arrays.to_torch_state_dict(), x, torch.float32), expected) > 0.1
    assert metrics["align_gain"] == 0.0


@pytest.mark.parametrize("mode", ["orthogonal", "permutation"])
def test_clients_that_kept_the_broadcast_basis_are_averaged_as_fedavg_does(mode):
    """Round 2: clients trained from the broadcast (here: it plus small noise) share its basis; the
    aligned strategy checks that (one permutation pass moves nothing) and returns FedAvg's aggregate
    bit for bit. ``already_aligned="align"`` aligns anyway (another aggregate); clients in other
    bases (exact group elements of the broadcast) are aligned whatever the option says."""
    spec = spec_of("vit", VIT)
    base = base_state()
    g = torch.Generator().manual_seed(3)
    near = [{k: v + 0.02 * v.std() * torch.randn(v.shape, generator=g) for k, v in base.items()} for _ in NODES]
    replies = lambda states: [reply(n, ArrayRecord(s), num_examples=100 + 10 * i)  # noqa: E731
                              for i, (n, s) in enumerate(zip(NODES, states))]

    def aggregate(states, **options):
        arrays, metrics = strategy_for(spec, base, **options).aggregate_train(2, replies(states))
        return {k: a.numpy().tobytes() for k, a in arrays.items()}, metrics

    fedavg, _ = aggregate(near, alignment=False)
    averaged, metrics = aggregate(near, mode=mode)
    assert averaged == fedavg and metrics["already_aligned"] == 1 and metrics["align_gain"] == 0.0
    aligned, metrics = aggregate(near, mode=mode, already_aligned="align")
    assert aligned != fedavg and "already_aligned" not in metrics

    moved = transformed_copies(spec, base, len(NODES), mode)
    aligned, metrics = aggregate(moved, mode=mode)
    assert aligned != aggregate(moved, alignment=False)[0]
    assert "already_aligned" not in metrics and metrics["align_gain"] > 0
    with pytest.raises(ValueError, match=r"^already_aligned='skip': expected one of average \| align$"):
        AlignedFedAvg(spec, already_aligned="skip")


def test_a_reply_the_cohort_rule_excludes_does_not_decide_whether_the_round_aligns():
    """One garbage reply among clients that kept the broadcast's basis: it is excluded, and the rest are averaged
    as FedAvg averages them without it (before, its mismatch forced the alignment path on everyone)."""
    spec = spec_of("vit", VIT)
    base = base_state()
    g = torch.Generator().manual_seed(3)
    near = [{k: v + 0.02 * v.std() * torch.randn(v.shape, generator=g) for k, v in base.items()} for _ in NODES]
    honest = [reply(n, ArrayRecord(s), num_examples=100 + 10 * i) for i, (n, s) in enumerate(zip(NODES, near))]
    garbage = reply(999, ArrayRecord({k: 100 * torch.randn(v.shape, generator=g) for k, v in base.items()}),
                    num_examples=100)  # noise in no basis: a permutation pass moves its units
    options = {"max_examples_ratio": 0.0}  # the counts as sent: the garbage reply's cannot move the honest weights
    arrays, metrics = strategy_for(spec, base, **options).aggregate_train(2, [*honest, garbage])
    fedavg, _ = strategy_for(spec, base, alignment=False, **options).aggregate_train(2, honest)
    assert metrics["excluded_nodes"] == [999] and metrics["already_aligned"] == 1
    assert {k: a.numpy().tobytes() for k, a in arrays.items()} == {k: a.numpy().tobytes() for k, a in fedavg.items()}


def test_shares_basis_tells_a_common_descent_from_other_bases():
    spec = spec_of("gpt", GPT)
    state = lambda seed: {k: v.detach().clone()  # noqa: E731
                          for k, v in trained_like("gpt", GPT, seed=seed, dtype=torch.float32).state_dict().items()}
    base, g = state(1), torch.Generator().manual_seed(0)
    near = {k: v + 0.01 * v.std() * torch.randn(v.shape, generator=g) for k, v in base.items()}
    permuted = apply_group(spec, canonicalize(spec, base).state,
                           random_group_element(spec, g, mode="permutation", dtype=torch.float32))
    before = {k: v.clone() for k, v in near.items()}
    assert shares_basis(spec, base, base) and shares_basis(spec, base, near)
    assert not shares_basis(spec, base, permuted) and not shares_basis(spec, base, state(2))
    assert all(torch.equal(near[k], v) for k, v in before.items())  # the inputs are not changed


def test_plain_fedavg_is_the_example_weighted_mean():
    spec = spec_of("vit", VIT)
    base = base_state()
    states = [{k: v + i for k, v in base.items()} for i in range(3)]
    strategy = strategy_for(spec, base, alignment=False, max_examples_ratio=0.0)  # no count cap: the weights are the counts
    arrays, _ = strategy.aggregate_train(
        1, [reply(n, ArrayRecord(s), w) for n, s, w in zip(NODES, states, (1, 1, 2))]
    )
    merged = arrays.to_torch_state_dict()
    for key, value in base.items():
        torch.testing.assert_close(merged[key], value + 1.25)


def corrupt(state: dict, how: str) -> ArrayRecord:
    key = "blocks.0.attn.q.weight"
    state = dict(state)
    if how == "shape":
        state[key] = state[key][:, :-1]
    elif how == "nan":
        state[key] = state[key].clone()
        state[key][0, 0] = float("nan")
    elif how == "missing":
        del state[key]
    elif how == "extra":
        state["unexpected.weight"] = torch.zeros(2)
    elif how == "dtype":
        state[key] = state[key].double()
    elif how == "zero-gain":
        state["blocks.0.norm1.weight"] = torch.zeros_like(state["blocks.0.norm1.weight"])
        state["blocks.0.norm1.bias"] = torch.ones_like(state["blocks.0.norm1.bias"])
    arrays = ArrayRecord(state)
    if how == "bytes":
        arrays[key] = Array(
            dtype="float32", shape=tuple(state[key].shape), stype="numpy.ndarray", data=b"garbage"
        )
    return arrays


def test_malformed_replies_are_excluded_and_the_round_goes_on(caplog):
    spec = spec_of("vit", VIT)
    base = base_state()
    good = transformed_copies(spec, base, 2)
    bad = {
        101: reply(101, corrupt(base, "shape")),
        102: reply(102, corrupt(base, "nan")),
        103: reply(103, corrupt(base, "missing")),
        104: reply(104, ArrayRecord(base), num_examples=0),
        105: reply(105, corrupt(base, "extra")),
        106: reply(106, corrupt(base, "dtype")),
        107: reply(107, corrupt(base, "bytes")),
        108: reply(108, error="ClientApp raised"),
        109: reply(109, ArrayRecord(base), num_examples=float("nan")),
        110: reply(110, corrupt(base, "zero-gain")),
    }
    replies = [
        reply(NODES[0], ArrayRecord(good[0])),
        *bad.values(),
        reply(NODES[1], ArrayRecord(good[1])),
    ]
    strategy = strategy_for(spec, base)
    with caplog.at_level("WARNING", logger="flwr"):
        arrays, metrics = strategy.aggregate_train(3, replies)
    assert arrays is not None
    assert metrics["num_excluded"] == len(bad)
    assert sorted(metrics["excluded_nodes"]) == sorted(bad)
    x, _ = inputs("vit", VIT, dtype=torch.float32)
    expected = run("vit", VIT, base, x, torch.float32)
    assert rel_err(run("vit", VIT, arrays.to_torch_state_dict(), x, torch.float32), expected) < 1e-3
    log = caplog.text
    for node, reason in [
        (101, "shape"),
        (102, "NaN"),
        (103, "missing"),
        (104, "num-examples=0"),
        (105, "unexpected"),
        (106, "dtype"),
        (107, "cannot decode"),
        (108, "ClientApp raised"),
        (109, "num-examples=nan"),
        (110, "cannot fold"),
    ]:
        line = next((ln for ln in log.splitlines() if f"node {node}:" in ln), "")
        assert reason in line, f"node {node}: expected {reason!r} in the log, got {line!r}"


def test_all_replies_bad_keeps_the_previous_model():
    spec = spec_of("vit", VIT)
    base = base_state()
    strategy = strategy_for(spec, base)
    arrays, metrics = strategy.aggregate_train(
        1, [reply(1, corrupt(base, "nan")), reply(2, error="boom")]
    )
    assert arrays is None  # Flower keeps broadcasting the previous global model
    assert metrics["round_failed"] == 1 and metrics["excluded_nodes"] == [1, 2]
    assert strategy.screening[1]["failed"] == "no valid replies"
    arrays, metrics = strategy.aggregate_train(2, [])
    assert arrays is None and metrics["round_failed"] == 1 and metrics["num_excluded"] == 0


def test_evaluate_replies_without_examples_are_excluded():
    strategy = AlignedFedAvg(spec_of("vit", VIT))
    instruction = Message(RecordDict(), dst_node_id=5, message_type=MessageType.EVALUATE)
    good = Message(
        RecordDict({"m": MetricRecord({"eval_loss": 1.0, "num-examples": 10})}),
        reply_to=instruction,
    )
    bad = Message(RecordDict({"m": MetricRecord({"eval_loss": 9.0})}), reply_to=instruction)
    metrics = strategy.aggregate_evaluate(1, [good, bad])
    assert metrics["eval_loss"] == pytest.approx(1.0)
    assert strategy.aggregate_evaluate(1, [bad]) is None


def test_universe_matching_and_server_side_refinement_keep_the_function():
    """Universe matching re-aligns to the running average; server-side refinement is wired in."""
    import torch.nn.functional as F

    from fedbasin.alignment import learned_refine
    from fedbasin.models import build_model

    spec = spec_of("vit", VIT)
    base = base_state()
    copies = transformed_copies(spec, base, len(NODES))
    replies = [reply(n, ArrayRecord(s)) for n, s in zip(NODES, copies)]

    # noisier copies move the average away from the reference: universe matching re-aligns
    noisy = [reply(n, ArrayRecord(s)) for n, s in zip(NODES, transformed_copies(spec, base, len(NODES), noise=2e-3))]
    universe = strategy_for(spec, base, universe_iterations=3)
    arrays, metrics = universe.aggregate_train(2, noisy)
    assert metrics["universe_passes"] >= 2  # what the passes do to trained clients: tests/test_universe.py

    proxy_x = torch.rand(40, 1, 8, 8)
    with torch.no_grad():
        proxy_y = run("vit", VIT, base, proxy_x, torch.float32).argmax(-1)

    def batches():
        while True:
            yield proxy_x[:32], proxy_y[:32]

    calls, results = [], []

    def refine(reference, clients, include_reference):
        calls.append((len(clients), include_reference))
        results.append(learned_refine(spec, build_model("vit", VIT), reference, clients, loss_fn=F.cross_entropy,
                              batches=batches(), selection=(proxy_x[32:], proxy_y[32:]), steps=4, eval_every=2,
                              include_reference=include_reference))
        return results[-1]

    refined = strategy_for(spec, base, refine=refine)
    arrays, metrics = refined.aggregate_train(2, replies)
    # the previous global model is only the alignment target (weight 0): every client is refined, in a
    # mixture without the global model
    assert calls == [(len(NODES), False)]
    # the round's model is the example-weighted mean of the refined clients, in the global model's gauge
    # (what refinement gains on unseen data: tests/test_refine_selection.py)
    result = results[0]
    canonical = [canonicalize(spec, s).state for s in result.states]
    expected_state = to_gauge(spec, {k: sum(c[k] for c in canonical) / len(canonical) for k in base},
                              canonicalize(spec, base).gains)
    torch.testing.assert_close(arrays.to_torch_state_dict(), expected_state, rtol=1e-5, atol=1e-6)
    assert metrics["refine_heldout_loss"] == pytest.approx(result.best_loss)
    assert metrics["align_gain"] == pytest.approx(result.initial_loss - result.best_loss)
