"""How one stored array is kept on disk: a blosc2 NDArray file (``.b2nd``), LZ4HC with bit shuffle (unfiltered for
one-byte values), chunks and blocks sized from the crop the store is read in (:func:`layout`), one CRC-32 per
compressed chunk.

Why (the figures: ``benchmarks/store_format.py``, its result and ``benchmarks/README.md``):

- A crop from the store costs what the in-memory path costs plus the decompression of the blocks it covers, on the
  one core of a loader worker; bytes stored are what a corpus of 100k volumes takes on disk and what a cold read
  moves. LZ4HC decompresses a crop's blocks markedly faster than zstd for a few percent more bytes; plain LZ4 stores
  more for no faster reads than LZ4HC's, a raw ``.npy`` memmap about three times the bytes.
- Bit shuffle groups the bits of multi-byte values (int16 CT, quantized MRI, float32) so that the codec finds runs;
  a one-byte label map compresses about as well without it, and its decoding is then skipped on every read.
- zarr v3 with the same codec is larger and slower to read (its per-chunk Python and asyncio overhead); blosc2 is
  also what nnU-Net v2 and nnssl store their data in.
- Writing is small beside decoding the ``.nii.gz`` a volume comes from.

Why the CRCs: blosc2 holds no checksum of its own; a flipped byte in a compressed chunk decompresses into wrong
values without an error, and a flipped byte of the frame's header can make ``blosc2.open`` return another kind of
object or an array of another block shape, whose values then come out scrambled (tried with blosc2 4.14). So every
byte of the file is checked before blosc2 parses it: a blosc2 frame is a header, the compressed chunks one after the
other, and a tail (the chunk offsets and the trailer); the CRC-32 of the header and of the tail are recorded with
their lengths, and that of each compressed chunk (:func:`chunk_checksums`). A reader checks the file's size and the
header and tail when it opens the file (:func:`head_tail_problem`, on the mapped bytes:
:class:`~components.data.store.mapped.MappedArray`), and the chunks a slice covers before decompressing them.

Integer-valued floating arrays (a label map that ``LoadImaged`` loaded as float32) are stored in the narrowest
integer dtype that holds their values exactly and read back in their own dtype (:func:`storage_dtype`). Other
floating arrays (a normalised MRI, a resampled and scaled CT) are stored exactly, or with ``floats="quantized"``
as int16 with one scale per channel (:func:`quantize`): bounded error, half of float32's bytes before compression.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

__all__ = [
    "ARRAY_SUFFIX",
    "FORMAT_VERSION",
    "FLOATS",
    "chunk_checksums",
    "chunk_numbers",
    "decode",
    "dequantize",
    "layout",
    "frame_problem",
    "head_tail_problem",
    "quantize",
    "storage_dtype",
    "write_array",
]

FORMAT_VERSION = 3
"""Part of every store's fingerprint: a store of another version is refused and rebuilt (2: quantized floats,
foreground locations, chunks from the crop size, the frame's header and tail checked, the block shape recorded;
3: LZ4HC instead of zstd, blocks of 16 voxels per axis for chunks from the crop size, one-byte values unfiltered)."""

ARRAY_SUFFIX = ".b2nd"
CODEC, CLEVEL, FILTER = "LZ4HC", 6, "BITSHUFFLE"
"""The codec, its level, and the filter of values wider than one byte (one-byte values: none)."""
CHUNK = 64
BLOCK = 32
PATCH_BLOCK = 16
"""Voxels per axis of a block in chunks sized from the crop (:func:`layout`)."""
_NARROW = (np.uint8, np.int8, np.int16, np.uint16, np.int32)
_SAMPLE_STEP = 997
FLOATS = ("exact", "quantized")
"""How non-integer floating arrays are stored: as they are, or as int16 with a scale per channel."""
_LEVELS = 32767  # int16 codes -32767..32767: symmetric, so 0.0 is stored exactly
_MIN_CHUNK = 16


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


def quantize(array: np.ndarray) -> tuple[np.ndarray, list[float]]:
    """``array`` (channel-first, floating, finite) as int16 codes and one scale per channel: ``code * scale`` is
    within ``scale / 2`` (plus float32 rounding) of the value, ``scale`` = the channel's largest magnitude / 32767.
    Zeros stay exactly zero (the background of a normalised MRI, the padding of a crop).

    Example:
        >>> codes, scales = quantize(np.array([[0.0, 0.5, -1.0]], np.float32))
        >>> codes.tolist(), scales
        ([[0, 16384, -32767]], [3.051850947599719e-05])
    """
    codes = np.empty(array.shape, np.int16)
    scales = []
    for channel, values in enumerate(array):
        largest = float(np.abs(values).max()) if values.size else 0.0
        scale = largest / _LEVELS if largest > 0 else 1.0
        codes[channel] = np.clip(np.rint(values.astype(np.float64) / scale), -_LEVELS, _LEVELS)
        scales.append(scale)
    return codes, scales


def dequantize(codes: np.ndarray, scales: Sequence[float], dtype: np.dtype, channels: slice = slice(None),
               out: np.ndarray | None = None) -> np.ndarray:  # fmt: skip
    """The values of ``codes`` (a region of an array :func:`quantize` made, channel-first) in ``dtype``;
    ``channels``: which of the array's channels the region holds; ``out``: where to write them (of ``codes``' shape
    and of ``dtype``), else a new array."""
    scale = np.asarray(scales, dtype)[channels].reshape((-1,) + (1,) * (codes.ndim - 1))
    if out is None:
        return codes.astype(dtype) * scale
    return np.multiply(codes, scale, out=out)


def decode(values: np.ndarray, record: dict, channels: slice = slice(None),
           out: np.ndarray | None = None) -> np.ndarray:  # fmt: skip
    """Stored ``values`` (a region of the array of ``record``, :func:`write_array`'s) in the array's own dtype;
    ``channels``: which channels the region holds; ``out``: where to write them (of ``values``' shape and of the
    array's dtype), else a new array unless ``values`` already is one of that dtype."""
    dtype = np.dtype(record["dtype"])
    if "scales" in record:
        return dequantize(np.asarray(values), record["scales"], dtype, channels, out)
    if out is None:
        return np.asarray(values).astype(dtype, copy=False)
    np.copyto(out, values, casting="unsafe")
    return out


def layout(shape: Sequence[int], patch_size: Sequence[int] | None = None) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Chunk and block shapes of a channel-first array read in crops of ``patch_size`` (spatial): one channel per
    chunk; per spatial axis a chunk of half the crop (rounded up to a multiple of 16, at least 16) and blocks of
    :data:`PATCH_BLOCK` voxels. A crop of ``p`` covers ``p - 1 + chunk`` voxels of chunks per axis on average (what a
    cold read moves and the CRCs check) and ``p - 1 + block`` voxels of blocks (what blosc2 decompresses): smaller
    blocks decompress less beyond the crop, until the cost per block and the lost compression outweigh it. Without
    ``patch_size``: 64^3 chunks of 32^3 blocks. Never larger than the array.

    Example:
        >>> layout((1, 200, 180, 120), (96, 96, 96))
        ((1, 48, 48, 48), (1, 16, 16, 16))
    """
    lead = (1,) if len(shape) > 1 else ()
    spatial = [int(n) for n in shape[len(lead) :]]
    if patch_size is None:
        chunks, blocks = [CHUNK] * len(spatial), [BLOCK] * len(spatial)
    else:
        if len(patch_size) != len(spatial):
            raise ValueError(f"patch_size {list(patch_size)} has {len(patch_size)} axes, the array {len(spatial)} "
                             f"spatial axes (shape {list(shape)}).")  # fmt: skip
        chunks = [max(_MIN_CHUNK, -(-int(p) // 32) * 16) for p in patch_size]
        blocks = [PATCH_BLOCK] * len(spatial)
    chunks = [max(1, min(c, n)) for c, n in zip(chunks, spatial)]
    blocks = [max(1, min(b, c)) for b, c in zip(blocks, chunks)]
    return (*lead, *chunks), (*lead, *blocks)


def chunk_checksums(path: str | os.PathLike) -> list[int]:
    """The CRC-32 of every compressed chunk of the ``.b2nd`` file at ``path``, in blosc2's chunk order."""
    import blosc2

    array = blosc2.open(os.fspath(path), mode="r", mmap_mode="r")  # held: its schunk dies with it (a segfault)
    return [zlib.crc32(array.schunk.get_chunk(n)) for n in range(array.schunk.nchunks)]


_MAGIC = b"b2frame\x00"


def _frame_parts(data: bytes, chunks: list[bytes]) -> tuple[int, int]:
    """(header length, tail length) of the blosc2 frame ``data`` whose compressed chunks are ``chunks``: the header
    (msgpack: magic at byte 2, its length as int32 at 11, the frame's length as uint64 at 16, the stored chunks'
    bytes as int64 at 39, big endian), the stored chunks one after the other, then the tail.

    Raises:
        ValueError: a layout other than that (another frame format version): nothing could check such a file.
    """
    if len(data) < 48 or data[2:10] != _MAGIC or (data[10], data[15], data[38]) != (0xD2, 0xCF, 0xD3):
        raise ValueError("not a blosc2 frame of the known layout (magic, header length, frame length, chunk bytes)")
    header = int.from_bytes(data[11:15], "big")
    frame = int.from_bytes(data[16:24], "big")
    stored = int.from_bytes(data[39:47], "big")
    at = header
    for chunk in chunks:  # chunks of one special value (all zeros) are described in the offsets, not stored
        if data[at : at + len(chunk)] == chunk:
            at += len(chunk)
    if frame != len(data) or at != header + stored or at > len(data):
        raise ValueError(f"the frame's chunks are not stored one after the other from byte {header} "
                         f"({at - header} of {stored} bytes found)")  # fmt: skip
    return header, len(data) - at


def frame_problem(path: str | os.PathLike, record: Mapping) -> str | None:
    """What is wrong with the header or tail of the ``.b2nd`` file at ``path`` against its ``record`` (they are
    read and checked against their CRC-32), or None; the file's size must already match ``record["nbytes"]``."""
    try:
        with open(path, "rb") as f:
            head = f.read(int(record["head_bytes"]))
            f.seek(-int(record["tail_bytes"]), os.SEEK_END)
            tail = f.read()
    except OSError as err:
        return f"{type(err).__name__}: {err.strerror or err}"
    return head_tail_problem(head, tail, record)


def head_tail_problem(head: bytes | memoryview, tail: bytes | memoryview, record: Mapping) -> str | None:
    """What is wrong with a frame's ``head`` and ``tail`` bytes (``record["head_bytes"]`` and
    ``record["tail_bytes"]`` of them) against their CRC-32 in ``record``, or None."""
    if zlib.crc32(head) != record["head_crc32"]:
        return f"its header (bytes 0-{len(head) - 1}) fails its CRC-32 check (the file is corrupt)"
    if zlib.crc32(tail) != record["tail_crc32"]:
        return f"its tail (the last {len(tail)} bytes: chunk offsets, trailer) fails its CRC-32 check (the file is corrupt)"
    return None


def write_array(array: np.ndarray, path: str | os.PathLike, patch_size: Sequence[int] | None = None,
                floats: str = "exact", chunks: Sequence[int] | None = None) -> dict:  # fmt: skip
    """Writes ``array`` (channel-first ``(C, *spatial)``; at least 1-D) to ``path`` as a blosc2 NDArray and returns
    what the index records of it: ``file`` (the name), ``shape``, ``dtype`` (read back as), ``stored_dtype``,
    ``chunks``, ``blocks``, ``nbytes`` (the file's size), ``crc32`` (one per compressed chunk) and the lengths and
    CRC-32 of the frame's header and tail (``head_bytes``, ``head_crc32``, ``tail_bytes``, ``tail_crc32``); for a
    quantized array also ``scales`` (one per channel) and ``max_abs_error`` / ``mean_abs_error`` (measured against
    ``array``).

    Args:
        patch_size: the crop size the array is read in (:func:`layout`); None: 64^3 chunks.
        floats: non-integer floating arrays stored "exact" or "quantized" (:func:`quantize`).
        chunks: the chunk shape, overriding :func:`layout` (blocks of the same shape).

    The caller makes the file visible atomically (the store writes a volume's files into a temporary folder that
    it renames into place)."""
    import blosc2

    if floats not in FLOATS:
        raise ValueError(f"floats must be one of {FLOATS}, got {floats!r}.")
    array = np.ascontiguousarray(array)
    if array.ndim < 1:
        raise ValueError(f"{path}: a stored array has at least one axis, got a scalar.")
    stored = storage_dtype(array)
    extra: dict = {}
    if floats == "quantized" and stored.kind == "f" and array.ndim > 1 and np.isfinite(array).all():
        data, scales = quantize(array)
        error = np.abs(dequantize(data, scales, array.dtype) - array)
        stored = data.dtype
        extra = {"scales": scales, "max_abs_error": float(error.max(initial=0.0)),
                 "mean_abs_error": float(error.mean()) if error.size else 0.0}  # fmt: skip
    else:
        data = array.astype(stored) if stored != array.dtype else array
    path = Path(path)
    if chunks is None:
        chunks, blocks = layout(data.shape, patch_size)
    else:
        chunks = blocks = tuple(max(1, min(int(c), int(n))) for c, n in zip(chunks, data.shape))
    shuffle = FILTER if data.dtype.itemsize > 1 else "NOFILTER"
    cparams = blosc2.CParams(
        codec=getattr(blosc2.Codec, CODEC), clevel=CLEVEL, filters=[getattr(blosc2.Filter, shuffle)], nthreads=1
    )
    blosc2.asarray(data, urlpath=str(path), mode="w", chunks=chunks, blocks=blocks, cparams=cparams)
    written = blosc2.open(str(path), mode="r")
    compressed = [written.schunk.get_chunk(n) for n in range(written.schunk.nchunks)]
    del written
    content = path.read_bytes()
    head, tail = _frame_parts(content, compressed)
    return {
        "file": path.name,
        "shape": list(array.shape),
        "dtype": array.dtype.str,
        "stored_dtype": np.dtype(stored).str,
        "chunks": list(chunks),
        "blocks": list(blocks),
        "nbytes": len(content),
        "crc32": [zlib.crc32(chunk) for chunk in compressed],
        "head_bytes": head,
        "head_crc32": zlib.crc32(content[:head]),
        "tail_bytes": tail,
        "tail_crc32": zlib.crc32(content[len(content) - tail :]),
        **extra,
    }


def chunk_numbers(shape: Sequence[int], chunks: Sequence[int], region: Sequence[slice]) -> list[int]:
    """The numbers (blosc2's C order over the chunk grid) of the chunks that ``region`` (one ``slice`` with step 1
    per axis, bounds already clipped to ``shape``) covers, in increasing order; none for an empty region."""
    numbers = [0]
    for (start, stop), size, length in zip(((s.start, s.stop) for s in region), chunks, shape):
        if stop <= start:
            return []
        grid = -(-int(length) // int(size))
        covered = range(start // size, (stop - 1) // size + 1)
        numbers = [n * grid + c for n in numbers for c in covered]  # row-major: the last axis varies fastest
    return numbers
