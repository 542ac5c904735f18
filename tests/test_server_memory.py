"""The strategy's memory savings keep its results: replies decoded as read-only views of their
bytes, cohort statistics accumulated chunk-wise; the benchmark's measurement path runs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord

from fedbasin.strategies import aligned_fedavg, robust
from tests.helpers import VIT, spec_of
from tests.test_strategy import NODES, base_state, reply, serverapp_identity, strategy_for  # noqa: F401


@pytest.mark.parametrize("value", [
    np.arange(12, dtype=np.float32).reshape(3, 4), np.float64(2.5) * np.ones(()), np.zeros((0, 5), np.float16),
    np.arange(7, dtype=np.int64), np.ones((2, 3, 4), dtype=np.float32)[:, ::2],
])
def test_reply_arrays_are_read_only_views_of_the_message_bytes(value):
    array = Array.from_numpy_ndarray(np.ascontiguousarray(value))
    view = aligned_fedavg._array_view(array)
    np.testing.assert_array_equal(view, array.numpy())
    assert view.dtype == array.numpy().dtype and view.shape == array.numpy().shape
    assert not view.flags.writeable  # shares the immutable bytes: no copy was made


def test_fortran_ordered_and_truncated_arrays():
    fortran = Array.from_numpy_ndarray(np.asfortranarray(np.arange(6.0).reshape(2, 3)))
    np.testing.assert_array_equal(aligned_fedavg._array_view(fortran), np.arange(6.0).reshape(2, 3))
    truncated = Array(dtype="float32", shape=(3, 4), stype="numpy.ndarray",
                      data=Array.from_numpy_ndarray(np.ones((3, 4), np.float32)).data[:-4])
    with pytest.raises(ValueError, match="data bytes for shape"):
        aligned_fedavg._array_view(truncated)


def _reference_statistics(states, center):
    """The cohort statistics computed on whole flattened models (the definition)."""
    flat = torch.stack([torch.cat([s[k].reshape(-1).double() for k in robust.float_keys(s)]) for s in states])
    others = [float((flat[k] - robust._median_rows(torch.cat([flat[:k], flat[k + 1:]]))).norm())
              for k in range(len(states))]
    center_flat = torch.cat([center[k].reshape(-1).double() for k in robust.float_keys(center)])
    return others, (flat - center_flat).norm(dim=1).tolist()


@pytest.mark.parametrize("chunk", [7, 1000, 2**20])
def test_chunked_cohort_screening_equals_the_whole_model_statistics(monkeypatch, chunk):
    g = torch.Generator().manual_seed(0)
    states = [{"w": torch.randn(40, 30, generator=g), "b": torch.randn(13, generator=g), "step": torch.tensor(3)}
              for _ in range(6)]
    states[4] = {k: v * 4 if v.is_floating_point() else v for k, v in states[4].items()}
    center = {k: 0.5 * v if v.is_floating_point() else v for k, v in states[0].items()}
    monkeypatch.setattr(robust, "CHUNK", chunk)
    assert sorted(robust.cohort_outliers(states, center, 3.5)) == [4]
    seen = []
    monkeypatch.setattr(robust, "mad_outliers", lambda values, *args: seen.append(values) or [])
    robust.cohort_outliers(states, center, 3.5)
    for got, want in zip(seen, _reference_statistics(states, center), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-12)


def test_benchmark_measures_one_aggregation(monkeypatch):
    from fedbasin.benchmarks import bench_server_memory as bench

    monkeypatch.setitem(bench.SHAPES, "small",
                        {"vocab_size": 50, "block_size": 8, "dim": 16, "depth": 1, "heads": 2, "mlp_dim": 32})
    row = bench.measure(3, iterations=1)
    assert row["clients"] == 3 and row["target"] == 6 and row["params"] > 0
    assert row["peak"] >= row["held"] - 0.5  # the peak is measured over the same baseline
    row = bench.measure(3, iterations=1, universe=2, aggregator="median", trace=True, distill_steps=1)
    assert row["universe_passes"] == 2 and row["distill_steps"] == 1
    assert {"weight_match", "aggregate", "merge", "distill"} <= {p["phase"] for p in row["phases"]}
    assert max(p["peak"] for p in row["phases"]) <= row["peak"] + 0.01


def test_the_strategy_aggregates_views_of_the_reply_bytes():
    """Screened reply states point into the message's bytes (no decoded copy of each model)."""
    state = base_state()
    strategy = strategy_for(spec_of("vit", VIT), state)
    arrays = ArrayRecord(state)
    decoded = strategy._checked_state(reply(NODES[0], arrays), strategy._global)
    for key, tensor in decoded.items():
        data = arrays[key].data
        start = np.frombuffer(data, np.uint8).ctypes.data
        assert start <= tensor.data_ptr() < start + len(data), key
        torch.testing.assert_close(tensor, state[key])


def _previous_merge(spec, states, weights, reference=0, combine=None):
    """What ``merge`` computed before streaming (one pass): every model canonicalised up front,
    each non-reference one weight-matched to the canonical reference, then combined. The
    reference's tiny-gain dims are folded alike in every model (``like=``: the canonical
    reference no longer carries its gains, canonical.py)."""
    from fedbasin.alignment import average_states, canonicalize, to_gauge, weight_match

    combine = combine or average_states
    ref = canonicalize(spec, states[reference], validate=False)
    canon = [canonicalize(spec, s, validate=False, like=ref.gains).state for s in states]
    aligned = [canon[k] if k == reference else
               weight_match(spec, ref.state, canon[k], iterations=3, like=ref.gains).canonical
               for k in range(len(states))]
    return to_gauge(spec, combine(aligned, weights), ref.gains)


def test_streamed_merge_equals_the_previous_merge_bitwise_and_releases_the_models():
    from fedbasin.alignment import merge
    from tests.test_strategy import transformed_copies

    spec = spec_of("vit", VIT)
    base = base_state()
    states = [base, *transformed_copies(spec, base, 3, noise=1e-3)]
    weights = [0.5, 1.0, 2.0, 3.0]
    expected = _previous_merge(spec, states, weights)
    for release in (False, True):
        given = [dict(s) for s in states]
        handed = list(given)
        result = merge(spec, given, weights, iterations=3, release=release)
        assert result.state.keys() == expected.keys()
        for key in expected:
            assert torch.equal(result.state[key], expected[key]), key
        if release:  # the caller's inputs and the aligned models are let go, dicts emptied
            assert given == [None] * 4 and handed == [{}] * 4
            assert all(m.state == {} and m.canonical == {} and m.objective for m in result.matches)
        else:
            assert all(a is b for a, b in zip(given, handed)) and all(len(h) == len(base) for h in handed)
            assert all(m.canonical for m in result.matches)


def _match_working_bytes(monkeypatch, live_tensor_bytes, spec, reference, make_candidate, **options):
    """(peak live tensor bytes above those before the call, result) of a weight_match whose
    candidate only the match holds; sampled after every group action and rotation."""
    import importlib

    matching = importlib.import_module("fedbasin.alignment.matching")
    samples = []

    def sampled(function):
        def wrapper(*args, **kwargs):
            out = function(*args, **kwargs)
            samples.append(live_tensor_bytes())
            return out
        return wrapper

    for name in ("apply_group", "contract_axis", "canonicalize"):
        monkeypatch.setattr(matching, name, sampled(getattr(matching, name)))
    before = live_tensor_bytes()
    result = matching.weight_match(spec, reference, make_candidate(), **options)
    monkeypatch.undo()
    return max(samples) - before, result


def test_weight_match_holds_one_state_and_one_step_beyond_its_inputs(monkeypatch, live_tensor_bytes):
    """Memory of one match whose candidate is handed over (``release``): the candidate's tensors
    as they are replaced by its current state, plus, while a step is tried, its successor —
    not the canonical copies of the reference and candidate, the start points, or each
    iteration's starting state (2.2 model sizes here, the candidate included; keeping any one
    of those, or the candidate's dict, measured 2.9–3.0). Same canonical result with and
    without ``release``."""
    from fedbasin.alignment import canonicalize, weight_match
    from tests.helpers import GPT
    from tests.test_strategy import transformed_copies

    config = dict(GPT, vocab_size=64, dim=32, mlp_dim=64)
    spec = spec_of("gpt", config)
    base = {k: v.detach().clone() for k, v in trained_like_float32(config).items()}
    reference = canonicalize(spec, base).state  # as the merge passes it (no copy may be made)
    size = sum(v.numel() * v.element_size() for v in base.values())
    candidate = lambda: transformed_copies(spec, base, 1, noise=1e-2)[0]  # noqa: E731  (only the match holds it)
    working, released = _match_working_bytes(monkeypatch, live_tensor_bytes, spec, reference, candidate, iterations=3, release=True)
    assert released.state == {}
    kept = weight_match(spec, reference, candidate(), iterations=3)
    for key in kept.canonical:
        assert torch.equal(released.canonical[key], kept.canonical[key]), key
    inner = sum(v.numel() * v.element_size() for k, v in base.items() if k.startswith("blocks."))
    square = config["dim"] ** 2 * 4  # d×d matrices: residual maps, covariances (large in a tiny model)
    assert working <= size + inner + 8 * square + 0.02 * size, (working / size, inner / size)


def trained_like_float32(config):
    from tests.helpers import trained_like

    return trained_like("gpt", config, seed=0, dtype=torch.float32).state_dict()


@pytest.mark.parametrize("chunk", [5, 64, 2**20])
@pytest.mark.parametrize("how", ["trimmed-mean", "median", "mean"])
def test_aggregators_in_blocks_and_releasing_their_inputs_equal_the_whole_tensor_ones(monkeypatch, chunk, how):
    """Row blocks (any CHUNK, non-contiguous inputs included) and ``release`` give bitwise the
    whole-tensor result; with ``release`` every input dict is emptied."""
    from fedbasin.alignment import average_states

    g = torch.Generator().manual_seed(0)
    states = [{"w": torch.randn(30, 7, generator=g).T, "b": torch.randn(13, generator=g),
               "s": torch.randn((), generator=g), "step": torch.tensor(3)} for _ in range(5)]
    weights = [1.0, 2.0, 0.5, 1.0, 3.0]
    whole = {}
    for key in ("w", "b", "s"):  # the definition: sort the stacked tensors at once
        stacked = torch.stack([s[key].double() for s in states]).sort(dim=0).values
        if how == "median":
            whole[key] = robust._median_rows(stacked).float()
        elif how == "trimmed-mean":
            whole[key] = stacked[1:4].mean(dim=0).float()
        else:
            whole[key] = average_states(states, weights)[key]
    monkeypatch.setattr(robust, "CHUNK", chunk)
    for release in (False, True):
        given = [dict(s) for s in states]
        out = robust.aggregate(given, weights, how, 0.25, average_states, release=release)
        assert out["step"] is states[0]["step"]
        for key in whole:
            assert torch.equal(out[key], whole[key]), (key, release)
        assert all(g == {} for g in given) if release else all(len(g) == 4 for g in given)


def test_consumed_replies_give_the_same_aggregate_and_are_freed_before_aggregation(monkeypatch):
    """With consume_replies (as inside ``start``) every reply's ArrayRecord leaves its message,
    and once all models are aligned nothing holds a reply's bytes any more; the aggregate is
    bitwise the one of a call that leaves the messages intact."""
    import sys

    from tests.test_strategy import transformed_copies

    spec = spec_of("vit", VIT)
    base = base_state()
    copies = transformed_copies(spec, base, len(NODES), noise=1e-3)

    def replies():
        return [reply(n, ArrayRecord(s)) for n, s in zip(NODES, copies)]

    kept = replies()
    plain, _ = strategy_for(spec, base).aggregate_train(2, kept)
    assert all(m.content.array_records for m in kept)  # a direct call leaves the messages alone

    consumed = replies()
    probe = [next(iter(m.content["arrays"].values())).data for m in consumed]
    holders = []
    real_aggregate = aligned_fedavg.aggregate
    monkeypatch.setattr(aligned_fedavg, "aggregate", lambda *a, **k: holders.append(
        [sys.getrefcount(probe[i]) - 2 for i in range(len(probe))]) or real_aggregate(*a, **k))  # probe, argument
    strategy = strategy_for(spec, base)
    strategy.consume_replies = True
    arrays, metrics = strategy.aggregate_train(2, consumed)
    assert metrics["num_excluded"] == 0 and holders == [[0] * len(NODES)]
    assert not any(m.content.array_records for m in consumed)
    assert arrays.keys() == plain.keys()
    for key in plain:
        np.testing.assert_array_equal(arrays[key].numpy(), plain[key].numpy())


@pytest.mark.parametrize("mode", ["orthogonal", "permutation", "invertible"])
def test_inverse_undoes_every_group_element(mode):
    """``inverse(g)`` takes ``g·θ`` back to θ for every architecture variant (heads permuted with
    their maps, non-orthogonal duals, neuron scalings): exactly for pure permutations."""
    from fedbasin.alignment import apply_group, canonicalize, random_group_element
    from fedbasin.alignment.width import inverse
    from tests.helpers import trained_like, variants

    for family, config in variants()[::3]:
        spec = spec_of(family, config)
        state = canonicalize(spec, trained_like(family, config, seed=1).state_dict()).state
        g = random_group_element(spec, 3, mode, scales=mode != "permutation", state=state)
        moved = apply_group(spec, state, g)
        assert any(not torch.equal(moved[k], state[k]) for k in state)
        back = apply_group(spec, moved, inverse(g), in_place=True)
        for key in state:
            if mode == "permutation":
                assert torch.equal(back[key], state[key]), key
            else:
                torch.testing.assert_close(back[key], state[key], rtol=0, atol=1e-12)


def _previous_universe_merge(spec, states, weights, reference, passes, **options):
    """Universe matching as computed before the lean merge: every model canonicalised up front
    and kept, each pass re-aligning the canonical models to the running average."""
    from fedbasin.alignment import average_states, canonicalize, to_gauge, weight_match

    ref = canonicalize(spec, states[reference], validate=False)
    canon = [canonicalize(spec, s, validate=False).state for s in states]
    universe, changes = ref.state, []
    for t in range(passes):
        aligned = [canon[k] if (t == 0 and k == reference) or (t > 0 and weights[k] == 0)
                   else weight_match(spec, universe, canon[k], **options).canonical for k in range(len(states))]
        new = average_states(aligned, weights)
        keys = sorted(spec.keys())
        num = sum(float((new[k].double() - universe[k].double()).pow(2).sum()) for k in keys)
        changes.append((num / sum(float(universe[k].double().pow(2).sum()) for k in keys)) ** 0.5)
        universe = new
    return to_gauge(spec, universe, ref.gains), changes


@pytest.mark.parametrize("mode", ["orthogonal", "permutation"])
@pytest.mark.parametrize("weights,reference", [([0.0, 1.0, 2.0, 3.0], 0), ([1.0, 2.0, 3.0, 4.0], 1)])
def test_lean_universe_merge_equals_the_previous_universe_merge(mode, weights, reference, monkeypatch):
    """Three universe passes: without ``release`` bitwise the previous computation; with
    ``release`` (each model kept only in its aligned form and turned back into its original
    before the next pass) the same within float32 round-off, bitwise for permutations; the
    handed-over dicts are emptied.

    Weight matching runs without maps-only sweeps here: they converge further into a flat optimum
    where the restores' float32 round-off moves the maps (1.8e-4 in the weights after 3 passes,
    see tests/test_universe.py), which would hide a real difference of that size."""
    from fedbasin.alignment import matching, merge

    monkeypatch.setattr(matching, "INNER_SWEEPS", 0)

    from .helpers import DIGITS_VIT, trained_digits_vit

    spec = spec_of("vit", DIGITS_VIT)
    states = [trained_digits_vit(s) for s in (1, 2, 3, 4)]
    options = {"mode": mode, "iterations": 3, "tol": 0.0}
    expected, changes = _previous_universe_merge(spec, states, weights, reference, 3, **options)
    kept = merge(spec, [dict(s) for s in states], weights, reference, universe_iterations=3, universe_tol=-1.0,
                 **options)
    assert kept.universe_change == pytest.approx(changes, rel=1e-9, abs=1e-15)
    for key in expected:
        assert torch.equal(kept.state[key], expected[key]), key
    given = [dict(s) for s in states]
    handed = list(given)
    lean = merge(spec, given, weights, reference, universe_iterations=3, universe_tol=-1.0, release=True, **options)
    assert given == [None] * 4 and handed == [{}] * 4
    assert lean.universe_change == pytest.approx(changes, rel=1e-4)
    for key in expected:
        if mode == "permutation":
            assert torch.equal(lean.state[key], expected[key]), key
        else:
            torch.testing.assert_close(lean.state[key], expected[key], rtol=1e-4, atol=2e-6)
    assert any(not torch.equal(kept.state[k], _previous_universe_merge(spec, states, weights, reference, 1,
                                                                       **options)[0][k]) for k in expected)


@pytest.mark.parametrize("weights, reads_unweighted", [([1.0, 2.0, 3.0, 4.0], True), ([0.0, 1.0, 2.0, 3.0], True),
                                                      ([0.0, 1.0, 2.0, 3.0], False)])
def test_lean_universe_merge_holds_one_form_of_each_model(monkeypatch, live_tensor_bytes, weights, reads_unweighted):
    """Live tensors at the entry and exit of every weight-matching call and every ``combine`` of a
    3-pass universe merge with ``release`` (nothing else holds the models), less the transforms
    kept for the restores: the K models, each in one form (raw, aligned or restored), the running
    average and, while combine runs, the weight-0 model's canonical entry; after the first pass
    the running average's entries go as combine completes the new one's (``on_key``), so the two
    averages together never exceed one model size plus one entry — K + 1 model sizes plus the
    largest entry and the weight-0 entry's copied readers (none when combine says it does not
    read weight-0 entries: ``reads_unweighted = False``). Holding both averages whole measured
    K + 2 (6.01 / 6.59 here); the previous implementation, keeping every canonical model beside
    its aligned copy (and each pass's gauged copies), measured 17.5 / 14.8."""
    import importlib

    from fedbasin.alignment import canonicalize
    from tests.helpers import GPT
    from tests.test_strategy import transformed_copies

    merge_module = importlib.import_module("fedbasin.alignment.merge")
    config = dict(GPT, vocab_size=64, dim=32, mlp_dim=64)
    spec = spec_of("gpt", config)
    base = trained_like_float32(config)
    size = sum(v.numel() * v.element_size() for v in base.values())
    samples = []

    def sampled(function):
        def wrapper(*args, **kwargs):
            samples.append(live_tensor_bytes())
            out = function(*args, **kwargs)
            samples.append(live_tensor_bytes())
            return out
        return wrapper

    monkeypatch.setattr(merge_module, "weight_match", sampled(merge_module.weight_match))

    class Sampled(merge_module.Combiner):
        def combine(self, states, weights, on_key=None):
            def entry_done(key, tensor):
                on_key(key, tensor)
                samples.append(live_tensor_bytes())
            if not self.reads_unweighted:  # a mean over the weighted models alone, like the strategy's
                states, weights = zip(*[(s, w) for s, w in zip(states, weights) if w])
            return sampled(merge_module.average_states)(list(states), list(weights), release=True, on_key=entry_done)

    combine = Sampled()
    combine.reads_unweighted = reads_unweighted

    largest = max(v.numel() * v.element_size() for v in base.values())
    del base

    def models():
        return transformed_copies(spec, trained_like_float32(config), len(weights), noise=1e-2)

    first = models()[0]
    canonical = canonicalize(spec, first).state  # a weight-0 model's entry in later passes: its copied readers
    target = len(weights) + 1 + largest / size + (
        0 if weights[0] or not reads_unweighted else _bytes([v for k, v in canonical.items() if v.data_ptr() != first[k].data_ptr()]) / size)
    del first, canonical
    before = live_tensor_bytes()
    result = merge_module.merge(spec, models(), weights, universe_iterations=3, universe_tol=-1.0, iterations=2,
                                combine=combine, release=True)
    assert len(result.universe_change) == 3
    transforms = _bytes([t for m in result.matches for t in _tensors(m.transform)])  # the restores need them
    held = (max(samples) - before - transforms) / size
    assert held <= target + 0.05, (held, target)


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _tensors(g) -> list:
    """The tensors of a group element."""
    maps = [m for h in g.heads if h is not None for m in (h.perm, h.qk, h.ov, h.qk_dual, h.ov_dual)]
    maps += [m for n in g.neurons if n is not None for m in (n.perm, n.scale)]
    return [m for m in [g.residual, *maps] if m is not None]
