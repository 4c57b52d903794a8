"""Errors that name the data item's files: the source files of a batch (:func:`batch_filenames`) or of one item
(:func:`item_sources`), and the ``Compose`` whose errors name them (:class:`SourceNamingCompose`).

Every bundle pipeline runs as a :class:`SourceNamingCompose`, so a volume that breaks a transform at item 700 of
caching, or in a loader worker mid-training, is named in the error (:class:`DataItemError`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

from monai.data import MetaTensor
from monai.transforms import Compose

from ..errors import UserError, user_error

__all__ = ["DataItemError", "SourceNamingCompose", "batch_filenames", "item_sources"]

#: the message part used when the batch carries no file names
NOT_TRACKED = (
    "not tracked (the batch has no image meta data: load with LoadImaged(image_only=False), as the bundles do, "
    "or keep track_meta=True in the last EnsureTyped)"
)


def _filenames_from(value: Any) -> list[str] | None:
    if value is None:
        return None
    if isinstance(value, (str, os.PathLike)):
        return [str(value)]
    if isinstance(value, Sequence):
        names: list[str] = []
        for v in value:
            names.extend(_filenames_from(v) or [])
        return names
    return [str(value)]


def batch_filenames(batch: Any, image_key: str = "image") -> list[str] | None:
    """The source files of a batch, in order and without repeats (crops of one volume name it once): from the
    image's MetaTensor meta (``filename_or_obj``), else from ``<image_key>_meta_dict``; None when not tracked.
    ``batch`` is a collated dict or, as MONAI's trainers leave it after decollating, a list of per-sample dicts."""
    if isinstance(batch, Sequence) and not isinstance(batch, (str, bytes)):
        per_sample = [batch_filenames(item, image_key) for item in batch if isinstance(item, Mapping)]
        if not per_sample or any(names is None for names in per_sample):
            return None
        return list(dict.fromkeys(name for names in per_sample for name in names))
    if not isinstance(batch, Mapping):
        return None
    names = None
    image = batch.get(image_key)
    if isinstance(image, MetaTensor):
        names = _filenames_from(image.meta.get("filename_or_obj"))
    if not names:
        meta = batch.get(f"{image_key}_meta_dict")
        if isinstance(meta, Mapping):
            names = _filenames_from(meta.get("filename_or_obj"))
    if not names:
        return None
    return list(dict.fromkeys(names))


def item_sources(item: Any) -> dict[str, str]:
    """``{key: source file}`` of one data item, before or after transforms: path strings of a datalist entry,
    ``filename_or_obj`` of MetaTensors and of ``<key>_meta_dict``. Lists (the crops of one item) are merged."""
    if isinstance(item, Sequence) and not isinstance(item, (str, bytes)):
        merged: dict[str, str] = {}
        for element in item:
            merged.update(item_sources(element))
        return merged
    if not isinstance(item, Mapping):
        return {}
    sources: dict[str, str] = {}
    for key, value in item.items():
        name, key = None, str(key)
        if isinstance(value, (str, os.PathLike)):
            name = value
        elif isinstance(value, MetaTensor):
            name = value.meta.get("filename_or_obj")
        elif isinstance(value, Mapping) and key.endswith("_meta_dict"):  # LoadImaged(image_only=False)
            name, key = value.get("filename_or_obj"), key.removesuffix("_meta_dict")
        names = _filenames_from(name)
        if names:
            sources.setdefault(key, ", ".join(names))
    return sources


class DataItemError(UserError, RuntimeError):
    """A transform failed on a data item; the message names the item's files, the transform and the root error."""


_TRANSFORM_IN_MESSAGE = re.compile(r"applying transform <?([\w.]+)")


def _describe_failure(err: BaseException) -> str:
    """``"<Transform>: <RootType>: <root message>"`` from MONAI's chain of "applying transform ..." errors."""
    chain, seen = [err], {id(err)}
    while (cause := chain[-1].__cause__ or chain[-1].__context__) is not None and id(cause) not in seen:
        chain.append(cause)
        seen.add(id(cause))
    transforms = [m.group(1).split(".")[-1] for e in chain if (m := _TRANSFORM_IN_MESSAGE.search(str(e)))]
    root = chain[-1]
    where = f"{transforms[-1]}: " if transforms else ""
    return f"{where}{type(root).__name__}: {root}"


class SourceNamingCompose(Compose):
    """The transforms of ``compose`` (the same objects, settings and random state: nothing is re-seeded), with
    errors that name the data item's files.

    MONAI's ``Compose`` reports only the transform ("applying transform <LoadImaged object ...>"), so an error
    while caching a thousand volumes, or in a data-loader worker mid-training, does not say which volume caused
    it. This raises :class:`DataItemError` (chained to the original) naming the stage (caching: the transforms
    before the first random one; after the cache: the rest), the item's files (:func:`item_sources`), the
    transform and the root error; a transform that raises a :class:`DataItemError` itself (one that names the file
    it found wrong, such as :class:`~components.data.check_voxels.CheckVoxelsd`) is reported in its own words.
    ``CacheDataset`` and ``SmartCacheDataset`` call it with ``start`` / ``end`` like any ``Compose``.
    """

    def __init__(self, compose: Compose) -> None:
        if not isinstance(compose, Compose):
            raise TypeError(f"SourceNamingCompose wraps a monai.transforms.Compose, got {type(compose).__name__}.")
        self.__dict__.update(vars(compose))

    def __call__(self, input_, start=0, end=None, threading=False, lazy: bool | None = None):
        try:
            return super().__call__(input_, start=start, end=end, threading=threading, lazy=lazy)
        except DataItemError:
            raise
        except Exception as err:
            inner = user_error(err)
            if isinstance(inner, DataItemError):  # a transform that names the file itself (CheckVoxelsd): its words
                raise DataItemError(str(inner)) from err
            stage = "the transforms after the cache" if start else "caching" if end is not None else "a transform"
            sources = item_sources(input_)
            named = ", ".join(f"{k}={v}" for k, v in sources.items()) if sources else "an item with no file names"
            raise DataItemError(f"{stage} failed for {named}: {_describe_failure(err)}") from err
