"""The checks of one file, each problem a line of a :class:`~components.data.check_report.DataReport`:
:func:`read_header` (missing, unreadable, truncated, voxel type, spacing, affine) gives the :class:`FileHeader` that
:func:`channels_of` and :func:`ras_geometry` read (its channels and RAS shape), and with a deep check
:func:`check_image_voxels` / :func:`check_label_voxels` read its voxels (NaN / Inf, constant images, label values,
empty labels).

Truncation without reading voxels: a truncated ``.nii.gz`` still opens (its header sits in the first
compressed block) and fails only when the voxels are read. For uncompressed files the file size is compared
with ``vox_offset + prod(shape) * itemsize`` from the header. For gzip files the 4-byte ``ISIZE`` trailer
(uncompressed size mod 2**32) is compared with the same number; after a cut, the last four bytes are
compressed data and almost never match. Only when they disagree is the stream decompressed (without keeping
the data) to confirm, which also accepts valid multi-member gzip files whose trailer covers the last member
only, and tells "ends early" from "corrupt".
"""

from __future__ import annotations

import math
import os
import struct
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nibabel as nib
import numpy as np
from nibabel.orientations import io_orientation

from .check_report import WARNING, DataReport

__all__ = [
    "FileHeader",
    "channels_of",
    "check_image_voxels",
    "check_label_voxels",
    "format_numbers",
    "is_image_path",
    "label_messages",
    "non_finite_message",
    "ras_geometry",
    "read_header",
]

# Files nibabel reads (NIfTI-1/2 single files and pairs, Analyze, MGH). Problems with these are errors;
# other formats (.nrrd, .mha, DICOM folders, ...) are read by MONAI through ITK and are only noted.
_NIBABEL_SUFFIXES = (".nii", ".nii.gz", ".img", ".hdr", ".img.gz", ".hdr.gz", ".mgh", ".mgz")
_GZIP_SUFFIXES = (".gz", ".mgz")
_NIFTI_HEADER_BYTES = 348


# ----------------------------------------------------------------------------------------------------- headers


@dataclass
class FileHeader:
    """What the header says about one file (``img`` is nibabel's lazy image, for a deep read)."""

    shape: tuple[int, ...]
    affine: np.ndarray
    img: Any
    geometry_ok: bool  # affine finite and invertible, so orientation / spacing can be derived


def _has_suffix(path: str, suffixes: Iterable[str]) -> bool:
    lower = path.lower()
    return any(lower.endswith(s) for s in suffixes)


def is_image_path(value: Any) -> bool:
    """True for a path string (or a list of them) with a medical image suffix: a datalist value naming files."""
    values = value if isinstance(value, (list, tuple)) else [value]
    suffixes = (*_NIBABEL_SUFFIXES, ".nrrd", ".nhdr", ".mha", ".mhd", ".dcm")
    return bool(values) and all(
        isinstance(v, (str, os.PathLike)) and _has_suffix(os.fspath(v), suffixes) for v in values
    )


def _gzip_stream_size(path: str, chunk: int = 1 << 20) -> tuple[int, str | None]:
    """Decompresses ``path`` without keeping the output: (uncompressed bytes, problem or None).

    Handles multi-member gzip files (each member has its own trailer) and ignores zero padding at the end;
    the problem says whether the stream ends early or is corrupt (bad deflate data or CRC).
    """
    total, member_open = 0, False
    decomp = zlib.decompressobj(16 + zlib.MAX_WBITS)
    with open(path, "rb") as f:
        pending = b""
        while True:
            if not pending:
                pending = f.read(chunk)
                if not pending:
                    break
            if not member_open and not pending.strip(b"\0"):
                pending = b""  # zero padding between / after members
                continue
            member_open = True
            try:
                out = decomp.decompress(pending, chunk * 16)
            except zlib.error as err:
                return total, f"corrupt compressed data after {total} bytes ({err})"
            total += len(out)
            if decomp.eof:
                pending, member_open = decomp.unused_data, False
                decomp = zlib.decompressobj(16 + zlib.MAX_WBITS)
            else:
                pending = decomp.unconsumed_tail
    if member_open:
        return total, "the compressed stream ends early"
    return total, None


def _truncation(path: str, info: FileHeader) -> str | None:
    """Says how ``path`` is truncated, or None: file size (uncompressed) or gzip ISIZE trailer vs the size the
    header needs (``vox_offset + prod(shape) * itemsize``); a gzip mismatch is confirmed by streaming."""
    proxy = info.img.dataobj
    if not all(hasattr(proxy, a) for a in ("offset", "shape", "dtype")):
        return None  # not a plain array proxy (e.g. PAR/REC): nothing cheap to compare
    data_file = info.img.file_map["image"].filename or path
    expected = int(proxy.offset) + math.prod(int(n) for n in proxy.shape) * np.dtype(proxy.dtype).itemsize
    size = os.path.getsize(data_file)
    if not _has_suffix(data_file, _GZIP_SUFFIXES):
        if size < expected:
            return f"truncated: {size} bytes on disk, the header needs {expected} ({expected - size} missing)"
        return None
    if size < 18:  # 10-byte gzip header + 8-byte trailer
        return f"truncated: {size} bytes cannot hold a gzip stream"
    with open(data_file, "rb") as f:
        f.seek(-4, os.SEEK_END)
        (isize,) = struct.unpack("<I", f.read(4))
    if isize == expected % (1 << 32):
        return None
    # the trailer disagrees: decompress (without keeping the data) to know for sure
    actual, problem = _gzip_stream_size(data_file)
    if problem is not None and "ends early" in problem:
        return f"truncated: the compressed stream ends after {actual} of the {expected} bytes the header needs"
    if problem is not None:
        return f"corrupt: {problem} (the header needs {expected} bytes)"
    if actual < expected:
        return f"truncated: decompresses to {actual} bytes, the header needs {expected} ({expected - actual} missing)"
    return None


def _diagnose_unreadable(path: str, err: Exception) -> str:
    """A clearer reason than nibabel's "Cannot work out file type" for a file nibabel should read."""
    size = os.path.getsize(path)
    if size == 0:
        return "unreadable: empty file (0 bytes)"
    if _has_suffix(path, _GZIP_SUFFIXES):
        with open(path, "rb") as f:
            magic = f.read(2)
        if magic != b"\x1f\x8b":
            return "unreadable: not a gzip file although its name ends in .gz"
        head, problem = _gzip_stream_size(path)
        if problem is not None and head < _NIFTI_HEADER_BYTES:
            return f"truncated: {problem} after {head} bytes, inside the {_NIFTI_HEADER_BYTES}-byte header"
        if problem is not None:
            return f"unreadable: {problem} ({type(err).__name__}: {err})"
    elif size < _NIFTI_HEADER_BYTES and _has_suffix(path, (".nii", ".hdr")):
        return f"truncated: {size} bytes, shorter than the {_NIFTI_HEADER_BYTES}-byte NIfTI header"
    return f"unreadable: {type(err).__name__}: {err}"


def read_header(path: str, entry: str, report: DataReport) -> FileHeader | None:
    """Loads the header of ``path`` lazily and records file-intrinsic problems (missing, unreadable,
    truncated, spacing); returns None when the file cannot be used further."""
    if not os.path.exists(path):
        report.add(path, entry, "missing: no such file")
        return None
    if os.path.isdir(path) or not _has_suffix(path, _NIBABEL_SUFFIXES):
        kind = "a folder" if os.path.isdir(path) else f"a {Path(path).suffix or 'suffix-less'} file"
        report.add(
            path, entry, f"not checked: {kind} is not a format nibabel reads (MONAI may read it with ITK)", WARNING
        )
        return None
    report.files += 1
    try:
        img = nib.load(path)
        shape = tuple(int(n) for n in img.shape)
        affine = np.asarray(img.affine, dtype=np.float64)
    except Exception as err:  # nibabel raises many types for broken files; each becomes one report line
        try:
            reason = _diagnose_unreadable(path, err)
        except OSError as os_err:  # e.g. no read permission
            reason = f"unreadable: {os_err}"
        report.add(path, entry, reason)
        return None
    if affine.shape != (4, 4):
        report.add(path, entry, f"has no usable 4x4 affine (got shape {affine.shape})")
        return None
    info = FileHeader(shape=shape, affine=affine, img=img, geometry_ok=True)
    try:
        problem = _truncation(path, info)
    except OSError as err:
        problem = f"unreadable: {err}"
    if problem:
        report.add(path, entry, problem)
        return None
    dtype = np.dtype(img.get_data_dtype())
    if dtype.fields is not None or dtype.kind == "c":
        report.add(path, entry, f"has a {dtype} voxel type (RGB / complex); expected real-valued intensities")

    zooms = np.asarray(img.header.get_zooms()[:3], dtype=np.float64)
    if zooms.size and not (np.all(np.isfinite(zooms)) and np.all(zooms > 0)):
        report.add(
            path, entry, f"bad voxel spacing in the header: pixdim {format_numbers(zooms)} must be finite and > 0"
        )
    linear = affine[:3, :3]
    norms = np.sqrt((linear**2).sum(axis=0))
    if not np.all(np.isfinite(affine)):
        spacing = format_numbers(norms)
        report.add(path, entry, f"non-finite affine: {format_numbers(affine[:3])} (spacing from its columns: {spacing})")
        info.geometry_ok = False
    elif not np.all(norms > 0) or abs(np.linalg.det(linear)) < 1e-12 * max(float(norms.prod()), 1e-300):
        report.add(path, entry, f"singular affine: spacing from its columns {format_numbers(norms)} must be > 0")
        info.geometry_ok = False
    return info


def format_numbers(values: Any) -> str:
    """Compact rendering of numbers / arrays for messages."""
    arr = np.asarray(values, dtype=np.float64)
    if arr.ndim == 2:
        return "; ".join(" ".join(f"{v:g}" for v in row) for row in arr)
    return "(" + ", ".join(f"{v:g}" for v in arr.reshape(-1)) + ")"


def channels_of(shape: tuple[int, ...], spatial_dims: int) -> int | None:
    """Number of channels of a volume of ``shape`` (trailing non-spatial dims; size-1 dims ignored), or None
    when it has more than one non-trivial non-spatial dim."""
    extra = [n for n in shape[spatial_dims:] if n != 1]
    if len(extra) > 1:
        return None
    return extra[0] if extra else 1


def ras_geometry(info: FileHeader, spatial_dims: int) -> tuple[tuple[int, ...], np.ndarray, str]:
    """Shape and spacing after reorientation to RAS (as ``Orientationd(axcodes="RAS")``), plus axis codes."""
    ornt = io_orientation(info.affine)  # row i: (RAS axis that voxel axis i maps to, flip)
    shape = [0] * spatial_dims
    spacing = np.zeros(spatial_dims)
    norms = np.sqrt((info.affine[:3, :3] ** 2).sum(axis=0))
    for axis in range(spatial_dims):
        target = int(ornt[axis, 0])
        shape[target] = info.shape[axis]
        spacing[target] = norms[axis]
    return tuple(shape), spacing, "RAS"[:spatial_dims]


# ------------------------------------------------------------------------------------------------------ voxels


def check_image_voxels(path: str, entry: str, info: FileHeader, spatial_dims: int, report: DataReport) -> None:
    """Voxel checks of an image: readable, finite, not constant (per channel)."""
    data = _read_voxels(path, entry, info, report)
    if data is None:
        return
    problem = non_finite_message(data)
    if problem:
        report.add(path, entry, problem)
        data = np.where(np.isfinite(data), data, 0)
    flat = data.reshape(*data.shape[:spatial_dims], -1)
    for c in range(flat.shape[-1]):
        channel = flat[..., c]
        low, high = channel.min(), channel.max()
        if low == high:
            which = "is constant" if flat.shape[-1] == 1 else f"channel {c} is constant"
            report.add(path, entry, f"{which} (every voxel = {float(low):g}): an empty or failed conversion?")


def check_label_voxels(
    path: str,
    entry: str,
    info: FileHeader,
    label_values: Sequence[int] | None,
    source: str,
    report: DataReport,
) -> None:
    """Voxel checks of a label map: finite integer class indices among ``label_values``; some foreground."""
    data = _read_voxels(path, entry, info, report)
    if data is None:
        return
    problems, values = label_messages(data, label_values, source)
    for problem in problems:
        report.add(path, entry, problem)
    if values.size and np.all(values == 0):
        report.add(path, entry, "label is empty: no foreground voxel (all 0)", WARNING)


def non_finite_message(data: np.ndarray) -> str | None:
    """What is wrong with an image's voxels that are NaN or Inf (``"has non-finite voxels: 3 NaN, 0 Inf (of 512)"``),
    None when all are finite. Shared by the deep check and :class:`~components.data.check_voxels.CheckVoxelsd`."""
    if data.dtype.kind != "f":
        return None
    nan, inf = int(np.isnan(data).sum()), int(np.isinf(data).sum())
    return f"has non-finite voxels: {nan} NaN, {inf} Inf (of {data.size})" if nan or inf else None


def label_messages(data: np.ndarray, label_values: Sequence[int] | None, source: str) -> tuple[list[str], np.ndarray]:
    """What is wrong with a label map's voxels (non-finite, non-integer, or outside ``label_values``, declared by
    ``source``), one message each, and the distinct finite values found. Shared by the deep check and
    :class:`~components.data.check_voxels.CheckVoxelsd`."""
    problems = []
    if data.dtype.kind == "f" and not np.all(np.isfinite(data)):
        problems.append(f"label has {int((~np.isfinite(data)).sum())} non-finite voxels (NaN / Inf)")
        data = data[np.isfinite(data)]
    values = np.unique(data)
    fractional = values[values != np.round(values)] if values.dtype.kind == "f" else values[:0]
    if fractional.size:
        problems.append(
            f"label has non-integer values (e.g. {format_numbers(fractional[:3])}): class indices expected "
            "(resampled with linear interpolation?)"
        )
    if label_values is not None:
        outside = np.setdiff1d(values, np.asarray(label_values))
        outside = outside[outside == np.round(outside)] if outside.dtype.kind == "f" else outside
        if outside.size:
            shown = ", ".join(f"{v:g}" for v in outside[:10].astype(np.float64))
            more = f" and {outside.size - 10} more" if outside.size > 10 else ""
            declared = ", ".join(str(int(v)) for v in label_values)
            problems.append(f"label values [{shown}{more}] are outside the declared classes [{declared}] ({source})")
    return problems, values


def _read_voxels(path: str, entry: str, info: FileHeader, report: DataReport) -> np.ndarray | None:
    """All voxels of ``info`` (scaled as MONAI's NibabelReader does), or None after recording why not."""
    try:
        return np.asanyarray(info.img.dataobj)
    except Exception as err:  # EOFError, zlib.error, OSError, ValueError ... each becomes one line
        report.add(path, entry, f"cannot read the voxel data: {type(err).__name__}: {err}")
        return None
