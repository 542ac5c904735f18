"""A module's architecture apart from its weights (fedbasin.weights), the scratch file
behind distillation's teacher cache and kept state (fedbasin.scratch), and a ServerApp run that
holds no model copy of its own."""

from __future__ import annotations

import pytest
import torch

from fedbasin.models import build_model
from fedbasin.weights import holding_weights, release_weights, weightless_copy
from fedbasin.scratch import ScratchTensors
from tests.helpers import DIGITS_VIT


def tied_gpt2(seed: int = 0):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    config = transformers.GPT2Config(vocab_size=40, n_positions=16, n_embd=16, n_layer=2, n_head=2)
    return transformers.GPT2LMHeadModel(config).eval()


def logits(module, x):
    out = module(x)
    return out if isinstance(out, torch.Tensor) else out.logits


@pytest.mark.parametrize("kind", ["vit", "gpt2"])
def test_a_released_module_runs_a_held_state_bitwise_without_copying_it(kind):
    """release_weights leaves meta tensors of the same shapes and dtypes (ties kept, the
    non-persistent buffers real); holding_weights lends a state's own tensors (same storage),
    gives the outputs of a module that loaded it, keeps ties, and puts the meta tensors back."""
    if kind == "vit":
        module, source = build_model("vit", DIGITS_VIT, seed=0).eval(), build_model("vit", DIGITS_VIT, seed=1).eval()
        x = torch.rand(3, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    else:
        module, source = tied_gpt2(0), tied_gpt2(1)
        x = torch.randint(0, 40, (2, 8), generator=torch.Generator().manual_seed(0))
    shapes = {k: (v.shape, v.dtype) for k, v in module.state_dict().items()}
    buffers = {k: v for k, v in module.named_buffers() if k not in module.state_dict()}
    release_weights(module)
    assert {k: (v.shape, v.dtype) for k, v in module.state_dict().items()} == shapes
    assert all(v.is_meta for v in module.state_dict().values())
    assert all(not v.is_meta and torch.equal(v, buffers[k]) for k, v in module.named_buffers() if k in buffers)
    state = source.state_dict()
    with holding_weights(module, state) as held:
        assert all(held[k].data_ptr() == v.data_ptr() for k, v in state.items())
        with torch.no_grad():
            assert torch.equal(logits(module, x), logits(source, x))
        if kind == "gpt2":
            assert module.lm_head.weight is module.transformer.wte.weight
    assert all(v.is_meta for v in module.state_dict().values())
    if kind == "gpt2":
        assert module.lm_head.weight is module.transformer.wte.weight


def test_holding_refuses_a_state_that_does_not_fit_and_restores_real_weights():
    module = build_model("vit", DIGITS_VIT, seed=0)
    own = {k: v.clone() for k, v in module.state_dict().items()}
    with pytest.raises(ValueError, match="state: head.weight has shape"), \
            holding_weights(module, {**own, "head.weight": torch.zeros(3, 3)}):
        pass
    with pytest.raises(ValueError, match="missing \\['head.bias'\\]"), \
            holding_weights(module, {k: v for k, v in own.items() if k != "head.bias"}):
        pass
    other = build_model("vit", DIGITS_VIT, seed=1).state_dict()
    with holding_weights(module, other):
        assert torch.equal(module.head.weight, other["head.weight"])
    for k, v in module.state_dict().items():  # a module with weights gets its own back
        assert torch.equal(v, own[k]), k


def test_weightless_copy_copies_no_weight_and_runs_any_state():
    module = build_model("gpt", {"vocab_size": 32, "block_size": 8, "dim": 16, "depth": 1, "heads": 2,
                                 "mlp_dim": 32}, seed=0).eval()
    twin = weightless_copy(module)
    assert all(v.is_meta for v in twin.state_dict().values())
    assert all(not v.is_meta for v in module.state_dict().values())  # the original keeps its weights
    x = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(torch.func.functional_call(twin, module.state_dict(), (x,)), module(x))


def test_scratch_tensors_round_trip_bitwise_and_leave_no_file(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(5, 7, generator=g), torch.randn(3, generator=g).to(torch.bfloat16),
               torch.randint(-9, 9, (2, 2, 2), generator=g), torch.empty(0, 4), torch.tensor(3.5, dtype=torch.float64),
               torch.randn(6, 4, generator=g).t()]  # not contiguous
    store = ScratchTensors(tmp_path)
    assert list(tmp_path.iterdir()) == []  # anonymous: nothing to leave behind
    assert [store.append(t) for t in tensors] == list(range(len(tensors)))
    assert len(store) == len(tensors) and store.nbytes == sum(t.numel() * t.element_size() for t in tensors)
    for i, t in enumerate(tensors):
        back = store[i]
        assert back.dtype == t.dtype and back.shape == t.shape and torch.equal(back, t), i
    store.clear()
    store.append(tensors[1])
    assert len(store) == 1 and torch.equal(store[0], tensors[1])
    store.close()


def test_a_server_run_with_refinement_and_distillation_holds_no_weights_of_its_own(tmp_path, monkeypatch):
    """End to end (Flower's in-process simulation, 2 nodes, 1 round): the ServerApp's module
    releases its weights once the initial model is sent, and every evaluation, refinement and
    distillation lends it the state it runs; the round refines, distils and records a usable model."""
    from fedbasin.config import resolve_run_config
    from fedbasin.server import server_app
    from tests.test_robust_simulation import run_in_process

    released = []

    def spy(module):
        released.append(module)
        return release_weights(module)

    monkeypatch.setattr(server_app, "release_weights", spy)
    config = resolve_run_config({"num-server-rounds": 1, "min-nodes": 2, "out-dir": str(tmp_path / "run"),
                                 "proxy-size": 100, "refine-steps": 3, "distill-steps": 3, "init": "client",
                                 "model.dim": 16, "model.depth": 1, "model.heads": 2, "model.mlp-dim": 16})
    from fedbasin.client.client_app import app as client_app

    results = run_in_process(config, 2, client_app)
    assert len(released) == 1 and all(v.is_meta for v in released[0].state_dict().values())
    last = results["rounds"][-1]
    assert last["round"] == 1 and results["final"]["usable"]
    assert "refine_heldout_loss" in last and "distill_best_step" in last and last["test_accuracy"] > 0
