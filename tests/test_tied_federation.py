"""Tied input/output embeddings in federation: accepted, untied by alignment with a warning,
the merged model keeps the function, and replies from still-tied client models are excluded."""

from __future__ import annotations

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord

from fedbasin.alignment.hf import hf_adapter, hf_config_updates, hf_model_class
from tests.test_strategy import NODES, StubGrid, reply, serverapp_identity, transformed_copies  # noqa: F401

transformers = pytest.importorskip("transformers")


def tied_model(model_type: str):
    from .causal_lm import hf_model as causal_model
    from .test_hf import hf_model as gpt2_model

    if model_type == "gpt2":
        model = gpt2_model("gpt2", dtype=torch.float32)
    else:
        model = causal_model(model_type, dtype=torch.float32, num_key_value_heads=2, tie_word_embeddings=True)
    assert model.config.tie_word_embeddings
    return model


def hf_logits(model_type, config, module_state):
    config = type(config).from_dict({**config.to_dict(), **hf_config_updates(config, module_state)})
    model = hf_model_class(model_type)(config).eval()
    model.load_state_dict(module_state, strict=True)
    ids = torch.randint(0, config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("model_type", ["gpt2", "qwen2"])
def test_tied_models_federate_untied(model_type, caplog):
    from fedbasin.strategies import AlignedFedAvg

    model = tied_model(model_type)
    adapter = hf_adapter(model)
    spec = adapter.spec
    (source, alias), = spec.tied
    state = {k: v.detach().clone() for k, v in adapter.to_standard(model.state_dict()).items()}
    state[alias] = state[source]  # as a tied client sends it
    with caplog.at_level("WARNING", logger="flwr"):
        strategy = AlignedFedAvg(spec, min_train_nodes=3, min_available_nodes=3)
    assert "unties" in caplog.text and alias in caplog.text and "tie_word_embeddings=False" in caplog.text
    list(strategy.configure_train(1, ArrayRecord(state), ConfigRecord(), StubGrid(NODES)))
    # round 1: one tied client and two untied clients holding exactly moved copies
    copies = transformed_copies(spec, state, 2, noise=0.0)
    replies = [reply(NODES[0], ArrayRecord(state))] + [reply(n, ArrayRecord(c)) for n, c in zip(NODES[1:], copies)]
    arrays, metrics = strategy.aggregate_train(1, replies)
    assert metrics["num_excluded"] == 0
    merged = arrays.to_torch_state_dict()
    assert not torch.equal(merged[source], merged[alias])  # untied ...
    want = hf_logits(model_type, model.config, model.state_dict())
    got = hf_logits(model_type, model.config, adapter.from_standard(merged))
    assert float((got - want).norm() / want.norm()) < 1e-4  # ... and the same function
    # round 2: a client that loaded the untied global model into a tied model is excluded
    list(strategy.configure_train(2, arrays, ConfigRecord(), StubGrid(NODES)))
    still_tied = dict(merged)
    still_tied[source] = still_tied[alias]  # load_state_dict into a tied model keeps one of the two
    caplog.clear()
    with caplog.at_level("WARNING", logger="flwr"):
        arrays2, metrics2 = strategy.aggregate_train(2, [reply(NODES[0], ArrayRecord(still_tied)),
                                                         reply(NODES[1], arrays)])
    assert metrics2["excluded_nodes"] == [NODES[0]]
    assert "the client model ties them" in caplog.text
