"""A lazy handle on one stored array: its shape and dtype at once, its values only for the region asked for.

:class:`StoredArray` is what a :class:`~components.data.store.StoreDataset` item holds in place of an array. It
opens its file on the first read, in the process that reads (a DataLoader worker), memory-mapped for random reads
(:class:`~components.data.store.mapped.MappedArray`: from a cold disk a read moves the compressed chunks it covers,
not the file); pickling it (to a worker) carries the path and the index's record, never an open file. Opening checks
the file's size and the CRC-32 of its header and tail before blosc2 parses them; ``handle[region]`` checks the CRC-32
of every compressed chunk the region covers (once per chunk and process), decompresses the blocks of those chunks
that the region covers and returns a numpy array in the array's own dtype. Any failure to open, verify or decompress
raises :class:`StoreReadError` naming the store file and the source volume: no corrupt byte reaches blosc2.

A process keeps the last :data:`OPEN_ARRAYS` arrays it opened, with the chunks it verified, across handles: a
dataset makes a new handle for every item it reads, and reopening the file and re-checking its chunks made a crop
from the store about a third slower. A kept array serves only the same file (inode, size and modification time), so
a rewritten store (``preprocess --overwrite``) is opened and checked anew.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ...errors import UserError

from .format import chunk_numbers, decode
from .mapped import FrameError, MappedArray

__all__ = ["StoreReadError", "StoredArray"]

#: opened arrays a process keeps (memory-mapped files: a few kB each)
OPEN_ARRAYS = 256
# path -> (process id, the file's (inode, size, mtime), opened array, the chunk numbers verified in it)
_OPENED: OrderedDict[Path, tuple[int, tuple[int, int, int], MappedArray, set[int]]] = OrderedDict()


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
        self._mapped: MappedArray | None = None
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
        state.update(_mapped=None, _pid=None, _verified=set())  # reopened in the process that reads
        return state

    def _error(self, reason: str) -> StoreReadError:
        return StoreReadError(self.path, self.source, reason)

    def _open(self) -> MappedArray:
        if self._mapped is not None and self._pid == os.getpid():
            return self._mapped
        try:
            stat = self.path.stat()
        except OSError as err:
            raise self._error(f"{type(err).__name__}: {err.strerror or err}") from err
        identity = (stat.st_ino, stat.st_size, stat.st_mtime_ns)
        opened = _OPENED.get(self.path)
        if opened is not None and opened[:2] == (os.getpid(), identity):
            _OPENED.move_to_end(self.path)
            self._pid, _, self._mapped, self._verified = opened
            return self._mapped
        if stat.st_size != int(self.record["nbytes"]):
            raise self._error(f"the file has {stat.st_size} bytes, the index {self.record['nbytes']} (truncated or replaced)")
        try:  # the header and tail are checked before blosc2 parses any of it
            mapped = MappedArray(self.path, self.record)
            array = mapped.array
            held = (tuple(array.shape), array.dtype, list(array.chunks), list(array.blocks), array.schunk.nchunks)
        except OSError as err:
            raise self._error(f"{type(err).__name__}: {err.strerror or err}") from err
        except FrameError as err:
            raise self._error(str(err)) from err
        except KeyError as err:
            raise self._error(f"its record in the volume's item.json has no {err} (written by another version of the "
                              "store: rebuild it)") from err  # fmt: skip
        except Exception as err:  # blosc2 raises RuntimeError / ValueError for files it cannot parse
            raise self._error(f"not a blosc2 array ({type(err).__name__}: {err})") from err
        recorded = (self.shape, np.dtype(self.record["stored_dtype"]), self.record["chunks"], self.record["blocks"],
                    len(self.record["crc32"]))  # fmt: skip
        if held != recorded:
            raise self._error(f"holds {held[1]}{held[0]} in chunks {held[2]} of blocks {held[3]} ({held[4]} chunks), "
                              f"the index {recorded[1]}{recorded[0]} in {recorded[2]} of {recorded[3]} ({recorded[4]})")  # fmt: skip
        self._mapped, self._pid, self._verified = mapped, os.getpid(), set()
        _OPENED[self.path] = (self._pid, identity, mapped, self._verified)
        while len(_OPENED) > OPEN_ARRAYS:
            _OPENED.popitem(last=False)
        return mapped

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

    def _verify(self, mapped: MappedArray, region: tuple[slice, ...]) -> None:
        """Checks the CRC-32 of the chunks ``region`` covers that this process has not checked yet, read from disk
        at once first."""
        todo = [n for n in chunk_numbers(self.shape, self.record["chunks"], region) if n not in self._verified]
        if not todo:
            return
        mapped.prefetch(todo)
        checksums = self.record["crc32"]
        for number in todo:
            try:
                checksum = mapped.checksum(number)
            except Exception as err:  # noqa: BLE001 -- any failure to fetch a chunk is a corrupt file
                raise self._error(f"chunk {number} unreadable ({type(err).__name__}: {err})") from err
            if checksum != checksums[number]:
                raise self._error(f"chunk {number} fails its CRC-32 check (the file is corrupt)")
            self._verified.add(number)

    def _stored(self, region: tuple[slice, ...]) -> np.ndarray | None:
        """The stored values (before :func:`~.format.decode`) of ``region`` (:meth:`_region`'s), its chunks checked
        first; None for an empty region (the file is opened and checked all the same)."""
        mapped = self._open()
        if any(r.stop == r.start for r in region):
            return None
        self._verify(mapped, region)
        try:
            return mapped.array[region]
        except Exception as err:  # noqa: BLE001 -- blosc2's decompression errors have no common type
            raise self._error(f"decompression failed ({type(err).__name__}: {err})") from err

    def __getitem__(self, index: Any) -> np.ndarray:
        """The values of ``index`` (slices, step 1) as a new numpy array of :attr:`dtype`."""
        region = self._region(index)
        values = self._stored(region)
        if values is None:
            return np.empty(tuple(r.stop - r.start for r in region), self.dtype)
        return decode(values, self.record, region[0])

    def read_into(self, index: Any, out: np.ndarray) -> None:
        """Writes the values of ``index`` into ``out`` (an array, or a view of one, of the region's shape and of
        :attr:`dtype`): one pass over the crop where ``out[...] = self[index]`` makes two, and no array between.

        Raises:
            ValueError: ``out`` of another shape or dtype.
        """
        region = self._region(index)
        shape = tuple(r.stop - r.start for r in region)
        if out.shape != shape or out.dtype != self.dtype:
            raise ValueError(f"{self!r}: out must be {self.dtype}{list(shape)}, got {out.dtype}{list(out.shape)}.")
        values = self._stored(region)
        if values is not None:
            decode(values, self.record, region[0], out)

    def read(self, index: Any = ...) -> torch.Tensor:
        """``self[index]`` as a torch tensor (the whole array by default)."""
        return torch.from_numpy(np.ascontiguousarray(self[index]))

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        values = self[...]
        return values if dtype is None else values.astype(dtype, copy=False)
