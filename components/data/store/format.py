"""How one stored array is kept on disk: a blosc2 NDArray file (``.b2nd``), zstd + byte shuffle, 64^3 chunks of
32^3 blocks, one CRC-32 per compressed chunk.

Why blosc2 with these settings: ``benchmarks/store_format.py`` wrote 12 synthetic 256 x 256 x 160 int16 CT
volumes in each candidate format and read 50 random 96^3 crops from each (results with the machine in
``benchmarks/results/store_format.json``; a 2-vCPU AMD EPYC VM, one compression thread):

- size: blosc2 zstd + shuffle takes 0.72 of the volume's ``.nii.gz`` (zarr v3 with the same blosc codec 0.76;
  lz4 0.81-0.97; a raw ``.npy`` memmap 2.3x, 3.2x the blosc2 file: at 100k volumes 2 TB instead of 650 GB);
- a random 96^3 crop: a few milliseconds with blosc2 (it decompresses only the chunks the crop covers, from a
  memory-mapped file), several times zarr v3's (its per-chunk Python and asyncio overhead), against well under a
  millisecond for the memmap, which pays with 3x the disk reads on a cold cache;
- writing: about 0.1 s per volume, 2-3x faster than zarr;
- chunk shape: 64^3 chunks with 32^3 blocks read crops as fast as 96^3 or 128^3 chunks and write faster than 16^3
  blocks; zstd level 1 and 3 give the same size here.

blosc2 holds no checksum of its own: a flipped byte in a compressed chunk decompresses into wrong values without
an error (tried with blosc2 4.14). So every compressed chunk's CRC-32 is recorded at write time
(:func:`chunk_checksums`) and a reader checks the chunks a slice covers before decompressing them
(:class:`~components.data.store.handle.StoredArray`); the file's size is checked when it is opened (truncation).

Integer-valued floating arrays (a label map that ``LoadImaged`` loaded as float32) are stored in the narrowest
integer dtype that holds their values exactly and read back in their own dtype (:func:`storage_dtype`).
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Sequence
from pathlib import Path

import numpy as np

__all__ = [
    "ARRAY_SUFFIX",
    "FORMAT_VERSION",
    "chunk_checksums",
    "chunk_numbers",
    "open_array",
    "storage_dtype",
    "write_array",
]

FORMAT_VERSION = 1
"""Part of every store's fingerprint: a store of another version is refused and rebuilt."""

ARRAY_SUFFIX = ".b2nd"
CODEC, CLEVEL, FILTER = "ZSTD", 3, "BITSHUFFLE"
CHUNK = 64
BLOCK = 32
_NARROW = (np.uint8, np.int8, np.int16, np.uint16, np.int32)
_SAMPLE_STEP = 997


def storage_dtype(array: np.ndarray) -> np.dtype:
    """The dtype ``array`` is stored in: the narrowest integer dtype holding every value exactly when it is a
    floating array of integers (a float32 label map: uint8), else its own dtype.

    Example:
        >>> storage_dtype(np.array([0.0, 3.0, 13.0], np.float32))
        dtype('uint8')
    """
    if array.dtype.kind != "f" or array.size == 0:
        return array.dtype
    sample = array.reshape(-1)[:: _SAMPLE_STEP]  # an image with fractions is told from a few voxels
    if not np.array_equal(np.rint(sample), sample) or not np.isfinite(array).all():
        return array.dtype
    if not np.array_equal(np.rint(array), array):
        return array.dtype
    low, high = float(array.min()), float(array.max())
    for dtype in _NARROW:
        info = np.iinfo(dtype)
        if info.min <= low and high <= info.max:
            return np.dtype(dtype)
    return array.dtype


def _grid(shape: Sequence[int], size: int) -> tuple[int, ...]:
    """Chunk or block shape of a channel-first array: one channel, ``size`` on every spatial axis (at most the
    array's)."""
    lead = (1,) if len(shape) > 1 else ()
    spatial = shape[len(lead) :]
    return (*lead, *(max(1, min(size, int(n))) for n in spatial))


def chunk_checksums(path: str | os.PathLike) -> list[int]:
    """The CRC-32 of every compressed chunk of the ``.b2nd`` file at ``path``, in blosc2's chunk order."""
    import blosc2

    array = blosc2.open(os.fspath(path), mode="r", mmap_mode="r")  # held: its schunk dies with it (a segfault)
    return [zlib.crc32(array.schunk.get_chunk(n)) for n in range(array.schunk.nchunks)]


def write_array(array: np.ndarray, path: str | os.PathLike) -> dict:
    """Writes ``array`` (channel-first ``(C, *spatial)``; at least 1-D) to ``path`` as a blosc2 NDArray and returns
    what the index records of it: ``file`` (the name), ``shape``, ``dtype`` (read back as), ``stored_dtype``,
    ``chunks``, ``nbytes`` (the file's size) and ``crc32`` (one per compressed chunk).

    The caller makes the file visible atomically (the store writes a volume's files into a temporary folder that
    it renames into place)."""
    import blosc2

    array = np.ascontiguousarray(array)
    if array.ndim < 1:
        raise ValueError(f"{path}: a stored array has at least one axis, got a scalar.")
    stored = storage_dtype(array)
    data = array.astype(stored) if stored != array.dtype else array
    path = Path(path)
    chunks, blocks = _grid(data.shape, CHUNK), _grid(data.shape, BLOCK)
    cparams = blosc2.CParams(
        codec=getattr(blosc2.Codec, CODEC), clevel=CLEVEL, filters=[getattr(blosc2.Filter, FILTER)], nthreads=1
    )
    blosc2.asarray(data, urlpath=str(path), mode="w", chunks=chunks, blocks=blocks, cparams=cparams)
    return {
        "file": path.name,
        "shape": list(array.shape),
        "dtype": array.dtype.str,
        "stored_dtype": np.dtype(stored).str,
        "chunks": list(chunks),
        "nbytes": path.stat().st_size,
        "crc32": chunk_checksums(path),
    }


def open_array(path: str | os.PathLike):
    """The blosc2 NDArray at ``path``, memory-mapped read-only: slicing it decompresses only the chunks it covers."""
    import blosc2

    return blosc2.open(os.fspath(path), mode="r", mmap_mode="r", dparams=blosc2.DParams(nthreads=1))


def chunk_numbers(shape: Sequence[int], chunks: Sequence[int], region: Sequence[slice]) -> list[int]:
    """The numbers (blosc2's C order over the chunk grid) of the chunks that ``region`` (one ``slice`` with step 1
    per axis, bounds already clipped to ``shape``) covers; none for an empty region."""
    ranges = []
    for (start, stop), size in zip(((s.start, s.stop) for s in region), chunks):
        if stop <= start:
            return []
        ranges.append(range(start // size, (stop - 1) // size + 1))
    grid = tuple(-(-int(n) // int(c)) for n, c in zip(shape, chunks))
    mesh = np.meshgrid(*(np.asarray(r) for r in ranges), indexing="ij")
    return sorted(int(n) for n in np.ravel_multi_index(tuple(m.ravel() for m in mesh), grid))
