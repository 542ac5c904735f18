"""fedbasin.heap.keep_freed_blocks: a loop that allocates the same large tensor every step stops
faulting its pages in again (the refinement steps' logits, see docs/journal/merging-notes.md §7)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from fedbasin import heap

ROOT = Path(__file__).resolve().parents[1]

LOOP = """
import resource, sys, threading, torch
from fedbasin import heap
if sys.argv[1] == "keep":
    assert heap.keep_freed_blocks()
def faults():
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
late = []
def loop():
    counts = []
    for _ in range(30):
        before = faults()
        block = torch.ones(16 << 20)  # 64 MB: above glibc's largest mmap threshold (32 MB)
        del block
        counts.append(faults() - before)
    late.append(sum(counts[-10:]))
if sys.argv[2] == "thread":  # a thread started after the setting, like the refinement's workers
    worker = threading.Thread(target=loop)
    worker.start()
    worker.join()
else:
    loop()
print(late[0])
"""


def _late_faults(mode: str, where: str = "main") -> int:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    for name in ("MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_THRESHOLD_"):
        env.pop(name, None)
    out = subprocess.run([sys.executable, "-c", LOOP, mode, where], env=env, capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(heap._libc() is None or not sys.platform.startswith("linux"), reason="glibc only")
def test_keep_freed_blocks_stops_refaulting_large_blocks():
    pages = (64 << 20) // os.sysconf("SC_PAGE_SIZE")
    assert _late_faults("default") >= 9 * pages  # each 64 MB block is mmap-ed and faulted in anew
    assert _late_faults("keep") < pages // 4  # the same pages are reused
    assert _late_faults("keep", "thread") < pages // 4  # in a later thread too (one arena)
