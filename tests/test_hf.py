"""Hugging Face adapters: exact layout round trips, exact invariance, planted recovery, errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from fedbasin.alignment import (
    apply_group,
    canonicalize,
    merge,
    random_group_element,
    to_gauge,
    weight_match,
)
from fedbasin.alignment.hf import (
    hf_adapter,
    hf_config_updates,
    hf_state_from_file,
    hf_state_to_file,
)

GPT2 = dict(
    n_layer=2, n_embd=32, n_head=4, vocab_size=50, n_positions=16, bos_token_id=0, eos_token_id=0
)
VIT = dict(
    image_size=8,
    patch_size=2,
    num_channels=1,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=64,
    num_labels=5,
)
# (model_type, config overrides)
VARIANTS = [
    ("gpt2", {}),  # tied head, gelu_new
    ("gpt2", {"tie_word_embeddings": False, "activation_function": "relu", "n_inner": 48}),
    ("vit", {}),
    ("vit", {"hidden_act": "relu", "qkv_bias": False}),
]


def variant_id(v) -> str:
    return "-".join([v[0]] + [f"{k}={x}" for k, x in v[1].items()])


def hf_config(model_type: str, **overrides):
    if model_type == "gpt2":
        return transformers.GPT2Config(**{**GPT2, **overrides})
    return transformers.ViTConfig(**{**VIT, **overrides})


def hf_model(model_type: str, seed: int = 0, dtype=torch.float64, config=None, **overrides):
    """A tiny HF model far from init (non-trivial gains and biases, some gains negative)."""
    config = config or hf_config(model_type, **overrides)
    cls = (
        transformers.GPT2LMHeadModel
        if model_type == "gpt2"
        else transformers.ViTForImageClassification
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = cls(config).to(dtype).eval()
        g = torch.Generator().manual_seed(1000 + seed)
        with torch.no_grad():
            for name, p in model.named_parameters():  # tied parameters appear once
                noise = torch.randn(p.shape, generator=g, dtype=torch.float64).to(dtype)
                if ("ln" in name or "layernorm" in name) and name.endswith("weight"):
                    p.copy_(1.0 + 0.5 * noise)
                else:
                    p.add_(0.1 * noise)
    return model


def hf_input(model_type: str, dtype=torch.float64, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    if model_type == "gpt2":
        return torch.randint(0, GPT2["vocab_size"], (2, GPT2["n_positions"]), generator=g)
    return torch.rand(
        2, 1, VIT["image_size"], VIT["image_size"], generator=g, dtype=torch.float64
    ).to(dtype)


def logits(model, x) -> torch.Tensor:
    with torch.no_grad():
        return model(x).logits


def rel_err(a, b) -> float:
    return float((a - b).norm() / b.norm())


def assert_same_tensors(got: dict, expected: dict) -> None:
    """Same keys, and every tensor equal in value, shape and dtype."""
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert got[key].dtype == value.dtype and torch.equal(got[key], value), key


def load_untied(model_type: str, config, state: dict):
    """A fresh HF model of ``config`` with the updates ``state`` needs, carrying ``state``."""
    config = type(config).from_dict({**config.to_dict(), **hf_config_updates(config, state)})
    model = hf_model(model_type, config=config)
    model.load_state_dict(state, strict=True)
    return model


# ----------------------------------------------------------------------------------------------
# layout


@pytest.mark.parametrize("variant", VARIANTS, ids=variant_id)
def test_layout_round_trip_is_exact(variant):
    model_type, overrides = variant
    model = hf_model(model_type, **overrides)
    raw = model.state_dict()
    adapter = hf_adapter(model)
    standard = adapter.to_standard(raw)
    adapter.spec.validate(standard)
    assert adapter.spec.keys() <= set(standard)
    back = adapter.from_standard(standard)
    assert list(back) == list(raw)
    for key in raw:
        assert back[key].dtype == raw[key].dtype and torch.equal(back[key], raw[key]), key
    # the standard layout is a fixed point of to_standard
    again = adapter.to_standard(standard)
    assert again.keys() == standard.keys() and all(torch.equal(again[k], v) for k, v in standard.items())


def test_gpt2_standard_layout_is_nn_linear_math():
    """q/k/v/o and up/down in the standard layout compute what GPT-2's Conv1D modules compute."""
    model = hf_model("gpt2")
    standard = hf_adapter(model).to_standard(model.state_dict())
    block = model.transformer.h[1]
    x = torch.randn(3, GPT2["n_embd"], dtype=torch.float64)
    q, k, v = block.attn.c_attn(x).split(GPT2["n_embd"], dim=-1)
    lin = lambda name, inp: F.linear(
        inp, standard[f"transformer.h.1.{name}.weight"], standard[f"transformer.h.1.{name}.bias"]
    )
    for name, want in (
        ("attn.q", q),
        ("attn.k", k),
        ("attn.v", v),
        ("attn.o", block.attn.c_proj(x)),
    ):
        torch.testing.assert_close(lin(name, x), want, rtol=0, atol=1e-12)
    torch.testing.assert_close(lin("mlp.up", x), block.mlp.c_fc(x), rtol=0, atol=1e-12)
    h = torch.randn(3, 4 * GPT2["n_embd"], dtype=torch.float64)
    torch.testing.assert_close(lin("mlp.down", h), block.mlp.c_proj(h), rtol=0, atol=1e-12)


def test_vit_file_layout_and_legacy_names():
    """ViT: save_pretrained's (transformers-4) key names convert to the module layout and back."""
    model = hf_model("vit")
    raw = model.state_dict()
    on_disk = hf_state_to_file(model.config, raw)
    assert "vit.encoder.layer.0.attention.attention.query.weight" in on_disk
    assert "vit.encoder.layer.1.output.dense.bias" in on_disk
    adapter = hf_adapter(model)
    assert_same_tensors(adapter.to_standard(on_disk), adapter.to_standard(raw))
    assert_same_tensors(hf_state_from_file(model.config, on_disk), raw)


def test_gpt2_file_layout_drops_and_restores_the_tied_head():
    model = hf_model("gpt2")
    on_disk = hf_state_to_file(model.config, model.state_dict())
    assert "lm_head.weight" not in on_disk
    # hub GPT-2 files: no "transformer." prefix, legacy causal-mask buffers
    hub = {k.removeprefix("transformer."): v for k, v in on_disk.items()}
    hub["h.0.attn.bias"] = torch.ones(1, 1, 16, 16)
    hub["h.0.attn.masked_bias"] = torch.tensor(-1e4)
    back = hf_state_from_file(model.config, hub)
    assert_same_tensors(back, model.state_dict())
    assert back["lm_head.weight"] is back["transformer.wte.weight"]


def test_buffers_and_unknown_keys_pass_through():
    model = hf_model("gpt2")
    adapter = hf_adapter(model)
    raw = dict(model.state_dict(), **{"transformer.h.0.attn.bias": torch.ones(1, 1, 4, 4)})
    standard = adapter.to_standard(raw)
    assert standard["transformer.h.0.attn.bias"] is raw["transformer.h.0.attn.bias"]
    assert (
        adapter.from_standard(standard)["transformer.h.0.attn.bias"]
        is raw["transformer.h.0.attn.bias"]
    )


def test_config_updates_untie_only_when_needed():
    model = hf_model("gpt2")
    adapter = hf_adapter(model)
    standard = adapter.to_standard(model.state_dict())
    assert hf_config_updates(model.config, model.state_dict()) == {}
    canonical = canonicalize(adapter.spec, standard).state
    assert hf_config_updates(model.config, canonical) == {"tie_word_embeddings": False}
    assert adapter.notes["untie_updates"] == {"tie_word_embeddings": False}
    vit = hf_model("vit")
    assert hf_config_updates(vit.config, vit.state_dict()) == {}


def test_unsupported_models_raise_clear_errors():
    with pytest.raises(ValueError, match=r"'bert'.*supported: \[.*'gpt2'.*'vit'\]"):
        hf_adapter(
            transformers.BertConfig(
                hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64
            )
        )
    with pytest.raises(ValueError, match="cross_attention"):
        hf_adapter(hf_config("gpt2", add_cross_attention=True))
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*GPT2Model"):
        hf_adapter(transformers.GPT2Model(hf_config("gpt2")))
    with pytest.raises(ValueError, match="num_labels=0"):
        hf_adapter(hf_config("vit", num_labels=0))


# ----------------------------------------------------------------------------------------------
# exact symmetry


@pytest.mark.parametrize("variant", VARIANTS, ids=variant_id)
def test_group_action_preserves_the_hf_function(variant):
    """to_standard → canonicalise → random group element → from_standard → same logits."""
    model_type, overrides = variant
    model = hf_model(model_type, **overrides)
    x = hf_input(model_type)
    adapter = hf_adapter(model)
    canonical = canonicalize(adapter.spec, adapter.to_standard(model.state_dict()))
    relu = model_type == "gpt2" and overrides.get("activation_function") == "relu"
    for mode in ("orthogonal", "permutation") if relu else ("orthogonal",):
        g = random_group_element(adapter.spec, 7, mode, dtype=torch.float64, scales=relu)
        moved = adapter.from_standard(apply_group(adapter.spec, canonical.state, g))
        assert (
            rel_err(logits(load_untied(model_type, model.config, moved), x), logits(model, x))
            < 1e-10
        )
    # and back in the original gauge: same function with the original gains
    regauged = adapter.from_standard(to_gauge(adapter.spec, canonical.state, canonical.gains))
    assert (
        rel_err(logits(load_untied(model_type, model.config, regauged), x), logits(model, x))
        < 1e-10
    )


@pytest.mark.parametrize("variant", [VARIANTS[0], VARIANTS[2]], ids=variant_id)
def test_weight_matching_recovers_a_planted_transform(variant):
    model_type, overrides = variant
    model = hf_model(model_type, **overrides)
    adapter = hf_adapter(model)
    spec = adapter.spec
    reference = adapter.to_standard(model.state_dict())
    canonical = canonicalize(spec, reference)
    g = random_group_element(spec, 11, "orthogonal", dtype=torch.float64)
    moved = apply_group(spec, canonical.state, g)
    result = weight_match(spec, reference, moved, iterations=50, tol=1e-12)
    diff = max(
        float((result.canonical[k] - canonical.state[k]).abs().max()) for k in canonical.state
    )
    assert diff < 1e-6, f"canonical weights not recovered: max diff {diff}"
    diff = max(float((result.state[k] - reference[k]).abs().max()) for k in reference)
    assert diff < 1e-6, f"reference-gauge weights not recovered: max diff {diff}"


@pytest.mark.parametrize("variant", [VARIANTS[0], VARIANTS[1], VARIANTS[2]], ids=variant_id)
def test_permutation_mode_recovers_a_planted_permutation(variant):
    """Permutation mode (residual, head, within-head and neuron permutations only) on HF layouts."""
    model_type, overrides = variant
    model = hf_model(model_type, **overrides)
    adapter = hf_adapter(model)
    reference = adapter.to_standard(model.state_dict())
    canonical = canonicalize(adapter.spec, reference)
    g = random_group_element(adapter.spec, 12, "permutation", dtype=torch.float64)
    moved = to_gauge(adapter.spec, apply_group(adapter.spec, canonical.state, g), canonical.gains)
    x = hf_input(model_type)
    moved_model = load_untied(model_type, model.config, adapter.from_standard(moved))
    assert rel_err(logits(moved_model, x), logits(model, x)) < 1e-10
    result = weight_match(adapter.spec, reference, moved, mode="permutation", iterations=50, tol=1e-12)
    diff = max(float((result.state[k] - reference[k]).abs().max()) for k in reference)
    assert diff < 1e-10, f"planted permutation not recovered: max diff {diff}"


@pytest.mark.parametrize("variant", [VARIANTS[0], VARIANTS[3]], ids=variant_id)
def test_merging_transformed_hf_copies_returns_the_model(variant):
    """merge() of an HF model with exact transforms of itself (weights 1:2:3) computes the model;
    plain averaging does not."""
    model_type, overrides = variant
    model = hf_model(model_type, **overrides)
    adapter = hf_adapter(model)
    reference = adapter.to_standard(model.state_dict())
    canonical = canonicalize(adapter.spec, reference)
    copies = [
        to_gauge(adapter.spec, apply_group(adapter.spec, canonical.state,
                                           random_group_element(adapter.spec, seed, dtype=torch.float64)),
                 canonical.gains)
        for seed in (21, 22)
    ]
    x = hf_input(model_type)
    for align, bound in ((True, 1e-8), (False, None)):
        result = merge(adapter.spec, [reference, *copies], weights=[1, 2, 3], iterations=50, tol=1e-12, align=align)
        merged = load_untied(model_type, model.config, adapter.from_standard(result.state))
        err = rel_err(logits(merged, x), logits(model, x))
        assert err < bound if align else err > 1e-2


def test_merging_independent_hf_models_is_the_weighted_aligned_average():
    model_type, overrides = VARIANTS[1]  # untied GPT-2
    a, b = hf_model(model_type, seed=1, **overrides), hf_model(model_type, seed=2, **overrides)
    adapter = hf_adapter(a)
    sa, sb = adapter.to_standard(a.state_dict()), adapter.to_standard(b.state_dict())
    result = merge(adapter.spec, [sa, sb], weights=[1, 3])
    ref = canonicalize(adapter.spec, sa)
    aligned = weight_match(adapter.spec, sa, sb).canonical
    expected = to_gauge(adapter.spec, {k: (ref.state[k] + 3 * aligned[k]) / 4 for k in sa}, ref.gains)
    assert max(float((result.state[k] - expected[k]).abs().max()) for k in expected) < 1e-10
    # the merged standard state loads back into the HF class
    load_untied(model_type, a.config, adapter.from_standard(result.state))


def test_cli_merges_hf_checkpoints(tmp_path, capsys):
    """`fedbasin merge` on two save_pretrained GPT-2 directories (a model and an exact transform
    of it) writes a from_pretrained-loadable model computing the same logits."""
    import json

    from fedbasin.cli import main

    model = hf_model("gpt2", dtype=torch.float32)
    model.save_pretrained(tmp_path / "ref")
    adapter = hf_adapter(model)
    canonical = canonicalize(adapter.spec, adapter.to_standard(model.state_dict()))
    g = random_group_element(adapter.spec, 5, dtype=torch.float32)
    moved = adapter.from_standard(to_gauge(adapter.spec, apply_group(adapter.spec, canonical.state, g),
                                           canonical.gains))
    load_untied("gpt2", model.config, moved).save_pretrained(tmp_path / "moved")
    assert main(["merge", str(tmp_path / "ref"), str(tmp_path / "moved"), "--out", str(tmp_path / "out"),
                 "--weights", "1,3", "--iterations", "50", "--tol", "0"]) == 0
    assert json.loads(capsys.readouterr().out)["weights"] == [1.0, 3.0]
    merged = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "out").eval()
    x = hf_input("gpt2")
    assert rel_err(logits(merged, x), logits(model, x)) < 1e-4
