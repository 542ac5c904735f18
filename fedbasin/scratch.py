"""Tensors spilled to an anonymous scratch file, so that they cost disk, not memory.

The file is created in ``directory`` (default: the system's temporary directory, ``TMPDIR``) and
unlinked at once: it has no name, nothing is left behind when the process ends or is killed, and
its space is freed when the :class:`ScratchTensors` is. Tensors are stored as their raw bytes
(any dtype, bitwise) and read back one at a time into fresh CPU memory (plain reads, no mapping:
the page cache holds the bytes, not the process).
"""

from __future__ import annotations

import os
import tempfile

import torch


class ScratchTensors:
    """An append-only list of tensors on disk: ``append(t)`` → index, ``self[i]`` → a CPU copy,
    ``clear()`` empties it for reuse (the space is reused)."""

    def __init__(self, directory: str | os.PathLike | None = None):
        fd, path = tempfile.mkstemp(prefix="fedbasin-scratch-", suffix=".bin", dir=directory)
        os.unlink(path)  # anonymous from now on: the open descriptor is its only reference
        self._file = os.fdopen(fd, "w+b", buffering=0)
        self._index: list[tuple[int, int, torch.dtype, tuple[int, ...]]] = []
        self._end = 0

    def append(self, tensor: torch.Tensor) -> int:
        data = tensor.detach().to("cpu").contiguous()
        raw = data.reshape(-1).view(torch.uint8).numpy() if data.numel() else b""
        self._file.seek(self._end)
        view, done = memoryview(raw), 0
        while done < len(view):  # a raw write may take fewer bytes than given (2 GiB per call on Linux)
            done += self._file.write(view[done:])
        self._index.append((self._end, data.numel() * data.element_size(), data.dtype, tuple(data.shape)))
        self._end += self._index[-1][1]
        return len(self._index) - 1

    def __len__(self) -> int:
        return len(self._index)

    def __getitem__(self, i: int) -> torch.Tensor:
        offset, nbytes, dtype, shape = self._index[i]
        buffer = bytearray(nbytes)
        self._file.seek(offset)
        view, done = memoryview(buffer), 0
        while done < nbytes:
            read = self._file.readinto(view[done:])
            if not read:
                raise OSError(f"scratch file ended at byte {offset + done}, expected {offset + nbytes}")
            done += read
        if not nbytes:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(buffer, dtype=torch.uint8).view(dtype).reshape(shape)

    def clear(self) -> None:
        self._index.clear()
        self._end = 0

    def close(self) -> None:
        self._file.close()

    @property
    def nbytes(self) -> int:
        return self._end
