"""Atomic file writes: write a temporary sibling, fsync, give it normal permissions, rename."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import sys
import uuid
from collections.abc import Callable
from pathlib import Path


@functools.lru_cache(maxsize=1)
def file_mode() -> int:
    """``0o666`` minus the process umask (what ``open()`` would give a new file)."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def publish(path: Path) -> None:
    """fsync ``path`` and give it normal permissions (tools like safetensors write 0600)."""
    os.chmod(path, file_mode())
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def atomic_write(path: str | os.PathLike, write: Callable[[Path], None]) -> None:
    """Run ``write(tmp)`` on a temporary file next to ``path``, then rename it onto ``path``.

    An interrupted or failing write leaves ``path`` as it was and removes the temporary file.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}.tmp{path.suffix}")
    try:
        write(tmp)
        publish(tmp)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


@functools.lru_cache(maxsize=1)
def _renameat2():
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    return getattr(libc, "renameat2", None)


def exchange(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """Swap two existing paths in one step (Linux ``renameat2(RENAME_EXCHANGE)``): at every
    moment each name holds either its old or its new content. Returns False, changing nothing,
    where the platform or file system cannot do this."""
    renameat2 = _renameat2()
    if renameat2 is None:
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    errno = ctypes.get_errno()
    if errno in (22, 38, 95):  # EINVAL, ENOSYS, EOPNOTSUPP: not supported here
        return False
    raise OSError(errno, os.strerror(errno), str(a), None, str(b))
