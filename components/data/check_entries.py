"""The checks of datalist entries: the settings of one check, validated once (:meth:`CheckOptions.validated`), and
the :class:`EntryChecker` that takes every entry through its keys, duplicates, file headers
(:mod:`components.data.check_files`), dimensions and channels, the agreement of label and image (shape, affine),
the ROI and, with a deep check, the voxels, writing each problem into one report.
:mod:`components.data.check` walks the datalists through it."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .check_files import (
    FileHeader,
    channels_of,
    check_image_voxels,
    check_label_voxels,
    format_numbers,
    ras_geometry,
    read_header,
)
from .check_report import WARNING, DataIssue, DataReport

__all__ = ["CheckOptions", "EntryChecker", "as_tuple", "declared_classes", "will_be_padded"]

_PADDED = "it will be padded"


def will_be_padded(issue: DataIssue) -> bool:
    """Whether ``issue`` is the warning that a volume is smaller than the ROI (one line for all of them is enough)."""
    return _PADDED in issue.message


def as_tuple(value: Any, name: str, kind: type) -> tuple | None:
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


def declared_classes(
    num_classes: int | None, label_values: Sequence[int] | None, label_source: str = "label_values"
) -> tuple[tuple[int, ...] | None, str]:
    """A label's declared classes, ``range(num_classes)`` or the sorted distinct ``label_values`` (None: not declared),
    and what declared them (for messages).

    Raises:
        ValueError: both given, or ``num_classes`` not a positive integer.
    """
    if num_classes is not None and label_values is not None:
        raise ValueError("give num_classes or label_values, not both.")
    if num_classes is not None:
        if isinstance(num_classes, bool) or int(num_classes) != num_classes or num_classes < 1:
            raise ValueError(f"num_classes must be a positive integer, got {num_classes!r}.")
        return tuple(range(int(num_classes))), f"num_classes={int(num_classes)}"
    if label_values is not None:
        return tuple(sorted({int(v) for v in as_tuple(label_values, "label_values", float)})), label_source
    return None, label_source


@dataclass
class CheckOptions:
    """Validated settings shared by every entry of one check (made by :meth:`validated`)."""

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

    @classmethod
    def validated(
        cls,
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
    ) -> CheckOptions:
        """The options of :func:`~components.data.check.check_items`' arguments, validated once.

        Raises:
            ValueError, TypeError: an argument out of range, with a message that says what was expected.
        """
        keys_t = as_tuple(keys, "keys", str)
        if not keys_t or any(not k for k in keys_t):
            raise ValueError(f"keys must name at least one datalist key, e.g. ('image', 'label'); got {keys!r}.")
        if spatial_dims not in (2, 3):
            raise ValueError(f"spatial_dims must be 2 or 3, got {spatial_dims!r}.")
        roi = as_tuple(roi_size, "roi_size", int)
        if roi is not None:
            roi = roi * spatial_dims if len(roi) == 1 else roi
            if len(roi) != spatial_dims:
                raise ValueError(f"roi_size must have 1 or {spatial_dims} values, got {roi_size!r}.")
        target = as_tuple(pixdim, "pixdim", float)
        if target is not None:
            target = target * spatial_dims if len(target) == 1 else target
            if len(target) != spatial_dims or not all(math.isfinite(v) and v > 0 for v in target):
                raise ValueError(f"pixdim must be 1 or {spatial_dims} positive numbers, got {pixdim!r}.")
        if channels is not None and (isinstance(channels, bool) or int(channels) != channels or channels < 1):
            raise ValueError(f"channels must be a positive integer or None, got {channels!r}.")
        values, label_source = declared_classes(num_classes, label_values, label_source)
        return cls(
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


class EntryChecker:
    """Checks entries one by one into one report; remembers file headers and image paths across lists.

    Args:
        options: the check's settings.
        report: where every problem goes.
        source: the datalist's path (or ``"<items>"``), named by the problems of a list rather than a file.
    """

    def __init__(self, options: CheckOptions, report: DataReport, source: str) -> None:
        self.opt = options
        self.report = report
        self.source = source  # datalist path (or "<items>") for list-level issues
        self.infos: dict[str, FileHeader | None] = {}
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

        volumes: dict[str, tuple[str, FileHeader]] = {}  # key -> (first file, its header) for cross-key checks
        for key, files in paths.items():
            where = f"{name} {key}"
            infos = []
            for path in files:
                if path not in self.infos:
                    self.infos[path] = read_header(path, where, report)
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
                        check_label_voxels(path, f"{name} {key}", info, opt.label_values, opt.label_source, report)
                    else:
                        check_image_voxels(path, f"{name} {key}", info, opt.spatial_dims, report)

    def _check_layout(self, key: str, files: list[str], infos: list[FileHeader], where: str) -> bool:
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
            channels = channels_of(shape, dims)
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
        self, reference: tuple[str, FileHeader], path: str, info: FileHeader, key: str, ref_key: str, where: str
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

    def _check_roi(self, path: str, info: FileHeader, where: str) -> None:
        """Warns when the volume is smaller than ``roi_size`` along a RAS axis (it will be padded)."""
        opt = self.opt
        if opt.roi_size is None:
            return
        shape, spacing, codes = ras_geometry(info, opt.spatial_dims)
        after = "reorientation to RAS"
        if opt.pixdim is not None:
            shape = tuple(int(round(n * s / p)) for n, s, p in zip(shape, spacing, opt.pixdim))
            after += f" and resampling to pixdim {format_numbers(opt.pixdim)}"
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
