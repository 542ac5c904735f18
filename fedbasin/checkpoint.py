"""Checkpoint I/O for the CLI, the Flower server and benchmarks.

A checkpoint is a directory holding ``config.json`` and ``model.safetensors``:

* **fedbasin** — ``config.json`` is the model config dataclass as JSON plus a top-level
  ``"fedbasin_family"`` (``"vit"`` or ``"gpt"``); the weights are the model's ``state_dict()``.
* **hf** — a Hugging Face directory (``"model_type"`` in ``config.json``: ``"gpt2"`` or ``"vit"``)
  that ``GPT2LMHeadModel.from_pretrained`` / ``ViTForImageClassification.from_pretrained`` load.
  Reading also accepts ``pytorch_model.bin`` and sharded ``model.safetensors.index.json``, hub
  files without the base-model prefix and transformers-4 key names.

Each kind is one :class:`~fedbasin.formats.ModelFormat` (:mod:`fedbasin.formats`), the interface
this module dispatches through: what data the family reads (``data``, ``data_values``,
``context_length``), its config (from and to JSON, ``with_updates``, the fields that change the
function), its tensors (``adapter``, ``expected_shapes``, ``tied_pairs``, ``config_updates``, file
layout ↔ ``state_dict()`` keys) and ``build(config)`` → ``nn.Module``. :func:`fedbasin.formats.detect`
is the one place a ``config.json`` is told apart; ``Checkpoint.kind`` (``"fedbasin"``/``"hf"``) is
reported and names the format, and no code here branches on it.

``Checkpoint.state`` always uses the model's ``state_dict()`` keys (for HF: of the installed
transformers), so ``checkpoint.adapter.to_standard(checkpoint.state)`` gives the layout the
alignment code works in and ``adapter.from_standard`` brings results back for
:func:`save_checkpoint` and :func:`build_torch_model`.

Saving is atomic: files are written into a hidden sibling directory that replaces the target
only once complete; an existing checkpoint is removed only after the new one is in place.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import safetensors
import safetensors.torch
import torch
from torch import nn

from .alignment.adapters import Adapter
from .atomic import exchange, publish, sweep_stale, temporary_sibling
from .data.sources import TOKENIZER_FILES
from .formats import FAMILY_FIELD, ModelFormat, detect, for_kind, kind_of, same_values  # noqa: F401  (FAMILY_FIELD: re-exported)

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"
TORCH_WEIGHTS_FILE = "pytorch_model.bin"
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
    stored_dtype: the floating dtype its file holds when ``state`` was converted for computing
    (:func:`in_float32`); None: ``state``'s own.
    """

    kind: str
    family: str
    config: Any
    state: dict[str, torch.Tensor]
    adapter: Adapter
    path: Path | None = None
    stored_dtype: torch.dtype | None = None

    @property
    def model_type(self) -> str:
        return self.family

    @property
    def spec(self):
        return self.adapter.spec

    @property
    def format(self) -> ModelFormat:
        """How this checkpoint's family is read, written, checked and built (:mod:`fedbasin.formats`)."""
        return for_kind(self.kind, self.family)

    # what the model reads, as its family declares it — callers ask here instead of branching on
    # family names

    @property
    def data(self) -> str:
        """``"text"`` (token ids → next-token logits) or ``"images"`` (pixels → class logits)."""
        return self.format.data

    def data_values(self) -> dict:
        """The config fields the data fixes, in fedbasin names (``vocab_size``, ``block_size``;
        ``image_size``, ``channels``, ``num_classes``)."""
        return self.format.data_values(self.config)

    @property
    def context_length(self) -> int | None:
        """Tokens per example the model takes (None for image models)."""
        return self.format.context_length(self.config)


# ----------------------------------------------------------------------------------------------
# checks


def config_updates(kind: str, family: str, config, state: dict) -> dict:
    """Config fields to change so that ``state`` loads faithfully: a tie is dropped
    (``tie_embeddings`` / ``tie_word_embeddings`` → False) when the tied tensors differ, as
    they do after canonicalisation folds the final norm's gain into the head."""
    return for_kind(kind, family).config_updates(config, state)


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
    """Every tensor is floating point (the weights of every registered family are) and finite; the
    error names the first tensor that is not."""
    for key, value in state.items():
        if not value.is_floating_point():
            raise ValueError(f"{what}: tensor {key} has dtype {str(value.dtype).removeprefix('torch.')}; "
                             "model weights must be floating point")
        if not bool(torch.isfinite(value).all()):
            bad = int((~torch.isfinite(value)).sum())
            raise ValueError(f"{what}: tensor {key} has {bad} NaN or infinite value(s)")


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
    function_fields = reference.format.function_fields
    ref_fields, other_fields = function_fields(reference.config), function_fields(other.config)
    differing = [f"{f}={other_fields[f]!r} (reference {ref_fields[f]!r})" for f in ref_fields
                 if f != "tie_embeddings" and other_fields.get(f) != ref_fields[f]]  # ties: see config_updates
    if differing:
        return f"different architecture: {', '.join(differing[:4])}"
    return None


def _alias_ties(fmt: ModelFormat, config, state: dict, what: str) -> None:
    """Make tied entries one tensor (as in ``state_dict()``); differing values are an error."""
    for source, alias, field_name in fmt.tied_pairs(config):
        if state[alias] is not state[source] and not same_values(state[alias], state[source]):
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


def _write_safetensors(tensors: dict, file: Path) -> None:
    """``save_file``, its I/O failures (a full disk, a quota) raised as the ``OSError`` they are
    (safetensors reports them as ``SafetensorError("... (os error 28)")``)."""
    try:
        safetensors.torch.save_file(tensors, str(file), metadata={"format": "pt"})
    except safetensors.SafetensorError as e:
        if found := re.search(r"\(os error (\d+)\)", str(e)):
            code = int(found.group(1))
            raise OSError(code, os.strerror(code), str(file)) from e
        raise


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
    fmt = detect(data, config_path)
    family = fmt.family
    try:
        config = fmt.config_from_json(data)
        expected = fmt.expected_shapes(config)
    except (TypeError, ValueError, RuntimeError) as e:  # (RuntimeError: e.g. a negative size)
        raise ValueError(f"{config_path}: invalid {family} config: {e}") from e
    stored, weights_path = _read_weights(path, allow_torch=fmt.reads_torch_weights)
    state = fmt.state_from_file(config, stored)
    arch = f"the {family} architecture in {config_path}"
    _check_state(state, expected, str(weights_path), arch)
    _check_finite(state, str(weights_path))
    _alias_ties(fmt, config, state, str(weights_path))
    return Checkpoint(fmt.kind, family, config, state, fmt.adapter(config), path)


def cast_floating(state: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """``state`` with its floating tensors as ``dtype``; entries sharing one tensor (ties) still do."""
    cast: dict[int, torch.Tensor] = {}
    return {k: cast.setdefault(id(v), v.to(dtype)) if v.is_floating_point() else v for k, v in state.items()}


def in_float32(checkpoint: Checkpoint) -> Checkpoint:
    """The checkpoint computing in float32 (the data's dtype: a float16, bfloat16 or float64 model evaluates,
    aligns and merges as float32); ``stored_dtype`` remembers the file's dtype, for writing results in it."""
    stored = _state_dtype(checkpoint.state)
    if stored in (None, torch.float32):
        return checkpoint
    return replace(checkpoint, state=cast_floating(checkpoint.state, torch.float32), stored_dtype=stored)


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


#: files that describe one checkpoint's weights (how they were trained, the token ids they read): replaced
#: with them, never carried over to the weights that replace them
TRAIN_RECORD = "train.json"  # what `fedbasin train` wrote these weights with
WEIGHT_RECORDS = (TRAIN_RECORD, *TOKENIZER_FILES)


def _keep_sidecars(old: Path, new: Path) -> None:
    """Copy files of the checkpoint being replaced (README, ...) that ``new`` lacks;
    weights, ``config.json`` and the records of the old weights (:data:`WEIGHT_RECORDS`) are
    never carried over: they would describe weights that are gone."""
    for item in old.iterdir():
        if (item.is_file() and not (new / item.name).exists() and not _WEIGHT_FILE.search(item.name)
                and item.name not in WEIGHT_RECORDS):
            shutil.copy2(item, new / item.name)


def _atomic_replace_dir(path: Path, write) -> None:
    """Run ``write(tmp)`` on a fresh sibling directory, then swap it in at ``path``.

    The new directory is swapped in only once complete, in one step where the platform can
    (:func:`~fedbasin.atomic.exchange`: ``path`` always names a whole checkpoint, old or new),
    and the old one is deleted only after that; on any failure the temporary directory is
    removed and ``path`` is left as it was.
    """
    if path.exists() and not path.is_dir():
        raise FileExistsError(f"{path} exists and is not a directory")
    if path.is_dir() and any(path.iterdir()) and not (path / CONFIG_FILE).is_file():
        raise FileExistsError(
            f"{path} is a non-empty directory without {CONFIG_FILE}; refusing to replace it"
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    sweep_stale(path.parent)  # what killed writes left here (fedbasin.atomic)
    tmp = temporary_sibling(path)
    tag = tmp.name.rpartition(".tmp-")[2]
    os.mkdir(tmp)
    try:
        write(tmp)
        if path.is_dir():
            _keep_sidecars(path, tmp)
        for item in tmp.iterdir():
            if item.is_file():
                publish(item)
        if path.exists() and exchange(tmp, path):  # no moment without a checkpoint at path
            shutil.rmtree(tmp, ignore_errors=True)  # now the old checkpoint
        elif path.exists():  # no atomic exchange on this platform: a short window remains
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
    extra_files=None,
) -> Path:
    """Write ``state`` (``state_dict()`` keys) and ``config`` as a checkpoint directory, atomically.

    ``extra_files(directory)``, if given, writes more files (e.g. a tokenizer) into the
    directory before it is swapped in.

    ``kind`` defaults to ``"hf"`` when ``config`` is a transformers ``PretrainedConfig``, else
    ``"fedbasin"`` (``config`` a dataclass or dict). The config is written with
    :func:`config_updates` applied (a tie is dropped when the tied tensors differ) plus
    ``updates``. The state is checked against the config's architecture before anything is
    written. HF checkpoints are written as ``save_pretrained`` would (file key layout,
    ``dtype`` set to the tensors' dtype) and load with ``from_pretrained``. Returns the path.
    """
    path = Path(path)
    fmt = for_kind(kind_of(config) if kind is None else kind, family_or_type)
    family = fmt.family
    config = fmt.config_to_save(config)
    updates = {**fmt.config_updates(config, state), **(updates or {})}
    config = fmt.with_updates(config, updates)
    expected = fmt.expected_shapes(config)
    _check_state(state, expected, "state to save", f"the {family} architecture")
    config_text = fmt.config_json(config, _state_dtype(state))
    file_state = fmt.state_to_file(config, state)

    def write(tmp: Path) -> None:
        (tmp / CONFIG_FILE).write_text(config_text)
        _write_safetensors(_file_tensors(file_state), tmp / WEIGHTS_FILE)
        if extra_files is not None:
            extra_files(tmp)

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
    fmt = checkpoint.format
    config = fmt.with_updates(checkpoint.config, fmt.config_updates(checkpoint.config, state))
    model = fmt.build(config)
    dtype = _state_dtype(state)
    if dtype is not None:
        model.to(dtype)
    model.load_state_dict(state, strict=True)
    return model.eval()


__all__ = [
    "Checkpoint",
    "LazyWeights",
    "ShardWriter",
    "stream_align",
    "architecture_mismatch",
    "build_torch_model",
    "config_updates",
    "load_checkpoint",
    "save_checkpoint",
]


# ----------------------------------------------------------------------------------------------
# lazy reading and streamed writing (large checkpoints)


class LazyWeights:
    """The tensors of a checkpoint's safetensors file(s), read on demand in their stored dtype.

    ``path``: a checkpoint directory with ``model.safetensors`` or a sharded
    ``model.safetensors.index.json``. Keys are the file's keys (``rename`` maps them to module
    keys, e.g. adding a missing base-model prefix); ``aliases`` maps a missing key to the key it
    shares storage with (a tied head). ``load(keys)`` opens each shard once per call and copies
    out only the requested tensors, so memory holds what the caller keeps, not the checkpoint.
    """

    def __init__(self, path: str | os.PathLike, rename=None, aliases: dict | None = None):
        path = Path(path)
        single, index = path / WEIGHTS_FILE, path / WEIGHTS_INDEX_FILE
        if single.is_file():
            files = [single]
        elif index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(f"{index}: malformed shard index, expected a 'weight_map' object ({e})") from e
            files = [path / shard for shard in sorted(set(weight_map.values()))]
            for f in files:
                if not f.is_file():
                    raise FileNotFoundError(f"{index}: shard {f.name} is missing from {path}")
        else:
            raise FileNotFoundError(f"{path}: no {WEIGHTS_FILE} or {WEIGHTS_INDEX_FILE} (streamed reading needs safetensors)")
        self.path = path
        self.where: dict[str, tuple[Path, str]] = {}  # module key -> (file, stored key)
        for f in files:
            try:
                with safetensors.safe_open(str(f), framework="pt") as handle:
                    stored = list(handle.keys())
                    shapes = {k: tuple(handle.get_slice(k).get_shape()) for k in stored}
                    dtypes = {k: handle.get_slice(k).get_dtype() for k in stored}
            except Exception as e:
                raise ValueError(f"{f}: cannot read safetensors file ({e})") from e
            for key in stored:
                name = rename(key) if rename else key
                if name in self.where:
                    raise ValueError(f"{f}: tensor {key!r} also stored in {self.where[name][0].name}")
                self.where[name] = (f, key)
                self._shapes = getattr(self, "_shapes", {})
                self._shapes[name] = shapes[key]
                self._dtypes = getattr(self, "_dtypes", {})
                self._dtypes[name] = dtypes[key]
        for alias, source in (aliases or {}).items():
            if alias not in self.where and source in self.where:
                self.where[alias] = self.where[source]
                self._shapes[alias] = self._shapes[source]
                self._dtypes[alias] = self._dtypes[source]

    def keys(self) -> list[str]:
        return list(self.where)

    def shape(self, key: str) -> tuple[int, ...]:
        return self._shapes[key]

    def nbytes(self) -> int:
        """Bytes the stored tensors take (each stored tensor once)."""
        seen, total = set(), 0
        for f, stored in self.where.values():
            if (f, stored) in seen:
                continue
            seen.add((f, stored))
            with safetensors.safe_open(str(f), framework="pt") as handle:
                t = handle.get_slice(stored)
                total += math.prod(t.get_shape()) * _DTYPE_BYTES.get(t.get_dtype(), 4)
        return total

    def load(self, keys) -> dict[str, torch.Tensor]:
        """Copies of the tensors ``keys`` (stored dtype, CPU); a missing key is a ``KeyError`` naming it."""
        missing = [k for k in keys if k not in self.where]
        if missing:
            raise KeyError(f"{self.path}: no tensor(s) {missing[:5]}")
        by_file: dict[Path, list[str]] = {}
        for key in keys:
            by_file.setdefault(self.where[key][0], []).append(key)
        out = {}
        for f, names in by_file.items():
            with safetensors.safe_open(str(f), framework="pt") as handle:
                for name in names:
                    out[name] = handle.get_tensor(self.where[name][1]).clone()
        return out


_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


class ShardWriter:
    """Write tensors into safetensors shards of at most ``max_shard_bytes`` as they arrive, then
    ``model.safetensors.index.json`` (or a single ``model.safetensors`` if one shard suffices)."""

    def __init__(self, directory: Path, max_shard_bytes: int = 2 * 2**30):
        self.directory, self.max = Path(directory), max_shard_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.weight_map: dict[str, str] = {}
        self.shards: list[str] = []
        self.total = 0

    def add(self, tensors: dict) -> None:
        for key, value in _file_tensors(tensors).items():
            size = value.numel() * value.element_size()
            if self.pending and self.pending_bytes + size > self.max:
                self._flush()
            self.pending[key] = value
            self.pending_bytes += size
            self.total += size

    def _flush(self) -> None:
        name = f"model-{len(self.shards) + 1:05d}.safetensors"
        safetensors.torch.save_file(self.pending, str(self.directory / name), metadata={"format": "pt"})
        self.weight_map.update(dict.fromkeys(self.pending, name))
        self.shards.append(name)
        self.pending, self.pending_bytes = {}, 0

    def close(self) -> None:
        if self.pending or not self.shards:
            self._flush()
        if len(self.shards) == 1:
            os.replace(self.directory / self.shards[0], self.directory / WEIGHTS_FILE)
            return
        index = {"metadata": {"total_size": self.total}, "weight_map": dict(sorted(self.weight_map.items()))}
        (self.directory / WEIGHTS_INDEX_FILE).write_text(json.dumps(index, indent=2))


def stream_align(
    reference: str | os.PathLike,
    candidate: str | os.PathLike,
    out: str | os.PathLike,
    *,
    mode: str = "orthogonal",
    iterations: int = 2,
    tol: float = 1e-4,
    max_shard_bytes: int = 2 * 2**30,
    device: str = "cpu",
    progress: bool = False,
    extra_files=None,
):
    """Align checkpoint ``candidate`` to ``reference`` layer by layer and write it to ``out``.

    For checkpoints stored in the standard layout (Hugging Face Llama/Mistral/Qwen2, fedbasin
    models): tensors are read lazily (sharded safetensors included), computed in float32 one
    layer at a time and written shard by shard in the stored dtype (see
    :func:`fedbasin.alignment.streaming.stream_match`). Tensors outside the spec are copied.
    The output directory is written atomically and loads with ``from_pretrained``. Returns the
    :class:`~fedbasin.alignment.streaming.StreamResult`. ``extra_files(directory)`` adds files (e.g. a
    tokenizer) inside the same atomic write.
    """
    from .alignment.streaming import stream_match

    paths = [Path(reference), Path(candidate)]
    configs = []
    for p in paths:
        if not p.is_dir():
            raise FileNotFoundError(f"checkpoint directory {p} does not exist")
        configs.append(_read_config(p))
    formats = [detect(c, p / CONFIG_FILE) for p, c in zip(paths, configs)]
    fmt, family = formats[0], formats[0].family
    config = fmt.config_from_json(configs[0])
    rename = fmt.lazy_rename(config, paths[0])
    for p, other in zip(paths[1:], formats[1:]):
        if (other.kind, other.family) != (fmt.kind, family):
            raise ValueError(f"{p}: a {other.family} checkpoint but the reference is {family}")
    spec = fmt.adapter(config).spec
    tied = fmt.tied_pairs(config)
    aliases = {alias: source for source, alias, _ in tied}
    sources = [LazyWeights(p, rename, aliases) for p in paths]
    expected = fmt.expected_shapes(config)
    for p, src in zip(paths, sources):
        _check_state({k: _Shape(src.shape(k)) for k in src.keys() if k in expected or not fmt.ignores(k)},
                     expected, str(p), f"the {family} architecture in {paths[0] / CONFIG_FILE}")
    result_box = {}

    def write(tmp: Path) -> None:
        writer = ShardWriter(tmp, max_shard_bytes)
        tie_kept = {}

        def sink(tensors: dict) -> None:
            for source, alias, _ in tied:
                if source in tensors and alias in tensors:
                    tie_kept[alias] = torch.equal(tensors[source], tensors[alias])
            writer.add({k: v for k, v in tensors.items()
                        if fmt.stores_tied_alias or not (k in aliases and tie_kept.get(k))})

        result_box["result"] = stream_match(spec, sources[0].load, sources[1].load, sink, mode=mode,
                                            iterations=iterations, tol=tol, device=device, progress=progress)
        rest = [k for k in expected if k not in spec.keys() and k in sources[1].keys()]
        if rest:
            writer.add(sources[1].load(rest))
        writer.close()
        updates = {field: False for _, alias, field in tied if not tie_kept.get(alias)}
        (tmp / CONFIG_FILE).write_text(fmt.config_json(fmt.with_updates(config, updates)))
        if extra_files is not None:
            extra_files(tmp)

    _atomic_replace_dir(Path(out), write)
    return result_box["result"]


class _Shape:
    """A stand-in with only ``.shape`` for checking lazily read tensors against a config."""

    def __init__(self, shape):
        self.shape = torch.Size(shape)
