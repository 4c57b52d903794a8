"""Checks a datalist and its volumes before hours of caching: every problem at once, one line each.

Caching a large dataset (``CacheDataset``) takes hours, and a broken file found by the loader halfway through
stops the run with a stack trace about a single file. :func:`check_datalist` (the whole Decathlon datalist,
``python -m components check-data``) and :func:`check_items` (a list of entries, e.g. one rank's shard, used
by :func:`check_before_caching`) look at every entry first and return a :class:`DataReport` that names each
file, its datalist entry and what is wrong with it.

By default only headers are read (``nibabel.load`` is lazy: shape, affine and data offset come from the
header; no voxel is decoded), so checking thousands of volumes takes seconds:

errors
    malformed datalist (not JSON, no such list, not a list, empty list); an entry that is not an object or
    lacks a required key; a path that is not a string; the same image twice (within a list or across lists);
    a missing file; an unreadable file; a truncated file (see below); an image that is not 3D or has the
    wrong number of channels; a label with channels; image and label whose spatial shapes or affines
    disagree; non-finite or non-positive voxel spacing (header ``pixdim`` or affine column norms) or a
    singular affine.
warnings
    a volume smaller than ``roi_size`` along an axis after MONAI's reorientation to RAS (and, with
    ``pixdim``, resampling): it will be padded; an axis with a single voxel; a file format nibabel does not
    read (not checked).

With ``deep=True`` the voxels are read as well: NaN / Inf voxels, a constant image (or image channel) and
label values that are not integers or not among the declared classes are errors; a label without any
foreground is a warning.

Truncation without reading voxels: a truncated ``.nii.gz`` still opens (its header sits in the first
compressed block) and fails only when the voxels are read. For uncompressed files the file size is compared
with ``vox_offset + prod(shape) * itemsize`` from the header. For gzip files the 4-byte ``ISIZE`` trailer
(uncompressed size mod 2**32) is compared with the same number; after a cut, the last four bytes are
compressed data and almost never match. Only when they disagree is the stream decompressed (without keeping
the data) to confirm, which also accepts valid multi-member gzip files whose trailer covers the last member
only, and tells "ends early" from "corrupt".
"""

from __future__ import annotations

import json
import logging
import math
import os
import struct
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nibabel as nib
import numpy as np
import torch
from nibabel.orientations import io_orientation

from .distributed import all_reduce_mean, collective_device, get_rank, get_world_size, is_distributed

__all__ = [
    "DataIssue",
    "DataReport",
    "DataCheckError",
    "check_datalist",
    "check_items",
    "check_before_caching",
]

logger = logging.getLogger(__name__)

ERROR, WARNING = "error", "warning"

# Files nibabel reads (NIfTI-1/2 single files and pairs, Analyze, MGH). Problems with these are errors;
# other formats (.nrrd, .mha, DICOM folders, ...) are read by MONAI through ITK and are only noted.
_NIBABEL_SUFFIXES = (".nii", ".nii.gz", ".img", ".hdr", ".img.gz", ".hdr.gz", ".mgh", ".mgz")
_GZIP_SUFFIXES = (".gz", ".mgz")
_NIFTI_HEADER_BYTES = 348
_PADDED = "it will be padded"


@dataclass(frozen=True)
class DataIssue:
    """One problem: the file (or datalist) it concerns, the datalist entry (``"training[3] image"``) and what
    is wrong. ``severity`` is ``"error"`` (training would fail or silently learn garbage) or ``"warning"``."""

    path: str
    entry: str | None
    message: str
    severity: str = ERROR

    def format(self) -> str:
        """``ERROR <file> [<entry>]: <what is wrong>`` -- one line."""
        where = f" [{self.entry}]" if self.entry else ""
        return f"{self.severity.upper()} {self.path}{where}: {self.message}"


class DataCheckError(ValueError):
    """Raised by :meth:`DataReport.raise_if_errors`; the message holds a summary line and every error line,
    and ``report`` the full :class:`DataReport` (warnings included)."""

    def __init__(self, message: str, report: DataReport | None = None) -> None:
        super().__init__(message)
        self.report = report


@dataclass
class DataReport:
    """What a check found.

    Attributes:
        errors: problems that must be fixed before training.
        warnings: problems that training survives (e.g. padding of small volumes).
        checked: number of datalist entries checked.
        files: number of distinct files whose header was read.
        deep: whether voxel data was read too.
    """

    errors: list[DataIssue] = field(default_factory=list)
    warnings: list[DataIssue] = field(default_factory=list)
    checked: int = 0
    files: int = 0
    deep: bool = False

    @property
    def ok(self) -> bool:
        """True when there are no errors (warnings allowed)."""
        return not self.errors

    def add(self, path: str | os.PathLike, entry: str | None, message: str, severity: str = ERROR) -> None:
        """Records one issue under ``errors`` or ``warnings`` according to ``severity``."""
        if severity not in (ERROR, WARNING):
            raise ValueError(f"severity must be {ERROR!r} or {WARNING!r}, got {severity!r}.")
        issue = DataIssue(str(path), entry, message, severity)
        (self.errors if severity == ERROR else self.warnings).append(issue)

    def extend(self, other: DataReport) -> None:
        """Adds the issues and counts of ``other`` (e.g. the report of another list)."""
        self.errors.extend(other.errors)
        self.warnings.extend(other.warnings)
        self.checked += other.checked
        self.files += other.files
        self.deep = self.deep or other.deep

    def lines(self) -> list[str]:
        """One line per issue, errors first."""
        return [issue.format() for issue in [*self.errors, *self.warnings]]

    def summary(self) -> str:
        """One line: what was checked and how many errors / warnings were found."""
        mode = "headers and voxels" if self.deep else "headers only"
        verdict = "FAILED" if self.errors else "OK"
        return (
            f"data check {verdict} ({mode}): {self.checked} entries, {self.files} files; "
            f"{_plural(len(self.errors), 'error')}, {_plural(len(self.warnings), 'warning')}"
        )

    def format(self) -> str:
        """Every issue line, then the summary line."""
        return "\n".join([*self.lines(), self.summary()])

    def raise_if_errors(self, context: str | None = None) -> None:
        """Raises :class:`DataCheckError` listing all errors (after a summary line) when there are any.

        Args:
            context: prefix of the summary line saying who checked what, e.g. ``"rank 1 shard"``.
        """
        if not self.errors:
            return
        head = f"{context}: {self.summary()}" if context else self.summary()
        lines = [head, *(issue.format() for issue in self.errors)]
        if self.warnings:
            lines.append(f"(and {_plural(len(self.warnings), 'warning')}; see DataCheckError.report)")
        raise DataCheckError("\n".join(lines), report=self)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


# ----------------------------------------------------------------------------------------------------- headers


@dataclass
class _FileInfo:
    """What the header says about one file (``img`` is nibabel's lazy image, for a deep read)."""

    shape: tuple[int, ...]
    affine: np.ndarray
    img: Any
    geometry_ok: bool  # affine finite and invertible, so orientation / spacing can be derived


def _has_suffix(path: str, suffixes: Iterable[str]) -> bool:
    lower = path.lower()
    return any(lower.endswith(s) for s in suffixes)


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


def _truncation(path: str, info: _FileInfo) -> str | None:
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


def _read_header(path: str, entry: str, report: DataReport) -> _FileInfo | None:
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
    info = _FileInfo(shape=shape, affine=affine, img=img, geometry_ok=True)
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
        report.add(path, entry, f"bad voxel spacing in the header: pixdim {_fmt(zooms)} must be finite and > 0")
    linear = affine[:3, :3]
    norms = np.sqrt((linear**2).sum(axis=0))
    if not np.all(np.isfinite(affine)):
        report.add(path, entry, f"non-finite affine: {_fmt(affine[:3])} (spacing from its columns: {_fmt(norms)})")
        info.geometry_ok = False
    elif not np.all(norms > 0) or abs(np.linalg.det(linear)) < 1e-12 * max(float(norms.prod()), 1e-300):
        report.add(path, entry, f"singular affine: spacing from its columns {_fmt(norms)} must be > 0")
        info.geometry_ok = False
    return info


def _fmt(values: Any) -> str:
    """Compact rendering of numbers / arrays for messages."""
    arr = np.asarray(values, dtype=np.float64)
    if arr.ndim == 2:
        return "; ".join(" ".join(f"{v:g}" for v in row) for row in arr)
    return "(" + ", ".join(f"{v:g}" for v in arr.reshape(-1)) + ")"


def _channels(shape: tuple[int, ...], spatial_dims: int) -> int | None:
    """Number of channels of a volume of ``shape`` (trailing non-spatial dims; size-1 dims ignored), or None
    when it has more than one non-trivial non-spatial dim."""
    extra = [n for n in shape[spatial_dims:] if n != 1]
    if len(extra) > 1:
        return None
    return extra[0] if extra else 1


def _ras(info: _FileInfo, spatial_dims: int) -> tuple[tuple[int, ...], np.ndarray, str]:
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


def _deep_image(path: str, entry: str, info: _FileInfo, spatial_dims: int, report: DataReport) -> None:
    """Voxel checks of an image: readable, finite, not constant (per channel)."""
    data = _read_voxels(path, entry, info, report)
    if data is None:
        return
    if data.dtype.kind == "f":
        nan, inf = int(np.isnan(data).sum()), int(np.isinf(data).sum())
        if nan or inf:
            report.add(path, entry, f"has non-finite voxels: {nan} NaN, {inf} Inf (of {data.size})")
            data = np.where(np.isfinite(data), data, 0)
    flat = data.reshape(*data.shape[:spatial_dims], -1)
    for c in range(flat.shape[-1]):
        channel = flat[..., c]
        low, high = channel.min(), channel.max()
        if low == high:
            which = "is constant" if flat.shape[-1] == 1 else f"channel {c} is constant"
            report.add(path, entry, f"{which} (every voxel = {float(low):g}): an empty or failed conversion?")


def _deep_label(
    path: str,
    entry: str,
    info: _FileInfo,
    label_values: Sequence[int] | None,
    source: str,
    report: DataReport,
) -> None:
    """Voxel checks of a label map: finite integer class indices among ``label_values``; some foreground."""
    data = _read_voxels(path, entry, info, report)
    if data is None:
        return
    if data.dtype.kind == "f" and not np.all(np.isfinite(data)):
        report.add(path, entry, f"label has {int((~np.isfinite(data)).sum())} non-finite voxels (NaN / Inf)")
        data = data[np.isfinite(data)]
    values = np.unique(data)
    fractional = values[values != np.round(values)] if values.dtype.kind == "f" else values[:0]
    if fractional.size:
        report.add(
            path,
            entry,
            f"label has non-integer values (e.g. {_fmt(fractional[:3])}): class indices expected "
            "(resampled with linear interpolation?)",
        )
    if label_values is not None:
        outside = np.setdiff1d(values, np.asarray(label_values))
        outside = outside[outside == np.round(outside)] if outside.dtype.kind == "f" else outside
        if outside.size:
            shown = ", ".join(f"{v:g}" for v in outside[:10].astype(np.float64))
            more = f" and {outside.size - 10} more" if outside.size > 10 else ""
            declared = ", ".join(str(int(v)) for v in label_values)
            report.add(
                path, entry, f"label values [{shown}{more}] are outside the declared classes [{declared}] ({source})"
            )
    if values.size and np.all(values == 0):
        report.add(path, entry, "label is empty: no foreground voxel (all 0)", WARNING)


def _read_voxels(path: str, entry: str, info: _FileInfo, report: DataReport) -> np.ndarray | None:
    """All voxels of ``info`` (scaled as MONAI's NibabelReader does), or None after recording why not."""
    try:
        return np.asanyarray(info.img.dataobj)
    except Exception as err:  # EOFError, zlib.error, OSError, ValueError ... each becomes one line
        report.add(path, entry, f"cannot read the voxel data: {type(err).__name__}: {err}")
        return None


# ----------------------------------------------------------------------------------------------------- entries


def _as_tuple(value: Any, name: str, kind: type) -> tuple | None:
    """``value`` as a tuple of ``kind`` (a scalar becomes a 1-tuple); None stays None."""
    if value is None:
        return None
    if isinstance(value, (str, bytes)) and kind is not str:
        raise TypeError(f"{name} must be a number or a sequence of numbers, got {value!r}.")
    items = (value,) if isinstance(value, (str, int, float, np.integer, np.floating)) else tuple(value)
    try:
        return tuple(kind(v) for v in items)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must hold {kind.__name__} values, got {value!r}.") from None


@dataclass
class _Options:
    """Validated settings shared by every entry of one check."""

    keys: tuple[str, ...]
    label_key: str
    roi_size: tuple[int, ...] | None
    pixdim: tuple[float, ...] | None
    channels: int | None
    spatial_dims: int
    label_values: tuple[int, ...] | None
    label_source: str
    deep: bool
    atol: float
    duplicates: bool


def _options(
    keys: Sequence[str] | str,
    roi_size: Sequence[int] | int | None,
    deep: bool,
    channels: int | None,
    num_classes: int | None,
    label_values: Sequence[int] | None,
    label_key: str,
    pixdim: Sequence[float] | float | None,
    spatial_dims: int,
    atol: float,
    duplicates: bool,
    label_source: str = "label_values",
) -> _Options:
    """Validates the arguments once, with messages that say what was expected."""
    keys_t = _as_tuple(keys, "keys", str)
    if not keys_t or any(not k for k in keys_t):
        raise ValueError(f"keys must name at least one datalist key, e.g. ('image', 'label'); got {keys!r}.")
    if spatial_dims not in (2, 3):
        raise ValueError(f"spatial_dims must be 2 or 3, got {spatial_dims!r}.")
    roi = _as_tuple(roi_size, "roi_size", int)
    if roi is not None:
        roi = roi * spatial_dims if len(roi) == 1 else roi
        if len(roi) != spatial_dims:
            raise ValueError(f"roi_size must have 1 or {spatial_dims} values, got {roi_size!r}.")
    target = _as_tuple(pixdim, "pixdim", float)
    if target is not None:
        target = target * spatial_dims if len(target) == 1 else target
        if len(target) != spatial_dims or not all(math.isfinite(v) and v > 0 for v in target):
            raise ValueError(f"pixdim must be 1 or {spatial_dims} positive numbers, got {pixdim!r}.")
    if channels is not None and (isinstance(channels, bool) or int(channels) != channels or channels < 1):
        raise ValueError(f"channels must be a positive integer or None, got {channels!r}.")
    if num_classes is not None and label_values is not None:
        raise ValueError("give num_classes or label_values, not both.")
    values = None
    if num_classes is not None:
        if isinstance(num_classes, bool) or int(num_classes) != num_classes or num_classes < 1:
            raise ValueError(f"num_classes must be a positive integer, got {num_classes!r}.")
        values, label_source = tuple(range(int(num_classes))), f"num_classes={int(num_classes)}"
    elif label_values is not None:
        values = tuple(sorted({int(v) for v in _as_tuple(label_values, "label_values", float)}))
    return _Options(
        keys=keys_t,
        label_key=label_key,
        roi_size=roi,
        pixdim=target,
        channels=None if channels is None else int(channels),
        spatial_dims=spatial_dims,
        label_values=values,
        label_source=label_source,
        deep=bool(deep),
        atol=float(atol),
        duplicates=duplicates,
    )


class _Checker:
    """Checks entries one by one into one report; remembers file headers and image paths across lists."""

    def __init__(self, options: _Options, report: DataReport, source: str) -> None:
        self.opt = options
        self.report = report
        self.source = source  # datalist path (or "<items>") for list-level issues
        self.infos: dict[str, _FileInfo | None] = {}
        self.seen: dict[tuple[str, ...], str] = {}
        self.deep_done: set[str] = set()

    def check_list(self, items: Any, list_name: str, base_dir: str | None) -> None:
        """All entries of one list (``list_name`` names them in the report)."""
        if not isinstance(items, list):
            self.report.add(self.source, list_name, f"must be a list of entries, got {type(items).__name__}")
            return
        if not items:
            self.report.add(self.source, list_name, "the list is empty: nothing to train / validate on")
            return
        for index, entry in enumerate(items):
            self.check_entry(entry, f"{list_name}[{index}]", base_dir)

    def _resolve(self, value: Any, base_dir: str | None) -> list[str] | None:
        """Absolute paths of one entry value (a path or a list of paths, as ``LoadImaged`` accepts)."""
        values = value if isinstance(value, (list, tuple)) else [value]
        if not values or not all(isinstance(v, (str, os.PathLike)) and str(v) for v in values):
            return None
        root = base_dir if base_dir is not None else os.getcwd()
        return [os.path.normpath(os.path.join(root, os.fspath(v))) for v in values]

    def check_entry(self, entry: Any, name: str, base_dir: str | None) -> None:
        """One datalist entry: keys, duplicates, headers, shapes / affines, ROI, and voxels when deep."""
        opt, report = self.opt, self.report
        report.checked += 1
        if isinstance(entry, (str, os.PathLike)):  # Decathlon "test" lists may hold bare paths
            entry = {opt.keys[0]: os.fspath(entry)}
        if not isinstance(entry, Mapping):
            report.add(self.source, name, f"entry must be an object like {{'{opt.keys[0]}': path}}, got {entry!r}")
            return
        missing = [k for k in opt.keys if k not in entry]
        if missing:
            has = ", ".join(repr(k) for k in entry) or "none"
            report.add(
                self.source,
                name,
                f"entry has no {', '.join(repr(k) for k in missing)} key (it has: {has}); "
                f"expected keys: {', '.join(repr(k) for k in opt.keys)}",
            )
        paths: dict[str, list[str]] = {}
        for key in opt.keys:
            if key not in entry:
                continue
            resolved = self._resolve(entry[key], base_dir)
            if resolved is None:
                report.add(
                    self.source, f"{name} {key}", f"must be a file path (or a list of paths), got {entry[key]!r}"
                )
            else:
                paths[key] = resolved
        if not paths:
            return

        image_key = next((k for k in opt.keys if k in paths and k != opt.label_key), None)
        if opt.duplicates and image_key is not None:
            ident = tuple(paths[image_key])
            if ident in self.seen:
                report.add(
                    ident[0], f"{name} {image_key}", f"duplicate entry: the same {image_key} as {self.seen[ident]}"
                )
            else:
                self.seen[ident] = name

        volumes: dict[str, tuple[str, _FileInfo]] = {}  # key -> (first file, its header) for cross-key checks
        for key, files in paths.items():
            where = f"{name} {key}"
            infos = []
            for path in files:
                if path not in self.infos:
                    self.infos[path] = _read_header(path, where, report)
                infos.append(self.infos[path])
            if any(info is None for info in infos):
                continue
            if self._check_layout(key, files, infos, where):
                volumes[key] = (files[0], infos[0])

        reference = volumes.get(image_key) if image_key is not None else None
        if reference is not None:
            for key, (path, info) in volumes.items():
                if key != image_key:
                    self._compare(reference, path, info, key, image_key, f"{name} {key}")
            self._check_roi(*reference, f"{name} {image_key}")
        if opt.deep:
            for key, files in paths.items():
                for path in files:
                    info = self.infos.get(path)
                    if info is None or path in self.deep_done:
                        continue
                    self.deep_done.add(path)
                    if key == opt.label_key:
                        _deep_label(path, f"{name} {key}", info, opt.label_values, opt.label_source, report)
                    else:
                        _deep_image(path, f"{name} {key}", info, opt.spatial_dims, report)

    def _check_layout(self, key: str, files: list[str], infos: list[_FileInfo], where: str) -> bool:
        """Dimensionality and channels of one key's file(s); True when its spatial geometry is usable."""
        opt, report = self.opt, self.report
        dims = opt.spatial_dims
        total_channels, usable = 0, True
        for path, info in zip(files, infos):
            shape = info.shape
            if len(shape) < dims:
                report.add(path, where, f"is {len(shape)}D (shape {shape}); expected a {dims}D volume")
                usable = False
                continue
            if any(n == 0 for n in shape):
                report.add(path, where, f"has an empty axis (shape {shape})")
                usable = False
                continue
            channels = _channels(shape, dims)
            if channels is None:
                report.add(path, where, f"has shape {shape}: more than one non-spatial dimension")
                usable = False
                continue
            if key == opt.label_key and channels != 1:
                report.add(
                    path, where, f"label has {channels} channels (shape {shape}); expected one {dims}D label map"
                )
            elif len(files) > 1 and channels != 1:
                report.add(
                    path,
                    where,
                    f"has {channels} channels (shape {shape}); each file of a multi-file entry must be {dims}D",
                )
            total_channels += channels
            if 1 in shape[:dims] and opt.roi_size is None:
                axes = [i for i, n in enumerate(shape[:dims]) if n == 1]
                report.add(
                    path,
                    where,
                    f"has a single voxel along axis {axes} (shape {shape}): a 2D image saved as {dims}D?",
                    WARNING,
                )
            if len(files) > 1 and shape[:dims] != infos[0].shape[:dims]:
                report.add(
                    path, where, f"spatial shape {shape[:dims]} differs from {files[0]}'s {infos[0].shape[:dims]}"
                )
                usable = False
        if usable and key != opt.label_key:
            expected = opt.channels or 1
            if total_channels != expected:
                shape = infos[0].shape
                if opt.channels is None:
                    hint = (
                        f"a single-channel {dims}D volume; pass channels={total_channels} "
                        f"(--channels {total_channels}) if the images are multi-channel"
                    )
                else:  # the setting named: a bundle's in_channels reaches here as build_dataset's channels
                    plural = "s" if expected > 1 else ""
                    hint = f"{expected} channel{plural} (a bundle's in_channels, check-data's --channels)"
                what = (
                    f"{len(shape)}D with {total_channels} channels (shape {shape})"
                    if len(files) == 1
                    else f"{total_channels} files"
                )
                report.add(files[0], where, f"is {what}; expected {hint}")
        return usable and all(info.geometry_ok for info in infos)

    def _compare(
        self, reference: tuple[str, _FileInfo], path: str, info: _FileInfo, key: str, ref_key: str, where: str
    ) -> None:
        """The same spatial shape and (within ``atol``) the same affine as the reference (image) volume."""
        dims = self.opt.spatial_dims
        ref_path, ref = reference
        if info.shape[:dims] != ref.shape[:dims]:
            self.report.add(
                path,
                where,
                f"{key} spatial shape {info.shape[:dims]} differs from the {ref_key}'s {ref.shape[:dims]} ({ref_path})",
            )
        diff = np.abs(info.affine - ref.affine)
        if diff.max() > self.opt.atol:
            row, col = np.unravel_index(int(diff.argmax()), diff.shape)
            self.report.add(
                path,
                where,
                f"{key} affine differs from the {ref_key}'s ({ref_path}): largest difference {diff.max():g} at "
                f"[{row}, {col}] (tolerance {self.opt.atol:g}): {info.affine[row, col]:g} vs {ref.affine[row, col]:g}; "
                "they would not be aligned",
            )

    def _check_roi(self, path: str, info: _FileInfo, where: str) -> None:
        """Warns when the volume is smaller than ``roi_size`` along a RAS axis (it will be padded)."""
        opt = self.opt
        if opt.roi_size is None:
            return
        shape, spacing, codes = _ras(info, opt.spatial_dims)
        after = "reorientation to RAS"
        if opt.pixdim is not None:
            shape = tuple(int(round(n * s / p)) for n, s, p in zip(shape, spacing, opt.pixdim))
            after += f" and resampling to pixdim {_fmt(opt.pixdim)}"
        short = [
            f"{codes[i]} ({shape[i]} < {opt.roi_size[i]})"
            for i in range(opt.spatial_dims)
            if 0 < shape[i] < opt.roi_size[i]
        ]
        if short:
            self.report.add(
                path,
                where,
                f"smaller than roi_size {tuple(opt.roi_size)} along {', '.join(short)}: shape {shape} after {after}; "
                + _PADDED,
                WARNING,
            )


# ---------------------------------------------------------------------------------------------------------- API


def check_items(
    items: Sequence[Any],
    keys: Sequence[str] | str = ("image", "label"),
    roi_size: Sequence[int] | int | None = None,
    deep: bool = False,
    channels: int | None = None,
    num_classes: int | None = None,
    label_values: Sequence[int] | None = None,
    label_key: str = "label",
    pixdim: Sequence[float] | float | None = None,
    base_dir: str | os.PathLike | None = None,
    list_name: str = "items",
    spatial_dims: int = 3,
    atol: float = 1e-3,
    duplicates: bool = True,
    source: str = "<items>",
) -> DataReport:
    """Checks a list of datalist entries (e.g. the output of ``load_datalist`` or one rank's shard).

    Args:
        items: entries like ``{"image": path, "label": path}``; values may be lists of paths (stacked as
            channels by ``LoadImaged``); a bare path string stands for ``{keys[0]: path}``.
        keys: keys every entry must have; their files are checked. The first key that is not ``label_key``
            is the reference image: the other keys' volumes must match its spatial shape and affine.
        roi_size: training crop size; a volume smaller along a RAS axis gives a warning (it will be padded).
        deep: also read the voxels (NaN / Inf, constant images, label values, empty labels).
        channels: channels of the images; None expects single-channel volumes (``(H, W, D)`` or
            ``(H, W, D, 1)``); e.g. 4 for BraTS-like ``(H, W, D, 4)`` MRI.
        num_classes / label_values: the declared label classes (``range(num_classes)`` or an explicit set
            such as ``(0, 1, 2, 4)``); checked in deep mode. At most one of the two.
        label_key: the key holding label maps (3D, single channel, class indices).
        pixdim: target spacing of a ``Spacingd`` in the pipeline, to estimate the shape compared with the ROI.
        base_dir: folder that relative paths are joined to (default: the current directory).
        list_name: names the entries in the report (``"training"`` gives ``training[3]``).
        spatial_dims: number of spatial dimensions (3 for the Swin UNETR bundles).
        atol: largest tolerated difference between the affine of a label and its image.
        duplicates: report entries whose image repeats an earlier one (off for rank shards, which repeat
            entries on purpose to make all shards equal).

    Returns:
        a :class:`DataReport`; nothing is raised for bad data (see :meth:`DataReport.raise_if_errors`).

    Example:
        >>> report = check_items(load_datalist("data/dataset.json"), keys=("image",), roi_size=96)
        >>> report.raise_if_errors("training list")
    """
    opt = _options(
        keys, roi_size, deep, channels, num_classes, label_values, label_key, pixdim, spatial_dims, atol, duplicates
    )
    report = DataReport(deep=opt.deep)
    checker = _Checker(opt, report, source=source)
    checker.check_list(
        list(items) if not isinstance(items, list) else items,
        list_name,
        None if base_dir is None else os.fspath(base_dir),
    )
    return report


def check_datalist(
    datalist: str | os.PathLike | Mapping,
    base_dir: str | os.PathLike | None = None,
    keys: Sequence[str] | str = ("image", "label"),
    roi_size: Sequence[int] | int | None = None,
    deep: bool = False,
    channels: int | None = None,
    num_classes: int | None = None,
    label_values: Sequence[int] | None = None,
    list_keys: Sequence[str] | str | None = None,
    label_key: str = "label",
    pixdim: Sequence[float] | float | None = None,
    spatial_dims: int = 3,
    atol: float = 1e-3,
) -> DataReport:
    """Checks a Decathlon-format datalist file (or its parsed dict) and every volume it names.

    Problems of the datalist itself (missing file, not JSON, not an object, a list key missing, an empty
    list) are reported as errors like those of the volumes, so one run shows everything. Duplicates are
    detected within and across the lists.

    Args:
        datalist: path of ``dataset.json`` or the already parsed dict.
        base_dir: folder relative paths are joined to; default the datalist's folder (as
            ``load_decathlon_datalist``), or the current directory for a dict.
        list_keys: the lists to check; each must exist and be non-empty. None (default): ``training``, and
            ``validation`` when the datalist has one (a plain Decathlon datalist has ``training`` and ``test``
            only; the bundles then hold out part of ``training``, see :func:`components.load_split`: a warning).
        channels: as in :func:`check_items`; when None and the datalist says ``"tensorImageSize": "4D"`` with
            n ``"modality"`` entries, n channels are expected (the MSD convention, e.g. BraTS: 4).
        num_classes / label_values: declared classes for the deep label check; when both are None the keys
            of the datalist's ``"labels"`` (e.g. ``{"0": "background", "1": ...}``) are used.
        keys, roi_size, deep, label_key, pixdim, spatial_dims, atol: as in :func:`check_items`.

    Returns:
        a :class:`DataReport` with every problem found.
    """
    default_lists = list_keys is None
    list_keys = ("training", "validation") if default_lists else _as_tuple(list_keys, "list_keys", str)
    if isinstance(datalist, Mapping):
        content, source = datalist, "<datalist>"
        root = os.fspath(base_dir) if base_dir is not None else os.getcwd()
    else:
        source = os.fspath(datalist)
        root = os.fspath(base_dir) if base_dir is not None else os.path.dirname(os.path.abspath(source))
        content = None
    report = DataReport(deep=bool(deep))
    if content is None:
        if not os.path.isfile(source):
            report.add(
                source, None, "datalist does not exist" if not os.path.exists(source) else "datalist is not a file"
            )
            return report
        try:
            content = json.loads(Path(source).read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            report.add(source, None, f"datalist is not valid JSON: {err}")
            return report
    if not isinstance(content, Mapping):
        report.add(
            source, None, f"datalist must be a JSON object with lists {list(list_keys)}, got a {type(content).__name__}"
        )
        return report

    label_source = "label_values"
    if num_classes is None and label_values is None and isinstance(content.get("labels"), Mapping):
        try:
            label_values = sorted(int(k) for k in content["labels"])
            label_source = "the datalist's 'labels'"
        except (TypeError, ValueError):
            label_values = None
    if channels is None and str(content.get("tensorImageSize", "")).upper() == "4D":
        modality = content.get("modality")
        if isinstance(modality, Mapping) and len(modality) > 1:
            channels = len(modality)
    opt = _options(
        keys,
        roi_size,
        deep,
        channels,
        num_classes,
        label_values,
        label_key,
        pixdim,
        spatial_dims,
        atol,
        True,
        label_source,
    )
    checker = _Checker(opt, report, source)
    for list_key in list_keys:
        if default_lists and list_key == "validation" and list_key not in content and "training" in content:
            report.add(source, list_key, "datalist has no 'validation' list: the bundles validate on a fixed part "
                       "of 'training' (--lists training,validation requires one)", WARNING)  # fmt: skip
            continue
        if list_key not in content:
            has = ", ".join(repr(k) for k, v in content.items() if isinstance(v, list)) or "none"
            report.add(source, list_key, f"datalist has no {list_key!r} list (its lists: {has})")
            continue
        checker.check_list(content[list_key], list_key, root)
    return report


def check_before_caching(
    items: Sequence[dict],
    keys: Sequence[str] | str | None = None,
    roi_size: Sequence[int] | int | None = None,
    enabled: bool = True,
    deep: bool = False,
    channels: int | None = None,
    num_classes: int | None = None,
    label_values: Sequence[int] | None = None,
    label_key: str = "label",
    pixdim: Sequence[float] | float | None = None,
    sync: bool = True,
    context: str = "dataset",
    source: str = "<items>",
) -> DataReport | None:
    """The check ``build_dataset`` runs on this rank's shard before caching: raises on any error.

    Each distinct entry is checked once (shards repeat entries to be equal, so duplicates are not
    reported here; :func:`check_datalist` reports them for the whole datalist). Warnings are logged. With
    ``sync`` under ``torch.distributed`` every rank learns whether any rank failed, and all of them raise, so
    no rank is left caching and then waiting at a barrier for a rank that already stopped.

    Args:
        items: this rank's entries, paths already absolute (as ``load_datalist`` returns them).
        keys: keys to check; None means the keys of the first entry whose values are file paths.
        enabled: False skips the check (returns None), e.g. for a dataset checked before.
        sync: agree on failure across ranks (a collective: every rank must call this function).
        context: names the dataset in the error message, e.g. ``"training"``.
        source: where the items came from (the datalist path), named by errors about an entry rather than a file.
        roi_size, deep, channels, num_classes, label_values, label_key, pixdim: as in :func:`check_items`.

    Returns:
        the :class:`DataReport` (warnings only), or None when disabled.

    Raises:
        DataCheckError: with every error line of this rank's shard, or naming the ranks that failed.
    """
    if not enabled:
        logger.info("%s: data check disabled", context)
        return None
    unique, seen = [], set()
    for entry in items:
        ident = json.dumps(entry, sort_keys=True, default=str) if isinstance(entry, Mapping) else repr(entry)
        if ident not in seen:
            seen.add(ident)
            unique.append(entry)
    if keys is None:
        first = next((e for e in unique if isinstance(e, Mapping)), {})
        keys = tuple(k for k, v in first.items() if _looks_like_paths(v)) or ("image",)
    rank = get_rank()
    report = check_items(
        unique,
        keys=keys,
        roi_size=roi_size,
        deep=deep,
        channels=channels,
        num_classes=num_classes,
        label_values=label_values,
        label_key=label_key,
        pixdim=pixdim,
        list_name=context,
        duplicates=False,
        source=source,
    )
    # one line for all the volumes that will be padded (every volume of a thin-slab dataset, e.g. synthetic CT),
    # one line per other warning
    padded = [issue for issue in report.warnings if _PADDED in issue.message]
    for issue in report.warnings:
        if _PADDED not in issue.message:
            logger.warning("rank %d: %s", rank, issue.format())
    if padded:
        logger.warning("rank %d: %d of %d volumes are smaller than roi_size and will be padded, e.g. %s", rank,
                       len(padded), len(unique), padded[0].format())  # fmt: skip
    where = f"{context} (rank {rank})" if is_distributed() else context
    failed_ranks = 1 if report.errors else 0
    if sync and is_distributed() and get_world_size() > 1:
        flag = torch.tensor(float(bool(report.errors)), device=collective_device())
        failed_ranks = int(round(float(all_reduce_mean(flag)) * get_world_size()))
    report.raise_if_errors(where)
    if failed_ranks:
        raise DataCheckError(
            f"{where}: data check FAILED on {failed_ranks} other rank(s); their errors are in their own "
            f"exceptions / logs. This rank's shard: {report.summary()}",
            report=report,
        )
    logger.info("%s: %s", where, report.summary())
    return report


def _looks_like_paths(value: Any) -> bool:
    """True for a path string (or a list of them) with a medical image suffix."""
    values = value if isinstance(value, (list, tuple)) else [value]
    suffixes = (*_NIBABEL_SUFFIXES, ".nrrd", ".nhdr", ".mha", ".mhd", ".dcm")
    return bool(values) and all(
        isinstance(v, (str, os.PathLike)) and _has_suffix(os.fspath(v), suffixes) for v in values
    )


# ---------------------------------------------------------------------------------------------------------- CLI


def _words(value: Any, name: str) -> tuple[str, ...] | None:
    """CLI strings: a list / tuple (fire's parse of ``[a,b]`` or ``a,b``) or one string, split on commas."""
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        parts = [str(v) for v in value]
    else:
        parts = str(value).strip().strip("[]()").replace(",", " ").split()
    parts = [p.strip().strip("'\"") for p in parts if p.strip().strip("'\"")]
    if not parts:
        raise ValueError(f"--{name} needs at least one value.")
    return tuple(parts)


def _numbers(value: Any, name: str, kind: type) -> tuple | None:
    """CLI numbers: a number, a list / tuple, or a string like ``96,96,96`` / ``[96,96,96]``."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise ValueError(f"--{name} needs numbers, got {value!r}.")
    parts = value if isinstance(value, (list, tuple)) else str(value).strip().strip("[]()").replace(",", " ").split()
    try:
        numbers = tuple(kind(p) for p in parts)
    except (TypeError, ValueError):
        raise ValueError(f"--{name} needs {kind.__name__} values, got {value!r}.") from None
    if not numbers or (kind is int and any(isinstance(p, float) and not float(p).is_integer() for p in parts)):
        raise ValueError(f"--{name} needs {kind.__name__} values, got {value!r}.")
    return numbers


def _distribute(extra: Sequence[Any], flags: dict[str, Any]) -> dict[str, list]:
    """Gives the leftover CLI words to the flag they continue.

    python-fire takes one value per flag, so ``--keys image label --roi 96 96 96`` arrives as ``keys="image"``,
    ``roi=96`` and the leftovers ``("label", 96, 96)`` (order across flags is lost). Words go to the one
    word flag (``keys`` / ``lists``) given as a single word, numbers to the one number flag (``roi`` /
    ``pixdim``) given as a single number; anything else is ambiguous and an error asking for commas.
    """

    def is_number(v: Any) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool)

    extra_words = [v for v in extra if isinstance(v, str)]
    extra_numbers = [v for v in extra if is_number(v)]
    odd = [v for v in extra if not isinstance(v, str) and not is_number(v)]
    if odd:
        raise ValueError(f"unexpected argument(s) {odd!r}.")
    out: dict[str, list] = {}
    for kind, values, candidates in (
        ("word", extra_words, [k for k in ("keys", "lists") if isinstance(flags.get(k), str) and "," not in flags[k]]),
        ("number", extra_numbers, [k for k in ("roi", "pixdim") if is_number(flags.get(k))]),
    ):
        if not values:
            continue
        if len(candidates) != 1:
            which = " and ".join(f"--{c}" for c in candidates) or "no flag that takes several values"
            raise ValueError(
                f"cannot tell which flag the extra {kind}(s) {values!r} belong to ({which}); the DATALIST goes first, "
                "and several values can always be joined with commas: --keys image,label --roi 96,96,96."
            )
        out[candidates[0]] = values
    return out


def check_data_cli(
    datalist: str,
    extra: Sequence[Any] = (),
    base_dir: str | None = None,
    keys: Any = ("image", "label"),
    roi: Any = None,
    deep: bool = False,
    channels: int | None = None,
    num_classes: int | None = None,
    pixdim: Any = None,
    lists: Any = None,
) -> int:
    """Runs :func:`check_datalist` for the ``check-data`` command: prints one line per problem and a summary
    line, and returns the exit status (0: no errors, warnings allowed; 1: errors; 2: bad arguments)."""
    try:
        flags = {"keys": keys, "lists": lists, "roi": roi, "pixdim": pixdim}
        for name, values in _distribute(extra, flags).items():
            flags[name] = [flags[name], *values]
        report = check_datalist(
            str(datalist),
            base_dir=None if base_dir is None else str(base_dir),
            keys=_words(flags["keys"], "keys"),
            roi_size=_numbers(flags["roi"], "roi", int),
            deep=bool(deep),
            channels=channels,
            num_classes=num_classes,
            list_keys=None if flags["lists"] is None else _words(flags["lists"], "lists"),
            pixdim=_numbers(flags["pixdim"], "pixdim", float),
        )
    except (TypeError, ValueError) as err:
        print(f"check-data: {err}", flush=True)
        return 2
    print(report.format(), flush=True)
    return 1 if report.errors else 0
