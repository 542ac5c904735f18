"""pytest option ``--mutate NAME``: run the tests against a deliberately broken feature
(tests/mutants.py). Without the option nothing changes. Also: the Flower modules' xdist group, and one
share of the cores per xdist worker."""

from __future__ import annotations

import gc
import os

import pytest

from tests.mutants import MUTATIONS

# Test modules that start Flower's processes (a SuperLink, SuperNodes, Ray's cluster): the suite runs on two
# pytest-xdist workers (pyproject's addopts: ``-n 2 --dist loadgroup``), and these all run on one of them, one at
# a time, so two Ray clusters or two federations never start side by side; the other worker takes the rest.
FLOWER_PROCESS_MODULES = {"test_simulation", "test_processes", "test_deployment", "test_robust_simulation",
                          "test_federated_causal_lm", "test_weights", "test_server_app"}


def pytest_addoption(parser):
    parser.addoption("--mutate", choices=sorted(MUTATIONS), default=None,
                     help="break one fedbasin feature in this test process (mutation check of the tests)")


def pytest_configure(config):
    # transformers makes its log handler on first use, bound to the sys.stderr of that moment: make it
    # now, so that it never keeps a test's closed capsys stream (a later test's warning then fails
    # with "Logging error" whichever test file happened to run first)
    try:
        from transformers.utils import logging as transformers_logging
    except ImportError:
        pass
    else:
        transformers_logging.get_logger("transformers")
    _one_share_of_the_cores_per_worker()
    name = config.getoption("--mutate")
    if name:
        MUTATIONS[name]()


def _one_share_of_the_cores_per_worker() -> None:
    """In a pytest-xdist worker, torch and the processes it starts use cores / workers threads (unless
    ``OMP_NUM_THREADS`` is set): two workers of torch's default two threads each oversubscribe a 2-core
    machine. Measured back to back on the 2-core Xeon (journal/merging-notes.md §28): 980 s → 756 s."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if not workers or "OMP_NUM_THREADS" in os.environ:
        return
    import torch

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = max(1, cores // int(workers))
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.module.__name__.rpartition(".")[2] in FLOWER_PROCESS_MODULES:
            item.add_marker(pytest.mark.xdist_group("flower"))


def pytest_report_header(config):
    name = config.getoption("--mutate")
    return f"MUTATION ACTIVE: {name} ({MUTATIONS[name].__doc__.strip()})" if name else None


@pytest.fixture(autouse=True)
def _same_random_state_in_every_test():
    """Each test starts from the same global random state (torch, numpy, random): a test that draws from the
    global generators then gets the same numbers whichever tests ran before it in its xdist worker (a test
    of the collusion check once failed on CI for that reason)."""
    import random

    import numpy
    import torch

    random.seed(0)
    numpy.random.seed(0)
    torch.manual_seed(0)


@pytest.fixture
def calls(monkeypatch) -> list[dict]:
    """Every ``ensemble_distill`` call of the CLI, recorded (teachers counted) and run for 4 steps instead of
    its budget, with its result (the merge tests of images and of language models)."""
    from fedbasin.server import distill as distill_module

    original, record = distill_module.ensemble_distill, []

    def spy(model, student, teachers, *args, **kwargs):
        call = {**kwargs, "teachers": len(teachers)}
        kwargs.update(steps=4, budget=None)
        call["result"] = original(model, student, teachers, *args, **kwargs)
        record.append(call)
        return call["result"]

    monkeypatch.setattr(distill_module, "ensemble_distill", spy)
    return record


def _storage_bytes(objects) -> dict[int, int]:
    """{storage address: bytes} of the CPU tensors among ``objects``."""
    import torch

    found = {}
    for obj in objects:
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
            storage = obj.untyped_storage()
            found[storage.data_ptr()] = storage.nbytes()
    return found


@pytest.fixture
def live_tensor_bytes():
    """A function: the bytes of every distinct CPU tensor storage the garbage collector can see. What is
    alive when the test starts is counted once and frozen out of the collector's lists (``gc.freeze``), so
    a sample scans only the objects the test made: ~1e-4 s instead of ~0.2 s for a whole test process's
    ~400k objects (the memory tests take hundreds of samples)."""
    gc.collect()
    before_the_test = _storage_bytes(gc.get_objects())
    gc.freeze()
    try:
        yield lambda: sum({**before_the_test, **_storage_bytes(gc.get_objects())}.values())
    finally:
        gc.unfreeze()
