"""One volume of a store: what the deterministic transforms made of a datalist entry, written as a folder of
arrays and an ``item.json`` (:func:`write_volume`), and read back as a dict with lazy array handles
(:func:`read_item`).

A transformed item is split three ways:

- arrays: every top-level tensor or numpy array with at least 2 dimensions (a channel-first image, label or
  compact array) becomes a ``<key>.b2nd`` file (:mod:`~components.data.store.format`); a MetaTensor's metadata
  goes to ``item.json`` with it (its trace of applied operations does not: training pipelines never invert);
- metadata: mappings under keys ending in ``_meta_dict`` (``LoadImaged(image_only=False)``) go to ``item.json``;
- values: everything else (the compact geometry, the foreground box) goes to the volume's index entry too, except
  the compact array's ``affine``, which goes with its array's record (``item.json`` only: the index stays small).

Each array's record in ``item.json`` holds its ``affine`` in the stored axis order (a MetaTensor's, or the compact
geometry's), and the index entry's ``spacing`` is that affine's. A single-channel integer label map also gets its
sampled foreground locations (:mod:`~components.data.store.foreground`), which its handle then carries.

Values and metadata are written with :func:`~components.data.store.values.encode_value`, so they come back as
the same types.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import torch

from ..compact_cache import COMPACT_SUFFIX
from .foreground import ClassLocations, label_and_image, locations_path, write_locations
from .format import ARRAY_SUFFIX, write_array
from .handle import StoredArray, StoreReadError
from .index import ITEM, VOLUMES, StoreError, commit_volume, read_json, source_key, source_records, write_json
from .values import decode_value, encode_value

__all__ = ["read_item", "source_files", "write_volume"]

META_SUFFIX = "_meta_dict"
LOCATION_KEYS = ("label", "image")
"""(label, image): whose foreground locations a volume keeps, and the image whose values they record."""
_INDEXED = ("file", "shape", "dtype", "stored_dtype", "nbytes")  # of an array's record (its CRCs: item.json only)
_SAFE_KEY = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")


def source_files(item: Mapping, keys: tuple[str, ...]) -> list[str]:
    """The files of ``keys`` in a datalist entry (a path or a list of paths per key), in order."""
    files = []
    for key in keys:
        value = item[key]
        files += [os.fspath(v) for v in (value if isinstance(value, (list, tuple)) else [value])]
    return files


def _affine(data: Mapping, key: str) -> np.ndarray | None:
    """The affine of the stored array ``data[key]`` in its own axis order: its MetaTensor's, or the compact
    geometry's (:class:`~components.data.compact_cache.CompactCropForegroundd`); None when it has none (a
    ``<key>_meta_dict``'s affine is the file's, in the file's axis order: not the stored array's)."""
    affine = getattr(data[key], "affine", None)
    geometry = data.get(f"{key}{COMPACT_SUFFIX}")
    if affine is None and isinstance(geometry, Mapping):
        affine = geometry.get("affine")
    if affine is None:
        return None
    return np.asarray(affine.detach().cpu() if isinstance(affine, torch.Tensor) else affine, dtype=np.float64)


def _spacing(affine: np.ndarray | None) -> list[float] | None:
    """Voxel spacing (affine column norms: the stored axes) or None."""
    return None if affine is None else [float(v) for v in np.linalg.norm(affine[:-1, :-1], axis=0)]


def split_item(data: Mapping, where: str) -> tuple[dict, dict, dict]:
    """(arrays, metadata, values) of a transformed item (see the module docstring); ``where`` names it in errors.

    Raises:
        ValueError: an array key that cannot be a file name, or a key that is not a string.
        TypeError: a value :func:`encode_value` cannot write.
    """
    arrays, meta, values = {}, {}, {}
    for key, value in data.items():
        if not isinstance(key, str):
            raise ValueError(f"{where}: key {key!r} is not a string; only string keys can be stored.")
        if isinstance(value, (torch.Tensor, np.ndarray)) and value.ndim >= 2:
            if not _SAFE_KEY.fullmatch(key):
                raise ValueError(f"{where}: array key {key!r} cannot name a file (letters, digits, _ . - only).")
            arrays[key] = value
        elif key.endswith(META_SUFFIX) and isinstance(value, Mapping):
            meta[key] = encode_value(value, f"{where} {key}")
        else:
            values[key] = encode_value(value, f"{where} {key}")
    for key in arrays:
        geometry = values.get(f"{key}{COMPACT_SUFFIX}")
        if isinstance(geometry, dict):
            geometry.pop("affine", None)  # with the array's record (item.json), not in the index
    return arrays, meta, values


def write_volume(data: Mapping, item: Mapping, keys: tuple[str, ...], root: Path, volume: str, position: int,
                 fingerprint: str, tag: str, source_root: str, patch_size: Sequence[int] | None = None,
                 floats: str = "exact", locations: Sequence[str] | None = LOCATION_KEYS) -> dict:  # fmt: skip
    """Writes the transformed ``data`` of datalist entry ``item`` (at ``position``) as ``root/volumes/<volume>/``
    and returns its index entry: ``id``, ``position``, ``key`` and ``files`` (the source files of ``keys`` under
    ``source_root``: :func:`~.index.source_key`, :func:`~.index.source_records`), ``arrays`` (shape, dtype, file of
    each), ``spacing`` (of the stored axes) and ``values``.

    ``patch_size`` and ``floats`` go to :func:`~.format.write_array`; ``locations`` = (label key, image key): the
    foreground locations of that label, when it is a single-channel integer label map (None: none).

    The files go to ``volumes/.<volume>.<tag>.tmp`` first (removed if a killed run left it), then the folder is
    renamed into place: a volume folder is always complete."""
    files = source_files(item, keys)
    where = files[0] if files else str(volume)
    arrays, meta, values = split_item(data, where)
    temporary = root / VOLUMES / f".{volume}.{tag}.tmp"
    shutil.rmtree(temporary, ignore_errors=True)
    temporary.mkdir(parents=True)
    records, array_meta, plain = {}, {}, {}
    for key, array in arrays.items():
        plain[key] = array.detach().cpu().numpy() if isinstance(array, torch.Tensor) else np.asarray(array)
        records[key] = write_array(plain[key], temporary / f"{key}{ARRAY_SUFFIX}", patch_size, floats)
        affine = _affine(data, key)
        if affine is not None:
            records[key]["affine"] = affine.tolist()
        if hasattr(array, "meta"):
            array_meta[key] = encode_value(dict(array.meta), f"{where} {key}.meta")
    sampled = {}
    pair = label_and_image(plain, locations)
    if pair is not None:
        label, image = pair
        sampled[label] = write_locations(plain[label], None if image is None else plain[image],
                                         locations_path(temporary, label), image)  # fmt: skip
    first_affine = next((records[k]["affine"] for k in arrays if "affine" in records[k]), None)
    entry = {
        "id": volume,
        "position": position,
        "key": source_key(files, source_root),
        "files": source_records(files, source_root),
        "arrays": {key: {f: record[f] for f in _INDEXED} for key, record in records.items()},
        "spacing": _spacing(None if first_affine is None else np.asarray(first_affine)),
        "values": values,
    }
    write_json(temporary / ITEM, {"fingerprint": fingerprint, "entry": entry, "arrays": records, "meta": meta,
                                  "array_meta": array_meta, "locations": sampled})  # fmt: skip
    commit_volume(temporary, root / VOLUMES / volume)
    return entry


def read_item(root: Path, volume: str, source: str | None = None) -> dict:
    """The stored item of ``volume`` (made from ``source``): its values and metadata decoded, a
    :class:`StoredArray` per array.

    Raises:
        StoreReadError: its ``item.json`` is missing or unreadable, naming the file and ``source``.
    """
    folder = Path(root) / VOLUMES / volume
    try:
        stored = read_json(folder / ITEM, "volume entry")
    except StoreError as err:
        raise StoreReadError(folder / ITEM, source, str(err).removeprefix(f"{folder / ITEM}: ")) from err
    if source is None:
        source = next((f["path"] for f in stored["entry"].get("files", ())), None)
    item = {key: decode_value(value) for key, value in stored["entry"]["values"].items()}
    item.update({key: decode_value(value) for key, value in stored["meta"].items()})
    sampled = stored.get("locations", {})
    for key, record in stored["arrays"].items():
        meta = stored["array_meta"].get(key)
        locations = None
        if key in sampled:
            table = StoredArray(folder / sampled[key]["record"]["file"], sampled[key]["record"], source)
            locations = ClassLocations(table, sampled[key])
        item[key] = StoredArray(folder / record["file"], record, source, None if meta is None else decode_value(meta),
                                locations)  # fmt: skip
        geometry = item.get(f"{key}{COMPACT_SUFFIX}")
        if isinstance(geometry, dict) and "affine" in record:
            geometry["affine"] = torch.tensor(record["affine"], dtype=torch.float64)
    return item
