"""Learned refinement's batch workers: one forward and backward pass, and the maps' transform.

    python -m fedbasin.benchmarks.bench_workers [--batch 64] [--repeats 20]

On the CIFAR-10 recipe's ViT (width 96, 4 layers, 65 tokens; random weights and images: the
timings do not depend on them), times the forward and backward pass of one batch through
``functional_call`` as :func:`fedbasin.alignment.learned_refine` runs it: on one thread, on two
intra-op threads, and cut into two slices on two worker threads (``_Workers.backward``); then
the orthogonal group's transform of a state with its gradient (the serial part of a step) on one
and on two intra-op threads. Prints the median seconds of ``--repeats`` runs as JSON, with the
1-minute load average (the machine may be shared).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch

from fedbasin.alignment import fedbasin_adapter
from fedbasin.alignment.parametrize import _Delta
from fedbasin.alignment.workers import _Workers
from fedbasin.models import build_model, make_config
from fedbasin.training import RECIPES, cross_entropy

CIFAR10_VIT = {**RECIPES["cifar10"]["model"], "image_size": 32, "patch_size": 4, "channels": 3, "num_classes": 10}


def median_seconds(run, repeats: int) -> float:
    run()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    threads = torch.get_num_threads()
    model = build_model("vit", make_config("vit", CIFAR10_VIT))
    spec = fedbasin_adapter("vit", model.config).spec
    weights = {k: v.detach() for k, v in model.state_dict().items()}
    g = torch.Generator().manual_seed(0)
    x, y = torch.rand(args.batch, 3, 32, 32, generator=g), torch.randint(0, 10, (args.batch,), generator=g)
    delta = _Delta(spec, weights, "ste", init_scale=1.0)

    def forward(state, inputs, module=model):
        return torch.func.functional_call(module, state, (inputs,))

    def pass_with(workers: _Workers):
        def run():
            state = {k: v.clone().requires_grad_(v.is_floating_point()) for k, v in weights.items()}
            workers.backward(cross_entropy, forward, state, x, y)
        return run

    def transform():
        delta.zero_grad()
        state = delta.transform(weights, tau=0.1)
        sum(v.square().sum() for v in state.values() if v.is_floating_point()).backward()

    result = {"machine": f"{platform.machine()} {platform.processor() or ''}".strip(), "torch": torch.__version__,
              "threads": threads, "batch": args.batch, "repeats": args.repeats}
    one, two = _Workers(model, torch.device("cpu"), 1), _Workers(model, torch.device("cpu"), 2)
    torch.set_num_threads(1)
    result["pass_one_thread_s"] = median_seconds(pass_with(one), args.repeats)
    result["transform_one_thread_s"] = median_seconds(transform, args.repeats)
    torch.set_num_threads(2)
    result["pass_two_intra_op_threads_s"] = median_seconds(pass_with(one), args.repeats)
    result["transform_two_intra_op_threads_s"] = median_seconds(transform, args.repeats)
    result["pass_two_slices_two_workers_s"] = median_seconds(pass_with(two), args.repeats)
    torch.set_num_threads(threads)
    two.close()
    result["load_average_1min"] = os.getloadavg()[0]
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
