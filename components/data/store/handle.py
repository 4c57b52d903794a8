"""A lazy handle on one stored array: its shape and dtype at once, its values only for the region asked for.

:class:`StoredArray` is what a :class:`~components.data.store.StoreDataset` item holds in place of an array. It
opens its file on the first read, in the process that reads (a DataLoader worker), memory-mapped; pickling it
(to a worker) carries the path and the index's record, never an open file. Opening checks the file's size and the
CRC-32 of its header and tail before blosc2 parses them; ``handle[region]`` checks the CRC-32 of every compressed
chunk the region covers (once per chunk and process), decompresses those chunks only and returns a numpy array in
the array's own dtype. Any failure to open, verify or decompress raises :class:`StoreReadError` naming the store
file and the source volume: no corrupt byte reaches blosc2.

A process keeps the last :data:`OPEN_ARRAYS` arrays it opened, with the chunks it verified, across handles: a
dataset makes a new handle for every item it reads, and reopening the file and re-checking its chunks made a crop
from the store about a third slower. A kept array serves only the same file (inode, size and modification time), so
a rewritten store (``preprocess --overwrite``) is opened and checked anew.
"""

from __future__ import annotations

import os
import zlib
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ...errors import UserError

from .format import chunk_numbers, decode, frame_problem, open_array

__all__ = ["StoreReadError", "StoredArray"]

#: opened arrays a process keeps (memory-mapped files: a few kB each)
OPEN_ARRAYS = 256
# path -> (process id, the file's (inode, size, mtime), opened array, the chunk numbers verified in it)
_OPENED: OrderedDict[Path, tuple[int, tuple[int, int, int], Any, set[int]]] = OrderedDict()


class StoreReadError(UserError, RuntimeError):
    """A stored array could not be read: missing, truncated or corrupt file, or a failed decompression.

    Attributes:
        store_file: the ``.b2nd`` file.
        source: the volume it was made from (the datalist's path).
    """

    def __init__(self, store_file: str | os.PathLike, source: str | None, reason: str) -> None:
        self.store_file, self.source = str(store_file), source
        super().__init__(f"cannot read {self.store_file} (from {source or 'an unknown source'}): {reason}")


class StoredArray:
    """The stored array at ``path`` as the index records it (``record``: :func:`~.format.write_array`'s dict).

    Args:
        path: the ``.b2nd`` file.
        record: ``shape``, ``dtype``, ``stored_dtype``, ``chunks``, ``nbytes``, ``crc32``.
        source: the source volume, named by errors.
        meta: the MetaTensor metadata the array had when it was stored (None for a plain array).
        locations: a label map's sampled foreground locations
            (:class:`~components.data.store.foreground.ClassLocations`), None for other arrays.

    Example:
        >>> crop = handle[:, 10:42, 0:32, 5:37]      # numpy, only the chunks this region covers are read
        >>> handle.shape, handle.dtype
        ((1, 120, 96, 80), dtype('int16'))
    """

    def __init__(self, path: str | os.PathLike, record: Mapping[str, Any], source: str | None = None,
                 meta: Mapping | None = None, locations: Any = None) -> None:  # fmt: skip
        self.path = Path(path)
        self.record = dict(record)
        self.source = source
        self.meta = meta
        self.locations = locations
        self.shape = tuple(int(n) for n in record["shape"])
        self.dtype = np.dtype(record["dtype"])
        self._array = None
        self._pid: int | None = None
        self._verified: set[int] = set()

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __len__(self) -> int:
        return self.shape[0]

    def __repr__(self) -> str:
        return f"StoredArray({str(self.path)!r}, shape={self.shape}, dtype={self.dtype})"

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state.update(_array=None, _pid=None, _verified=set())  # reopened in the process that reads
        return state

    def _error(self, reason: str) -> StoreReadError:
        return StoreReadError(self.path, self.source, reason)

    def _open(self):
        if self._array is not None and self._pid == os.getpid():
            return self._array
        try:
            stat = self.path.stat()
        except OSError as err:
            raise self._error(f"{type(err).__name__}: {err.strerror or err}") from err
        identity = (stat.st_ino, stat.st_size, stat.st_mtime_ns)
        opened = _OPENED.get(self.path)
        if opened is not None and opened[:2] == (os.getpid(), identity):
            _OPENED.move_to_end(self.path)
            self._pid, _, self._array, self._verified = opened
            return self._array
        if stat.st_size != int(self.record["nbytes"]):
            raise self._error(f"the file has {stat.st_size} bytes, the index {self.record['nbytes']} (truncated or replaced)")
        problem = frame_problem(self.path, self.record)  # before blosc2 parses any of it
        if problem:
            raise self._error(problem)
        try:
            array = open_array(self.path)
            held = (tuple(array.shape), array.dtype, list(array.chunks), list(array.blocks), array.schunk.nchunks)
        except Exception as err:  # blosc2 raises RuntimeError / ValueError for files it cannot parse
            raise self._error(f"not a blosc2 array ({type(err).__name__}: {err})") from err
        recorded = (self.shape, np.dtype(self.record["stored_dtype"]), self.record["chunks"], self.record["blocks"],
                    len(self.record["crc32"]))  # fmt: skip
        if held != recorded:
            raise self._error(f"holds {held[1]}{held[0]} in chunks {held[2]} of blocks {held[3]} ({held[4]} chunks), "
                              f"the index {recorded[1]}{recorded[0]} in {recorded[2]} of {recorded[3]} ({recorded[4]})")  # fmt: skip
        self._array, self._pid, self._verified = array, os.getpid(), set()
        _OPENED[self.path] = (self._pid, identity, array, self._verified)
        while len(_OPENED) > OPEN_ARRAYS:
            _OPENED.popitem(last=False)
        return array

    def _region(self, index: Any) -> tuple[slice, ...]:
        """``index`` as one step-1 slice per axis with bounds clipped to the shape (what numpy would select)."""
        index = index if isinstance(index, tuple) else (index,)
        if any(i is Ellipsis for i in index):
            at = index.index(Ellipsis)
            index = index[:at] + (slice(None),) * (self.ndim - len(index) + 1) + index[at + 1 :]
        if len(index) > self.ndim or not all(isinstance(i, slice) for i in index):
            raise IndexError(f"{self!r}: index with at most {self.ndim} slices, got {index!r}.")
        region = []
        for axis, size in enumerate(self.shape):
            part = index[axis] if axis < len(index) else slice(None)
            start, stop, step = part.indices(size)
            if step != 1:
                raise IndexError(f"{self!r}: slices with step 1 only, got {part!r}.")
            region.append(slice(start, max(start, stop)))
        return tuple(region)

    def _verify(self, array, region: tuple[slice, ...]) -> None:
        chunks, checksums = self.record["chunks"], self.record["crc32"]
        for number in chunk_numbers(self.shape, chunks, region):
            if number in self._verified:
                continue
            try:
                compressed = array.schunk.get_chunk(number)
            except Exception as err:  # noqa: BLE001 -- any failure to fetch a chunk is a corrupt file
                raise self._error(f"chunk {number} unreadable ({type(err).__name__}: {err})") from err
            if zlib.crc32(compressed) != checksums[number]:
                raise self._error(f"chunk {number} fails its CRC-32 check (the file is corrupt)")
            self._verified.add(number)

    def __getitem__(self, index: Any) -> np.ndarray:
        """The values of ``index`` (slices, step 1) as a new numpy array of :attr:`dtype`."""
        region = self._region(index)
        array = self._open()
        if any(r.stop == r.start for r in region):
            return np.empty(tuple(r.stop - r.start for r in region), self.dtype)
        self._verify(array, region)
        try:
            values = array[region]
        except Exception as err:  # noqa: BLE001 -- blosc2's decompression errors have no common type
            raise self._error(f"decompression failed ({type(err).__name__}: {err})") from err
        return decode(values, self.record, region[0])

    def read(self, index: Any = ...) -> torch.Tensor:
        """``self[index]`` as a torch tensor (the whole array by default)."""
        return torch.from_numpy(np.ascontiguousarray(self[index]))

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        values = self[...]
        return values if dtype is None else values.astype(dtype, copy=False)
