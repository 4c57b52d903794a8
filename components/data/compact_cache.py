"""A compact, exact cache for the SSL pretraining pipeline (Tang et al., CVPR 2022).

The recipe caches what ``ScaleIntensityRanged -> SpatialPadd(roi) -> CropForegroundd(k_divisible=roi)`` produce:
float32 values in [0, 1], padded with zeros up to a multiple of the ROI along every axis. On CT that is mostly
padding and 4 bytes per voxel for integer Hounsfield units. The two transforms here give the *same crops* from a
fraction of the memory:

- :class:`CompactCropForegroundd` (deterministic, cached): computes the recipe's padded foreground box exactly as
  MONAI does, but stores only the part of the image inside it that is not zero after scaling (no padding), in the
  image's own values (raw integers in the narrowest exact dtype, e.g. int16 HU), plus the box geometry.
- :class:`RandCompactSpatialCropSamplesd` (random, after the cache): draws crop corners with the same random calls
  in the same order as ``RandSpatialCropSamplesd(random_center=True, random_size=False)`` on the padded box, cuts
  each crop from the compact array, fills the padding of that crop only and applies the recipe's intensity scaling
  to the crop (:class:`IntensityScaler`: MONAI's ``ScaleIntensityRange`` arithmetic in place, checked bit for bit
  against MONAI's transform).

For the same random state the crops are ``torch.equal`` to the recipe's (tests/test_transforms.py). Why this is
exact:

- ``SpatialPadd`` before ``CropForegroundd`` changes no value a crop can see: it pads with 0, which is background
  for ``x > 0``, and the foreground box plus its ``k_divisible`` growth (centred, ``floor((S - s) / 2)`` before) is
  the same relative to the foreground whatever the padding; outside the image ``CropForeground`` pads with 0 too.
- Inside the padded box, voxels outside the stored region are exactly 0 after scaling (the stored region is the
  bounding box of the non-zero scaled voxels), so filling them with 0 lazily is exact.
- Integers with ``|v| <= 2**24`` convert to float32 exactly, so ``float32(stored int) == float32(loaded value)``
  and the same elementwise scaling gives the same bits. For uint8 / int8 / int16 images the foreground test
  ``scaled > 0`` is an integer comparison ``x > t`` found by scaling every value of the dtype once, so caching
  never makes a float copy of such a volume. Images whose values are not such integers (float data with fractions,
  huge integers) are stored as the recipe's scaled float32 values instead, still without padding.

Load images with ``LoadImaged(dtype=None)`` (the file's own dtype) in front of :class:`CompactCropForegroundd`;
with the default ``float32`` loading, integer-valued volumes are still detected and stored as integers, only
the loading itself costs more.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from copy import deepcopy
from typing import Any

import numpy as np
import torch
from monai.config import KeysCollection
from monai.transforms import MapTransform, Randomizable, ScaleIntensityRange
from monai.transforms.utils import compute_divisible_spatial_size, generate_spatial_bounding_box, is_positive
from monai.transforms.traits import MultiSampleTrait
from monai.utils import MAX_SEED, ensure_tuple_rep

from .store.handle import StoredArray

__all__ = [
    "CompactCropForegroundd",
    "RandCompactSpatialCropSamplesd",
    "IntensityScaler",
    "COMPACT_SUFFIX",
    "compact_nbytes",
]

COMPACT_SUFFIX = "_compact"
"""``data[key + COMPACT_SUFFIX]`` holds the geometry and scaling of the compact array ``data[key]``."""

_EXACT_INT = 2**24  # every integer of magnitude <= 2**24 is exactly representable in float32
_INT_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32)


def _plain(x: Any) -> torch.Tensor:
    """A plain ``torch.Tensor`` view of a tensor, MetaTensor or array (no metadata, no copy where possible)."""
    if isinstance(x, torch.Tensor):
        return x.as_tensor() if hasattr(x, "as_tensor") else x
    return torch.as_tensor(np.asarray(x))


def _region(array: torch.Tensor | StoredArray, region: tuple[slice, ...]) -> torch.Tensor:
    """``array[region]`` as a tensor: a view of a tensor, or the values a store's lazy handle reads for it."""
    return array.read(region) if isinstance(array, StoredArray) else array[region]


def moved_affine(affine: torch.Tensor, first: Sequence[int]) -> torch.Tensor:
    """The affine (float64, CPU) of an array whose first voxel is voxel ``first`` of the array of ``affine``."""
    moved = affine.detach().cpu().as_subclass(torch.Tensor).to(torch.float64).clone()
    moved[:-1, -1] += moved[:-1, :-1] @ torch.tensor([float(v) for v in first], dtype=torch.float64)
    return moved


def _positive_sizes(value: Sequence[int] | int, ndim: int, name: str) -> tuple[int, ...]:
    """``value`` as one positive int per spatial axis; a clear error otherwise (MONAI would silently fall back)."""
    sizes = tuple(int(v) for v in ensure_tuple_rep(value, ndim))
    if any(v < 1 for v in sizes):
        raise ValueError(f"{name} must be positive on every spatial axis, got {value!r}.")
    return sizes


def _narrow_int_dtype(low: int, high: int) -> torch.dtype | None:
    """The smallest integer dtype holding [low, high], or None beyond int32."""
    for dtype in _INT_DTYPES:
        info = torch.iinfo(dtype)
        if info.min <= low and high <= info.max:
            return dtype
    return None


def _exact_integer_storage(values: torch.Tensor) -> torch.Tensor | None:
    """``values`` in the narrowest integer dtype if every value is an integer with ``|v| <= 2**24`` (so that the
    float32 the recipe loads equals float32 of the stored integer), else None."""
    if values.numel() == 0:
        return values.to(torch.uint8)
    if values.dtype == torch.bool:
        return values.to(torch.uint8)
    if values.is_floating_point():
        as_float = values.to(torch.float32)  # what the recipe's LoadImaged(dtype=float32) keeps
        if not bool(torch.isfinite(as_float).all()) or not bool((as_float == torch.round(as_float)).all()):
            return None
        low, high = as_float.aminmax()
    elif values.is_complex():
        return None
    else:
        as_float = None
        low, high = values.aminmax()
    low, high = int(low), int(high)
    if max(abs(low), abs(high)) > _EXACT_INT:
        return None
    dtype = _narrow_int_dtype(low, high)
    source = values if as_float is None else as_float
    return source.to(dtype).contiguous()


class IntensityScaler:
    """The recipe's ``ScaleIntensityRange(a_min, a_max, b_min, b_max, clip)`` of float32 values, bit for bit.

    MONAI's transform computes ``(x - a_min) / (a_max - a_min) * (b_max - b_min) + b_min`` then clamps, one new
    tensor per step and through MetaTensor dispatch. The same IEEE operations in place on one float32 copy give the
    same bits (each step is correctly rounded, whichever kernel runs it) in a fraction of the time; this is checked
    once per argument set against MONAI's own transform on every int16 value plus large and fractional probes, and
    MONAI's transform is used whenever the check fails (e.g. ``a_min == a_max``, which MONAI special-cases).
    """

    def __init__(self, a_min: float, a_max: float, b_min: float | None, b_max: float | None, clip: bool) -> None:
        self.args = (float(a_min), float(a_max), b_min, b_max, bool(clip))
        self.monai = ScaleIntensityRange(*self.args)
        self._fast: bool | None = None
        self._thresholds: dict[torch.dtype, int | None] = {}

    def _in_place(self, x: torch.Tensor) -> torch.Tensor:
        a_min, a_max, b_min, b_max, clip = self.args
        x.sub_(a_min).div_(a_max - a_min)
        if b_min is not None and b_max is not None:
            x.mul_(b_max - b_min).add_(b_min)
            if clip:
                x.clamp_(b_min, b_max)
        return x

    def _monai(self, values: torch.Tensor) -> torch.Tensor:
        return _plain(self.monai(values))

    @property
    def fast(self) -> bool:
        """Whether the in-place arithmetic reproduces MONAI's transform (checked on first use)."""
        if self._fast is None:
            probe = torch.cat(
                [
                    torch.arange(-(2**15), 2**15, dtype=torch.float32),
                    torch.tensor([-(2.0**24), 2.0**24, -1e6, 1e6, 0.5, -0.25, 1e-3, 1234.567]),
                    torch.linspace(self.args[0] - 3.0, self.args[1] + 3.0, 4097),
                ]
            )
            expected = self._monai(probe.clone())
            self._fast = expected.dtype == torch.float32 and torch.equal(expected, self._in_place(probe.clone()))
        return self._fast

    def __call__(self, values: torch.Tensor) -> torch.Tensor:
        """A new float32 tensor of the scaled ``values`` (any real dtype; converted to float32 first, as the recipe's
        ``LoadImaged`` does)."""
        if self.fast:
            return self._in_place(_plain(values).to(torch.float32, copy=True))
        return self._monai(_plain(values).to(torch.float32))

    def threshold(self, dtype: torch.dtype) -> int | None:
        """For uint8 / int8 / int16 values: ``t`` with ``scaled(x) > 0 <=> scaled(x) != 0 <=> x > t`` for every
        value of ``dtype`` (found by scaling all of them), so foreground and non-zero masks need no float copy of
        the volume; None for other dtypes or when no such ``t`` exists (e.g. negative scaled values)."""
        if dtype not in (torch.uint8, torch.int8, torch.int16):
            return None
        if dtype not in self._thresholds:
            info = torch.iinfo(dtype)
            scaled = self(torch.arange(info.min, info.max + 1, dtype=torch.float32))
            positive = scaled > 0
            first = int(torch.argmax(positive.to(torch.uint8))) if bool(positive.any()) else positive.numel()
            upper_set = bool(positive[first:].all()) and not bool(positive[:first].any())
            nonzero_is_positive = torch.equal(positive, scaled != 0)
            self._thresholds[dtype] = info.min + first - 1 if upper_set and nonzero_is_positive else None
        return self._thresholds[dtype]


def compact_nbytes(data: Any) -> int:
    """Bytes held by the tensors and arrays in ``data`` (nested dicts / lists / tuples; MetaTensor metadata
    included): the memory a cached item costs, used by the cache benchmark."""
    if isinstance(data, torch.Tensor):
        total = data.untyped_storage().nbytes()
        meta = getattr(data, "meta", None)
        if isinstance(meta, Mapping):
            total += compact_nbytes(dict(meta))
        return total
    if isinstance(data, np.ndarray):
        return int(data.nbytes)
    if isinstance(data, Mapping):
        return sum(compact_nbytes(v) for v in data.values())
    if isinstance(data, (list, tuple)):
        return sum(compact_nbytes(v) for v in data)
    return 0


class CompactCropForegroundd(MapTransform):
    """Deterministic half of the compact cache: what the recipe's
    ``ScaleIntensityRanged(a_min, a_max, b_min, b_max, clip) -> SpatialPadd(roi_size) ->
    CropForegroundd(source_key, k_divisible=roi_size, allow_smaller=True)`` keeps, without padding and in the
    image's own values.

    For every key, ``data[key]`` becomes the channel-first array of the region of the recipe's padded box that
    holds non-zero scaled values (voxels the recipe would keep as anything but 0), stored as

    - the raw values in the narrowest integer dtype (uint8 / int8 / int16 / int32) when they are integers of
      magnitude <= 2**24 (CT in Hounsfield units: int16, half of float32 and no padding), scaled after the cache;
    - otherwise the recipe's scaled float32 values (already scaled; only the padding is saved),

    and ``data[key + "_compact"]`` holds a small dict: ``padded_shape`` (the recipe's cached spatial shape),
    ``offset`` (where the stored array starts inside it), ``scale`` (the scaling arguments, or None when the
    array is already scaled) and, when the image was a MetaTensor, ``affine``: the stored array's own (the image's
    affine moved to the array's first voxel), so a store knows its voxels' position and spacing in the stored axis
    order. The image's other metadata is dropped: the pretraining crops carry none
    (``EnsureTyped(track_meta=False)`` in the recipe); other keys, such as the ``image_meta_dict`` that
    ``LoadImaged(image_only=False)`` adds, are kept, so errors can still name the file.

    The box is MONAI's: ``generate_spatial_bounding_box`` of the foreground ``scaled > 0`` of ``source_key`` (the
    ``CropForegroundd`` default), grown to ``compute_divisible_spatial_size`` with ``(S - s) // 2`` voxels before,
    as ``CropForeground.compute_bounding_box`` does. For uint8 / int8 / int16 images the foreground is the
    integer comparison ``x > t`` (:meth:`IntensityScaler.threshold`), so caching CT never makes a float copy of a
    volume; other dtypes are scaled first.

    Args:
        keys: keys of the images (channel-first, after ``Orientationd``).
        source_key: key whose foreground defines the box (the recipe: "image").
        roi_size: the recipe's ``SpatialPadd`` size and ``k_divisible`` (int or one per spatial axis).
        a_min, a_max, b_min, b_max, clip: as ``ScaleIntensityRanged`` (recipe: -1000, 1000, 0, 1, True).
        k_divisible: defaults to ``roi_size``.
        start_coord_key, end_coord_key: keys receiving the box in the coordinates of the recipe's padded image, as
            ``CropForegroundd`` records it (int64 arrays; None to skip), so the samples hold the same keys.
        allow_missing_keys: as ``MapTransform``.

    Example:
        >>> t = CompactCropForegroundd("image", "image", roi_size=96, a_min=-1000, a_max=1000)
        >>> out = t({"image": torch.randint(-1024, 1500, (1, 70, 80, 50), dtype=torch.int16)})
        >>> out["image"].dtype, out["image_compact"]["padded_shape"]
        (torch.int16, (96, 96, 96))
    """

    def __init__(
        self,
        keys: KeysCollection,
        source_key: str,
        roi_size: Sequence[int] | int,
        a_min: float,
        a_max: float,
        b_min: float | None = 0.0,
        b_max: float | None = 1.0,
        clip: bool = True,
        k_divisible: Sequence[int] | int | None = None,
        start_coord_key: str | None = "foreground_start_coord",
        end_coord_key: str | None = "foreground_end_coord",
        allow_missing_keys: bool = False,
    ) -> None:
        super().__init__(keys, allow_missing_keys)
        self.source_key = source_key
        self.roi_size = roi_size
        self.k_divisible = roi_size if k_divisible is None else k_divisible
        self.start_coord_key = start_coord_key
        self.end_coord_key = end_coord_key
        self.scale_args = (float(a_min), float(a_max), b_min, b_max, bool(clip))
        self.scaler = IntensityScaler(*self.scale_args)

    def _foreground_box(self, image: torch.Tensor) -> tuple[list[int], list[int], torch.Tensor | None]:
        """``CropForeground``'s ``generate_spatial_bounding_box`` of ``scaled > 0``, and the scaled image when it had
        to be computed (None when the integer threshold answered)."""
        threshold = self.scaler.threshold(image.dtype)
        if threshold is not None:
            if threshold < torch.iinfo(image.dtype).min:  # every value is foreground (a scalar below the dtype's
                select = lambda x: torch.ones_like(x, dtype=torch.bool)  # noqa: E731  range would wrap around)
            else:
                select = lambda x: x > threshold  # noqa: E731
            start, end = generate_spatial_bounding_box(image, select, None, 0, True)
            return [int(v) for v in start], [int(v) for v in end], None
        scaled = self.scaler(image)
        start, end = generate_spatial_bounding_box(scaled, is_positive, None, 0, True)
        return [int(v) for v in start], [int(v) for v in end], scaled

    def padded_box(self, fg_start: Sequence[int], fg_end: Sequence[int]) -> tuple[list[int], list[int]]:
        """The recipe's cached box (image coordinates, may reach outside the image) around a foreground box:
        ``CropForeground.compute_bounding_box`` (MONAI 1.5, 1.6) -- size made divisible by ``k_divisible``, the growth
        split with ``(S - s) // 2`` before."""
        size = [e - s for s, e in zip(fg_start, fg_end)]
        _positive_sizes(self.roi_size, len(size), "roi_size")
        grown = compute_divisible_spatial_size(size, k=self.k_divisible)
        start = [s - (g - n) // 2 for s, g, n in zip(fg_start, grown, size)]
        return start, [s + g for s, g in zip(start, grown)]

    def _record_box(self, d: dict, shape: Sequence[int], box_start: Sequence[int], box_end: Sequence[int]) -> None:
        """``CropForegroundd``'s coordinate keys: the box in the image after ``SpatialPadd(roi_size)`` (symmetric:
        ``(roi - size) // 2`` voxels before), all zeros when there is no foreground (MONAI's convention)."""
        roi = _positive_sizes(self.roi_size, len(shape), "roi_size")
        before = np.asarray([max(r - n, 0) // 2 for r, n in zip(roi, shape)], dtype=np.int64)
        start, end = np.asarray(box_start, dtype=np.int64), np.asarray(box_end, dtype=np.int64)
        if not (end - start).any():  # no foreground: MONAI returns a zero box before any padding shift
            before = np.zeros_like(before)
        if self.start_coord_key is not None:
            d[self.start_coord_key] = start + before
        if self.end_coord_key is not None:
            d[self.end_coord_key] = end + before

    def _nonzero_region(self, image: torch.Tensor, scaled: torch.Tensor | None, lo: list[int], hi: list[int]):
        """The bounding box (within [lo, hi)) of the voxels whose scaled value is not 0, and the scaled image."""
        region = (slice(None), *(slice(l, h) for l, h in zip(lo, hi)))
        if scaled is None:
            scaled = self.scaler(image)
        nonzero = (scaled[region] != 0).any(0)
        if not bool(nonzero.any()):
            return lo, list(lo), scaled
        new_lo, new_hi = list(lo), list(hi)
        for axis in range(nonzero.ndim):
            others = tuple(a for a in range(nonzero.ndim) if a != axis)
            where = torch.nonzero(nonzero.any(others) if others else nonzero).flatten()
            new_lo[axis], new_hi[axis] = lo[axis] + int(where[0]), lo[axis] + int(where[-1]) + 1
        return new_lo, new_hi, scaled

    def compact(
        self,
        image: torch.Tensor,
        box_start: Sequence[int],
        box_end: Sequence[int],
        fg_box: tuple[Sequence[int], Sequence[int]] | None = None,
        scaled: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict]:
        """The stored array and geometry of one image, given the recipe's box. ``fg_box``: the image's own non-zero
        box when already known (the source under an integer threshold), else it is found inside the box."""
        image = _plain(image)
        shape = image.shape[1:]
        lo = [max(s, 0) for s in box_start]
        hi = [min(e, n) for e, n in zip(box_end, shape)]
        if any(h <= l for l, h in zip(lo, hi)):
            lo, hi = list(box_start), list(box_start)  # empty: the recipe's crops hold nothing but zeros
        elif fg_box is not None:
            lo, hi = list(fg_box[0]), list(fg_box[1])
        else:
            lo, hi, scaled = self._nonzero_region(image, scaled, lo, hi)
        region = (slice(None), *(slice(l, h) for l, h in zip(lo, hi)))
        stored = _exact_integer_storage(image[region])
        scale = self.scale_args
        if stored is None:
            scaled = self.scaler(image[region]) if scaled is None else scaled[region]
            stored, scale = scaled, None
        if stored.untyped_storage().nbytes() > stored.nbytes or not stored.is_contiguous():
            stored = stored.clone(memory_format=torch.contiguous_format)  # never keep the whole volume alive
        geometry = {
            "padded_shape": tuple(e - s for s, e in zip(box_start, box_end)),
            "offset": tuple(l - s for l, s in zip(lo, box_start)),
            "scale": scale,
        }
        return stored, geometry

    def __call__(self, data: Mapping[Hashable, Any]) -> dict[Hashable, Any]:
        d = dict(data)
        if self.source_key not in d:
            raise KeyError(f"source_key {self.source_key!r} is not in the data (keys: {sorted(map(str, d))}).")
        source = _plain(d[self.source_key])
        fg_start, fg_end, source_scaled = self._foreground_box(source)
        box_start, box_end = self.padded_box(fg_start, fg_end)
        self._record_box(d, source.shape[1:], box_start, box_end)
        for key in self.key_iterator(d):
            affine = getattr(d[key], "affine", None)
            image = _plain(d[key])
            if image.shape[1:] != source.shape[1:]:
                raise ValueError(
                    f"{key!r} has spatial shape {tuple(image.shape[1:])}, the source {self.source_key!r} "
                    f"{tuple(source.shape[1:])}: the box of one cannot crop the other."
                )
            if key == self.source_key:
                fg_box = (fg_start, fg_end) if source_scaled is None else None
                d[key], d[f"{key}{COMPACT_SUFFIX}"] = self.compact(image, box_start, box_end, fg_box, source_scaled)
            else:
                d[key], d[f"{key}{COMPACT_SUFFIX}"] = self.compact(image, box_start, box_end)
            if isinstance(affine, torch.Tensor):
                geometry = d[f"{key}{COMPACT_SUFFIX}"]
                first = [s + o for s, o in zip(box_start, geometry["offset"])]
                geometry["affine"] = moved_affine(affine, first)
        return d


class RandCompactSpatialCropSamplesd(Randomizable, MapTransform, MultiSampleTrait):
    """Random half of the compact cache: ``num_samples`` crops of ``roi_size`` drawn exactly as
    ``RandSpatialCropSamplesd(roi_size, num_samples, random_center=True, random_size=False)`` draws them on the
    recipe's padded volume, cut from the compact arrays of :class:`CompactCropForegroundd`.

    Random calls, in order (those of MONAI 1.5.1 and 1.6.1): one ``R.randint(MAX_SEED, dtype="uint32")`` per call (the
    sub-seed); per key a ``RandomState(sub_seed)`` and, per crop and spatial axis whose padded size exceeds the ROI,
    ``randint(0, size - roi + 1)`` for the corner. Seeding this transform (``set_random_state``, or
    ``monai.data.utils.set_rnd`` / ``Compose.set_random_state`` through a pipeline, as the trainer does per epoch)
    therefore reproduces the recipe's crops draw for draw.

    Each crop is a new float32 tensor on the compact array's device (e.g. a GPU with a cache on the device): zeros,
    then the part of the crop that overlaps the stored region, converted and scaled with MONAI's
    ``ScaleIntensityRange`` (when stored raw). Only the crop is ever padded. The ``key + "_compact"`` entries are
    removed from the output; other keys are deep-copied into every sample, as MONAI does.

    The compact array may also be an on-disk store's lazy handle (:class:`~components.data.store.StoredArray`, in a
    :class:`~components.data.store.StoreDataset` item): then each crop reads only its own region from disk.

    Args:
        keys: keys of compact arrays.
        roi_size: crop size (positive ints; a padded axis shorter than the ROI gives a shorter crop, as MONAI).
        num_samples: crops per input.
        allow_missing_keys: as ``MapTransform``.
    """

    def __init__(
        self, keys: KeysCollection, roi_size: Sequence[int] | int, num_samples: int, allow_missing_keys: bool = False
    ) -> None:
        MapTransform.__init__(self, keys, allow_missing_keys)
        if int(num_samples) < 1:
            raise ValueError(f"num_samples must be a positive int, got {num_samples!r}.")
        self.roi_size = roi_size
        self.num_samples = int(num_samples)
        self.sub_seed = 0
        self._scalers: dict[tuple, IntensityScaler] = {}

    def randomize(self, data: Any = None) -> None:
        self.sub_seed = self.R.randint(MAX_SEED, dtype="uint32")

    def corners(self, padded_shape: Sequence[int]) -> tuple[tuple[int, ...], list[tuple[int, ...]]]:
        """The crop size and the ``num_samples`` corners (padded coordinates) for the current sub-seed."""
        roi = _positive_sizes(self.roi_size, len(padded_shape), "roi_size")
        size = tuple(min(p, r) for p, r in zip(padded_shape, roi))  # get_valid_patch_size
        state = np.random.RandomState(np.int64(self.sub_seed) % MAX_SEED)  # Randomizable.set_random_state
        corners = [  # get_random_patch: a draw only on the axes where the padded size exceeds the crop
            tuple(int(state.randint(0, p - s + 1)) if p > s else 0 for p, s in zip(padded_shape, size))
            for _ in range(self.num_samples)
        ]
        return size, corners

    def _scale(self, values: torch.Tensor, args: tuple | None) -> torch.Tensor:
        """A new float32 tensor of the recipe's values of the stored ``values``."""
        if args is None:  # stored already scaled (float32 fallback)
            return values.to(torch.float32, copy=True)
        args = tuple(args)  # the cache may have turned the tuple into a list
        scaler = self._scalers.get(args)
        if scaler is None:
            scaler = self._scalers[args] = IntensityScaler(*args)
        return scaler(values)

    def crop(
        self, array: torch.Tensor | StoredArray, geometry: Mapping, corner: Sequence[int], size: Sequence[int]
    ) -> torch.Tensor:
        """The recipe's crop ``padded[:, corner : corner + size]`` from the compact ``array`` (a tensor, or a
        store's lazy handle, of which only the crop's region is read)."""
        offset, stored = geometry["offset"], array.shape[1:]
        lo = [max(c, o) for c, o in zip(corner, offset)]
        hi = [min(c + s, o + n) for c, s, o, n in zip(corner, size, offset, stored)]
        inside = all(h > l for l, h in zip(lo, hi))
        source = (slice(None), *(slice(l - o, h - o) for l, h, o in zip(lo, hi, offset)))
        if inside and all(h - l == s for l, h, s in zip(lo, hi, size)):  # no padding in this crop
            # always a new tensor: never aliases the cache
            return self._scale(_region(array, source), geometry["scale"])
        device = array.device if isinstance(array, torch.Tensor) else None
        out = torch.zeros((array.shape[0], *size), dtype=torch.float32, device=device)
        if inside:
            target = (slice(None), *(slice(l - c, h - c) for l, h, c in zip(lo, hi, corner)))
            out[target] = self._scale(_region(array, source), geometry["scale"])
        return out

    def __call__(self, data: Mapping[Hashable, Any]) -> list[dict[Hashable, Any]]:
        geometry_keys = {f"{k}{COMPACT_SUFFIX}" for k in self.keys}
        others = set(data) - set(self.keys) - geometry_keys
        out: list[dict[Hashable, Any]] = [
            {k: deepcopy(data[k]) for k in data if k in others} for _ in range(self.num_samples)
        ]
        self.randomize()
        for key in self.key_iterator(dict(data)):
            geometry_key = f"{key}{COMPACT_SUFFIX}"
            if geometry_key not in data:
                raise KeyError(f"{geometry_key!r} is missing: run CompactCropForegroundd on {key!r} first.")
            geometry = data[geometry_key]
            array = data[key] if isinstance(data[key], StoredArray) else _plain(data[key])
            size, corners = self.corners(geometry["padded_shape"])
            for sample, corner in zip(out, corners):
                sample[key] = self.crop(array, geometry, corner, size)
        return out
