"""Foreground locations of a stored label map: a bounded random sample of the voxels of each class, written once per
volume at preprocessing (as nnU-Net v2 stores its class locations), so that a label-centred crop from the store
draws its centre without reading the label map, and then reads only the chunks its crop covers.

Per class (each value of a single-channel integer-valued label map, background 0 included) at most
``max(SAMPLES, ceil(MIN_FRACTION * count))`` voxels are drawn without replacement (all of them for a smaller class),
with a fixed seed, so the same volume always gives the same file. Each sampled voxel is a row of one float32 table
(``<label>_locations.b2nd``): its spatial coordinates (exact below 2**24) and the largest value over the channels of
the image at that voxel, which lets a crop keep only background voxels above any ``image_threshold``, as MONAI's
``map_binary_to_indices`` does (``label == 0 & any(image > threshold)``). Rows are grouped by class; ``item.json``
records each class's voxel count and its rows.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .format import ARRAY_SUFFIX, storage_dtype, write_array

__all__ = ["LOCATIONS_SUFFIX", "ClassLocations", "label_and_image", "locations_path", "sample_locations",
           "write_locations"]  # fmt: skip

SAMPLES = 10_000
MIN_FRACTION = 0.01
SEED = 1234
LOCATIONS_SUFFIX = "_locations"
_ROWS_PER_CHUNK = 1024  # a drawn centre reads one chunk of rows


def sample_locations(label: np.ndarray, image: np.ndarray | None = None, samples: int = SAMPLES,
                     min_fraction: float = MIN_FRACTION, seed: int = SEED) -> tuple[np.ndarray, dict[str, dict]]:  # fmt: skip
    """The sampled voxels of each class of ``label`` (channel-first, one channel, integer values).

    Args:
        label: ``(1, *spatial)``.
        image: ``(C, *spatial)`` of the same spatial shape, whose largest value over the channels each row keeps;
            None: the rows keep 0.
        samples: voxels drawn per class (at least, for a class of more than ``samples / min_fraction`` voxels,
            ``min_fraction`` of them).
        seed: of the draws.

    Returns:
        ``(table, classes)``: a float32 ``(rows, ndim + 1)`` table (coordinates, then the image value), rows grouped
        by class in increasing class value and, within a class, in C order; ``classes`` maps each class value (as a
        string) to ``{"count": voxels, "start": first row, "stop": row after its last}``.

    Raises:
        ValueError: a label with more than one channel, values that are not integers, or an image of another
            spatial shape.
    """
    if label.ndim < 2 or label.shape[0] != 1:
        raise ValueError(f"foreground locations need a single-channel label map, got shape {list(label.shape)}.")
    if storage_dtype(np.asarray(label)).kind not in "iub":
        raise ValueError("foreground locations need a label map of integer values.")
    if image is not None and tuple(image.shape[1:]) != tuple(label.shape[1:]):
        raise ValueError(f"image shape {list(image.shape)} and label shape {list(label.shape)} differ in space.")
    spatial = label.shape[1:]
    flat = np.asarray(label).reshape(-1)
    values = flat.astype(np.int64, copy=False)
    low = int(values.min()) if values.size else 0
    counts = np.bincount(values - low) if values.size else np.zeros(0, np.int64)
    image_flat = None if image is None else np.asarray(image).reshape(image.shape[0], -1)
    rng = np.random.default_rng(seed)
    rows, classes, start = [], {}, 0
    for offset in np.flatnonzero(counts):
        count = int(counts[offset])
        voxels = np.flatnonzero(values == offset + low)
        keep = min(count, max(int(samples), math.ceil(min_fraction * count)))
        if keep < count:
            voxels = np.sort(voxels[rng.choice(count, keep, replace=False)])
        table = np.empty((keep, len(spatial) + 1), np.float32)
        table[:, :-1] = np.stack(np.unravel_index(voxels, spatial), axis=1)
        table[:, -1] = 0.0 if image_flat is None else image_flat[:, voxels].max(axis=0)
        rows.append(table)
        classes[str(int(offset + low))] = {"count": count, "start": start, "stop": start + keep}
        start += keep
    table = np.concatenate(rows) if rows else np.zeros((0, len(spatial) + 1), np.float32)
    return table, classes


def write_locations(label: np.ndarray, image: np.ndarray | None, path: str | os.PathLike,
                    image_key: str | None) -> dict:  # fmt: skip
    """Samples the locations of ``label`` (:func:`sample_locations`), writes the table to ``path`` and returns what
    ``item.json`` records of them: ``record`` (the table's array record), ``classes``, ``spatial_shape``,
    ``image_key`` (whose values the rows keep, or None), ``samples``, ``min_fraction`` and ``seed``."""
    table, classes = sample_locations(label, image)
    record = write_array(table, path, chunks=(_ROWS_PER_CHUNK, table.shape[1]))
    return {"record": record, "classes": classes, "spatial_shape": list(label.shape[1:]), "image_key": image_key,
            "samples": SAMPLES, "min_fraction": MIN_FRACTION, "seed": SEED}  # fmt: skip


class ClassLocations:
    """The stored foreground locations of one label map (what :func:`write_locations` recorded), read a row at a
    time: a drawn centre decompresses one chunk of rows.

    Args:
        table: the lazy handle (:class:`~components.data.store.handle.StoredArray`) on the rows.
        recorded: :func:`write_locations`'s dict.

    Attributes:
        counts: voxels per class value (int), background 0 included.
        image_key: the image whose largest channel value each row keeps, or None.
    """

    def __init__(self, table: Any, recorded: Mapping[str, Any]) -> None:
        self.table = table
        self.spatial_shape = tuple(int(n) for n in recorded["spatial_shape"])
        self.image_key = recorded.get("image_key")
        self.rows = {int(c): (int(v["start"]), int(v["stop"])) for c, v in recorded["classes"].items()}
        self.counts = {int(c): int(v["count"]) for c, v in recorded["classes"].items()}

    def __repr__(self) -> str:
        return f"ClassLocations({self.table!r}, counts={self.counts})"

    def foreground(self) -> int:
        """Voxels of every class but 0."""
        return sum(n for c, n in self.counts.items() if c != 0)

    def row(self, number: int) -> tuple[tuple[int, ...], float]:
        """(voxel coordinates, image value) of row ``number``."""
        values = np.asarray(self.table[number : number + 1])[0]
        return tuple(int(v) for v in values[:-1]), float(values[-1])

    def rows_of(self, value: int) -> np.ndarray:
        """All rows of class ``value`` (reads every chunk they span)."""
        start, stop = self.rows.get(int(value), (0, 0))
        return np.asarray(self.table[start:stop])

    def draw_foreground(self, state: np.random.RandomState) -> tuple[int, ...]:
        """A voxel drawn uniformly from all voxels of the classes but 0: a class with probability in proportion to
        its voxel count, then one of its sampled voxels uniformly.

        Raises:
            ValueError: no foreground voxel.
        """
        classes = [c for c in sorted(self.counts) if c != 0]
        total = sum(self.counts[c] for c in classes)
        if total == 0:
            raise ValueError("no foreground voxel to draw.")
        pick = state.randint(total)
        for value in classes:
            if pick < self.counts[value]:
                break
            pick -= self.counts[value]
        start, stop = self.rows[value]
        return self.row(start + state.randint(stop - start))[0]

    def background_rows(self, threshold: float | None) -> np.ndarray:
        """Coordinates (int64 rows) of the sampled background voxels whose image value exceeds ``threshold`` (all
        of them for None)."""
        rows = self.rows_of(0)
        if threshold is not None:
            rows = rows[rows[:, -1] > threshold]
        return rows[:, :-1].astype(np.int64)

    def draw_background(self, state: np.random.RandomState, threshold: float | None,
                        tries: int = 32) -> tuple[int, ...] | None:  # fmt: skip
        """A background voxel drawn uniformly from those sampled whose image value exceeds ``threshold`` (rows drawn
        until one does, then from all of them at once after ``tries``); None when none does."""
        start, stop = self.rows.get(0, (0, 0))
        if stop == start:
            return None
        for _ in range(tries):
            coordinates, value = self.row(start + state.randint(stop - start))
            if threshold is None or value > threshold:
                return coordinates
        rows = self.background_rows(threshold)
        return None if len(rows) == 0 else tuple(int(v) for v in rows[state.randint(len(rows))])


def locations_path(folder: Path, key: str) -> Path:
    """The table file of the locations of array ``key`` in a volume folder."""
    return Path(folder) / f"{key}{LOCATIONS_SUFFIX}{ARRAY_SUFFIX}"


def label_and_image(arrays: Mapping[str, Any], keys: Sequence[str] | None) -> tuple[str, str | None] | None:
    """(label key, image key or None) of ``keys`` = (label, image) when ``arrays`` holds a single-channel
    integer-valued label under the first; None otherwise (nothing to sample)."""
    if not keys or keys[0] not in arrays:
        return None
    label = arrays[keys[0]]
    if label.ndim < 2 or label.shape[0] != 1 or storage_dtype(np.asarray(label)).kind not in "iub":
        return None
    image = keys[1] if len(keys) > 1 and keys[1] in arrays else None
    if image is not None and tuple(arrays[image].shape[1:]) != tuple(label.shape[1:]):
        image = None
    return keys[0], image
