"""Federated Hugging Face causal LMs (GPT-2, Llama with grouped-query attention) through the Flower
apps: run-config keys, the client's standard-layout messages, untying, pretrained starts, and
2-round end-to-end simulations whose saved models load with ``from_pretrained``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from flwr.app import ArrayRecord, MessageType

from fedbasin.config import model_adapter, model_from_config, resolve_run_config, task_from_config
from tests.test_simulation import ask, cli, node, part
from tests.test_strategy import serverapp_identity  # noqa: F401  (autouse: a run identity)
from tests.test_tokenizer_data import SHAKESPEARE, TOKENIZER, pytestmark  # noqa: F401  (skip without data)

transformers = pytest.importorskip("transformers")
TINY = {"model.dim": 32, "model.depth": 2, "model.heads": 4, "model.mlp-dim": 64, "block-size": 32}


@pytest.fixture(scope="module")
def text_file(tmp_path_factory) -> str:
    """The first 30,000 characters of Tiny Shakespeare (about 8,000 GPT-2 tokens)."""
    path = tmp_path_factory.mktemp("text") / "shakespeare.txt"
    path.write_text(SHAKESPEARE.read_text(encoding="utf-8")[:30000], encoding="utf-8")
    return str(path)


def run_config(text_file: str, **overrides) -> dict:
    return resolve_run_config({"data": f"text:{text_file}", "tokenizer": str(TOKENIZER), **TINY, **overrides})


def test_client_replies_in_the_standard_layout_and_untied(text_file):
    """A GPT-2 client receives and sends the adapter's standard layout (separate q/k/v, the
    strategy's spec keys), builds an untied model when the run aligns, and trains."""
    config = run_config(text_file, **{"hf-config": "gpt2", "local-epochs": 1, "max-train-examples": 150,
                                          "batch-size": 8, "lr": 0.01})
    task = task_from_config(config)
    model = model_from_config(task, config, seed=0)
    assert type(model).__name__ == "GPT2LMHeadModel" and not model.config.tie_word_embeddings
    state = model.state_dict()
    torch.testing.assert_close(state["lm_head.weight"], state["transformer.wte.weight"])  # tied function
    family, adapter = model_adapter(task, model)
    assert family == "gpt2" and adapter.spec.tied == ()
    broadcast = adapter.to_standard(state)
    assert "transformer.h.0.attn.q.weight" in broadcast and "transformer.h.0.attn.c_attn.weight" not in broadcast
    sent = {k: v.clone() for k, v in broadcast.items()}
    reply = ask(MessageType.TRAIN, ArrayRecord(sent), node(part(0)), **config, **{"server-round": 1})
    trained = reply.content["arrays"].to_torch_state_dict()
    assert sorted(trained) == sorted(broadcast)
    assert not torch.equal(trained["lm_head.weight"], trained["transformer.wte.weight"])  # trained apart
    assert reply.content["metrics"]["train_loss"] < 10.6  # ln(50257) = 10.82 at initialisation
    frozen = ask(MessageType.TRAIN, ArrayRecord(sent), node(part(1)), **{**config, "lr": 0.0, "weight-decay": 0.0},
                 **{"server-round": 1}).content["arrays"].to_torch_state_dict()
    for key, value in frozen.items():
        torch.testing.assert_close(value, broadcast[key])
    evaluated = ask(MessageType.EVALUATE, ArrayRecord(sent), node(part(1)), **config, **{"server-round": 1})
    assert evaluated.content["metrics"]["eval_loss"] == pytest.approx(10.82, abs=0.1)


def test_plain_fedavg_keeps_the_tie(text_file):
    config = run_config(text_file, **{"hf-config": "gpt2", "alignment": False})
    model = model_from_config(task_from_config(config), config, seed=0)
    assert model.config.tie_word_embeddings and model.lm_head.weight is model.transformer.wte.weight


def test_pretrained_directory_starts_the_run_with_its_weights_and_tokenizer(tmp_path, text_file):
    """hf-pretrained=DIR: the tokenizer saved there is used, the tied model is untied into the
    same function, and a config.json file (hf-config=FILE) builds the same architecture."""
    source = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_embd=32, n_layer=2, n_head=4, n_positions=32, vocab_size=50257)).eval()
    source.save_pretrained(tmp_path / "pretrained")
    transformers.AutoTokenizer.from_pretrained(str(TOKENIZER)).save_pretrained(tmp_path / "pretrained")
    config = resolve_run_config({"data": f"text:{text_file}", "hf-pretrained": str(tmp_path / "pretrained"),
                                 "block-size": 32})
    task = task_from_config(config)
    assert Path(task.tokenizer.path) == tmp_path / "pretrained"
    model = model_from_config(task, config, seed=5)
    assert not model.config.tie_word_embeddings
    ids = task.test.inputs[:2]
    with torch.no_grad():
        torch.testing.assert_close(model(ids), source(ids).logits)
    from_file = model_from_config(task, resolve_run_config(
        {**config, "hf-pretrained": "", "hf-config": str(tmp_path / "pretrained" / "config.json")}), seed=5)
    assert {k: v.shape for k, v in from_file.state_dict().items()} == {k: v.shape for k, v in model.state_dict().items()}
    assert not torch.equal(from_file.transformer.h[0].mlp.c_fc.weight, model.transformer.h[0].mlp.c_fc.weight)


@pytest.mark.parametrize("overrides, message", [
    ({"hf-config": "gpt2", "hf-pretrained": "x"}, "hf-config and hf-pretrained both name a model"),
    ({"hf-config": "gpt3"}, "hf-config 'gpt3' is neither a supported model type"),
    ({"hf-config": "gpt2", "tokenizer": ""}, "needs text data tokenised by a Hugging Face tokenizer"),
    ({"hf-config": "gpt2", "model.activation": "swiglu"}, "model.activation='swiglu' does not apply"),
    ({"hf-config": "gpt2", "model.kv-heads": 2}, "model.kv-heads=2 does not apply to gpt2"),
    ({"hf-config": "llama", "model.kv-heads": 3}, "4 query heads do not split into 3 key/value groups"),
    ({"hf-pretrained": "/nonexistent/model"}, "hf-pretrained /nonexistent/model is not a directory"),
    ({"hf-config": "CONFIG"}, "has 50257 tokens but the model of hf-config="),
    ({"hf-config": "CONFIG", "vocab": 50304, "block-size": 64}, "block-size=64 exceeds the 32 positions"),
])
def test_bad_keys_fail_before_the_run_with_one_line(tmp_path, text_file, capsys, overrides, message):
    overrides = dict(overrides)
    if overrides.get("hf-config") == "CONFIG":
        (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 32, "n_layer": 1, "n_head": 4,
                                                          "n_positions": 32, "vocab_size": overrides.pop("vocab", 1000)}))
        overrides["hf-config"] = str(tmp_path / "config.json")
        sizes = {"block-size": 32}  # the file fixes the architecture
    else:
        sizes = TINY
    settings = {"data": f"text:{text_file}", "tokenizer": str(TOKENIZER), **sizes, **overrides}
    text = " ".join(f"{k}={json.dumps(v)}" for k, v in settings.items() if v != "")
    missing = "is not a directory" in message or "neither a supported model type" in message  # no such file
    assert cli("--run-config", text, "--out", str(tmp_path / "run")) == (3 if missing else 2)  # README's table
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "run").exists()


def federate(tmp_path: Path, text_file: str, **overrides) -> dict:
    from fedbasin.client.client_app import app as client_app
    from tests.test_robust_simulation import run_in_process

    config = run_config(text_file, **{
        "num-server-rounds": 2, "local-epochs": 1, "batch-size": 8, "lr": 0.01, "max-train-examples": 160,
        "align-iterations": 5, "out-dir": str(tmp_path / "run"), **overrides})
    return run_in_process(config, 2, client_app)


def check_saved_model(saved: Path, model_type: str, text_file: str, overrides: dict, test_loss: float):
    """``saved`` is a from_pretrained directory (untied) with the run's tokenizer beside it, whose
    model has the recorded test loss; returns the run's task."""
    cls = getattr(transformers, {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM"}[model_type])
    model = cls.from_pretrained(saved).eval()
    assert not model.config.tie_word_embeddings
    tokenizer = transformers.AutoTokenizer.from_pretrained(saved)
    task = task_from_config(run_config(text_file, **{"hf-config": model_type, **overrides}))
    assert tokenizer("O Romeo")["input_ids"] == task.tokenizer.tokenizer("O Romeo")["input_ids"]
    ids, targets = task.test.inputs, task.test.targets
    with torch.no_grad():
        logits = model(ids).logits
    loss = float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)))
    assert loss == pytest.approx(test_loss, rel=1e-4)
    return task


def test_a_language_model_round_sizes_its_distillation_for_the_memo_instead_of_a_cache(text_file, monkeypatch):
    """distill-steps = auto with GPT-2's 50,257-token outputs: caching them per step would pass half the
    clients' weights, so ``prepare`` caches nothing and sizes the run for the memo (the teachers run in
    the first epoch of the proxy's training part only: ⌈N / batch⌉ steps), more steps than with the
    teachers in every step; ``distill`` asks for that many from the clients' weights."""
    import math
    from types import SimpleNamespace

    from fedbasin.server import distill as distill_module
    from fedbasin.server import server_app
    from tests.test_distill_budget import TICK, fake_clock

    config = run_config(text_file, **{"hf-config": "gpt2", "proxy-size": 40, "batch-size": 4,
                                      "distill-steps": "auto", "distill-budget": 0.75})
    task = task_from_config(config)
    model = model_from_config(task, config, seed=0)
    adapter = model_adapter(task, model)[1]
    states = [adapter.to_standard(model_from_config(task, config, seed=s).state_dict()) for s in (1, 2)]
    costs, given = [], []
    probe = server_app.probe_step
    monkeypatch.setattr(server_app, "probe_step", lambda *a, **k: costs.append(probe(*a, **k)) or costs[-1])
    monkeypatch.setattr(server_app, "ensemble_distill",  # the run itself: test_distill_budget.py
                        lambda model, student, teachers, *a, **k: given.append((teachers, k)) or SimpleNamespace(
                            state=student))
    fake_clock(monkeypatch, distill_module, server_app)
    distill = server_app.make_distiller(model, task, config, adapter)
    assert distill.prepare(states) is None
    training = server_app.server_proxy_streams(task, model, config).batches
    epoch = math.ceil(len(training.split) / 4)
    expected = costs[0].steps(0.75 - 15 * TICK, server_app.EVAL_EVERY, epoch)
    assert epoch == 6 and expected > costs[0].steps(0.75 - 15 * TICK, server_app.EVAL_EVERY) > 0
    distill(states[0], states)
    teachers, keywords = given[0]
    assert keywords["steps"] == expected and all(isinstance(t, dict) for t in teachers)


#: GPT-2's run also distils on the server: 2 rounds with distill-steps > 0 (the proxy split held by the server)
DISTILLED = {"proxy-size": 48, "distill-steps": 20, "distill-lr": 0.003, "refine-steps": 0}


@pytest.mark.slow
@pytest.mark.parametrize("model_type, overrides", [
    ("gpt2", DISTILLED),
    ("llama", {"model.kv-heads": 2}),
], ids=["gpt2-distilled", "llama-gqa"])
def test_two_rounds_federate_a_causal_lm_and_save_it_loadable(tmp_path, text_file, model_type, overrides):
    """2 rounds: the global model learns, the clients' replies are aligned to the broadcast (or averaged as
    they are when they kept its basis), the saved round model loads with ``from_pretrained`` and reproduces
    its recorded test loss, and the run resumes from it. With distillation (GPT-2): after each aligned merge
    the server distils the clients' logit ensemble into it on its proxy split; keep-best never returns a
    student worse than the merge on the selection split, round 1's student is better than its merge there,
    and the distilled model is the round's saved global model."""
    results = federate(tmp_path, text_file, **{"hf-config": model_type, **overrides})
    rounds = results["rounds"]
    assert [r["round"] for r in rounds] == [0, 1, 2]
    assert rounds[0]["test_loss"] == pytest.approx(10.82, abs=0.1)  # ln(50257): untrained
    assert rounds[2]["test_loss"] < rounds[1]["test_loss"] < rounds[0]["test_loss"] - 1.0
    for r in rounds[1:]:
        assert r["num_excluded"] == 0 and r["round_failed"] == 0
        # the clients trained from the broadcast: averaged as they are when they kept its basis, else aligned to it
        assert r["universe_passes"] == (0 if r.get("already_aligned") else 1) and r["align_gain"] >= 0.0
        if "distill-steps" in overrides:
            assert r["distill_selection_loss"] <= r["distill_selection_loss_start"]
    if "distill-steps" in overrides:
        assert rounds[1]["distill_best_step"] > 0, rounds[1]
        assert rounds[1]["distill_selection_loss"] < rounds[1]["distill_selection_loss_start"] - 0.01, rounds[1]
    else:
        assert "distill_best_step" not in rounds[1]
    assert results["final"]["usable"] and results["model"]["family"] == model_type
    task = check_saved_model(tmp_path / "run" / "round-0002", model_type, text_file, overrides, rounds[2]["test_loss"])
    # the run resumes from its last checkpoint; a run that builds another model is refused
    from fedbasin.server.outputs import RunOutputs

    config = resolve_run_config({**results["run_config"], "resume": True})
    built = model_from_config(task, config, seed=0)
    last, state = RunOutputs(config["out-dir"], model_type, built.config, config).resume()
    built.load_state_dict(state)
    assert last == 2
    other = resolve_run_config({**config, "model.mlp-dim": 48})
    with pytest.raises(ValueError, match=r"differs from this run's: .*\(this run: 48\)"):
        RunOutputs(config["out-dir"], model_type, model_from_config(task, other, seed=0).config, other).resume()
