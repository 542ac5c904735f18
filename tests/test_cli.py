"""CLI: align / merge / barrier on fedbasin and Hugging Face checkpoints, and its error messages."""

from __future__ import annotations

import json

import pytest
import torch

from fedbasin.alignment import apply_group, canonicalize, random_group_element, to_gauge, weight_match
from fedbasin.alignment.canonical import tiny_gain_dims
from fedbasin.checkpoint import build_torch_model, load_checkpoint, save_checkpoint
from fedbasin.cli import main

from .helpers import trained_like

DIGITS_VIT = dict(image_size=8, patch_size=2, channels=1, num_classes=10, dim=16, depth=1, heads=2, mlp_dim=32)


def _transformed(checkpoint, seed):
    spec = checkpoint.spec
    std = checkpoint.adapter.to_standard(checkpoint.state)
    c = canonicalize(spec, std)
    g = random_group_element(spec, seed, dtype=torch.float32, state=std)
    return checkpoint.adapter.from_standard(to_gauge(spec, apply_group(spec, c.state, g), c.gains))


@pytest.fixture
def vit_pair(tmp_path):
    """A digits ViT A, an independent ViT B and a transformed copy of A, saved as checkpoints."""
    a = trained_like("vit", DIGITS_VIT, seed=1, dtype=torch.float32)
    b = trained_like("vit", DIGITS_VIT, seed=2, dtype=torch.float32)
    save_checkpoint(tmp_path / "a", "vit", a.config, a.state_dict())
    save_checkpoint(tmp_path / "b", "vit", b.config, b.state_dict())
    ckpt = load_checkpoint(tmp_path / "a")
    save_checkpoint(tmp_path / "a_moved", "vit", a.config, _transformed(ckpt, 5))
    return tmp_path


def _run(capsys, *argv) -> dict:
    assert main([str(a) for a in argv]) == 0
    return json.loads(capsys.readouterr().out)


def _outputs(path, x):
    ckpt = load_checkpoint(path)
    with torch.no_grad():
        return build_torch_model(ckpt)(x)


def test_align_keeps_candidate_function(vit_pair, capsys):
    out = vit_pair / "aligned"
    summary = _run(capsys, "align", vit_pair / "a", vit_pair / "b", "--out", out, "--iterations", "5")
    # matching raises the objective well above the unaligned candidate's (measured -0.03 -> 0.44)
    assert summary["objective"][-1] > summary["initial_objective"] + 0.3
    # the file holds what the Python API computes
    a, b = load_checkpoint(vit_pair / "a"), load_checkpoint(vit_pair / "b")
    expected = weight_match(a.spec, a.state, b.state, iterations=5).state
    assert max(float((load_checkpoint(out).state[k] - v).abs().max()) for k, v in expected.items()) < 1e-6
    x = torch.rand(5, 1, 8, 8)
    assert torch.allclose(_outputs(out, x), _outputs(vit_pair / "b", x), atol=1e-4)


def _off_tiny_dims(spec, state: dict, dims: dict) -> dict:
    """Per tensor, the entries the tiny-gain rule (canonical.py) leaves as they are: all but the
    tiny dims of a norm's gain and bias and of its readers' residual axis, and its readers' biases
    (they take the norm bias of those dims, ``b + β_i W_i``)."""
    keep = {k: torch.ones_like(v, dtype=torch.bool) for k, v in state.items()}
    for norm in spec.norms:
        if idx := dims.get(norm.weight):
            for key in (norm.weight, norm.bias):
                if key:
                    keep[key][idx] = False
            for key, axis in norm.readers:
                keep[key].index_fill_(axis, torch.tensor(idx), False)
                if (bias := key[: -len("weight")] + "bias") in keep:
                    keep[bias][:] = False
    return keep


def test_align_recovers_planted_copy_and_barrier_vanishes(vit_pair, capsys):
    """A planted copy of A comes back as A's gauged form: A itself except on A's tiny-gain dims
    (trained_like draws one, 0.0011 × its median), where it keeps γ = 1 (canonical.py); the CLI says so."""
    out = vit_pair / "recovered"
    assert main([str(a) for a in ("align", vit_pair / "a", vit_pair / "a_moved", "--out", out,
                                  "--iterations", "50", "--tol", "0")]) == 0
    captured = capsys.readouterr()
    ckpt = load_checkpoint(vit_pair / "a")
    a, rec, spec = ckpt.state, load_checkpoint(out).state, ckpt.spec
    c = canonicalize(spec, a)
    gauged, dims = to_gauge(spec, c.state, c.gains), tiny_gain_dims(c.gains)
    assert dims and json.loads(captured.out)["tiny_gain_dims"] == dims
    assert captured.err.count("tiny norm gains") == 1
    x = torch.rand(5, 1, 8, 8)
    assert torch.allclose(_outputs(out, x), _outputs(vit_pair / "a", x), atol=1e-5)  # A's function
    assert max(float((gauged[k] - rec[k]).abs().max()) for k in a) < 1e-3  # A's gauged form
    keep = _off_tiny_dims(spec, a, dims)
    assert max(float(torch.where(keep[k], a[k] - rec[k], 0).abs().max()) for k in a) < 1e-3  # A off its tiny dims
    _run(capsys, "align", vit_pair / "a", vit_pair / "a", "--out", vit_pair / "a_gauged")  # what the CLI advises
    assert max(float((gauged[k] - v).abs().max()) for k, v in load_checkpoint(vit_pair / "a_gauged").state.items()) < 1e-5
    plot = vit_pair / "curve.png"
    summary = _run(capsys, "barrier", vit_pair / "a", vit_pair / "a_moved", "--data", "digits", "--align",
                   "--max-examples", "200", "--plot", plot)
    assert len(summary["losses"]) == 11 and abs(summary["barrier"]) < 1e-5  # from A's gauged form
    assert summary["tiny_gain_dims"] == dims
    assert plot.stat().st_size > 0
    vanilla = _run(capsys, "barrier", vit_pair / "a", vit_pair / "a_moved", "--data", "digits",
                   "--max-examples", "200", "--points", "5")
    assert vanilla["barrier"] > 0.01 > abs(summary["barrier"]) and len(vanilla["lambdas"]) == 5


def test_merge_of_transformed_copies_is_the_model(vit_pair, capsys):
    out = vit_pair / "merged"
    summary = _run(capsys, "merge", vit_pair / "a", vit_pair / "a_moved", "--out", out, "--weights", "1,3",
                   "--iterations", "50", "--tol", "0")
    assert summary["weights"] == [1.0, 3.0]
    x = torch.rand(5, 1, 8, 8)
    assert torch.allclose(_outputs(out, x), _outputs(vit_pair / "a", x), atol=1e-4)


def test_hf_gpt2_align_round_trip(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=50, n_positions=16,
                                      bos_token_id=0, eos_token_id=0)
    models = []
    for seed, name in ((0, "ref"), (1, "cand")):
        torch.manual_seed(seed)
        m = transformers.GPT2LMHeadModel(config)
        with torch.no_grad():  # trained-like gains: the final gain folded into lm_head unties it
            for key, p in m.named_parameters():
                if "ln_" in key and key.endswith("weight"):
                    p.uniform_(0.5, 1.5)
        m.save_pretrained(tmp_path / name)
        models.append(m.eval())
    summary = _run(capsys, "align", tmp_path / "ref", tmp_path / "cand", "--out", tmp_path / "out",
                   "--iterations", "3")
    assert summary["command"] == "align"
    aligned = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "out").eval()
    assert aligned.config.tie_word_embeddings is False
    ids = torch.randint(0, 50, (2, 10))
    with torch.no_grad():
        assert torch.allclose(aligned(ids).logits, models[1](ids).logits, atol=1e-4)
