"""The voxel checks of every volume where it is first read: :class:`CheckVoxelsd`, a transform placed right after
``LoadImaged`` in each bundle's ``train#transforms#deterministic``.

Without it, NaN or Inf voxels show only as a non-finite loss some iterations into training (naming a batch, not a
file), or not at all: ``ScaleIntensityRanged(clip=True)`` turns an all-Inf image into a constant one that trains
without a word. A label holding values beyond the network's classes (e.g. 20 and 255 for 14 classes) fails after
the whole dataset is cached, as an index error that names no file, and a BraTS label in another convention (3 for
the enhancing tumour) is silently read as background by ``ConvertToMultiChannelBasedOnBratsClassesd``.

Why a transform on the cache's first pass rather than a check before caching: the voxels are read there anyway
(decoding them is what caching costs; the data check before caching reads headers only), so every volume is checked,
not a sample, for one reduction over memory already loaded; and the same transform runs wherever the deterministic
transforms run: ``CacheDataset`` before the first iteration, the on-disk store's preprocessing
(``python -m components preprocess``), evaluation. What is wrong is said with the messages of the deep data check
(``python -m components check-data --deep``, :mod:`components.data.check_files`), computed only for a volume that
fails.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import torch
from monai.config import KeysCollection
from monai.transforms import MapTransform
from monai.utils import convert_to_tensor

from .check_entries import declared_classes
from .check_files import label_messages, non_finite_message
from .sources import DataItemError, item_sources

__all__ = ["CheckVoxelsd"]


def _finite(x: torch.Tensor) -> bool:
    """Whether every value of ``x`` is finite: one ``aminmax`` pass (min and max propagate NaN and hold any Inf),
    which allocates nothing, unlike ``isfinite(x).all()``; integer volumes need no pass."""
    if not x.is_floating_point() or x.numel() == 0:
        return True
    low, high = torch.aminmax(x)
    return bool(torch.isfinite(low) & torch.isfinite(high))


class CheckVoxelsd(MapTransform):
    """Raises :class:`~components.data.sources.DataItemError` naming the file when a volume's voxels cannot be
    trained on: an image (``keys``) with NaN or Inf voxels, or a label map (``label_key``) with values that are not
    among its classes (``num_classes``: 0 .. n-1, or ``label_values``). The data passes through unchanged.

    The volumes that pass cost one ``aminmax`` pass each (a float label map one more for integrality, and one per
    value the classes skip, such as 3 in BraTS's 0, 1, 2, 4); the message, with the counts or the values found
    (those of ``check-data --deep``), is computed only for a volume that fails. Place it right after ``LoadImaged``,
    before any transform that resamples, clips or converts the values (why here, not before caching: see the
    module's docstring).

    Args:
        keys: the images whose voxels must all be finite.
        label_key: the label map whose values must be class indices; None checks no label.
        num_classes: the label's classes are 0 .. ``num_classes`` - 1 (a segmentation network's ``out_channels``).
        label_values: the label's classes when they are not 0 .. n-1 (BraTS 2018-2021: 0, 1, 2, 4). Give one of
            ``num_classes`` and ``label_values`` with ``label_key``, neither without it.
        allow_missing_keys: as ``MapTransform`` (the label key too: an inference item has no label).

    Raises:
        ValueError: (at construction) classes without a label key, or a label key without classes.

    Example (BTCV's ``train#transforms#deterministic``, after ``LoadImaged``)::

        {"_target_": "components.CheckVoxelsd", "keys": "image",
         "label_key": "label", "num_classes": "$len(@label_names)"}
    """

    def __init__(
        self,
        keys: KeysCollection,
        label_key: str | None = None,
        num_classes: int | None = None,
        label_values: Sequence[int] | None = None,
        allow_missing_keys: bool = False,
    ) -> None:
        super().__init__(keys, allow_missing_keys)
        declared = num_classes is not None or label_values is not None
        if (label_key is None) == declared:
            raise ValueError(
                "CheckVoxelsd: give label_key together with num_classes or label_values (got label_key "
                f"{label_key!r}, num_classes {num_classes!r}, label_values {label_values!r})."
            )
        self.label_key = label_key
        self.label_values, self.label_source = declared_classes(num_classes, label_values)
        values = self.label_values or ()
        span = range(values[0], values[-1] + 1) if values else range(0)
        self._gaps = tuple(v for v in span if v not in values)  # the values the classes skip: 3 in 0, 1, 2, 4

    def _labels_ok(self, x: torch.Tensor) -> bool:
        """Whether every value of ``x`` is one of the classes, without copying ``x`` when it is an integer type."""
        if x.numel() == 0:
            return True
        if x.dtype == torch.bool:
            x = x.to(torch.uint8)
        low, high = (float(v) for v in torch.aminmax(x))  # NaN fails both comparisons
        if not (self.label_values[0] <= low and high <= self.label_values[-1]):
            return False
        if x.is_floating_point() and not torch.equal(x, torch.round(x)):
            return False
        if len(self._gaps) <= len(self.label_values):  # a pass per value skipped, each cheaper than isin's
            return not any(bool((x == gap).any()) for gap in self._gaps)
        return bool(torch.isin(x, torch.tensor(self.label_values, dtype=x.dtype)).all())

    def __call__(self, data: Mapping[Hashable, Any]) -> Mapping[Hashable, Any]:
        problems = []
        for key in self.key_iterator(data):
            volume = convert_to_tensor(data[key], track_meta=False)
            if not _finite(volume):
                problems.append((key, non_finite_message(volume.detach().cpu().numpy())))
        if self.label_key is not None and (self.label_key in data or not self.allow_missing_keys):
            label = convert_to_tensor(data[self.label_key], track_meta=False)
            if not self._labels_ok(label):
                messages, _ = label_messages(label.detach().cpu().numpy(), self.label_values, self.label_source)
                problems += [(self.label_key, message) for message in messages]
        if problems:
            sources = item_sources(data)
            fix = "correct the file or leave it out of the datalist"
            raise DataItemError("\n".join(
                f"{key} {sources.get(key, '(no file name)')}: {message}; {fix}" for key, message in problems
            ))  # fmt: skip
        return data
