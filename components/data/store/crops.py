"""The finetuning bundles' random crops cut from a store, reading only the chunks each crop covers.

A finetuning bundle's random transforms start with ``SpatialPadd(keys, roi) -> RandCropByPosNegLabeld`` (BTCV) or
``SpatialPadd(keys, roi) -> RandSpatialCropSamplesd`` (BraTS). On whole arrays that means reading every voxel of a
stored volume for a few crops. The transforms here take a store item (lazy
:class:`~components.data.store.handle.StoredArray` handles) and do both steps at once: the padding is virtual (a
crop reaching outside the stored region gets zeros there) and each crop reads its own region only.

- :class:`StoreRandSpatialCropSamplesd` draws its corners with the random calls of ``RandSpatialCropSamplesd``
  (through :class:`~components.data.compact_cache.RandCompactSpatialCropSamplesd`), so for the same random state
  its crops are the in-memory pipeline's, draw for draw.
- :class:`StoreRandCropByPosNegLabeld` draws its centres from the label's stored foreground locations
  (:mod:`~components.data.store.foreground`) with the probabilities of ``RandCropByPosNegLabeld``: a positive
  centre with probability ``pos / (pos + neg)``, uniform over all voxels of label > 0 (a class in proportion to its
  voxel count, then one of its sampled voxels); a negative one uniform over the sampled voxels of label 0 whose
  image value exceeds ``image_threshold``; then MONAI's ``correct_crop_centers``. Equal in distribution, not draw
  for draw. Where it cannot be (no stored locations, padding that MONAI would count as background, another image
  key than the stored one, no stored background voxel above the threshold), it runs MONAI's transforms on the
  whole arrays instead, with a WARNING once per process and reason.

:func:`store_crops` is how ``data_pipeline`` (``loader#cache`` "disk") puts them in place of a bundle's own.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Hashable, Mapping, Sequence
from copy import deepcopy
from typing import Any

import numpy as np
import torch
from monai.config import KeysCollection
from monai.data import MetaTensor
from monai.transforms import (
    Compose,
    MapTransform,
    Randomizable,
    RandCropByPosNegLabeld,
    RandSpatialCropSamplesd,
    SpatialPadd,
)
from monai.transforms.traits import MultiSampleTrait
from monai.transforms.utils import correct_crop_centers
from monai.utils import fall_back_tuple

from ..compact_cache import RandCompactSpatialCropSamplesd, moved_affine
from .dataset import ReadStoredd
from .handle import StoredArray

__all__ = ["StoreRandCropByPosNegLabeld", "StoreRandSpatialCropSamplesd", "store_crops"]

logger = logging.getLogger("components.data")
_WARNED: set[str] = set()


def _padded(shape: Sequence[int], pad_size: Sequence[int] | int | None) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(padded spatial shape, voxels before) of ``SpatialPad(pad_size, method="symmetric")`` on ``shape``."""
    if pad_size is None:
        return tuple(shape), (0,) * len(shape)
    target = fall_back_tuple(pad_size, shape)
    padded = tuple(max(int(n), int(t)) for n, t in zip(shape, target))
    return padded, tuple((p - n) // 2 for p, n in zip(padded, shape))


def _zero_outside(out: np.ndarray, target: tuple[slice, ...]) -> None:
    """Zeros ``out`` (channel-first) outside the box ``target`` (all channels, one slice per spatial axis): the
    padding of a crop."""
    for axis, part in enumerate(target[1:], start=1):
        for pad in (slice(0, part.start), slice(part.stop, None)):
            out[(slice(None),) * axis + (pad,)] = 0


def _cut(array: StoredArray | torch.Tensor, padded: Sequence[int], before: Sequence[int], start: Sequence[int],
         size: Sequence[int]) -> torch.Tensor:  # fmt: skip
    """``padded_array[:, start : start + size]`` (clipped to ``padded``, as slicing is) of ``array`` zero-padded to
    ``padded`` with ``before`` voxels in front, reading only the stored part the crop covers (a crop wholly inside the
    stored array is the array blosc2 decompresses it into, converted only where it is stored in another dtype; one
    with padding is written into the zeroed crop in one pass); a MetaTensor with the affine moved to the crop when
    the array had metadata."""
    shape = array.shape[1:]
    end = [min(s + z, p) for s, z, p in zip(start, size, padded)]
    lo = [min(max(s - b, 0), n) for s, b, n in zip(start, before, shape)]
    hi = [max(min(e - b, n), l) for e, b, n, l in zip(end, before, shape, lo)]
    region = (slice(None), *(slice(l, h) for l, h in zip(lo, hi)))
    crop_shape = [e - s for s, e in zip(start, end)]
    target = (slice(None), *(slice(l + b - s, h + b - s) for l, h, b, s in zip(lo, hi, before, start)))
    if isinstance(array, StoredArray) and [h - l for l, h in zip(lo, hi)] == crop_shape:
        values = array.read(region)  # no padding: no array to copy it into
    elif isinstance(array, StoredArray):
        out = np.empty((array.shape[0], *crop_shape), array.dtype)
        _zero_outside(out, target)
        array.read_into(region, out[target])
        values = torch.from_numpy(out)
    else:
        values = torch.as_tensor(array)[region]
        values = values.as_subclass(torch.Tensor) if isinstance(values, MetaTensor) else values
        if list(values.shape[1:]) != crop_shape:
            crop = torch.zeros((values.shape[0], *crop_shape), dtype=values.dtype)
            crop[target] = values
            values = crop
        else:
            values = values.clone()  # never a view of the caller's tensor
    meta = array.meta if isinstance(array, StoredArray) else getattr(array, "meta", None)
    if meta is None:
        return values
    meta = dict(meta)
    if meta.get("affine") is not None:
        meta["affine"] = moved_affine(torch.as_tensor(meta["affine"]), [s - b for s, b in zip(start, before)])
    return MetaTensor(values, meta=meta)


def _read_whole(data: Mapping[Hashable, Any]) -> dict:
    """``data`` with every stored array read whole (``ReadStoredd``)."""
    handles = [key for key, value in data.items() if isinstance(value, StoredArray)]
    return ReadStoredd(handles)(data) if handles else dict(data)


def _warn_once(reason: str) -> None:
    if reason not in _WARNED:
        _WARNED.add(reason)
        logger.warning("store crops read whole volumes: %s", reason)


class _StoreCrop(Randomizable, MapTransform, MultiSampleTrait):
    """What both crops share: the virtual padding, the samples' other keys (deep-copied, as MONAI does; other
    stored arrays read whole, as ``ReadStoredd`` would have) and the cutting of every key at the same corners."""

    def __init__(self, keys: KeysCollection, pad_size: Sequence[int] | int | None, allow_missing_keys: bool) -> None:
        MapTransform.__init__(self, keys, allow_missing_keys)
        self.pad_size = pad_size

    def _cut_all(self, data: Mapping[Hashable, Any], corners: Sequence[Sequence[int]],
                 size: Sequence[int]) -> list[dict]:  # fmt: skip
        """One sample per corner: the other keys copied, every key's crop of ``size`` at that corner."""
        others = _read_whole({k: v for k, v in data.items() if k not in self.keys})
        out = [{k: deepcopy(v) for k, v in others.items()} for _ in corners]
        for key in self.key_iterator(dict(data)):
            array = data[key]
            padded, before = _padded(array.shape[1:], self.pad_size)
            for sample, corner in zip(out, corners):
                sample[key] = _cut(array, padded, before, corner, size)
        return out


class StoreRandSpatialCropSamplesd(_StoreCrop):
    """``SpatialPadd(keys, pad_size) -> RandSpatialCropSamplesd(keys, roi_size, num_samples, random_center=True,
    random_size=False)`` on a store item (or on tensors), each crop reading only its region: the same crops for the
    same random state.

    Args:
        keys: keys of the arrays to crop (one spatial shape for all, as the bundles' image and label).
        roi_size: crop size (positive ints, or -1 for a whole axis).
        num_samples: crops per item.
        pad_size: ``SpatialPadd``'s ``spatial_size``; None: no padding.
        allow_missing_keys: as ``MapTransform``.
    """

    def __init__(self, keys: KeysCollection, roi_size: Sequence[int] | int, num_samples: int,
                 pad_size: Sequence[int] | int | None = None, allow_missing_keys: bool = False) -> None:  # fmt: skip
        super().__init__(keys, pad_size, allow_missing_keys)
        self.roi_size = roi_size
        self.num_samples = int(num_samples)
        self.drawer = RandCompactSpatialCropSamplesd(keys, 1, num_samples)  # its corners are RandSpatialCropSamplesd's

    def set_random_state(self, seed: int | None = None, state: np.random.RandomState | None = None):
        super().set_random_state(seed, state)
        self.drawer.set_random_state(state=self.R)
        return self

    def randomize(self, data: Any = None) -> None:
        self.drawer.randomize()

    def __call__(self, data: Mapping[Hashable, Any]) -> list[dict]:
        self.randomize()
        first = data[self.first_key(dict(data))]
        padded, _ = _padded(first.shape[1:], self.pad_size)
        self.drawer.roi_size = fall_back_tuple(self.roi_size, padded)
        size, corners = self.drawer.corners(padded)
        return self._cut_all(data, corners, size)


class StoreRandCropByPosNegLabeld(_StoreCrop):
    """``SpatialPadd(keys, pad_size) -> RandCropByPosNegLabeld(keys, label_key, spatial_size, pos, neg, num_samples,
    image_key, image_threshold, allow_smaller)`` on a store item: centres drawn from the label's stored foreground
    locations with MONAI's probabilities (see the module docstring), each crop reading only its region.

    Args:
        keys, label_key, spatial_size, pos, neg, num_samples, image_key, image_threshold, allow_smaller: as
            ``RandCropByPosNegLabeld``.
        pad_size: ``SpatialPadd``'s ``spatial_size``; None: no padding.
        allow_missing_keys: as ``MapTransform``.

    Attributes:
        last_centres: (voxel drawn in padded coordinates, "pos" or "neg") of each crop of the last call that drew
            from the stored locations; empty after a call that read whole volumes.
    """

    def __init__(self, keys: KeysCollection, label_key: str, spatial_size: Sequence[int] | int, pos: float = 1.0,
                 neg: float = 1.0, num_samples: int = 1, image_key: str | None = None, image_threshold: float = 0.0,
                 allow_smaller: bool = False, pad_size: Sequence[int] | int | None = None,
                 allow_missing_keys: bool = False) -> None:  # fmt: skip
        super().__init__(keys, pad_size, allow_missing_keys)
        if pos < 0 or neg < 0 or pos + neg == 0:
            raise ValueError(f"pos and neg must be >= 0 and not both 0, got pos={pos}, neg={neg}.")
        self.label_key, self.image_key = label_key, image_key
        self.spatial_size, self.pos_ratio = spatial_size, pos / (pos + neg)
        self.num_samples, self.image_threshold = int(num_samples), float(image_threshold)
        self.allow_smaller = allow_smaller
        self.monai = RandCropByPosNegLabeld(self.keys, label_key, spatial_size, pos, neg, num_samples, image_key,
                                            image_threshold, allow_smaller=allow_smaller)  # fmt: skip
        pad = [SpatialPadd(self.keys, pad_size, allow_missing_keys=allow_missing_keys)] if pad_size is not None else []
        self.whole = Compose([*pad, self.monai])
        self.last_centres: list[tuple[tuple[int, ...], str]] = []

    def set_random_state(self, seed: int | None = None, state: np.random.RandomState | None = None):
        super().set_random_state(seed, state)
        self.monai.set_random_state(state=self.R)
        return self

    def randomize(self, data: Any = None) -> None:
        """Nothing ahead: each centre is drawn in :meth:`__call__`."""

    def _why_whole(self, data: Mapping[Hashable, Any]) -> str | None:
        """Why this item's crops cannot come from the stored locations, or None."""
        label = data.get(self.label_key)
        if not isinstance(label, StoredArray) or label.locations is None:
            return f"{self.label_key!r} has no stored foreground locations (not a single-channel integer label map)"
        stored_image = label.locations.image_key
        if self.image_key is not None and self.image_key != stored_image:
            return f"image_key {self.image_key!r} is not the image whose values the locations keep ({stored_image!r})"
        padded, _ = _padded(label.shape[1:], self.pad_size)
        if padded != tuple(label.shape[1:]) and (self.image_key is None or self.image_threshold < 0):
            return "padded voxels count as background (no image_key, or image_threshold < 0)"
        return None

    def _centre(self, locations: Any, before: Sequence[int]) -> tuple[tuple[int, ...], str] | None:
        """A drawn centre (padded coordinates) and its kind, or None when there is no voxel to draw."""
        threshold = self.image_threshold if self.image_key is not None else None
        has_foreground = locations.foreground() > 0
        voxel, kind = None, "pos"
        if has_foreground and self.R.rand() < self.pos_ratio:
            voxel = locations.draw_foreground(self.R)
        else:
            voxel, kind = locations.draw_background(self.R, threshold), "neg"
            if voxel is None and has_foreground:  # no background: all positive, as MONAI does
                voxel, kind = locations.draw_foreground(self.R), "pos"
        return None if voxel is None else (tuple(v + b for v, b in zip(voxel, before)), kind)

    def __call__(self, data: Mapping[Hashable, Any]) -> list[dict]:
        self.last_centres = []
        reason = self._why_whole(data)
        if reason is None:
            label = data[self.label_key]
            padded, before = _padded(label.shape[1:], self.pad_size)
            centres = [self._centre(label.locations, before) for _ in range(self.num_samples)]
            if all(c is not None for c in centres):
                size = fall_back_tuple(self.spatial_size, padded)
                corners = []
                for voxel, _ in centres:
                    centre = correct_crop_centers(list(voxel), size, padded, self.allow_smaller)
                    corners.append([max(int(c) - s // 2, 0) for c, s in zip(centre, size)])
                self.last_centres = centres
                return self._cut_all(data, corners, size)
            reason = "no stored voxel to centre a crop on (no foreground, no background above image_threshold)"
        _warn_once(reason)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # MONAI's "unable to generate class balanced samples"
            return self.whole(_read_whole(data))


def _pad_size(transform: Any, keys: tuple) -> Sequence[int] | int | None:
    """``transform``'s ``spatial_size`` when it is a plain symmetric zero ``SpatialPadd`` of ``keys``, else None."""
    padder = getattr(transform, "padder", None)
    if not isinstance(transform, SpatialPadd) or tuple(transform.keys) != keys or padder is None:
        return None
    modes = [str(m) for m in transform.mode]  # one per key
    plain = str(padder.method) == "symmetric" and set(modes) == {"constant"} and not padder.kwargs
    return padder.spatial_size if plain else None


def store_crops(random: Sequence[Any]) -> list[Any] | None:
    """``random`` (a bundle's random transforms, instantiated) with its leading ``[SpatialPadd,]
    RandCropByPosNegLabeld`` or ``[SpatialPadd,] RandSpatialCropSamplesd(random_center=True, random_size=False)``
    replaced by the store crop that does the same; None when it starts otherwise (then whole arrays are read)."""
    if not random:
        return None
    first = random[0]
    crop, pad, rest = first, None, list(random[1:])
    if isinstance(first, SpatialPadd) and len(random) > 1:
        crop, rest = random[1], list(random[2:])
        pad = _pad_size(first, tuple(crop.keys) if isinstance(crop, MapTransform) else ())
        if pad is None:
            return None
    if isinstance(crop, RandCropByPosNegLabeld):
        cropper = crop.cropper
        if crop.fg_indices_key is not None or crop.bg_indices_key is not None or crop.lazy:
            return None
        store = StoreRandCropByPosNegLabeld(
            crop.keys, crop.label_key, cropper.spatial_size, cropper.pos_ratio, 1.0 - cropper.pos_ratio,
            cropper.num_samples, crop.image_key, cropper.image_threshold, cropper.allow_smaller, pad,
            crop.allow_missing_keys,
        )  # fmt: skip
        return [store, *rest]
    if isinstance(crop, RandSpatialCropSamplesd):
        inner = crop.cropper.cropper
        if inner.random_size or not inner.random_center or crop.lazy:
            return None
        store = StoreRandSpatialCropSamplesd(crop.keys, inner.roi_size, crop.cropper.num_samples, pad,
                                             crop.allow_missing_keys)  # fmt: skip
        return [store, *rest]
    return None
