"""Model passes of learned refinement shared among CPU threads.

A batch is cut into n slices whose forward and backward passes run at once, one thread each on
its own weightless copy of the model, torch single-threaded inside. With ``loss_fn`` a mean over
the batch's examples, the gradient ``Σ_i (n_i/n)·∇L_i`` equals the whole batch's up to rounding.
"""

from __future__ import annotations

import contextlib
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import torch
from torch import nn

from fedbasin.weights import weightless_copy

from .matching import one_thread


class _Workers:
    """Model passes on ``count`` CPU threads at once (see :func:`learned_refine`'s ``batch_workers``).

    Each thread gets its own weightless copy of the model, since ``functional_call`` swaps a
    module's tensors in place and one module cannot serve two threads; torch runs single-threaded
    inside (:func:`~fedbasin.alignment.matching.one_thread`). Small passes side by side use the
    cores better than one pass with intra-op threads: a CIFAR-10 ViT (width 96, 65 tokens) forward
    and backward on 64 images took 0.078 s wall as two slices of 32 on 2 threads, 0.116 s with 2
    intra-op threads and 0.157 s on one (2-core AMD EPYC; ``python -m
    fedbasin.benchmarks.bench_workers``)."""

    def __init__(self, model: nn.Module, device: torch.device, count: int = 0):
        if device.type != "cpu":
            count = 1
        self.count, self.device = count or torch.get_num_threads(), device
        self.modules = []
        for _ in range(self.count):  # the states bring the weights; RoPE tables follow them
            module = weightless_copy(model, device).eval()
            for p in module.parameters():
                p.requires_grad_(False)
            self.modules.append(module)
        self.pool = ThreadPoolExecutor(self.count) if self.count > 1 else None

    def map(self, fn: Callable[[nn.Module, object], object], items) -> list:
        """``[fn(module, item) for item in items]``: thread j takes items j, j + n, … with module j."""
        items = list(items)
        n = min(self.count, len(items))
        if n < 2:
            return [fn(self.modules[0], item) for item in items]
        def thread(j: int) -> list:
            torch.set_num_threads(1)  # per thread: the main thread's setting does not reach the pool's threads
            return [fn(self.modules[j], item) for item in items[j::n]]

        with one_thread(self.device):
            done = [c.result() for c in [self.pool.submit(thread, j) for j in range(n)]]
        return [done[i % n][i // n] for i in range(len(items))]

    def backward(self, loss_fn, forward, state: dict, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Back-propagate ``loss_fn(forward(state, x), y)`` into whatever ``state`` was computed
        from; returns the (detached) loss. With n > 1 slices, each thread differentiates
        ``(n_i/n)·L(slice_i)`` with respect to detached copies of the state's differentiable tensors,
        and their gradients, summed in slice order, continue the backward pass from ``state``."""
        slices = min(self.count, len(y))
        if slices < 2:
            loss = loss_fn(forward(state, x), y)
            loss.backward()
            return loss.detach()
        keys = [k for k, v in state.items() if v.requires_grad]
        leaves = {k: v.detach().requires_grad_(k in keys) for k, v in state.items()}

        def one_slice(module, part):
            xs, ys = part
            loss = loss_fn(forward(leaves, xs, module), ys) * (len(ys) / len(y))
            return loss.detach(), torch.autograd.grad(loss, [leaves[k] for k in keys], allow_unused=True)

        done = self.map(one_slice, zip(x.tensor_split(slices), y.tensor_split(slices)))
        grads = [sum(g[i] for _, g in done if g[i] is not None) for i in range(len(keys))]
        used = [i for i, g in enumerate(grads) if isinstance(g, torch.Tensor)]
        torch.autograd.backward([state[keys[i]] for i in used], [grads[i] for i in used])
        return sum(loss for loss, _ in done)

    def serial(self):
        """Context: torch single-threaded while worker threads are in use (a no-op with one)."""
        return one_thread(self.device) if self.count > 1 else contextlib.nullcontext()

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown()
