"""Soft labels: refinement's training targets from the mixed models' own predictions.

Each endpoint keeps its function under the group, so the ensemble's mean predicted probabilities
p̄(x) are computed once, before training, and the maps train on ``t = (1 − w)·one-hot(y) + w·p̄(x)``
(w = 1: the models' predictions alone, for inputs without labels). Sparse targets keep each
example's k largest entries as (id, weight) pairs: N·k·8 bytes instead of N·C·4.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from .proxy import Batch, Examples, LabelledSplit
from .vocabulary import TrainingVocabulary
from .workers import _Workers

#: soft labels are refused above this size (the mixed models' probabilities on the training part)
SOFT_LABEL_BYTES = 1 << 30


def _soft_labels(split: LabelledSplit | Examples, states: list[dict], workers: _Workers, weight: float, device, forward,
                 top_k: int = 0, vocabulary: TrainingVocabulary | None = None) -> torch.Tensor:
    """``t = (1 − w)·one-hot(y) + w·p̄(x)`` for every example of ``split``, p̄ the mean softmax of
    ``forward(state, x, module)`` (logits) over ``states``. ``top_k`` = k > 0 keeps each target's k
    largest entries as (class id, weight) pairs of shape (…, k, 2); their weights are not renormalised:
    the mass they leave is the unlisted classes' bucket of :func:`fedbasin.training.cross_entropy`.
    With a training ``vocabulary`` (sparse targets only) p̄ is the softmax over its tokens (their rows
    only: |vocabulary| instead of V logits per token), the ids stay the full model's. Targets over
    :data:`SOFT_LABEL_BYTES` are refused."""
    if vocabulary is not None:
        states = [vocabulary.cut(state) for state in states]

    def target_of(module, batch):
        x, y = batch[0].to(device), batch[1].to(device)
        if vocabulary is not None:
            x, y = vocabulary.renumber(x), vocabulary.renumber(y)
        p = None
        for state in states:  # summed in this order, each term divided first: the figures do not depend on batching
            term = forward(state, x, module).float().softmax(-1) / len(states)
            p = term if p is None else p + term
        t = (1.0 - weight) * F.one_hot(y, p.shape[-1]).to(p) + weight * p
        if not top_k:
            return t.cpu()
        values, ids = t.topk(min(top_k, t.shape[-1]), dim=-1)
        if vocabulary is not None:
            ids = vocabulary.ids.to(ids.device)[ids]
        return torch.stack([ids.to(values), values], -1).cpu()

    with torch.no_grad():
        first = next(split.batches(1))[0].to(device)  # the model's input: the split's transform applied
        classes = forward(states[0], first if vocabulary is None else vocabulary.renumber(first),
                          workers.modules[0]).shape[-1]
        per_example = split.targets[:1].numel()
        size = len(split) * per_example * (min(top_k, classes) * 8 if top_k else classes * 4)
        if size > SOFT_LABEL_BYTES:
            raise ValueError(f"soft_labels: the targets of {len(split)} training examples would take "
                             f"{size / 2**30:.1f} GiB (limit {SOFT_LABEL_BYTES / 2**30:.0f} GiB): use fewer proxy "
                             "examples" + (", a smaller top-k" if top_k else " or sparse top-k targets"))
        # a labelling batch's dense probabilities stay under 128 MiB per thread
        rows = max(1, min(256, (128 << 20) // (per_example * classes * 4)))
        return torch.cat(workers.map(target_of, split.batches(rows)))


def _relabelled(batches: list[Batch], label: Callable[[Examples], torch.Tensor]) -> list[Batch]:
    """The same inputs, batch for batch, with the targets ``label`` gives for them all at once."""
    split = Examples(torch.cat([x.cpu() for x, _ in batches]), torch.cat([y.cpu() for _, y in batches]))
    targets = label(split).split([len(y) for _, y in batches])
    return [(x, t.to(x.device)) for (x, _), t in zip(batches, targets)]
