"""Hugging Face causal LMs in the Flower apps: the model a run config names, built identically on
the server and on every client.

Run-config keys (``fedbasin.config``):

* ``hf-config``: a supported ``model_type`` (``gpt2``, ``gpt_neox``, ``llama``, ``mistral``,
  ``qwen2``) whose default config is sized by ``model.dim`` (hidden size), ``model.depth``
  (layers), ``model.heads``, ``model.kv-heads`` (grouped-query attention; 0: as many as heads)
  and ``model.mlp-dim``, with the tokenizer's vocabulary and ``block-size`` positions; or a
  ``config.json`` file (or a directory holding one) that fixes the architecture. Random
  initialisation from the seed.
* ``hf-pretrained``: a local directory with a saved model (``save_pretrained``: config +
  weights, read by :func:`fedbasin.checkpoint.load_checkpoint`) or a hub id (downloaded with
  ``huggingface_hub``); its weights are the initial global model.
* ``tokenizer``: a Hugging Face tokenizer directory (or hub id) that tokenises the ``text:``
  data; default: the one saved in the ``hf-pretrained`` directory.

Tied embeddings (GPT-2 by default): alignment folds the final norm's gain into the head, so the
global model carries an untied head (docs/scale.md, "Tied embeddings in federation"). With
``alignment = true`` every model built here is therefore untied — ``tie_word_embeddings=False``,
the head starting as a copy of the embedding, so the initial function is unchanged — and the
server logs it once. With ``alignment = false`` (plain FedAvg) the tie is kept exactly.

The Flower messages carry the adapter's *standard layout* (``hf_adapter(model).to_standard``),
the layout the strategy's symmetry spec describes; checkpoints are written in the module layout
with the config, loadable by ``from_pretrained``, the tokenizer saved beside them.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from logging import WARNING
from pathlib import Path

import torch
from torch import nn

from fedbasin.run_defaults import DEFAULT_RUN_CONFIG

#: run-config key → generic config attribute (transformers maps it, e.g. GPT-2's ``n_embd``)
SIZE_KEYS = {
    "model.dim": "hidden_size",
    "model.depth": "num_hidden_layers",
    "model.heads": "num_attention_heads",
    "model.mlp-dim": "intermediate_size",
}
#: ``model.*`` keys a Hugging Face model type fixes itself; refused when not at their defaults
FIXED_BY_TYPE = ("model.norm", "model.activation", "model.bias", "model.patch-size", "model.position")
_SAID: set = set()  # messages logged once per process


def selected(config: Mapping[str, object]) -> bool:
    """Whether the run config names a Hugging Face causal LM (``hf-config`` or ``hf-pretrained``)."""
    return bool(config["hf-config"] or config["hf-pretrained"])


@functools.lru_cache(maxsize=4)
def pretrained_dir(source: str) -> Path:
    """The local directory of ``hf-pretrained``: the path itself, or a hub snapshot (config,
    weights and tokenizer files only)."""
    from fedbasin.data.sources import is_hub_id

    if Path(source).expanduser().exists() or not is_hub_id(source):
        where = Path(source).expanduser()
        if not (where / "config.json").is_file():
            raise FileNotFoundError(f"hf-pretrained {where} is not a directory holding config.json "
                                    "(a model saved with save_pretrained)")
        return where
    from huggingface_hub import snapshot_download

    from fedbasin.data.hub import hub_access

    patterns = ["*.json", "*.safetensors", "*.txt", "*.model", "tokenizer*"]
    try:
        with hub_access():
            return Path(snapshot_download(source, allow_patterns=patterns))
    except Exception as error:  # noqa: BLE001 - offline, unknown id, gated repository
        raise RuntimeError(f"hf-pretrained {source!r}: could not download it from the Hugging Face "
                           f"hub ({type(error).__name__}: {error}); offline, give a local directory") from None


def tokenizer_source(config: Mapping[str, object]) -> str | None:
    """``tokenizer``, else the tokenizer saved in the ``hf-pretrained`` directory, else None."""
    if config["tokenizer"]:
        return str(config["tokenizer"])
    if config["hf-pretrained"]:
        where = pretrained_dir(str(config["hf-pretrained"]))
        if (where / "tokenizer_config.json").is_file() or (where / "tokenizer.json").is_file():
            return str(where)
    return None


def _config_from_type(model_type: str, config: Mapping[str, object], vocab_size: int, tokenizer):
    from fedbasin.alignment.hf import hf_config_class

    hf_config = hf_config_class(model_type)()
    for key, attribute in SIZE_KEYS.items():
        if model_type == "gpt2" and attribute == "intermediate_size":
            attribute = "n_inner"  # GPT-2's config has no generic name for it
        setattr(hf_config, attribute, config[key])
    if config["model.kv-heads"]:
        if not hasattr(hf_config, "num_key_value_heads"):
            raise ValueError(f"run-config model.kv-heads={config['model.kv-heads']} does not apply to "
                             f"{model_type} (no grouped-query attention)")
        hf_config.num_key_value_heads = config["model.kv-heads"]
    elif hasattr(hf_config, "num_key_value_heads"):
        hf_config.num_key_value_heads = config["model.heads"]
    if hasattr(hf_config, "head_dim"):
        hf_config.head_dim = config["model.dim"] // config["model.heads"]
    hf_config.vocab_size = vocab_size
    from fedbasin.alignment.families import family

    setattr(hf_config, family(model_type).data_fields["block_size"], config["block-size"])
    set_special_token_ids(hf_config, tokenizer)
    return hf_config


def set_special_token_ids(hf_config, tokenizer) -> None:
    """A new model's bos/eos/pad ids are its tokenizer's (None where it has none), not the model
    type's defaults (GPT-2's 50256, Llama's 1/2), which may lie outside a smaller vocabulary."""
    inner = tokenizer.tokenizer if tokenizer is not None else None
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        setattr(hf_config, name, getattr(inner, name, None))


def _config_from_file(source: str):
    from fedbasin.alignment.hf import SUPPORTED_MODEL_TYPES, hf_config_class

    where = Path(source).expanduser()
    file = where / "config.json" if where.is_dir() else where
    if not file.is_file():
        raise FileNotFoundError(
            f"hf-config {source!r} is neither a supported model type ({', '.join(SUPPORTED_MODEL_TYPES)}) "
            "nor a config.json file or a directory holding one")
    try:
        values = json.loads(file.read_text())
        model_type = values["model_type"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ValueError(f"hf-config {file}: not a Hugging Face config.json with a model_type ({error})") from None
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"hf-config {file}: model_type {model_type!r} is not supported; supported: "
                         f"{', '.join(SUPPORTED_MODEL_TYPES)}")
    try:
        return hf_config_class(model_type).from_dict(values)
    except Exception as error:  # noqa: BLE001 - transformers validates field types
        raise ValueError(f"hf-config {file}: {error}".splitlines()[0]) from None


def _positions(hf_config) -> int | None:
    from fedbasin.alignment.families import family

    return family(hf_config.model_type).context_length(hf_config)


def model_config(task, config: Mapping[str, object]):
    """The ``PretrainedConfig`` the run config names, checked against the data: one line naming
    the key at fault when the keys contradict each other, the tokenizer has more tokens than the
    model's vocabulary, or ``block-size`` exceeds the model's positions. Untied when the run
    aligns (see the module docstring)."""
    return _resolve(task, config)[0]


def _resolve(task, config: Mapping[str, object]):
    """``(PretrainedConfig, untied)``: ``untied`` when the named model ties its head and this
    run unties it."""
    from fedbasin.alignment.hf import SUPPORTED_MODEL_TYPES
    from fedbasin.data.sources import HFTokenizer

    if config["hf-config"] and config["hf-pretrained"]:
        raise ValueError("run-config hf-config and hf-pretrained both name a model; give one")
    where = "hf-pretrained" if config["hf-pretrained"] else "hf-config"
    by_type = config["hf-config"] in SUPPORTED_MODEL_TYPES
    if not isinstance(task.tokenizer, HFTokenizer):
        raise ValueError(  # noqa: TRY004 - a run-config error, not a caller's type
            f"run-config {where}={config[where]!r} needs text data tokenised by a Hugging Face "
            f"tokenizer (data='text:FILE' and tokenizer=DIR); got data={config['data']!r}, "
            f"tokenizer={config['tokenizer']!r}")
    if config["init"] == "client" and config["hf-pretrained"]:
        raise ValueError("run-config init='client' starts every node from its own random initialisation; "
                         "it does not apply to hf-pretrained (use hf-config)")
    vocab = task.tokenizer.vocab_size
    if by_type:
        hf_config = _config_from_type(str(config["hf-config"]), config, vocab, task.tokenizer)
    elif config["hf-config"]:
        hf_config = _config_from_file(str(config["hf-config"]))
    else:
        hf_config = _config_from_file(str(pretrained_dir(str(config["hf-pretrained"]))))
    changed = [k for k in (*FIXED_BY_TYPE, *(() if by_type else (*SIZE_KEYS, "model.kv-heads")))
               if config[k] != DEFAULT_RUN_CONFIG[k]]
    if changed:
        fixed_by = "the model type" if by_type else f"{where}={config[where]!r}"
        raise ValueError(f"run-config {changed[0]}={config[changed[0]]!r} does not apply to Hugging Face "
                         f"models: {fixed_by} fixes it")
    from fedbasin.alignment.hf import hf_adapter

    try:
        hf_adapter(hf_config)
    except ValueError as error:
        raise ValueError(f"run-config {where}={config[where]!r}: {error}") from None
    if vocab > hf_config.vocab_size:
        raise ValueError(f"tokenizer {task.tokenizer.path} has {vocab} tokens but the model of {where}="
                         f"{config[where]!r} has vocab_size {hf_config.vocab_size}: token ids would be out of range")
    positions = _positions(hf_config)
    if positions is not None and config["block-size"] > positions:
        raise ValueError(f"run-config block-size={config['block-size']} exceeds the {positions} positions of "
                         f"the model of {where}={config[where]!r}")
    untied = bool(config["alignment"] and getattr(hf_config, "tie_word_embeddings", False))
    if untied:
        hf_config.tie_word_embeddings = False
        _say_once(f"{hf_config.model_type}: the model ties its head to the token embedding; alignment unties "
                  "them (docs/scale.md, 'Tied embeddings in federation'), so the server and every client build "
                  f"untied models (tie_word_embeddings=false, head starting as a copy of the embedding: "
                  f"+{hf_config.vocab_size * hf_config.hidden_size:,} parameters); the saved models say so")
    return hf_config, untied


#: config fields that describe a saved file, not the architecture (``save_checkpoint`` sets them)
FILE_FIELDS = ("architectures", "dtype", "torch_dtype", "transformers_version", "_name_or_path")


def config_differences(built, saved) -> list[str]:
    """``field=saved (built ...)`` for every architecture field in which a saved Hugging Face
    config differs from the one this run builds (empty: the checkpoint fits the run)."""
    a, b = built.to_dict(), saved.to_dict()
    return [f"{k}={b.get(k)!r} (this run: {a.get(k)!r})" for k in sorted(set(a) | set(b))
            if k not in FILE_FIELDS and a.get(k) != b.get(k)]


def _say_once(message: str) -> None:
    if message not in _SAID:
        _SAID.add(message)
        from flwr.common.logger import log

        log(WARNING, message)


def build(task, config: Mapping[str, object], seed: int, load_weights: bool = True) -> nn.Module:
    """The run's causal LM (float32, training mode off): random initialisation from ``seed``
    (``torch.manual_seed``, the global generator restored afterwards), then, with
    ``load_weights``, the ``hf-pretrained`` weights. Its forward returns the logits tensor
    (:func:`logits_only`), as fedbasin's own models do."""
    from fedbasin.alignment.families import family
    from fedbasin.alignment.hf import hf_model_class

    hf_config, untied = _resolve(task, config)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = hf_model_class(hf_config.model_type)(hf_config).float()
    if load_weights and config["hf-pretrained"]:
        model.load_state_dict(_pretrained_state(str(config["hf-pretrained"]), model), strict=True)
    elif untied:  # the head starts as a copy of the embedding: the tied model's function
        embedding, head = family(hf_config.model_type).tie
        state = model.state_dict()
        state[head].copy_(state[embedding])
    return logits_only(model.eval())


def _pretrained_state(source: str, model: nn.Module) -> dict:
    """The pretrained weights as float32 tensors with the (possibly untied) model's keys."""
    from fedbasin.alignment.hf import hf_tied_pair
    from fedbasin.checkpoint import load_checkpoint

    checkpoint = load_checkpoint(pretrained_dir(source))
    state = {k: v.float() if v.is_floating_point() else v for k, v in checkpoint.state.items()}
    pair = hf_tied_pair(checkpoint.config)
    if pair is not None and not model.config.tie_word_embeddings:
        state[pair[1]] = state[pair[0]].clone()  # untied: the head starts as a copy
    return state


def _no_cache(module, args, kwargs):
    return args, {**kwargs, "use_cache": False}


def _logits(module, args, output):
    return output.logits


def logits_only(model: nn.Module) -> nn.Module:
    """``model(ids)`` returns the logits tensor (no key/value cache), what
    :func:`fedbasin.training.train` and ``evaluate`` expect; the state dict is unchanged."""
    model.register_forward_pre_hook(_no_cache, with_kwargs=True)
    model.register_forward_hook(_logits)
    return model


def save_tokenizer(task):
    """``write(directory)`` saving the run's tokens beside a checkpoint: the Hugging Face tokenizer,
    or the character vocabulary (``characters.json``); None for data without tokens."""
    tokenizer = getattr(task.tokenizer, "tokenizer", None)
    if tokenizer is not None:
        return lambda directory: tokenizer.save_pretrained(str(directory))
    return getattr(task.tokenizer, "save", None)
