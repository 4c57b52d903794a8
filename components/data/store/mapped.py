"""A stored array's file memory-mapped for random reads: what a crop moves from disk is the compressed chunks it
covers, not the whole file.

blosc2's own memory-mapped mode maps a file with the kernel's default access pattern, under which a page fault reads
the device's read-ahead window around the page (often larger than a stored volume's file): a crop from a file not in
the page cache read all of it. :class:`MappedArray` maps the file itself with ``MADV_RANDOM`` (a page fault reads
its own page only), asks for the chunks a read covers at once with ``MADV_WILLNEED`` (a few large reads, where page
faults would make one per page), and has blosc2 read the mapping in place (``blosc2.ndarray_from_cframe`` without a
copy), decompressing only the blocks a slice covers.

A blosc2 frame is a header, the compressed chunks one after the other, and a tail that starts with the chunk offsets
(a compressed chunk of int64, from the end of the header; negative for a chunk of one special value, which the
offsets describe and the chunks section does not hold). The offsets are read once the tail's CRC-32 is checked, and
give each stored chunk's bytes, whose CRC-32 is then computed on the mapping without a copy. Where the platform has
no ``madvise`` (Windows) the hints are skipped; reads stay the same.
"""

from __future__ import annotations

import mmap
import os
import zlib
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from .format import head_tail_problem

__all__ = ["FrameError", "MappedArray"]


class FrameError(ValueError):
    """A stored file whose header or tail fails its CRC-32, or whose chunk offsets do not fit the file."""


def chunk_spans(tail: bytes | memoryview, head: int, end: int, count: int) -> np.ndarray:
    """The ``(start, stop)`` byte positions in the file of each of ``count`` chunks, ``(-1, -1)`` for a chunk not
    stored (one special value), from a frame's ``tail`` (whose first part is the offsets chunk) with a header of
    ``head`` bytes and the chunks section ending at byte ``end``.

    Raises:
        FrameError: offsets that cannot be read, of another number of chunks, or that do not lay the stored chunks
            one after the other from the end of the header to ``end``.
    """
    import blosc2

    if count == 0:  # an array of no voxel: its offsets chunk holds nothing to decompress
        return np.zeros((0, 2), np.int64)
    try:  # one thread: blosc2's default context starts its threads for every call, most of what an open cost
        offsets = np.frombuffer(blosc2.decompress2(tail, nthreads=1), "<i8")
    except Exception as err:  # noqa: BLE001 -- blosc2 refuses a chunk it cannot parse with several error types
        raise FrameError(f"its chunk offsets cannot be read ({type(err).__name__}: {err})") from err
    if len(offsets) != count:
        raise FrameError(f"its chunk offsets name {len(offsets)} chunks, the index {count}")
    stored = np.flatnonzero(offsets >= 0)
    starts = head + offsets[stored]
    order = np.argsort(starts, kind="stable")
    starts = starts[order]
    stops = np.append(starts[1:], end)
    if len(starts) and (starts[0] != head or bool(np.any(stops <= starts))):
        raise FrameError(f"its chunk offsets do not lay the chunks one after the other from byte {head} to {end}")
    spans = np.full((count, 2), -1, np.int64)
    spans[stored[order], 0], spans[stored[order], 1] = starts, stops
    return spans


class MappedArray:
    """The blosc2 NDArray of the ``.b2nd`` file at ``path`` (written as ``record`` says), memory-mapped read-only for
    random reads. Opening reads the header and the tail (a page or two each) and checks them against ``record``;
    nothing else is read until a chunk is.

    Args:
        path: the file; its size must already match ``record["nbytes"]``.
        record: :func:`~.format.write_array`'s dict of it (``head_bytes``, ``head_crc32``, ``tail_bytes``,
            ``tail_crc32``, ``crc32``).

    Attributes:
        array: the blosc2 NDArray, reading the mapping in place.

    Raises:
        OSError: the file cannot be opened or mapped.
        FrameError: its header or tail fails its CRC-32, or its chunk offsets do not fit the file.
        KeyError: ``record`` lacks one of the fields above.
        RuntimeError, ValueError: blosc2 cannot parse the frame.
    """

    def __init__(self, path: str | os.PathLike, record: Mapping[str, Any]) -> None:
        import blosc2

        head, tail, count = int(record["head_bytes"]), int(record["tail_bytes"]), len(record["crc32"])
        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._advise(getattr(mmap, "MADV_RANDOM", None), 0, len(self._map))
        self._view = memoryview(self._map)
        end = len(self._view) - tail
        if head + tail > len(self._view):
            raise FrameError(f"{len(self._view)} bytes cannot hold a header of {head} and a tail of {tail}")
        problem = head_tail_problem(self._view[:head], self._view[end:], record)
        if problem:
            raise FrameError(problem)
        self._spans = chunk_spans(self._view[end:], head, end, count)
        self.array = blosc2.ndarray_from_cframe(self._map, copy=False)  # blosc2 keeps the mapping alive
        self.array.schunk.dparams = blosc2.DParams(nthreads=1)  # a loader worker decompresses in its own thread

    def _advise(self, option: int | None, start: int, stop: int) -> None:
        """``madvise(option)`` over bytes ``start``-``stop`` (from the page that holds ``start``); nothing where the
        platform has no such option."""
        if option is not None and stop > start:
            first = start - start % mmap.PAGESIZE
            self._map.madvise(option, first, stop - first)

    def prefetch(self, numbers: Iterable[int]) -> None:
        """Asks the kernel to read the stored chunks ``numbers`` now, each run of adjacent chunks as one range."""
        option = getattr(mmap, "MADV_WILLNEED", None)
        if option is None:
            return
        ranges = sorted((int(self._spans[n, 0]), int(self._spans[n, 1])) for n in numbers if self._spans[n, 0] >= 0)
        merged: list[list[int]] = []
        for start, stop in ranges:
            if merged and start <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], stop)
            else:
                merged.append([start, stop])
        for start, stop in merged:
            self._advise(option, start, stop)

    def checksum(self, number: int) -> int:
        """The CRC-32 of compressed chunk ``number`` as blosc2 holds it (the one :func:`~.format.write_array`
        recorded): its bytes in the file, or, for a chunk of one special value, the chunk blosc2 makes of it."""
        start, stop = (int(v) for v in self._spans[number])
        if start < 0:
            return zlib.crc32(self.array.schunk.get_chunk(number))
        return zlib.crc32(self._view[start:stop])
