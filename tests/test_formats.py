"""Checkpoint formats (issue 34): fedbasin's GPT and ViT are registered families like the Hugging Face
ones, and checkpoint I/O dispatches through one :class:`~fedbasin.formats.ModelFormat` per family —
every registered family round-trips save → load → build, and a newly registered one needs nothing else."""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import json
from pathlib import Path

import pytest
import torch

from fedbasin import formats
from fedbasin.alignment import adapters
from fedbasin.checkpoint import build_torch_model, load_checkpoint, save_checkpoint, stream_align
from fedbasin.models import GPT, GPTConfig, registry
from fedbasin.models import family as native_family
from fedbasin.models import names as native_names

HAS_HF = importlib.util.find_spec("transformers") is not None
TEXT = dict(vocab_size=29, block_size=12)
IMAGES = dict(image_size=8, channels=1, num_classes=5)
SHAPE = dict(dim=16, depth=2, heads=2, mlp_dim=24)


def _hf_types() -> list[str]:
    if not HAS_HF:
        return []
    from fedbasin.alignment.families import supported

    return supported()


FORMATS = [("fedbasin", name) for name in native_names()] + [("hf", t) for t in _hf_types()]


def _new(fmt: formats.ModelFormat, seed: int = 0):
    """(config, model) of a small new model of ``fmt``'s family, its weights perturbed off the init."""
    data = TEXT if fmt.data == "text" else IMAGES
    shape = SHAPE if fmt.data == "text" else {**SHAPE, "patch_size": 4}
    if isinstance(fmt, formats.NativeFormat):
        config = fmt.entry.make_config({**data, **shape})
    else:
        config = fmt.entry.new_config(fmt.family, shape, data)
    torch.manual_seed(seed)
    model = fmt.build(config).eval()
    g = torch.Generator().manual_seed(100 + seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return config, model


def _input(fmt: formats.ModelFormat):
    g = torch.Generator().manual_seed(0)
    if fmt.data == "text":
        return torch.randint(0, TEXT["vocab_size"], (2, TEXT["block_size"]), generator=g)
    return torch.rand(2, IMAGES["channels"], IMAGES["image_size"], IMAGES["image_size"], generator=g)


def _out(model, x):
    with torch.no_grad():
        y = model(x)
    return getattr(y, "logits", y)


@pytest.mark.parametrize("kind,family", FORMATS, ids=[f"{k}-{f}" for k, f in FORMATS])
def test_every_registered_family_round_trips_through_its_format(tmp_path, kind, family):
    fmt = formats.for_kind(kind, family)
    config, model = _new(fmt)
    x = _input(fmt)
    path = save_checkpoint(tmp_path / family, family, config, model.state_dict(), kind=kind)
    # the one config detection finds the same format in what was written
    found = formats.detect(json.loads((path / "config.json").read_text()), path / "config.json")
    assert (type(found), found.kind, found.family) == (type(fmt), kind, family)
    ckpt = load_checkpoint(path)
    assert (ckpt.kind, ckpt.family, type(ckpt.format)) == (kind, family, type(fmt))
    assert ckpt.state.keys() == model.state_dict().keys()
    assert all(torch.equal(ckpt.state[k], v) for k, v in model.state_dict().items())
    assert torch.equal(_out(build_torch_model(ckpt), x), _out(model, x))
    # what the CLI reads of the family
    assert ckpt.data == fmt.data == fmt.entry.data
    assert ckpt.data_values() == (TEXT if fmt.data == "text" else IMAGES)
    assert ckpt.context_length == (TEXT["block_size"] if fmt.data == "text" else None)


def test_native_families_declare_data_context_and_ties():
    gpt, vit = native_family("gpt"), native_family("vit")
    assert native_names() == ["vit", "gpt"]  # --model's order
    assert (gpt.data, vit.data) == ("text", "images")
    config = gpt.make_config({"block_size": 7, "tie_embeddings": True})
    assert gpt.context_length(config) == 7 and vit.context_length(vit.make_config()) is None
    assert gpt.tied_pairs(config) == [("tok_emb.weight", "head.weight", "tie_embeddings")]
    assert gpt.tied_pairs(dataclasses.replace(config, tie_embeddings=False)) == []
    assert vit.tied_pairs(vit.make_config()) == []
    with pytest.raises(ValueError, match=r"unknown model family 'resnet'; known: \['gpt', 'vit'\]"):
        native_family("resnet")
    with pytest.raises(ValueError, match="kind must be 'fedbasin' or 'hf', got 'onnx'"):
        formats.for_kind("onnx", "gpt")


@dataclasses.dataclass
class WideGPTConfig(GPTConfig):
    """A stand-in for a new fedbasin family: a GPT under another name and config class."""


def test_a_newly_registered_native_family_needs_no_change_to_checkpoint_io(tmp_path, monkeypatch):
    gpt = native_family("gpt")
    entry = dataclasses.replace(gpt, name="widegpt", config=WideGPTConfig)
    monkeypatch.setitem(registry._REGISTRY, "widegpt", entry)
    monkeypatch.setitem(adapters._NATIVE_INPUTS, "widegpt", entry.inputs)
    config = WideGPTConfig(vocab_size=17, block_size=8, dim=16, depth=1, heads=2, mlp_dim=24, tie_embeddings=True)
    models = [GPT(config, seed=seed) for seed in (0, 1)]
    paths = [save_checkpoint(tmp_path / f"m{i}", "widegpt", config, m.state_dict()) for i, m in enumerate(models)]
    written = json.loads((paths[0] / "config.json").read_text())
    assert written["fedbasin_family"] == "widegpt"
    ckpt = load_checkpoint(paths[0])
    assert (ckpt.kind, ckpt.family, type(ckpt.config)) == ("fedbasin", "widegpt", WideGPTConfig)
    assert ckpt.spec.name == "fedbasin-widegpt" and ckpt.context_length == 8
    assert ckpt.state["head.weight"] is ckpt.state["tok_emb.weight"]  # the family's tie
    x = torch.randint(0, 17, (2, 8))
    assert torch.equal(_out(build_torch_model(ckpt), x), _out(models[0].eval(), x))
    stream_align(paths[0], paths[1], tmp_path / "aligned")
    aligned = load_checkpoint(tmp_path / "aligned")
    assert aligned.family == "widegpt"
    assert torch.allclose(_out(build_torch_model(aligned), x), _out(models[1].eval(), x), atol=1e-5)


def test_checkpoint_io_compares_no_kind_or_family_names():
    """checkpoint.py asks the format; a comparison with ``"fedbasin"``, ``"hf"`` or a family name
    would be a second dispatch (formats.py holds the per-kind code)."""
    source = (Path(__file__).resolve().parents[1] / "fedbasin" / "checkpoint.py").read_text()
    names = {"fedbasin", "hf", *native_names(), *_hf_types()}
    compared = [ast.unparse(node) for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Compare)
                and any(isinstance(c, ast.Constant) and c.value in names for c in [node.left, *node.comparators])]
    assert compared == []
