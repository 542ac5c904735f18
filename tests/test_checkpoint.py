"""Checkpoint I/O: round trips (fedbasin and Hugging Face), clear errors, atomic saves."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time

import pytest
import safetensors.torch
import torch

from fedbasin.alignment import apply_group, canonicalize, random_group_element
from fedbasin.checkpoint import build_torch_model, load_checkpoint, save_checkpoint
from fedbasin.models import build_model

VIT = dict(
    image_size=8, patch_size=4, channels=1, num_classes=5, dim=16, depth=2, heads=2, mlp_dim=24
)
GPT = dict(vocab_size=23, block_size=12, dim=16, depth=2, heads=2, mlp_dim=24, tie_embeddings=True)
FEDBASIN = [("vit", VIT), ("gpt", GPT)]


def fedbasin_model(family, config, seed=0, dtype=torch.float32):
    model = build_model(family, config, seed=seed).to(dtype).eval()
    g = torch.Generator().manual_seed(100 + seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=torch.float64).to(dtype)
            p.copy_(1.0 + 0.5 * noise) if "norm" in name and name.endswith("weight") else p.add_(
                0.1 * noise
            )
    return model


def fedbasin_input(family, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    if family == "vit":
        return torch.rand(2, 1, 8, 8, generator=g, dtype=torch.float64).to(dtype)
    return torch.randint(0, GPT["vocab_size"], (2, GPT["block_size"]), generator=g)


def out(model, x):
    with torch.no_grad():
        y = model(x)
    return getattr(y, "logits", y)


def leftovers(parent) -> list[str]:
    return sorted(n for n in os.listdir(parent) if ".tmp-" in n or ".old-" in n)


# ----------------------------------------------------------------------------------------------
# fedbasin checkpoints


@pytest.mark.parametrize("family,config", FEDBASIN, ids=[f for f, _ in FEDBASIN])
def test_fedbasin_round_trip(tmp_path, family, config):
    model = fedbasin_model(family, config)
    path = save_checkpoint(tmp_path / "ckpt", family, model.config, model.state_dict())
    assert json.loads((path / "config.json").read_text())["fedbasin_family"] == family
    ckpt = load_checkpoint(path)
    assert (ckpt.kind, ckpt.family, ckpt.config) == ("fedbasin", family, model.config)
    original = model.state_dict()
    assert ckpt.state.keys() == original.keys()
    assert all(torch.equal(ckpt.state[k], original[k]) for k in original)
    ckpt.spec.validate(ckpt.adapter.to_standard(ckpt.state))
    if family == "gpt":  # tied entries come back as one tensor, like state_dict()
        assert ckpt.state["head.weight"] is ckpt.state["tok_emb.weight"]
    x = fedbasin_input(family)
    assert torch.equal(out(build_torch_model(ckpt), x), out(model, x))
    assert leftovers(tmp_path) == []


def test_fedbasin_untied_state_unties_the_config(tmp_path):
    """A canonicalised tied GPT (head ≠ embedding) is saved with tie_embeddings=false."""
    model = fedbasin_model("gpt", GPT, dtype=torch.float64)
    ckpt = load_checkpoint(save_checkpoint(tmp_path / "a", "gpt", model.config, model.state_dict()))
    canonical = canonicalize(ckpt.spec, ckpt.state).state
    path = save_checkpoint(tmp_path / "b", "gpt", ckpt.config, canonical)
    assert json.loads((path / "config.json").read_text())["tie_embeddings"] is False
    x = fedbasin_input("gpt")
    reloaded = load_checkpoint(path)
    torch.testing.assert_close(
        out(build_torch_model(reloaded), x), out(model, x), rtol=1e-10, atol=1e-12
    )
    # build_torch_model unties on its own when handed an untied state
    torch.testing.assert_close(
        out(build_torch_model(ckpt, canonical), x), out(model, x), rtol=1e-10, atol=1e-12
    )


# ----------------------------------------------------------------------------------------------
# Hugging Face checkpoints

HAS_HF = importlib.util.find_spec("transformers") is not None
needs_hf = pytest.mark.skipif(not HAS_HF, reason="transformers is not installed")
if HAS_HF:
    import transformers

    from fedbasin.alignment.hf import hf_adapter

    from .test_hf import hf_input, hf_model


@needs_hf
@pytest.mark.parametrize("model_type", ["gpt2", "vit"])
def test_hf_round_trip_and_from_pretrained(tmp_path, model_type):
    model = hf_model(model_type, dtype=torch.float32)
    cls = type(model)
    x = hf_input(model_type, dtype=torch.float32)
    path = save_checkpoint(tmp_path / "hf", model_type, model.config, model.state_dict())
    ckpt = load_checkpoint(path)
    assert (ckpt.kind, ckpt.model_type) == ("hf", model_type)
    assert ckpt.state.keys() == model.state_dict().keys()
    ckpt.spec.validate(ckpt.adapter.to_standard(ckpt.state))
    want = out(model, x)
    assert torch.equal(out(build_torch_model(ckpt), x), want)
    assert torch.equal(out(cls.from_pretrained(path).eval(), x), want)
    # and a directory written by transformers itself loads the same
    model.save_pretrained(tmp_path / "native")
    native = load_checkpoint(tmp_path / "native")
    assert all(torch.equal(native.state[k], ckpt.state[k]) for k in ckpt.state)


@needs_hf
def test_hf_aligned_gpt2_saves_untied_and_loads_with_from_pretrained(tmp_path):
    """CLI path: load → standard → canonicalise → transform → save; same function (float64)."""
    model = hf_model("gpt2")
    ckpt = load_checkpoint(
        save_checkpoint(tmp_path / "a", "gpt2", model.config, model.state_dict())
    )
    spec = ckpt.spec
    canonical = canonicalize(spec, ckpt.adapter.to_standard(ckpt.state)).state
    moved = apply_group(spec, canonical, random_group_element(spec, 3, dtype=torch.float64))
    path = save_checkpoint(
        tmp_path / "b", ckpt.family, ckpt.config, ckpt.adapter.from_standard(moved)
    )
    config = json.loads((path / "config.json").read_text())
    assert config["tie_word_embeddings"] is False and config["dtype"] == "float64"
    x = hf_input("gpt2")
    loaded = transformers.GPT2LMHeadModel.from_pretrained(path).eval()
    assert loaded.dtype == torch.float64
    err = (out(loaded, x) - out(model, x)).norm() / out(model, x).norm()
    assert err < 1e-10


@needs_hf
def test_hf_hub_style_files_load(tmp_path):
    """Hub GPT-2 files: no base-model prefix, legacy mask buffers, no tied head, .bin weights."""
    model = hf_model("gpt2", dtype=torch.float32)
    model.config.to_json_file(tmp_path / "config.json")
    hub = {
        k.removeprefix("transformer."): v.clone()
        for k, v in model.state_dict().items()
        if k != "lm_head.weight"
    }
    hub["h.0.attn.bias"] = torch.tril(torch.ones(1, 1, 16, 16))
    hub["h.0.attn.masked_bias"] = torch.tensor(-1e4)
    torch.save(hub, tmp_path / "pytorch_model.bin")
    ckpt = load_checkpoint(tmp_path)
    assert ckpt.state.keys() == model.state_dict().keys()
    x = hf_input("gpt2")
    assert torch.equal(out(build_torch_model(ckpt), x), out(model, x))


# ----------------------------------------------------------------------------------------------
# errors


@pytest.fixture
def saved(tmp_path):
    model = fedbasin_model("gpt", GPT)
    return save_checkpoint(tmp_path / "ckpt", "gpt", model.config, model.state_dict())


def test_missing_directory_and_config(tmp_path, saved):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_checkpoint(tmp_path / "nope")
    (saved / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_checkpoint(saved)


@pytest.mark.parametrize(
    "text,match",
    [
        ("{not json", r"config.json: malformed JSON"),
        ('{"model_type": "bert"}', r"unsupported model_type 'bert'; supported: \[.*'gpt2'.*'vit'\]"),
        ('{"fedbasin_family": "resnet"}', r"unknown fedbasin_family 'resnet'"),
        ('{"fedbasin_family": "gpt", "width": 3}', r"unknown gpt config field\(s\) \['width'\]"),
        ('{"hidden_size": 3}', r"no 'fedbasin_family' \(fedbasin\) or 'model_type'"),
    ],
)
def test_bad_config_json(saved, text, match):
    (saved / "config.json").write_text(text)
    with pytest.raises(ValueError, match=match):
        load_checkpoint(saved)


def test_bad_weights(saved):
    state = safetensors.torch.load_file(saved / "model.safetensors")
    (saved / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_checkpoint(saved)
    missing = {k: v for k, v in state.items() if k != "blocks.1.attn.q.weight"}
    safetensors.torch.save_file(missing, saved / "model.safetensors")
    with pytest.raises(
        ValueError, match=r"model.safetensors: missing tensor\(s\) \['blocks.1.attn.q.weight'\]"
    ):
        load_checkpoint(saved)
    wrong = dict(state, **{"blocks.0.mlp.up.weight": torch.zeros(7, 16)})
    safetensors.torch.save_file(wrong, saved / "model.safetensors")
    with pytest.raises(
        ValueError, match=r"blocks.0.mlp.up.weight has shape \(7, 16\) .* expects \(24, 16\)"
    ):
        load_checkpoint(saved)
    untied = dict(state, **{"head.weight": state["head.weight"] + 1})
    safetensors.torch.save_file(untied, saved / "model.safetensors")
    with pytest.raises(
        ValueError, match="tie_embeddings is true in config.json but head.weight differs"
    ):
        load_checkpoint(saved)
    (saved / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(ValueError, match="cannot read safetensors"):
        load_checkpoint(saved)


@needs_hf
def test_saving_a_state_of_the_wrong_layout_names_the_key(tmp_path):
    model = hf_model("gpt2", dtype=torch.float32)
    std = hf_adapter(model).to_standard(model.state_dict())  # forgot from_standard
    with pytest.raises(
        ValueError, match=r"missing tensor\(s\) \['transformer.h.0.attn.c_attn.weight'"
    ):
        save_checkpoint(tmp_path / "x", "gpt2", model.config, std)
    assert not (tmp_path / "x").exists() and leftovers(tmp_path) == []


# ----------------------------------------------------------------------------------------------
# atomic save


def test_failed_save_keeps_the_previous_checkpoint(tmp_path, saved, monkeypatch):
    before = load_checkpoint(saved).state
    other = fedbasin_model("gpt", GPT, seed=1)

    def broken_save_file(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"half a file")
        raise OSError("disk full")

    monkeypatch.setattr(safetensors.torch, "save_file", broken_save_file)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(saved, "gpt", other.config, other.state_dict())
    monkeypatch.undo()
    after = load_checkpoint(saved).state
    assert all(torch.equal(after[k], before[k]) for k in before)
    assert leftovers(tmp_path) == []


def test_overwrite_replaces_weights_keeps_sidecars_and_refuses_foreign_dirs(tmp_path, saved):
    (saved / "README.md").write_text("notes")
    (saved / "tokenizer.json").write_text("{}")  # the ids the replaced weights read
    (saved / "train.json").write_text('{"seed": 0}')  # describes the weights being replaced
    other = fedbasin_model("gpt", GPT, seed=1)
    save_checkpoint(saved, "gpt", other.config, other.state_dict(),
                    extra_files=lambda d: (d / "characters.json").write_text('{"characters": "ab"}'))
    state = load_checkpoint(saved).state
    assert all(torch.equal(state[k], v) for k, v in other.state_dict().items())
    assert (saved / "README.md").read_text() == "notes"
    # never left beside weights they do not describe: a stale tokenizer would outrank the new characters.json
    assert not (saved / "train.json").exists() and not (saved / "tokenizer.json").exists()
    assert (saved / "characters.json").is_file()
    assert leftovers(tmp_path) == []
    foreign = tmp_path / "home"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="refusing to replace"):
        save_checkpoint(foreign, "gpt", other.config, other.state_dict())
    assert (foreign / "notes.txt").read_text() == "keep me"


# ----------------------------------------------------------------------------------------------
# what killed writes leave behind


def _dead_pid() -> int:
    """The PID of a process that has exited (and been reaped)."""
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    return int(done.stdout)


@pytest.mark.parametrize("writer", ["checkpoint", "file"])
def test_the_next_write_removes_stale_temporaries_of_its_own_naming_only(tmp_path, writer):
    """A killed writer's ``.NAME.tmp-PID-HEX`` (its PID gone) is removed when the next write into
    that directory starts; a live writer's temporaries, temporaries of the old naming younger than
    a day, and every other name stay."""
    from fedbasin.atomic import OLD_TEMPORARY_AGE_S, atomic_write

    live = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        dead = _dead_pid()
        stale_dir = tmp_path / f".ckpt.tmp-{dead}-0123456789ab"
        stale_dir.mkdir()
        (stale_dir / "model.safetensors").write_bytes(b"half a file")
        stale_file = tmp_path / f".results.json.tmp-{dead}-abcdefabcdef.json"
        stale_file.write_text("{")
        old_naming = tmp_path / ".curves.png.0123456789ab.tmp.png"
        old_naming.write_bytes(b"png")
        days_ago = time.time() - 2 * OLD_TEMPORARY_AGE_S
        os.utime(old_naming, (days_ago, days_ago))
        kept = [
            tmp_path / f".ckpt.tmp-{live.pid}-0123456789ab",  # a concurrent writer, still running
            tmp_path / f".other.tmp-{os.getpid()}-0123456789ab",  # this process's own
            tmp_path / ".ckpt.tmp-fedcba987654",  # old naming, recent: its writer may still run
            tmp_path / f"ckpt.tmp-{dead}-0123456789ab",  # not hidden: not fedbasin's naming
            tmp_path / f".ckpt.old-{dead}-0123456789ab",  # may hold the only copy of a checkpoint
            tmp_path / f".notes.tmp-{dead}-xyz",  # no tag of ours
            tmp_path / "round-0001.damaged-20240101-000000",
            tmp_path / "notes.txt",
        ]
        for path in kept:
            path.mkdir() if "ckpt" in path.name else path.write_text("mine")
        if writer == "checkpoint":
            model = fedbasin_model("gpt", GPT)
            save_checkpoint(tmp_path / "ckpt", "gpt", model.config, model.state_dict())
        else:
            atomic_write(tmp_path / "results.json", lambda tmp: tmp.write_text("{}"))
        assert not stale_dir.exists() and not stale_file.exists() and not old_naming.exists()
        assert all(path.exists() for path in kept), [p.name for p in kept if not p.exists()]
        assert live.poll() is None
    finally:
        live.communicate(b"")
