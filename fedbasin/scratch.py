"""Tensors spilled to an anonymous scratch file, so that they cost disk, not memory.

The file is created in ``directory`` (default: the system's temporary directory, ``TMPDIR``) and
unlinked at once: it has no name, nothing is left behind when the process ends or is killed, and
its space is freed when the :class:`ScratchTensors` is. Tensors are stored as their raw bytes
(any dtype, bitwise) and read back one at a time into fresh CPU memory (plain reads, no mapping:
the page cache holds the bytes, not the process); :func:`arrays_on_disk` does the same for a
Flower ``ArrayRecord``'s raw bytes.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from flwr.app import Array


class ScratchTensors:
    """An append-only list of tensors on disk: ``append(t)`` → index, ``self[i]`` → a CPU copy,
    ``clear()`` empties it for reuse (the space is reused)."""

    def __init__(self, directory: str | os.PathLike | None = None):
        fd, path = tempfile.mkstemp(prefix="fedbasin-scratch-", suffix=".bin", dir=directory)
        os.unlink(path)  # anonymous from now on: the open descriptor is its only reference
        self._file = os.fdopen(fd, "w+b", buffering=0)
        self._index: list[tuple[int, int, tuple | None]] = []  # offset, bytes, (dtype, shape) of a tensor
        self._end = 0

    def append(self, tensor: torch.Tensor) -> int:
        data = tensor.detach().to("cpu").contiguous()
        raw = data.reshape(-1).view(torch.uint8).numpy() if data.numel() else b""
        return self._write(raw, (data.dtype, tuple(data.shape)))

    def append_bytes(self, data) -> int:
        """Any bytes-like object, read back with :meth:`bytes_at`."""
        return self._write(data, None)

    def _write(self, raw, kind) -> int:
        self._file.seek(self._end)
        view, done = memoryview(raw).cast("B"), 0
        while done < len(view):  # a raw write may take fewer bytes than given (2 GiB per call on Linux)
            done += self._file.write(view[done:])
        self._index.append((self._end, len(view), kind))
        self._end += len(view)
        return len(self._index) - 1

    def __len__(self) -> int:
        return len(self._index)

    def bytes_at(self, i: int) -> bytearray:
        """Entry ``i``'s raw bytes, read into fresh memory."""
        offset, nbytes, _ = self._index[i]
        buffer = bytearray(nbytes)
        self._file.seek(offset)
        view, done = memoryview(buffer), 0
        while done < nbytes:
            read = self._file.readinto(view[done:])
            if not read:
                raise OSError(f"scratch file ended at byte {offset + done}, expected {offset + nbytes}")
            done += read
        return buffer

    def __getitem__(self, i: int) -> torch.Tensor:
        dtype, shape = self._index[i][2]
        buffer = self.bytes_at(i)
        if not buffer:
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


@contextmanager
def arrays_on_disk(record, directory: str | os.PathLike | None = None) -> Iterator[None]:
    """For the block, a Flower ``ArrayRecord``'s arrays wait in a scratch file and the record is
    empty (their bytes are freed unless something else holds them); afterwards, also when the
    block raises, the record holds arrays equal to its own again, in their order."""
    store = ScratchTensors(directory)
    spilled: list[tuple[str, str, tuple, str]] = []
    try:
        for key in list(record.keys()):
            array = record[key]
            store.append_bytes(array.data)
            spilled.append((key, array.dtype, tuple(array.shape), array.stype))
            del record[key], array
        yield
    finally:
        for i, (key, dtype, shape, stype) in enumerate(spilled):
            record[key] = Array(dtype, shape, stype, bytes(store.bytes_at(i)))
        store.close()
