"""glibc heap controls for processes that hold several model-sized tensors at once.

glibc serves large blocks by ``mmap`` (returned to the kernel on ``free``) only above a
threshold that it raises whenever such a block is freed; after a few model-sized frees, later
blocks come from the heap and freed memory stays in the process (the server's peak RSS with
K = 4 clients was 18.6 model sizes instead of 9.8, docs/scale.md). Every call is a no-op off glibc.
"""

from __future__ import annotations

import ctypes

M_MMAP_THRESHOLD = -3  # mallopt parameter number in glibc's malloc.h


def _libc():
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc
        return None


def trim() -> None:
    """Hand freed heap pages (all arenas) back to the kernel: ``malloc_trim(0)``."""
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def fix_mmap_threshold(nbytes: int = 1 << 16) -> bool:
    """Serve every block of at least ``nbytes`` by ``mmap`` from now on (glibc's dynamic threshold
    off), so freed tensors go back to the kernel at once; True when set."""
    libc = _libc()
    return bool(libc is not None and hasattr(libc, "mallopt") and libc.mallopt(M_MMAP_THRESHOLD, nbytes))


M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_MAX, M_ARENA_MAX = -1, -2, -4, -8  # mallopt parameter numbers


def keep_freed_blocks(top_pad: int = 1 << 28) -> bool:
    """Serve every block from the heap (``mmap`` off), never trim it, and grow it ``top_pad`` bytes
    beyond each request, so a loop that allocates the same large tensors every step reuses its
    pages. By default glibc ``mmap``s every block over 32 MB (a refinement step's logits) and
    returns it on ``free``, so each step faults it in again page by page: on the GPT-2 refinement
    that was 20 million page faults, a third of the process's CPU time. Threads started later
    share the main arena (``M_ARENA_MAX`` 1): a thread's own arena holds at most 64 MB per heap and
    still maps larger blocks anew (the refinement's worker threads: 51 s of system time on the
    GPT-2 pair; 25 s when set in-process before those threads start; 12 s with
    ``MALLOC_ARENA_MAX=1`` in the environment, which also covers the thread ``import torch`` starts).
    True when set."""
    libc = _libc()
    if libc is None or not hasattr(libc, "mallopt"):
        return False
    return bool(libc.mallopt(M_MMAP_MAX, 0) and libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1)
                and libc.mallopt(M_TOP_PAD, top_pad) and libc.mallopt(M_ARENA_MAX, 1))
