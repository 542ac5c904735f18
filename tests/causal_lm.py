"""Tiny random Hugging Face causal LMs (Llama/Mistral/Qwen2, GPT-NeoX) and the checks every
family must pass: exact group action, planted recovery, CLI/API round trips through files."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from fedbasin.alignment import apply_group, canonicalize, random_group_element, to_gauge, weight_match  # noqa: E402
from fedbasin.alignment.hf import hf_adapter, hf_config_updates, hf_model_class  # noqa: E402

VOCAB, SEQ = 40, 12
LLAMA = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
             max_position_embeddings=32, bos_token_id=0, eos_token_id=0, pad_token_id=0)
NEOX = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
            max_position_embeddings=32, bos_token_id=0, eos_token_id=0)


@pytest.fixture(autouse=True)
def float64_rmsnorm(monkeypatch):
    """HF's RMSNorm casts to float32 inside; in float64 tests compute it in the input dtype, so
    the symmetry checks measure the maths (1e-10) and not float32 rounding (~1e-7)."""
    import importlib

    def forward(self, x):
        if x.dtype != torch.float64:
            return original[type(self)](self, x)
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    original = {}
    for name in ("llama", "mistral", "qwen2"):
        module = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
        cls = getattr(module, f"{name.capitalize() if name != 'qwen2' else 'Qwen2'}RMSNorm")
        original[cls] = cls.forward
        monkeypatch.setattr(cls, "forward", forward)
    yield


def hf_config(model_type: str, **overrides):
    from fedbasin.alignment.hf import hf_config_class

    base = NEOX if model_type == "gpt_neox" else LLAMA
    return hf_config_class(model_type)(**{**base, **overrides})


def hf_model(model_type: str, seed: int = 0, dtype=torch.float64, config=None, **overrides):
    """A tiny model far from init: every parameter perturbed, norm gains around 1 (some negative)."""
    config = config or hf_config(model_type, **overrides)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = hf_model_class(model_type)(config).to(dtype).eval()
    g = torch.Generator().manual_seed(1000 + seed)
    with torch.no_grad():
        for name, p in model.named_parameters():  # tied parameters appear once
            noise = torch.randn(p.shape, generator=g, dtype=torch.float64).to(dtype)
            if "norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.5 * noise)
            else:
                p.add_(0.2 * noise)
    return model


def tokens(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(seed))


def logits(model, x=None) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens() if x is None else x).logits


def rel_err(a, b) -> float:
    return float((a - b).norm() / b.norm())


def load_state(model_type: str, config, state: dict):
    """A fresh model of ``config`` (untied if ``state`` needs it) carrying ``state``."""
    config = type(config).from_dict({**config.to_dict(), **hf_config_updates(config, state)})
    model = hf_model(model_type, config=config)
    model.load_state_dict(state, strict=True)
    return model


def check_group_action(model_type: str, model, modes=("orthogonal",), scales=False, seed=7):
    """Canonicalise, move by random group elements, translate back: same logits (float64)."""
    adapter = hf_adapter(model)
    standard = adapter.to_standard(model.state_dict())
    canonical = canonicalize(adapter.spec, standard)
    want = logits(model)
    for mode in modes:
        g = random_group_element(adapter.spec, seed, mode, dtype=torch.float64, scales=scales)
        moved = adapter.from_standard(apply_group(adapter.spec, canonical.state, g))
        moved_model = load_state(model_type, model.config, moved)
        assert rel_err(logits(moved_model), want) < 1e-10, mode
        # the element really moved the weights
        assert max(float((moved[k] - v).abs().max()) for k, v in model.state_dict().items()) > 1e-3
    return adapter


def check_planted_recovery(model, seed=11, iterations=60, signed=False):
    adapter = hf_adapter(model)
    spec = adapter.spec
    reference = adapter.to_standard(model.state_dict())
    canonical = canonicalize(spec, reference)
    g = random_group_element(spec, seed, "orthogonal", dtype=torch.float64)
    signs = torch.Generator().manual_seed(seed)
    for m, neurons in zip(spec.mlp, g.neurons):  # gated units: signed permutations (up row and down column flip)
        if signed and m.activation == "gated":
            neurons.scale = torch.randint(0, 2, neurons.perm.shape, generator=signs).double() * 2 - 1
    moved = apply_group(spec, canonical.state, g)
    result = weight_match(spec, reference, moved, iterations=iterations, tol=1e-12)
    diff = max(float((result.canonical[k] - canonical.state[k]).abs().max()) for k in canonical.state)
    assert diff < 1e-6, f"canonical weights not recovered: max diff {diff}"
    # the reference's gauged form: the reference itself, but tiny-gain dims keep γ = 1 (canonical.py)
    gauged = to_gauge(spec, canonical.state, canonical.gains)
    diff = max(float((result.state[k] - gauged[k]).abs().max()) for k in reference)
    assert diff < 1e-6, f"reference-gauge weights not recovered: max diff {diff}"
    return result


def check_cli_and_api(model_type: str, tmp_path, capsys, **overrides):
    """Two independent float32 models saved with save_pretrained: ``fedbasin align`` and
    ``fedbasin merge`` outputs load with from_pretrained; the aligned one computes the
    candidate's function, the merge of a model with its moved copy computes the model's."""
    import json

    from fedbasin.cli import main

    cls = hf_model_class(model_type)
    a = hf_model(model_type, seed=0, dtype=torch.float32, **overrides)
    b = hf_model(model_type, seed=1, dtype=torch.float32, **overrides)
    a.save_pretrained(tmp_path / "a")
    b.save_pretrained(tmp_path / "b")
    assert main(["align", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "ab"),
                 "--iterations", "3"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["objective"][-1] > summary["initial_objective"]
    aligned = cls.from_pretrained(tmp_path / "ab").eval()
    assert rel_err(logits(aligned), logits(b)) < 1e-4
    # merge of a with an exactly moved copy of itself gives a back (Python API for the copy)
    adapter = hf_adapter(a)
    canonical = canonicalize(adapter.spec, adapter.to_standard({k: v.double() for k, v in a.state_dict().items()}))
    g = random_group_element(adapter.spec, 3, "orthogonal", dtype=torch.float64)
    moved = adapter.from_standard(apply_group(adapter.spec, canonical.state, g))
    copy = load_state(model_type, a.config, {k: v.float() for k, v in moved.items()}).float()
    copy.save_pretrained(tmp_path / "a_moved")
    assert main(["merge", str(tmp_path / "a"), str(tmp_path / "a_moved"), "--out", str(tmp_path / "m"),
                 "--iterations", "50", "--tol", "0"]) == 0
    capsys.readouterr()
    merged = cls.from_pretrained(tmp_path / "m").eval()
    assert rel_err(logits(merged), logits(a)) < 1e-4
    # the Python API on the loaded checkpoints agrees with the CLI output
    from fedbasin.checkpoint import load_checkpoint

    ref, cand = load_checkpoint(tmp_path / "a"), load_checkpoint(tmp_path / "b")
    result = weight_match(ref.spec, ref.adapter.to_standard(ref.state), cand.adapter.to_standard(cand.state),
                          iterations=3)
    api = load_state(model_type, a.config, ref.adapter.from_standard(result.state)).float()
    assert rel_err(logits(api), logits(b)) < 1e-4
