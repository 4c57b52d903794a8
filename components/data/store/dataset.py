"""Reading a store: :func:`open_store` (refuses a store of other transforms, an unfinished or corrupt one) and
:class:`StoreDataset`, a MONAI ``Dataset`` over its volumes whose items hold lazy array handles
(:class:`~components.data.store.handle.StoredArray`) for the random transforms to crop from.

Example::

    store = open_store("store", fingerprint=transforms_fingerprint(bundle_transforms("swin_unetr_ssl_pretrain")))
    dataset = StoreDataset(store, transform=random_transforms, shard=True)   # this rank's volumes
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from monai.config import KeysCollection
from monai.data import Dataset, MetaTensor
from monai.transforms import MapTransform, apply_transform

from ..partition import partition_for_rank
from .format import FORMAT_VERSION, chunk_checksums
from .handle import StoredArray
from .index import HEADER, INDEX, PARTS, StoreError, read_json
from .volume import read_item

__all__ = ["ReadStoredd", "Store", "StoreDataset", "open_store"]


class Store:
    """An opened store: its ``root`` folder and ``index`` (``index.json``); ``entries`` (one per stored volume, in
    datalist order), ``skipped`` and ``failed`` (volumes the preprocessing could not store, with the reason)."""

    def __init__(self, root: str | os.PathLike, index: Mapping[str, Any]) -> None:
        self.root = Path(root)
        self.index = dict(index)

    @property
    def fingerprint(self) -> str:
        return self.index["fingerprint"]

    @property
    def entries(self) -> list[dict]:
        return self.index["entries"]

    @property
    def skipped(self) -> list[dict]:
        return self.index["skipped"]

    @property
    def failed(self) -> list[dict]:
        return self.index["failed"]

    def __len__(self) -> int:
        return len(self.entries)

    def item(self, index: int) -> dict:
        """The stored item of the ``index``-th volume: values, metadata and a lazy handle per array."""
        entry = self.entries[index]
        return read_item(self.root, entry["id"], _source(entry))

    def verify(self) -> None:
        """Reads every stored file whole and checks its size and every chunk's CRC-32 (minutes for a large store;
        a training run checks only the chunks it reads).

        Raises:
            StoreError: naming every corrupt file and its source volume.
        """
        bad = []
        for index in range(len(self)):
            for handle in self.item(index).values():
                reason = _file_problem(handle.path, handle.record) if isinstance(handle, StoredArray) else None
                if reason:
                    bad.append(f"{handle.path} (from {handle.source}): {reason}")
        if bad:
            raise StoreError(f"{self.root}: {len(bad)} corrupt file(s), rebuild them ({self.rebuild_command()}): "
                             + "; ".join(bad))  # fmt: skip

    def rebuild_command(self) -> str:
        """The command that rebuilds this store from its datalist with the transforms it is opened for."""
        command = self.index.get("command")
        if command:
            return f"{command} --overwrite true"
        return f"components.data.store.preprocess(..., out={str(self.root)!r}, overwrite=True) as it was written"


def _source(entry: Mapping) -> str | None:
    """The first source file of an index entry (what errors name)."""
    return next(iter(entry["sha256"]), None)


def _file_problem(path: Path, record: Mapping) -> str | None:
    """What is wrong with a stored file against its record, or None."""
    try:
        size = path.stat().st_size
    except OSError as err:
        return f"{type(err).__name__}: {err.strerror or err}"
    if size != record["nbytes"]:
        return f"{size} bytes, the index says {record['nbytes']} (truncated or replaced)"
    try:
        checksums = chunk_checksums(path)
    except Exception as err:  # noqa: BLE001 -- blosc2 refuses a damaged file with several error types
        return f"not a blosc2 array ({type(err).__name__}: {err})"
    wrong = [n for n, (got, want) in enumerate(zip(checksums, record["crc32"])) if got != want]
    if wrong or len(checksums) != len(record["crc32"]):
        return f"chunk(s) {wrong or 'count'} fail their CRC-32 check"
    return None


def _missing_parts(root: Path) -> str:
    """Which parts of an unfinished split run have written no shard yet, or "" when there is no split run."""
    found: dict[int, set[int]] = {}
    for path in (root / PARTS).glob("part-*-of-*.json"):
        match = re.fullmatch(r"part-(\d+)-of-(\d+)\.json", path.name)
        if match:
            found.setdefault(int(match.group(2)), set()).add(int(match.group(1)))
    return "; ".join(f"part(s) {sorted(set(range(n)) - done)} of {n} have not finished (run them with --part i "
                     f"--parts {n})" for n, done in sorted(found.items()))  # fmt: skip


def open_store(path: str | os.PathLike, fingerprint: str | None = None, rebuild: str | None = None) -> Store:
    """The store at ``path``, checked against the transforms it is read for.

    Args:
        path: the store folder (``preprocess --out``).
        fingerprint: :func:`~components.data.store.transforms_fingerprint` of the transforms the reader would run;
            None skips the comparison.
        rebuild: the command to name when the store is refused (default: the one recorded when it was written).

    Raises:
        StoreError: in one line, naming the store and how to rebuild or finish it: no index (not a store, or a
            split run not finished: the missing parts are named), another format version, another fingerprint.
    """
    root = Path(path)
    if not (root / INDEX).is_file():
        missing = _missing_parts(root) if (root / HEADER).is_file() else ""
        raise StoreError(f"{root}: no {INDEX}: " + (missing or "not a store, or its preprocessing has not finished "
                         "(run `python -m components preprocess --datalist LIST --out STORE`)"))  # fmt: skip
    store = Store(root, read_json(root / INDEX, "index"))
    command = rebuild or store.rebuild_command()
    if store.index.get("format_version") != FORMAT_VERSION:
        raise StoreError(f"{root} has store format {store.index.get('format_version')}, this version reads "
                         f"{FORMAT_VERSION}: rebuild it with `{command}`")  # fmt: skip
    if fingerprint is not None and store.fingerprint != fingerprint:
        raise StoreError(f"{root} was written by other deterministic transforms (fingerprint {store.fingerprint:.12}, "
                         f"these {fingerprint:.12}): rebuild it with `{command}`")  # fmt: skip
    return store


class StoreDataset(Dataset):
    """A MONAI ``Dataset`` over a store's volumes: item ``i`` is the stored dict of volume ``i`` (values, metadata,
    a :class:`~components.data.store.handle.StoredArray` per array) passed through ``transform`` (the random
    transforms, e.g. ``RandCompactSpatialCropSamplesd``, which read only the crops they cut).

    Args:
        store: an opened :class:`Store` (or its folder, opened without a fingerprint check).
        transform: applied to every item (MONAI's ``apply_transform``); None returns the stored dict.
        shard: only this rank's volumes (``partition_for_rank`` with ``seed``: equal shards, as the in-memory
            caches split a datalist).
        seed: the partition's seed.

    Picklable: it holds the store's folder and the volumes' ids and sources; files are opened by the worker that
    reads them. A volume that cannot be read raises :class:`~components.data.store.handle.StoreReadError` naming the
    store file and the source volume.
    """

    def __init__(self, store: Store | str | os.PathLike, transform: Callable | None = None, shard: bool = False,
                 seed: int = 0) -> None:  # fmt: skip
        store = store if isinstance(store, Store) else open_store(store)
        volumes = [(entry["id"], _source(entry)) for entry in store.entries]
        self.root = store.root
        super().__init__(partition_for_rank(volumes, seed=seed) if shard else volumes, transform)

    def _transform(self, index: int) -> Any:
        item = read_item(self.root, *self.data[index])
        return item if self.transform is None else apply_transform(self.transform, item)


class ReadStoredd(MapTransform):
    """Reads whole stored arrays: the :class:`~components.data.store.handle.StoredArray` under each key becomes the
    tensor it holds, a ``MetaTensor`` with its stored metadata (affine included) when it was one. For random
    transforms that need the whole volume (a finetuning pipeline's ``RandCropByPosNegLabeld``); the SSL recipe's
    ``RandCompactSpatialCropSamplesd`` reads its crops from the handle instead.

    Example:
        >>> dataset = StoreDataset(store, transform=Compose([ReadStoredd(["image", "label"]), *random_transforms]))
    """

    def __init__(self, keys: KeysCollection, allow_missing_keys: bool = False) -> None:
        super().__init__(keys, allow_missing_keys)

    def __call__(self, data: Mapping[Any, Any]) -> dict:
        d = dict(data)
        for key in self.key_iterator(d):
            handle = d[key]
            values = handle.read()
            d[key] = values if handle.meta is None else MetaTensor(values, meta=dict(handle.meta))
        return d
