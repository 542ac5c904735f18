"""Atomic file writes: write a temporary sibling, fsync, give it normal permissions, rename.

Temporaries are named ``.NAME.tmp-PID-HEX[.SUFFIX]`` (:func:`temporary_sibling`): the writer's
process id makes the ones a killed writer left behind recognisable, and :func:`sweep_stale`
removes those (and only those) when the next write into the same directory starts.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import re
import shutil
import sys
import tempfile
import time
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


# .NAME.tmp-PID-HEX[.SUFFIX]; before the PID was part of the tag: .NAME.tmp-HEX (checkpoint
# directories) and .NAME.HEX.tmp[.SUFFIX] (files)
_TEMPORARY = re.compile(r"^\..+\.tmp-(?P<pid>\d+)-[0-9a-f]{12}(\.[^.]+)?$")
_OLD_TEMPORARY = re.compile(r"^\..+(\.tmp-[0-9a-f]{12}|\.[0-9a-f]{12}\.tmp(\.[^.]+)?)$")
#: a temporary of the old naming (no PID to ask) counts as stale once this old
OLD_TEMPORARY_AGE_S = 24 * 3600


def temporary_sibling(path: Path) -> Path:
    """A fresh temporary name next to ``path`` that :func:`sweep_stale` recognises (same suffix:
    some writers choose the format by it)."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:12]}{path.suffix}")


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this machine (a zombie counts: its writes may be pending)."""
    if pid <= 0:
        return True  # not a writer's PID: never treat it as gone
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: alive, another user's
        return True
    return True


def stale_temporaries(directory: Path) -> list[Path]:
    """The temporaries of fedbasin's own naming in ``directory`` whose writer is gone: its PID no
    longer runs on this machine, or (old naming, without a PID) it is older than
    :data:`OLD_TEMPORARY_AGE_S`. A live writer's temporaries and every other name are left alone."""
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return []
    stale = []
    for entry in entries:
        if match := _TEMPORARY.match(entry.name):
            gone = not _alive(int(match["pid"]))
        elif _OLD_TEMPORARY.match(entry.name):
            try:
                gone = time.time() - entry.stat(follow_symlinks=False).st_mtime > OLD_TEMPORARY_AGE_S
            except OSError:
                continue
        else:
            continue
        if gone:
            stale.append(Path(entry.path))
    return stale


def sweep_stale(directory: str | os.PathLike) -> list[Path]:
    """Remove :func:`stale_temporaries` of ``directory`` (what killed writes left); returns them.
    Failures are ignored: a sweep never stops the write that starts it."""
    removed = []
    for path in stale_temporaries(Path(directory)):
        try:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
        except OSError:
            continue
        removed.append(path)
    return removed


def missing_ancestors(path: str | os.PathLike) -> list[Path]:
    """The directories above ``path`` (nearest first) that do not exist yet."""
    missing = []
    for parent in Path(path).absolute().parents:
        if parent.exists():
            break
        missing.append(parent)
    return missing


def write_problem(path: str | os.PathLike, replaced: bool = True) -> str | None:
    """Why ``path`` cannot be written, or None when it can: atomically replaced or created
    (``replaced``), or, for a directory that is only written into, created or written into.

    Probes, by creating and removing a hidden directory, the nearest existing directory above
    ``path`` (where a temporary sibling goes, or ``path`` is created) and ``path`` itself where it
    is a directory; an existing file is opened for appending (nothing is written). A probe is the
    only check that also holds for root: permissions, read-only file systems and immutable
    (``chattr +i``) directories and files are all caught."""
    path = Path(path)
    missing = missing_ancestors(path)
    anchor = (missing[-1] if missing else path.absolute()).parent
    if not anchor.is_dir():
        return f"{anchor} is not a directory"
    existing = [path] if path.is_dir() else []
    for directory in ([anchor] if replaced or not existing else []) + existing:
        try:
            os.rmdir(tempfile.mkdtemp(prefix=".fedbasin-probe-", dir=directory))
        except OSError as exc:
            return f"cannot write in {directory} ({exc.strerror})"
    if path.is_file():
        try:
            open(path, "ab").close()
        except OSError as exc:
            return f"cannot replace it ({exc.strerror})"
    return None


def atomic_write(path: str | os.PathLike, write: Callable[[Path], None]) -> None:
    """Run ``write(tmp)`` on a temporary file next to ``path``, then rename it onto ``path``.

    An interrupted or failing write leaves ``path`` as it was and removes the temporary file;
    what killed writers left in the directory is swept first (:func:`sweep_stale`).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    sweep_stale(path.parent)
    tmp = temporary_sibling(path)
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
