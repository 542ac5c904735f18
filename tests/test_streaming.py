"""Streamed (layer-by-layer) alignment of checkpoints on disk: lazy sharded reading, exact
function, planted recovery, shard-by-shard writing in the stored dtype."""

from __future__ import annotations

import re

from tests.helpers import cli_error

import json

import pytest
import torch

from .causal_lm import float64_rmsnorm, hf_model, load_state, logits, rel_err, transformers  # noqa: F401
from fedbasin.alignment import apply_group, canonicalize, random_group_element, weight_match
from fedbasin.alignment.hf import hf_adapter
from fedbasin.alignment.streaming import units_of
from fedbasin.checkpoint import LazyWeights, stream_align

GQA = dict(num_key_value_heads=2, num_hidden_layers=3)


def saved(model, path, shard="30KB"):
    model.save_pretrained(path, max_shard_size=shard)
    return path


def test_units_partition_the_spec():
    spec = hf_adapter(hf_model("llama", **GQA)).spec
    units = units_of(spec)
    assert [u.layer for u in units] == [0, 1, 2, None]
    keys = [k for u in units for k in u.keys]
    assert sorted(keys) == sorted(spec.keys()) and len(keys) == len(set(keys))
    assert sum(len(u.spec.residual) for u in units) == len(spec.residual)
    assert "model.embed_tokens.weight" in units[-1].keys and "model.norm.weight" in units[-1].keys


def test_lazy_weights_read_shards_on_demand(tmp_path):
    model = hf_model("llama", dtype=torch.bfloat16, **GQA)
    saved(model, tmp_path / "m")
    assert (tmp_path / "m" / "model.safetensors.index.json").is_file()
    lazy = LazyWeights(tmp_path / "m")
    state = model.state_dict()
    assert set(lazy.keys()) == set(state)
    got = lazy.load(["model.layers.2.mlp.down_proj.weight", "lm_head.weight"])
    assert got["lm_head.weight"].dtype == torch.bfloat16
    assert torch.equal(got["model.layers.2.mlp.down_proj.weight"], state["model.layers.2.mlp.down_proj.weight"])
    index = json.loads((tmp_path / "m" / "model.safetensors.index.json").read_text())
    (tmp_path / "m" / sorted(set(index["weight_map"].values()))[-1]).unlink()
    with pytest.raises(FileNotFoundError, match="shard .* is missing"):
        LazyWeights(tmp_path / "m")


def test_streamed_alignment_recovers_a_planted_symmetry(tmp_path):
    """Candidate = reference moved by a random group element (float64 files): the streamed
    alignment written shard by shard equals the reference, and loads with from_pretrained."""
    ref = hf_model("llama", **GQA)
    adapter = hf_adapter(ref)
    spec = adapter.spec
    canonical = canonicalize(spec, adapter.to_standard(ref.state_dict()))
    g = random_group_element(spec, 5, "orthogonal", dtype=torch.float64)
    moved = load_state("llama", ref.config, adapter.from_standard(apply_group(spec, canonical.state, g)))
    saved(ref, tmp_path / "ref")
    saved(moved, tmp_path / "cand")
    result = stream_align(tmp_path / "ref", tmp_path / "cand", tmp_path / "out", iterations=60, tol=1e-12,
                          max_shard_bytes=40_000)
    assert all(b >= a - 1e-12 for a, b in zip(result.objective, result.objective[1:]))
    assert result.objective[-1] > 1 - 1e-9
    assert (tmp_path / "out" / "model.safetensors.index.json").is_file()
    out = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float64).eval()
    for key, value in ref.state_dict().items():
        assert float((out.state_dict()[key] - value).abs().max()) < 1e-6, key
    assert rel_err(logits(out), logits(moved)) < 1e-10


def test_streamed_alignment_matches_in_memory_matching_and_keeps_bf16(tmp_path):
    """Two independent bf16 models: the streamed output is bf16, computes the candidate's
    function, and its objective agrees with in-memory weight matching from the same start."""
    a = hf_model("llama", seed=0, dtype=torch.bfloat16, tie_word_embeddings=True, **GQA)
    b = hf_model("llama", seed=1, dtype=torch.bfloat16, tie_word_embeddings=True, **GQA)
    saved(a, tmp_path / "a")
    saved(b, tmp_path / "b")
    result = stream_align(tmp_path / "a", tmp_path / "b", tmp_path / "out", iterations=3, tol=0)
    out = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert out.dtype == torch.bfloat16 and out.config.tie_word_embeddings is False
    float_b = load_state("llama", b.config, {k: v.float() for k, v in b.state_dict().items()}).float()
    float_out = load_state("llama", out.config, {k: v.float() for k, v in out.state_dict().items()}).float()
    assert rel_err(logits(float_out), logits(float_b)) < 2e-2  # bf16 rounding of the written weights
    adapter = hf_adapter(a)
    std = lambda m: adapter.to_standard({k: v.float() for k, v in m.state_dict().items()})  # noqa: E731
    in_memory = weight_match(adapter.spec, std(a), std(b), iterations=3, tol=0, init=None)
    assert result.objective[0] == pytest.approx(in_memory.initial_objective, rel=1e-4)
    assert result.objective[-1] > result.objective[0]
    assert all(y >= x - 1e-9 for x, y in zip(result.objective, result.objective[1:]))


def test_streamed_alignment_refuses_non_standard_layouts(tmp_path):
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=10,
                                                                  n_positions=4))
    gpt2.save_pretrained(tmp_path / "g")
    with pytest.raises(ValueError, match="standard layout"):
        stream_align(tmp_path / "g", tmp_path / "g", tmp_path / "o")
    assert not (tmp_path / "o").exists()


def test_cli_stream_option(tmp_path, capsys):
    from fedbasin.cli import main

    a = hf_model("llama", seed=0, dtype=torch.float32, **GQA)
    b = hf_model("llama", seed=1, dtype=torch.float32, **GQA)
    saved(a, tmp_path / "a")
    saved(b, tmp_path / "b")
    (tmp_path / "a" / "tokenizer.json").write_text('{"stand-in": "tokenizer"}')  # copied as the in-memory path does
    assert main(["align", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "o"), "--stream",
                 "--iterations", "2"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["stream"] and summary["objective"][-1] > summary["initial_objective"]
    assert (tmp_path / "o" / "tokenizer.json").read_text() == '{"stand-in": "tokenizer"}'
    out = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "o").eval()
    assert rel_err(logits(out), logits(b)) < 1e-4
    assert re.search("nowhere", cli_error(capsys, ["align", str(tmp_path / "a"), str(tmp_path / "nowhere"), "--out", str(tmp_path / "x"), "--stream"]))
