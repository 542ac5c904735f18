"""What the grid benchmarks share (:mod:`~fedbasin.benchmarks.regime`,
:mod:`~fedbasin.benchmarks.oneshot_grid`): runs in worker processes with a progress bar, and the
report written atomically (markdown table and JSON)."""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path


def run_in_workers(work: Callable[..., dict], arguments: list[tuple], workers: int, done: int,
                   desc: str) -> list[dict]:
    """``work(*a)`` for every ``a`` of ``arguments`` in ``workers`` processes, results as they finish
    (a bar over ``done`` runs reused plus these). The workers are spawned, not forked: a fork copies the
    caller's threads' state, and a child forked from a process that has run Ray's simulation died of a
    segfault in Ray's library (seen once in the test suite, whose worker had run the Flower tests first)."""
    from tqdm import tqdm

    results = []
    spawned = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=workers, mp_context=spawned) as pool, \
            tqdm(total=done + len(arguments), initial=done, desc=desc) as bar:
        for future in as_completed([pool.submit(work, *a) for a in arguments]):
            results.append(future.result())
            bar.update()
    return results


def write_report(out: Path, stem: str, report: dict, table: str) -> None:
    """``out/stem.json`` (``report``) and ``out/stem.md`` (``table``), each written atomically."""
    from fedbasin.atomic import atomic_write
    from fedbasin.server.outputs import write_json_atomic

    write_json_atomic(out / f"{stem}.json", report)
    atomic_write(out / f"{stem}.md", lambda tmp: Path(tmp).write_text(table + "\n"))
