"""Proxy data of learned refinement: the training stream and the selection / evaluation splits.

A proxy set (any labelled split: ``inputs``, ``targets``, ``split``, ``batches``, e.g. a
:class:`fedbasin.data.Split`) is cut at random into three disjoint parts: the optimiser sees only
the *training* part, as an endless stream reshuffled each epoch; keep-best chooses on the
*selection* part; the optional *evaluation* part is only reported. Shares: selection > 0,
evaluation >= 0, their sum < 1.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Iterable, Iterator, Protocol

import torch

Batch = tuple[torch.Tensor, torch.Tensor]


class LabelledSplit(Protocol):
    """What the proxy's splits provide (:class:`fedbasin.data.Split` does): ``inputs`` (N, ...),
    ``targets`` (N, ...), a random ``split(fraction, seed)`` into two parts, and ``batches``
    (shuffled with a ``generator``); :func:`dataclasses.replace` must accept ``targets``."""

    inputs: torch.Tensor
    targets: torch.Tensor

    def __len__(self) -> int: ...

    def split(self, fraction: float, seed: int = 0) -> tuple[LabelledSplit, LabelledSplit]: ...

    def batches(self, batch_size: int, device: torch.device | str = "cpu",
                generator: torch.Generator | None = None) -> Iterator[Batch]: ...


@dataclass(frozen=True)
class Examples:
    """Model-ready examples held in memory, batched in their order (inputs and targets of a list of
    batches put together, see :func:`fedbasin.alignment.soft_labels._relabelled`)."""

    inputs: torch.Tensor
    targets: torch.Tensor

    def __len__(self) -> int:
        return len(self.targets)

    def batches(self, batch_size: int) -> Iterator[Batch]:
        """``(inputs, targets)`` batches of ``batch_size`` examples (the last one shorter), in order."""
        order = torch.arange(len(self))
        for start in range(0, len(self), batch_size):
            index = order[start : start + batch_size]
            yield self.inputs[index], self.targets[index]


@dataclass
class ProxyStreams:
    """Disjoint proxy data for :func:`learned_refine`: an endless shuffled training stream, and the
    selection and evaluation splits as lists of batches."""

    batches: Iterable[Batch]
    selection: list[Batch]
    evaluation: list[Batch] | None


class TrainingStream:
    """Endless training batches of ``split`` (a :class:`fedbasin.data.Split`): epoch after epoch,
    each in a new random order drawn from one generator seeded with ``seed``."""

    def __init__(self, split, batch_size: int, seed: int = 0):
        self.split, self.batch_size, self.seed = split, batch_size, seed
        self._batches = self._endless()

    def _endless(self) -> Iterator[Batch]:
        generator = torch.Generator().manual_seed(self.seed)
        while True:
            yield from self.split.batches(self.batch_size, generator=generator)

    def __iter__(self) -> TrainingStream:
        return self

    def __next__(self) -> Batch:
        return next(self._batches)

    def first(self, n: int) -> TrainingStream:
        """A fresh stream of the split's first ``n`` examples (a random sample: the proxy's splits are drawn
        in random order)."""
        return TrainingStream(examples_between(self.split, 0, n), self.batch_size, self.seed)

    def relabelled(self, targets: torch.Tensor) -> TrainingStream:
        """A fresh stream (the batch order of this one's start) of the same inputs with ``targets``."""
        return TrainingStream(dataclasses.replace(self.split, targets=targets), self.batch_size, self.seed)


def examples_between(split: LabelledSplit, start: int, stop: int) -> LabelledSplit:
    """Examples ``start`` to ``stop`` (exclusive) of ``split``, in its order."""
    return dataclasses.replace(split, inputs=split.inputs[start:stop], targets=split.targets[start:stop])


def split_share_problem(selection_fraction: float, evaluation_fraction: float) -> str | None:
    """Why these proxy split shares are refused (None if they are fine): the selection share must be
    > 0, the evaluation share >= 0, and the two below 1 together, so that some examples train."""
    if 0 < selection_fraction and 0 <= evaluation_fraction and selection_fraction + evaluation_fraction < 1:
        return None
    return "needs a selection share > 0, an evaluation share >= 0, and both below 1 together (the rest trains)"


def proxy_streams(proxy, batch_size: int, seed: int = 0, selection_fraction: float = 0.2,
                  evaluation_fraction: float = 0.2, eval_batch_size: int = 256) -> ProxyStreams:
    """Split ``proxy`` (a :class:`fedbasin.data.Split`) into training / selection / evaluation parts
    (evaluation may be 0, or leave no example to train on: then ``evaluation`` is None); the training
    part as a :class:`TrainingStream`."""
    if problem := split_share_problem(selection_fraction, evaluation_fraction):
        raise ValueError(f"proxy split shares selection {selection_fraction!r}, evaluation {evaluation_fraction!r}: "
                         f"{problem}")
    rest, selection = proxy.split(selection_fraction, seed=seed)
    evaluation = None
    if evaluation_fraction > 0 and len(rest) > 1:
        share = evaluation_fraction / (1.0 - selection_fraction)
        rest, evaluation = rest.split(share, seed=seed + 1)
        evaluation = list(evaluation.batches(eval_batch_size))
    return ProxyStreams(TrainingStream(rest, batch_size, seed), list(selection.batches(eval_batch_size)), evaluation)


def _as_batches(data) -> list[Batch]:
    """One ``(inputs, targets)`` batch or a list of them → a list."""
    if isinstance(data, tuple) and len(data) == 2 and isinstance(data[0], torch.Tensor):
        return [data]
    return list(data)
