"""Atomic file writes: write a temporary sibling, fsync, give it normal permissions, rename."""

from __future__ import annotations

import functools
import os
import uuid
from pathlib import Path
from typing import Callable


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
