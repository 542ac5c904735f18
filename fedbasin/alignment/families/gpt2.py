"""GPT-2 (``GPT2LMHeadModel``): Conv1D (in, out) weights with fused q|k|v ↔ nn.Linear layout.

``to_standard`` splits ``attn.c_attn`` (d, 3d) into ``attn.{q,k,v}`` and transposes every Conv1D
into ``transformer.h.{i}.attn.{q,k,v,o}`` / ``mlp.{up,down}`` (weight (out, in)); other keys
pass through. LayerNorm pre-norm blocks, learned positions, head tied to ``wte`` by default.
"""

from __future__ import annotations

import re

import torch

from .registry import Family, register
from .table import Table, prenorm_spec

_RAW = re.compile(r"^transformer\.h\.(\d+)\.(attn\.c_attn|attn\.c_proj|mlp\.c_fc|mlp\.c_proj)\.(weight|bias)$")
_STD = re.compile(r"^transformer\.h\.(\d+)\.(attn\.q|attn\.k|attn\.v|attn\.o|mlp\.up|mlp\.down)\.(weight|bias)$")
_RENAME = {"attn.c_proj": "attn.o", "mlp.c_fc": "mlp.up", "mlp.c_proj": "mlp.down"}
_UNRENAME = {v: k for k, v in _RENAME.items()}

TABLE = Table(
    name="hf-gpt2",
    layer="transformer.h.{i}.",
    q="attn.q", k="attn.k", v="attn.v", o="attn.o", up="mlp.up", down="mlp.down",
    norm1="ln_1", norm2="ln_2", final_norm="transformer.ln_f", head="lm_head.weight",
    writers=(("transformer.wte.weight", 1), ("transformer.wpe.weight", 1)),
    embedding="transformer.wte.weight",
)  # fmt: skip


def _put(out: dict, state: dict, key: str, value) -> None:
    if key in out or key in state:
        raise ValueError(f"{key} appears in both the GPT-2 and the standard layout")
    out[key] = value


def to_standard(state: dict, config=None) -> dict:
    out: dict = {}
    for key, value in state.items():
        m = _RAW.match(key)
        if m is None:
            _put(out, {}, key, value)
            continue
        layer, module, param = m.groups()
        prefix = f"transformer.h.{layer}."
        if module == "attn.c_attn":
            parts = value.split(value.shape[-1] // 3, dim=-1)
            # clone: the three parts must not share storage with each other or the input
            for n, part in zip("qkv", parts):
                _put(out, state, f"{prefix}attn.{n}.{param}", (part.T if param == "weight" else part).contiguous().clone())
        else:
            _put(out, state, f"{prefix}{_RENAME[module]}.{param}", (value.T if param == "weight" else value).contiguous())
    return out


def from_standard(state: dict, config=None) -> dict:
    out: dict = {}
    for key, value in state.items():
        m = _STD.match(key)
        if m is None:
            _put(out, {}, key, value)
            continue
        layer, module, param = m.groups()
        prefix = f"transformer.h.{layer}."
        if module in ("attn.q", "attn.k", "attn.v"):
            fused = f"{prefix}attn.c_attn.{param}"
            if fused in out:  # already built from the first of q/k/v
                continue
            names = [f"{prefix}attn.{n}.{param}" for n in "qkv"]
            missing = [n for n in names if n not in state]
            if missing:
                raise ValueError(f"cannot fuse {fused}: missing {missing}")
            _put(out, state, fused, torch.cat([state[n].T if param == "weight" else state[n] for n in names], dim=-1))
        else:
            _put(out, state, f"{prefix}{_UNRENAME[module]}.{param}", value.T.contiguous() if param == "weight" else value)
    return out


def spec(config):
    if getattr(config, "add_cross_attention", False):
        raise ValueError("GPT-2 with add_cross_attention=True (cross-attention blocks) is not supported")
    d = config.n_embd
    return prenorm_spec(
        TABLE,
        layers=config.n_layer,
        width=d,
        heads=config.n_head,
        hidden=config.n_inner if config.n_inner is not None else 4 * d,
        activation="relu" if config.activation_function == "relu" else "elementwise",
        qkv_bias=True,
        tied=bool(getattr(config, "tie_word_embeddings", False)),
    )


def config_fields(shape: dict) -> dict:
    return dict(n_embd=shape["dim"], n_layer=shape["depth"], n_head=shape["heads"], n_inner=shape["mlp_dim"],
                resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


FAMILY = register(Family(
    classes={"gpt2": ("GPT2LMHeadModel", "GPT2Config")},
    spec=spec,
    to_standard=to_standard,
    from_standard=from_standard,
    ignored_file_keys=(r"\.attn\.bias$", r"\.attn\.masked_bias$"),
    tie=("transformer.wte.weight", "lm_head.weight"),
    data_fields={"vocab_size": "vocab_size", "block_size": "n_positions"},
    config_fields=config_fields,
))  # fmt: skip
