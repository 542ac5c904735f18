"""Transfer inputs for a server without data: synthesised from the clients' models (model inversion).

A server that holds no proxy split can still distil the clients' ensemble into the merge if it has
inputs to distil on. In the spirit of DENSE (Zhang et al., 2022) and DeepInversion, the inputs are
found by gradient descent on the inputs themselves, so that the ensemble of the clients' models
classifies each as a class drawn for it, under image priors:

    min_x  CE(f̄(x), y) + tv · TV(x) + l2 · mean(x²),     f̄ = mean logits of the K clients,

with ``y`` balanced over the classes and ``x`` started from N(0, 1); with ``shift`` > 0 the ensemble sees
a randomly rolled view of ``x`` at each step (the priors see ``x`` itself: larger images then do not fit
one pixel grid; on 8 × 8 digits, in one exploratory trial, a one-pixel roll (with flips) lowered how often
the ensemble agreed after 100 steps from 1.00 to 0.70, so it is off by default). ``TV(x)`` is the mean
absolute difference of vertically neighbouring pixels plus that of horizontally neighbouring ones. No example of any client is needed;
the clients' weights are what the server receives anyway. The result is a labelled
:class:`~fedbasin.data.task.Split` (the classes drawn) that the ServerApp's ``make_refiner`` and
``make_distiller`` take as a proxy split (the one-shot benchmark's data-free arm, ``--synthetic N``).
"""

from __future__ import annotations

import torch
from torch import nn
from tqdm.auto import tqdm

from fedbasin.data.task import Split
from fedbasin.server.distill import StateEnsemble


def total_variation(x: torch.Tensor) -> torch.Tensor:
    """Mean absolute difference of vertically neighbouring pixels of ``x`` (N, C, H, W) plus that of
    horizontally neighbouring ones."""
    return (x[..., 1:, :] - x[..., :-1, :]).abs().mean() + (x[..., :, 1:] - x[..., :, :-1]).abs().mean()


def jitter(x: torch.Tensor, generator: torch.Generator, shift: int) -> torch.Tensor:
    """``x`` rolled by up to ``shift`` pixels each way (one draw for the batch; no flips: a mirrored
    digit is another symbol)."""
    dy, dx = (int(v) for v in torch.randint(-shift, shift + 1, (2,), generator=generator))
    return torch.roll(x, shifts=(dy, dx), dims=(-2, -1))


def synthesize_inputs(model: nn.Module, states: list[dict], count: int, shape: tuple[int, ...], classes: int,
                      steps: int = 200, lr: float = 0.1, tv: float = 0.05, l2: float = 0.01, shift: int = 0,
                      batch_size: int = 256, seed: int = 0, progress: bool = False) -> Split:
    """``count`` inputs of ``shape`` (C, H, W) that the ensemble of ``states`` (``model``'s architecture)
    classifies as their labels, balanced over ``classes`` (see the module doc); ``steps`` Adam steps of
    ``lr`` per batch of ``batch_size``. Deterministic for a ``seed`` on one machine."""
    if count < 1 or steps < 0 or lr <= 0 or tv < 0 or l2 < 0 or shift < 0 or classes < 1:
        raise ValueError("synthesize_inputs: count and classes >= 1, steps, tv, l2 and shift >= 0, lr > 0")
    device = next(iter(model.parameters())).device
    generator = torch.Generator().manual_seed(seed)
    labels = torch.arange(count) % classes
    labels = labels[torch.randperm(count, generator=generator)]
    ensemble = StateEnsemble(model, states)
    inputs = []
    for start in tqdm(range(0, count, batch_size), desc="synthesising inputs", disable=not progress):
        y = labels[start:start + batch_size].to(device)
        x = torch.randn((len(y), *shape), generator=generator).to(device).requires_grad_(True)
        optimiser = torch.optim.Adam([x], lr=lr)
        for _ in range(steps):
            optimiser.zero_grad(set_to_none=True)
            view = jitter(x, generator, shift) if shift else x
            loss = nn.functional.cross_entropy(ensemble(view), y) + tv * total_variation(x) + l2 * x.pow(2).mean()
            loss.backward()
            optimiser.step()
        inputs.append(x.detach().cpu())
    return Split(torch.cat(inputs), labels)
