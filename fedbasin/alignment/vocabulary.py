"""The restricted, sampled vocabulary of refinement's training loss (language models).

The token-indexed rows (embedding, output head) are cut to a kept token set V, renumbered
0 … |V|−1, so the model computes the full model's logits at those tokens and the softmax costs |V|
instead of the full vocabulary per token. The softmax's missing mass can be estimated by sampling:
k of the m tokens outside V drawn uniformly each step with ``log(m/k)`` added to their logits make
``(m/k)·Σ_sampled e^z`` an unbiased estimate of ``Σ_outside e^z`` (the uniform-proposal sampled
softmax); V itself can be sampled the same way around each step's own tokens.
"""

from __future__ import annotations

import math

import torch

from .spec import SymmetrySpec, token_indexed_keys


class TrainingVocabulary:
    """The token set of the *training* loss (see :func:`learned_refine`'s ``vocabulary``).

    The token-indexed rows (embedding, output head; :func:`token_indexed_keys`) are cut to the
    kept tokens, whose ids become 0 … n−1, so the model computes exactly the full model's logits
    at those tokens. With ``samples`` = k > 0, each step also draws k of the m tokens outside the
    vocabulary (uniformly, without replacement) and adds ``log(m/k)`` to their logits: the
    softmax's normaliser then contains ``(m/k)·Σ_sampled e^z``, an unbiased estimate of the
    outside tokens' share ``Σ_outside e^z`` (the uniform-proposal sampled softmax); k = m is the
    full softmax. With ``batch_samples`` = k' > 0 the vocabulary is sampled the same way each step: the
    step's own tokens (inputs, targets, and the tokens sparse soft targets list with weight > 0) exactly,
    then k' of the vocabulary's other m' tokens with ``log(m'/k')`` added. Inputs and targets must lie
    in the vocabulary (else ``ValueError``).
    """

    def __init__(self, spec: SymmetrySpec, state: dict, vocabulary, samples: int = 0, seed: int = 0,
                 batch_samples: int = 0):
        # rows cut: the token embedding, the output head and its bias (spec.token_biases)
        self.keys = token_indexed_keys(spec, state) | {k for k in spec.token_biases if k in state}
        if not self.keys:
            raise ValueError("vocabulary given but the model has no token embedding")
        size = state[spec.embedding_keys[0]].shape[0]
        ids = torch.as_tensor(vocabulary).reshape(-1)
        if ids.is_floating_point() or ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= size:
            raise ValueError(f"vocabulary must be non-empty integer token ids in [0, {size})")
        for name, value in (("vocabulary_samples", samples), ("vocabulary_batch_samples", batch_samples)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        self.ids = torch.unique(ids.long())
        self.lookup = torch.full((size,), -1, dtype=torch.long)
        self.lookup[self.ids] = torch.arange(self.ids.numel())
        inside = torch.zeros(size, dtype=torch.bool)
        inside[self.ids] = True
        self.outside = torch.nonzero(~inside).flatten()
        self.samples = min(samples, self.outside.numel())
        self.batch_samples = batch_samples
        self.generator = torch.Generator().manual_seed(seed)

    @property
    def fixed(self) -> bool:
        """Whether every step uses the same rows (the whole vocabulary, nothing sampled)."""
        return not (self.samples or self.batch_samples)

    def _sample(self, pool: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """k tokens of ``pool`` drawn uniformly without replacement, and their logit correction log(m/k)."""
        k = min(k, pool.numel())
        drawn = pool[torch.randperm(pool.numel(), generator=self.generator)[:k]]
        return drawn, torch.full((k,), math.log(pool.numel() / k) if k else 0.0)

    def draw(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(token ids of this step's rows, the logit correction of each row, x and y renumbered to the rows)."""
        x, y = self.renumber(x), self.renumber(y)  # also refuses tokens outside the vocabulary
        if self.batch_samples:
            sparse = y.is_floating_point()  # (id, weight) soft targets: the tokens they list with weight > 0
            targets = y[..., 0][y[..., 1] > 0].long() if sparse else y
            used = torch.zeros(self.ids.numel(), dtype=torch.bool)
            used[torch.cat([x.reshape(-1), targets.reshape(-1)]).cpu()] = True
            rest, correction = self._sample(self.ids[~used], self.batch_samples)
            rows, corrections = [self.ids[used], rest], [torch.zeros(int(used.sum())), correction]
            local = torch.full((self.ids.numel(),), -1, dtype=torch.long)
            local[used] = torch.arange(int(used.sum()))
            x, y = _mapped(local, x), _mapped(local, y)  # a listed token of weight 0 may lie outside the rows
        else:
            rows, corrections = [self.ids], [torch.zeros(self.ids.numel())]
        if self.samples:
            drawn, correction = self._sample(self.outside, self.samples)
            rows.append(drawn)
            corrections.append(correction)
        return torch.cat(rows), torch.cat(corrections), x, y

    def restrict(self, state: dict, ids: torch.Tensor) -> dict:
        return {k: v.index_select(0, ids.to(v.device)) if k in self.keys else v for k, v in state.items()}

    def cut(self, state: dict) -> dict:
        """``state`` with its token-indexed rows cut to the vocabulary (row i: token ``ids[i]``)."""
        return self.restrict(state, self.ids)

    def paste(self, full: dict, cut: dict) -> dict:
        """``cut`` (a state over the vocabulary's rows) with ``full``'s rows for every other token."""
        out = dict(cut)
        for key in self.keys:
            out[key] = full[key].detach().to(cut[key].dtype, copy=True)
            out[key][self.ids.to(out[key].device)] = cut[key].detach().to(out[key].device)
        return out

    def renumber_split(self, split):
        """A next-token :class:`fedbasin.data.Split` with its token ids renumbered to the vocabulary's rows."""
        return type(split)(self.renumber(split.inputs), self.renumber(split.targets), split.transform)

    def renumber(self, t: torch.Tensor) -> torch.Tensor:
        """Token ids → row numbers. Sparse (id, weight) targets (floats, see ``soft_label_top_k``) keep
        the weight of the vocabulary's tokens only; the weight of the others joins the unlisted bucket."""
        out = _mapped(self.lookup, t)
        if not t.is_floating_point() and bool((out < 0).any()):
            raise ValueError(f"a training batch holds token {int(t[out < 0][0])}, outside the refinement vocabulary")
        return out


def _mapped(lookup: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """Token ids → ``lookup[id]`` (−1: no row). Sparse (id, weight) targets keep the weight of the tokens
    that have a row; the others weigh 0 (id 0 stands in for them)."""
    if t.is_floating_point():
        ids = lookup.to(t.device)[t[..., 0].long()]
        return torch.stack([ids.clamp(min=0).to(t), t[..., 1] * (ids >= 0)], -1)
    return lookup.to(t.device)[t]


def vocabulary_ids(choice: str, proxy, train) -> torch.Tensor | None:
    """Token ids of a training vocabulary: ``"proxy"`` the tokens of the ``proxy`` blocks, ``"seen"`` also
    those of the text's training split ``train``; ``"full"``: None (every token)."""
    if choice == "full":
        return None
    splits = [proxy] + ([train] if choice == "seen" and train is not None else [])
    return torch.unique(torch.cat([t.reshape(-1) for s in splits for t in (s.inputs, s.targets)]))
