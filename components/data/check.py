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

How truncation is found without reading voxels: :mod:`components.data.check_files`. What a check found:
:mod:`components.data.check_report`; the ``check-data`` command: :mod:`components.data.check_command`.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import ignite.distributed as idist

from ..config.values import as_bool
from .check_entries import CheckOptions, EntryChecker, as_tuple, will_be_padded
from .check_files import is_image_path
from .check_report import WARNING, DataCheckError, DataReport

__all__ = ["check_before_caching", "check_datalist", "check_items"]

logger = logging.getLogger("components.data")  # one logger name for the whole package, as the logs show it


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
    opt = CheckOptions.validated(
        keys, roi_size, deep, channels, num_classes, label_values, label_key, pixdim, spatial_dims, atol, duplicates
    )
    report = DataReport(deep=opt.deep)
    checker = EntryChecker(opt, report, source=source)
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
    list_keys = ("training", "validation") if default_lists else as_tuple(list_keys, "list_keys", str)
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
    opt = CheckOptions.validated(
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
    checker = EntryChecker(opt, report, source)
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
    enabled: bool | str = True,
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
        enabled: False skips the check (returns None), e.g. for a dataset checked before (``"false"`` too, as a
            command line passes it).
        sync: agree on failure across ranks (a collective: every rank must call this function).
        context: names the dataset in the error message, e.g. ``"training"``.
        source: where the items came from (the datalist path), named by errors about an entry rather than a file.
        roi_size, deep, channels, num_classes, label_values, label_key, pixdim: as in :func:`check_items`.

    Returns:
        the :class:`DataReport` (warnings only), or None when disabled.

    Raises:
        DataCheckError: with every error line of this rank's shard, or naming the ranks that failed.
    """
    if not as_bool(enabled, "check_data"):
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
        keys = tuple(k for k, v in first.items() if is_image_path(v)) or ("image",)
    rank = idist.get_rank()
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
    padded = [issue for issue in report.warnings if will_be_padded(issue)]
    for issue in report.warnings:
        if not will_be_padded(issue):
            logger.warning("rank %d: %s", rank, issue.format())
    if padded:
        logger.warning("rank %d: %d of %d volumes are smaller than roi_size and will be padded, e.g. %s", rank,
                       len(padded), len(unique), padded[0].format())  # fmt: skip
    where = f"{context} (rank {rank})" if idist.get_world_size() > 1 else context
    failed_ranks = 1 if report.errors else 0
    if sync and idist.get_world_size() > 1:
        failed_ranks = int(idist.all_reduce(failed_ranks))  # the ranks with errors, this one included
    report.raise_if_errors(where)
    if failed_ranks:
        raise DataCheckError(
            f"{where}: data check FAILED on {failed_ranks} other rank(s); their errors are in their own "
            f"exceptions / logs. This rank's shard: {report.summary()}",
            report=report,
        )
    logger.info("%s: %s", where, report.summary())
    return report

