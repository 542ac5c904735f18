"""Checkpoint I/O for the CLI, the Flower server and benchmarks.

A checkpoint is a directory holding ``config.json`` and ``model.safetensors``:

* **fedbasin** — ``config.json`` is the model config dataclass as JSON plus a top-level
  ``"fedbasin_family"`` (``"vit"`` or ``"gpt"``); the weights are the model's ``state_dict()``.
* **hf** — a Hugging Face directory (``"model_type"`` in ``config.json``: ``"gpt2"`` or ``"vit"``)
  that ``GPT2LMHeadModel.from_pretrained`` / ``ViTForImageClassification.from_pretrained`` load.
  Reading also accepts ``pytorch_model.bin`` and sharded ``model.safetensors.index.json``, hub
  files without the base-model prefix and transformers-4 key names.

``Checkpoint.state`` always uses the model's ``state_dict()`` keys (for HF: of the installed
transformers), so ``checkpoint.adapter.to_standard(checkpoint.state)`` gives the layout the
alignment code works in and ``adapter.from_standard`` brings results back for
:func:`save_checkpoint` and :func:`build_torch_model`.

Saving is atomic: files are written into a hidden sibling directory that replaces the target
only once complete; an existing checkpoint is removed only after the new one is in place.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import json
import os
import re
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import safetensors
import safetensors.torch
import torch
from torch import nn

from .alignment.adapters import Adapter, fedbasin_adapter
from .atomic import publish
from .models import FAMILIES, build_model, make_config

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"
TORCH_WEIGHTS_FILE = "pytorch_model.bin"
FAMILY_FIELD = "fedbasin_family"
_WEIGHT_FILE = re.compile(r"\.(safetensors|bin|pt|pth|h5|msgpack|ckpt)$|\.index\.json$")


@dataclass
class Checkpoint:
    """A loaded (or in-memory) model.

    kind: ``"fedbasin"`` or ``"hf"``.
    family: fedbasin family (``"vit"``, ``"gpt"``) or HF ``model_type`` (``"gpt2"``, ``"vit"``).
    config: the fedbasin config dataclass, or the HF ``PretrainedConfig``.
    state: the tensors with the model's ``state_dict()`` keys (tied entries share one tensor).
    adapter: spec + translation between ``state`` and the standard layout.
    path: the directory it was loaded from, if any.
    """

    kind: str
    family: str
    config: Any
    state: dict[str, torch.Tensor]
    adapter: Adapter
    path: Path | None = None

    @property
    def model_type(self) -> str:
        return self.family

    @property
    def spec(self):
        return self.adapter.spec


# ----------------------------------------------------------------------------------------------
# per-kind helpers


def _is_hf_config(config) -> bool:
    try:
        from transformers import PretrainedConfig
    except ImportError:  # transformers is an optional extra
        return False
    return isinstance(config, PretrainedConfig)


def _hf():
    if importlib.util.find_spec("transformers") is None:
        raise ImportError("Hugging Face checkpoints need transformers: pip install 'fedbasin[hf]'")
    from .alignment import hf

    return hf


def _adapter(kind: str, family: str, config) -> Adapter:
    return fedbasin_adapter(family, config) if kind == "fedbasin" else _hf().hf_adapter(config)


def _expected_shapes(kind: str, family: str, config) -> dict[str, tuple[int, ...]]:
    if kind == "hf":
        return _hf().hf_expected_shapes(config)
    return {k: tuple(v.shape) for k, v in build_model(family, config).state_dict().items()}


def _tied_pairs(kind: str, family: str, config) -> list[tuple[str, str, str]]:
    """(source, alias, config field) for each tie the config declares."""
    if kind == "fedbasin" and family == "gpt" and config.tie_embeddings:
        return [("tok_emb.weight", "head.weight", "tie_embeddings")]
    if kind == "hf" and family == "gpt2" and _hf().hf_is_tied(config):
        return [("transformer.wte.weight", "lm_head.weight", "tie_word_embeddings")]
    return []


def config_updates(kind: str, family: str, config, state: dict) -> dict:
    """Config fields to change so that ``state`` loads faithfully: a tie is dropped
    (``tie_embeddings`` / ``tie_word_embeddings`` → False) when the tied tensors differ, as
    they do after canonicalisation folds the final norm's gain into the head."""
    if kind == "hf":
        return _hf().hf_config_updates(config, state)
    updates = {}
    for source, alias, field_name in _tied_pairs(kind, family, config):
        a, b = state.get(source), state.get(alias)
        if a is not None and b is not None and a is not b and not _same_values(a, b):
            updates[field_name] = False
    return updates


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a, b)


def _with_updates(kind: str, config, updates: dict):
    if not updates:
        return config
    if kind == "fedbasin":
        return dataclasses.replace(config, **updates)
    config = copy.deepcopy(config)
    for key, value in updates.items():
        setattr(config, key, value)
    return config


def _check_state(state: dict, expected: dict, what: str, arch: str) -> None:
    """``state`` has exactly the ``expected`` keys and shapes; errors name the key at fault."""
    missing = [k for k in expected if k not in state]
    if missing:
        raise ValueError(f"{what}: missing tensor(s) {missing[:8]} required by {arch}")
    unexpected = [k for k in state if k not in expected]
    if unexpected:
        raise ValueError(f"{what}: unexpected tensor(s) {unexpected[:8]} not part of {arch}")
    for key, shape in expected.items():
        if tuple(state[key].shape) != shape:
            raise ValueError(
                f"{what}: {key} has shape {tuple(state[key].shape)} but {arch} expects {shape}"
            )


def _check_finite(state: dict, what: str) -> None:
    """Every floating-point tensor is finite; the error names the first tensor with NaN/inf."""
    for key, value in state.items():
        if value.is_floating_point() and not bool(torch.isfinite(value).all()):
            bad = int((~torch.isfinite(value)).sum())
            raise ValueError(f"{what}: tensor {key} has {bad} NaN or infinite value(s)")


# fields of Hugging Face configs that change the function without changing any tensor shape
_HF_FUNCTION_FIELDS = ("activation_function", "hidden_act", "layer_norm_epsilon", "layer_norm_eps",
                       "scale_attn_weights", "scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn")


def architecture_mismatch(reference: Checkpoint, other: Checkpoint) -> str | None:
    """Why ``other`` cannot be aligned to / averaged with ``reference`` (``None`` if it can):
    a different kind or family, tensors one has and the other lacks (e.g. a different depth),
    a different shape, or a config field that changes the function (norm, activation, ...)."""
    if (reference.kind, reference.family) != (other.kind, other.family):
        return (f"it is a {other.kind} {other.family} model but the reference is a "
                f"{reference.kind} {reference.family} model")
    extra = [k for k in other.state if k not in reference.state]
    missing = [k for k in reference.state if k not in other.state]
    if extra or missing:
        parts = ([f"extra tensor(s) {extra[:4]}"] if extra else []) + (
            [f"missing tensor(s) {missing[:4]}"] if missing else [])
        return f"different architecture: {' and '.join(parts)} compared with the reference"
    for key, value in reference.state.items():
        if other.state[key].shape != value.shape:
            return (f"different architecture: {key} has shape {tuple(other.state[key].shape)}, "
                    f"the reference's {tuple(value.shape)}")
    if reference.kind == "fedbasin":
        ref_fields, other_fields = dataclasses.asdict(reference.config), dataclasses.asdict(other.config)
    else:
        ref_fields, other_fields = ({f: getattr(c.config, f, None) for f in _HF_FUNCTION_FIELDS}
                                    for c in (reference, other))
    differing = [f"{f}={other_fields[f]!r} (reference {ref_fields[f]!r})" for f in ref_fields
                 if f != "tie_embeddings" and other_fields.get(f) != ref_fields[f]]  # ties: see config_updates
    if differing:
        return f"different architecture: {', '.join(differing[:4])}"
    return None


def _alias_ties(kind: str, family: str, config, state: dict, what: str) -> None:
    """Make tied entries one tensor (as in ``state_dict()``); differing values are an error."""
    for source, alias, field_name in _tied_pairs(kind, family, config):
        if state[alias] is not state[source] and not _same_values(state[alias], state[source]):
            raise ValueError(
                f"{what}: {field_name} is true in {CONFIG_FILE} but {alias} differs from "
                f"{source}; set {field_name} to false to keep both"
            )
        state[alias] = state[source]


# ----------------------------------------------------------------------------------------------
# loading


def _read_config(path: Path) -> dict:
    config_path = path / CONFIG_FILE
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path}: no {CONFIG_FILE} in checkpoint directory {path}")
    try:
        data = json.loads(config_path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{config_path}: malformed JSON ({e})") from e
    if not isinstance(data, dict):
        raise ValueError(f"{config_path}: expected a JSON object, got {type(data).__name__}")
    return data


def _read_safetensors(file: Path) -> dict:
    try:
        return safetensors.torch.load_file(str(file), device="cpu")
    except Exception as e:  # SafetensorError, OSError, ... : say which file
        raise ValueError(f"{file}: cannot read safetensors file ({e})") from e


def _read_weights(path: Path, allow_torch: bool) -> tuple[dict, Path]:
    """Tensors of the checkpoint at ``path`` and the file (or index) they came from."""
    single, index = path / WEIGHTS_FILE, path / WEIGHTS_INDEX_FILE
    torch_file = path / TORCH_WEIGHTS_FILE
    if single.is_file():
        return _read_safetensors(single), single
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(
                f"{index}: malformed shard index, expected a 'weight_map' object ({e})"
            ) from e
        state: dict = {}
        for shard in sorted(set(weight_map.values())):
            if not (path / shard).is_file():
                raise FileNotFoundError(f"{index}: shard {shard} is missing from {path}")
            state.update(_read_safetensors(path / shard))
        return state, index
    if allow_torch and torch_file.is_file():
        try:
            return torch.load(torch_file, map_location="cpu", weights_only=True), torch_file
        except Exception as e:
            raise ValueError(f"{torch_file}: cannot read torch weights ({e})") from e
    names = [WEIGHTS_FILE, WEIGHTS_INDEX_FILE] + ([TORCH_WEIGHTS_FILE] if allow_torch else [])
    raise FileNotFoundError(f"{path}: no weights file; expected one of {names}")


def load_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """Load a fedbasin or Hugging Face checkpoint directory (see the module docstring).

    Raises ``FileNotFoundError`` for a missing directory, ``config.json`` or weights file and
    ``ValueError`` for malformed JSON, an unknown family/model_type, or tensors that are missing,
    unexpected or mis-shaped for the config's architecture, or that hold NaN or infinite values —
    each naming the file and key.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint directory {path} does not exist")
    if not path.is_dir():
        raise ValueError(f"{path} is a file; pass the checkpoint directory holding {CONFIG_FILE}")
    data = _read_config(path)
    config_path = path / CONFIG_FILE
    if FAMILY_FIELD in data:
        kind, family = "fedbasin", data.pop(FAMILY_FIELD)
        if family not in FAMILIES:
            raise ValueError(
                f"{config_path}: unknown {FAMILY_FIELD} {family!r}; known: {sorted(FAMILIES)}"
            )
        try:
            config = make_config(family, data)
            expected = _expected_shapes(kind, family, config)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{config_path}: invalid {family} config: {e}") from e
    elif "model_type" in data:
        kind, family = "hf", data["model_type"]
        hf = _hf()
        if family not in hf.SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"{config_path}: unsupported model_type {family!r}; "
                f"supported: {sorted(hf.SUPPORTED_MODEL_TYPES)}"
            )
        try:
            config = hf.hf_config_class(family).from_dict(data)
            expected = _expected_shapes(kind, family, config)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{config_path}: invalid {family} config: {e}") from e
    else:
        raise ValueError(
            f"{config_path}: cannot tell the checkpoint kind: no {FAMILY_FIELD!r} (fedbasin) "
            f"or 'model_type' (Hugging Face) field"
        )
    stored, weights_path = _read_weights(path, allow_torch=kind == "hf")
    state = _hf().hf_state_from_file(config, stored) if kind == "hf" else stored
    arch = f"the {family} architecture in {config_path}"
    _check_state(state, expected, str(weights_path), arch)
    _check_finite(state, str(weights_path))
    _alias_ties(kind, family, config, state, str(weights_path))
    return Checkpoint(kind, family, config, state, _adapter(kind, family, config), path)


# ----------------------------------------------------------------------------------------------
# saving


def _file_tensors(state: dict) -> dict:
    """CPU, contiguous tensors that share no storage (safetensors refuses shared storage)."""
    out, seen = {}, set()
    for key, value in state.items():
        t = value.detach().cpu()
        ptr = t.untyped_storage().data_ptr()
        partial = t.numel() * t.element_size() != t.untyped_storage().nbytes()
        if ptr in seen or partial or not t.is_contiguous():
            t = t.contiguous().clone()
        seen.add(t.untyped_storage().data_ptr())
        out[key] = t
    return out


def _state_dtype(state: dict) -> torch.dtype | None:
    dtypes = {v.dtype for v in state.values() if v.is_floating_point()}
    return dtypes.pop() if len(dtypes) == 1 else None


def _fsync(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # e.g. directories on platforms that cannot open them
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _keep_sidecars(old: Path, new: Path) -> None:
    """Copy files of the checkpoint being replaced (tokenizer, README, ...) that ``new`` lacks;
    weights and ``config.json`` are never carried over."""
    for item in old.iterdir():
        if item.is_file() and not (new / item.name).exists() and not _WEIGHT_FILE.search(item.name):
            shutil.copy2(item, new / item.name)


def _atomic_replace_dir(path: Path, write) -> None:
    """Run ``write(tmp)`` on a fresh sibling directory, then swap it in at ``path``.

    The previous directory at ``path`` is moved aside only once the new one is complete and
    deleted only after the new one is in place; on any failure the temporary directory is
    removed and ``path`` is left as it was.
    """
    if path.exists() and not path.is_dir():
        raise FileExistsError(f"{path} exists and is not a directory")
    if path.is_dir() and any(path.iterdir()) and not (path / CONFIG_FILE).is_file():
        raise FileExistsError(
            f"{path} is a non-empty directory without {CONFIG_FILE}; refusing to replace it"
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    tag = uuid.uuid4().hex[:12]
    tmp = path.parent / f".{path.name}.tmp-{tag}"
    os.mkdir(tmp)
    try:
        write(tmp)
        if path.is_dir():
            _keep_sidecars(path, tmp)
        for item in tmp.iterdir():
            if item.is_file():
                publish(item)
        if path.exists():
            old = path.parent / f".{path.name}.old-{tag}"
            os.replace(path, old)
            try:
                os.replace(tmp, path)
            except BaseException:
                os.replace(old, path)
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
        _fsync(path.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def save_checkpoint(
    path: str | os.PathLike,
    family_or_type: str,
    config,
    state: dict[str, torch.Tensor],
    *,
    kind: str | None = None,
    updates: dict | None = None,
) -> Path:
    """Write ``state`` (``state_dict()`` keys) and ``config`` as a checkpoint directory, atomically.

    ``kind`` defaults to ``"hf"`` when ``config`` is a transformers ``PretrainedConfig``, else
    ``"fedbasin"`` (``config`` a dataclass or dict). The config is written with
    :func:`config_updates` applied (a tie is dropped when the tied tensors differ) plus
    ``updates``. The state is checked against the config's architecture before anything is
    written. HF checkpoints are written as ``save_pretrained`` would (file key layout,
    ``dtype`` set to the tensors' dtype) and load with ``from_pretrained``. Returns the path.
    """
    path = Path(path)
    if kind is None:
        kind = "hf" if _is_hf_config(config) else "fedbasin"
    if kind not in ("fedbasin", "hf"):
        raise ValueError(f"kind must be 'fedbasin' or 'hf', got {kind!r}")
    family = family_or_type
    if kind == "fedbasin":
        if dataclasses.is_dataclass(config):
            config = dataclasses.asdict(config)
        config = make_config(family, config)
    else:
        hf = _hf()
        if isinstance(config, dict):
            config = hf.hf_config_class(family).from_dict(config)
        if getattr(config, "model_type", None) != family:
            raise ValueError(
                f"family_or_type {family!r} does not match the config's model_type "
                f"{getattr(config, 'model_type', None)!r}"
            )
    updates = {**config_updates(kind, family, config, state), **(updates or {})}
    config = _with_updates(kind, config, updates)
    expected = _expected_shapes(kind, family, config)
    _check_state(state, expected, "state to save", f"the {family} architecture")

    if kind == "fedbasin":
        config_text = json.dumps({FAMILY_FIELD: family, **dataclasses.asdict(config)}, indent=2)
        file_state = state
    else:
        config = copy.deepcopy(config)
        config.architectures = [_hf().SUPPORTED_MODEL_TYPES[family]]
        dtype = _state_dtype(state)
        if dtype is not None:
            config.dtype = dtype
        config_text = config.to_json_string(use_diff=True)
        file_state = _hf().hf_state_to_file(config, state)

    def write(tmp: Path) -> None:
        (tmp / CONFIG_FILE).write_text(config_text)
        tensors = _file_tensors(file_state)
        safetensors.torch.save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})

    _atomic_replace_dir(path, write)
    return path


# ----------------------------------------------------------------------------------------------
# models


def build_torch_model(checkpoint: Checkpoint, state: dict | None = None) -> nn.Module:
    """An ``nn.Module`` (eval mode) computing ``state`` (default: the checkpoint's).

    ``state`` uses ``state_dict()`` keys (``adapter.from_standard`` of an aligned state). The
    model takes the state's dtype; a tie in the config is dropped if the tied tensors differ.
    """
    state = checkpoint.state if state is None else state
    kind, family = checkpoint.kind, checkpoint.family
    updates = config_updates(kind, family, checkpoint.config, state)
    config = _with_updates(kind, checkpoint.config, updates)
    if kind == "fedbasin":
        model = build_model(family, config)
    else:
        model = _hf().hf_model_class(family)(config)
    dtype = _state_dtype(state)
    if dtype is not None:
        model.to(dtype)
    model.load_state_dict(state, strict=True)
    return model.eval()


__all__ = [
    "Checkpoint",
    "architecture_mismatch",
    "build_torch_model",
    "config_updates",
    "load_checkpoint",
    "save_checkpoint",
]
