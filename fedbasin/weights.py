"""A module's architecture apart from its weights (server memory).

A server needs a module of the model's architecture to run any state through it (evaluation,
refinement, distillation), not a copy of the weights of its own. :func:`release_weights` puts
every parameter and persistent buffer on the ``meta`` device (shape and dtype kept, no memory;
tied tensors stay tied; non-persistent buffers such as RoPE tables stay real);
:func:`holding_weights` lends a state's own tensors to the module for a block, without copying
them; :func:`weightless_copy` copies the architecture alone.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn


def check_fits(like: dict, state: dict, name: str, shapes: bool = True) -> None:
    """``state`` holds exactly the keys (and, with ``shapes``, the shapes) of the module state ``like``
    (as ``load_state_dict`` needs), else a ValueError naming ``name``."""
    missing, unexpected = sorted(set(like) - set(state)), sorted(set(state) - set(like))
    if missing or unexpected:
        raise ValueError(f"{name}: its state does not fit the model (missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]})")
    for k, v in state.items() if shapes else ():
        if tuple(v.shape) != tuple(like[k].shape):
            raise ValueError(f"{name}: {k} has shape {tuple(v.shape)}, the model's is {tuple(like[k].shape)}")


def weight_groups(module: nn.Module) -> list[tuple[list[str], torch.Tensor]]:
    """The module's distinct parameters and persistent buffers: (every state-dict key that names
    it — more than one when tied —, the tensor)."""
    groups: dict[int, tuple[list[str], torch.Tensor]] = {}
    for key, value in module.state_dict(keep_vars=True).items():
        groups.setdefault(id(value), ([], value))[0].append(key)
    return list(groups.values())


def _put(module: nn.Module, key: str, value: torch.Tensor) -> None:
    owner, _, leaf = key.rpartition(".")
    sub = module.get_submodule(owner)
    (sub._parameters if leaf in sub._parameters else sub._buffers)[leaf] = value


def _meta_like(value: torch.Tensor) -> torch.Tensor:
    empty = torch.empty(value.shape, dtype=value.dtype, device="meta")
    return nn.Parameter(empty, requires_grad=value.requires_grad) if isinstance(value, nn.Parameter) else empty


def _non_persistent_buffers_to(module: nn.Module, device) -> None:
    for sub in module.modules():
        for name in sub._non_persistent_buffers_set:
            if sub._buffers.get(name) is not None:
                sub._buffers[name] = sub._buffers[name].to(device)


def release_weights(module: nn.Module) -> nn.Module:
    """Free the module's weights: every parameter and persistent buffer becomes a ``meta`` tensor
    of its shape and dtype (ties kept). Returns the module."""
    for keys, value in weight_groups(module):
        meta = _meta_like(value)
        for key in keys:
            _put(module, key, meta)
    return module


def weightless_copy(module: nn.Module, device=None) -> nn.Module:
    """A copy of the module's architecture whose weights are ``meta`` tensors (nothing of the
    weights is copied), its non-persistent buffers on ``device`` (default: where they are)."""
    memo = {id(value): _meta_like(value) for _, value in weight_groups(module)}
    twin = copy.deepcopy(module, memo)
    if device is not None:
        _non_persistent_buffers_to(twin, device)
    return twin


@contextmanager
def holding_weights(module: nn.Module, state: dict, device=None, reshaped: bool = False) -> Iterator[dict]:
    """For the block, the module's weights are ``state``'s own tensors (in the module's dtypes, on
    ``device`` or where they are: copies only where those differ; tied keys share the tensor of
    the first). Yields the module's state dict (key → the tensor it now holds); afterwards the
    module holds its previous tensors again (its non-persistent buffers stay on ``device``).
    ``reshaped``: tensors may have other shapes than the module's (e.g. token rows cut to a vocabulary;
    the module then computes with them through ``torch.func.functional_call``)."""
    groups = weight_groups(module)
    check_fits(module.state_dict(keep_vars=True), state, "state", shapes=not reshaped)
    if device is not None:
        _non_persistent_buffers_to(module, device)
    held = {}
    try:
        for keys, value in groups:
            tensor = state[keys[0]].detach().to(device or state[keys[0]].device, value.dtype)
            if isinstance(value, nn.Parameter):
                tensor = nn.Parameter(tensor, requires_grad=value.requires_grad)
            for key in keys:
                _put(module, key, tensor)
                held[key] = tensor
        yield held
    finally:
        for keys, value in groups:  # the module's own tensors, as they were
            for key in keys:
                _put(module, key, value)
