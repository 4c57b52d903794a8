"""Reading a store: :func:`open_store` (refuses a store of other transforms, an unfinished or corrupt one) and
:class:`StoreDataset`, a MONAI ``Dataset`` over its volumes whose items hold lazy array handles
(:class:`~components.data.store.handle.StoredArray`) for the random transforms to crop from.

Example::

    store = open_store("store", fingerprint=transforms_fingerprint(bundle_transforms("swin_unetr_ssl_pretrain")))
    dataset = StoreDataset(store, transform=random_transforms, shard=True)   # this rank's volumes
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from monai.config import KeysCollection
from monai.data import Dataset, MetaTensor
from monai.transforms import MapTransform, apply_transform

from ...config.running import running_bundle
from ...distributed import get_world_size
from ..partition import check_shard_sizes, partition_for_rank
from .format import FORMAT_VERSION, chunk_checksums, frame_problem
from .handle import StoredArray, StoreReadError
from .index import HEADER, INDEX, PARTS, StoreError, read_json, transforms_fingerprint
from .packages import version_changes
from .read_errors import ReadErrors
from .volume import read_item

__all__ = ["ON_READ_ERROR", "ReadStoredd", "Store", "StoreDataset", "open_store", "run_fingerprint", "training_store"]

logger = logging.getLogger("components.data")  # one logger name for the whole package, as the logs show it

#: what a training run does with a stored volume it cannot read: stop, or skip it (logged and counted).
ON_READ_ERROR: tuple[str, ...] = ("stop", "skip")


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
            raise StoreError(f"{self.root}: {len(bad)} corrupt file(s); remove their volume folders and run "
                             f"`{self.rebuild_command()}`, which writes them again: " + "; ".join(bad))  # fmt: skip

    def rebuild_command(self) -> str:
        """The command that rebuilds this store from its datalist with the transforms it is opened for."""
        command = self.index.get("command")
        if command:
            return f"{command} --overwrite true"
        return f"components.data.store.preprocess(..., out={str(self.root)!r}, overwrite=True) as it was written"


def _source(entry: Mapping) -> str | None:
    """The first source file of an index entry (what errors name)."""
    return next(iter(entry["sha256"]), None)


def _first_file(entry: Mapping, key: str = "image") -> str:
    """The first file of an entry's ``key`` (a path or a list of paths), absolute, as the store records its sources."""
    value = entry[key]
    first = value[0] if isinstance(value, (list, tuple)) else value
    return os.path.abspath(os.fspath(first))


def _file_problem(path: Path, record: Mapping) -> str | None:
    """What is wrong with a stored file against its record, or None."""
    try:
        size = path.stat().st_size
    except OSError as err:
        return f"{type(err).__name__}: {err.strerror or err}"
    if size != record["nbytes"]:
        return f"{size} bytes, the index says {record['nbytes']} (truncated or replaced)"
    problem = frame_problem(path, record)
    if problem:
        return problem
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
            split run not finished: the missing parts are named), another format version, another fingerprint (the
            packages whose versions changed are named).
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
        changes = version_changes(store.index.get("packages"))
        what = f"with other package versions ({changes})" if changes else "by other deterministic transforms"
        raise StoreError(f"{root} was written {what} (fingerprint {store.fingerprint:.12}, these {fingerprint:.12}): "
                         f"rebuild it with `{command}`")  # fmt: skip
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
        on_read_error: ``"stop"``: a volume that cannot be read raises
            :class:`~components.data.store.handle.StoreReadError` naming the store file and the source volume;
            ``"skip"``: the next volume of the shard takes its place (a batch keeps its size; all volumes
            unreadable still raises), the skip is counted in :attr:`skipped_reads` and the volume's first failure
            is logged at WARNING, naming it and the error. ``components.SkippedReads`` tells the counts once per
            epoch, summed over ranks, and caps them.

    It holds the store's folder, the volumes' ids and sources and the skip counts (in memory shared with the
    loader's workers, :class:`~components.data.store.read_errors.ReadErrors`); files are opened by the worker that
    reads them. It is handed to spawned workers as they start, and shared with forked ones.
    """

    def __init__(self, store: Store | str | os.PathLike, transform: Callable | None = None, shard: bool = False,
                 seed: int = 0, on_read_error: str = "stop") -> None:  # fmt: skip
        if on_read_error not in ON_READ_ERROR:
            raise ValueError(f"on_read_error must be one of {ON_READ_ERROR}, got {on_read_error!r}.")
        store = store if isinstance(store, Store) else open_store(store)
        volumes = [(entry["id"], _source(entry)) for entry in store.entries]
        self.root = store.root
        self.rebuild_command = store.rebuild_command()
        self.on_read_error = on_read_error
        super().__init__(partition_for_rank(volumes, seed=seed) if shard else volumes, transform)
        self._errors = ReadErrors(len(self.data))

    @property
    def skipped_reads(self) -> int:
        """The reads this dataset skipped (``on_read_error`` "skip"), in this process and its loader workers."""
        return self._errors.reads

    def unreadable_volumes(self) -> list[str]:
        """The source of every volume of this dataset that failed to read at least once (in this process or its loader
        workers), in the dataset's order."""
        return [str(self.data[index][1]) for index in self._errors.volumes()]

    def _read(self, index: int) -> Any:
        item = read_item(self.root, *self.data[index])
        return item if self.transform is None else apply_transform(self.transform, item)

    def _transform(self, index: int) -> Any:
        for attempt in range(len(self.data)):
            volume = (index + attempt) % len(self.data)
            try:
                return self._read(volume)
            except Exception as err:  # the transforms wrap a read error raised inside them
                read_error = _read_error(err)
                if self.on_read_error == "stop" or read_error is None:
                    raise
                if self._errors.record(volume):
                    logger.warning("loader#on_read_error skip: a stored volume cannot be read, another takes its place "
                                   "whenever it is drawn (said once; the epoch's line counts every skip): %s",
                                   read_error)  # fmt: skip
        raise StoreError(f"{self.root}: none of the {len(self.data)} volumes of this shard could be read.")


def _read_error(err: BaseException | None) -> StoreReadError | None:
    """The :class:`StoreReadError` in ``err``'s chain of causes, if any."""
    while err is not None and not isinstance(err, StoreReadError):
        err = err.__cause__
    return err


def _run_parser() -> Any:
    """The running bundle's config (its files with its overrides) as a ``ConfigParser``, or None outside a run."""
    from monai.bundle import ConfigParser

    bundle = running_bundle()
    if bundle is None:
        return None
    parser = ConfigParser()
    parser.read_config([str(f) for f in bundle.config_files])
    parser.update(dict(bundle.overrides))
    return parser


def run_fingerprint() -> str | None:
    """The fingerprint of the deterministic transforms of the bundle run that is starting
    (:func:`~components.config.running.running_bundle`: its config files with its overrides), which a store must
    have been written with; None outside a bundle run (a bare ``ConfigParser``), where nothing can be compared."""
    from .transforms import bundle_transforms

    parser = _run_parser()
    return None if parser is None else transforms_fingerprint(bundle_transforms(parser))


def _rebuild_for_run(store: str | os.PathLike, datalist: str) -> str | None:
    """The preprocess command that writes ``store`` for the running bundle: its folder, and the overrides of the ids its
    deterministic transforms reference; None outside a bundle run."""
    from .transforms import TRANSFORMS_ID

    bundle = running_bundle()
    if bundle is None:
        return None
    raw = json.dumps(_run_parser()[TRANSFORMS_ID])
    used = {k: v for k, v in bundle.overrides.items() if f"@{k}" in raw}
    overrides = f" --overrides '{json.dumps(used)}'" if used else ""
    return (f"python -m components preprocess --datalist {datalist} --out {store} --bundle {bundle.folder}"
            f"{overrides} --overwrite true")


def training_store(
    store: str | os.PathLike,
    data: Sequence[Mapping],
    transform: Callable,
    shard: bool = True,
    seed: int = 0,
    on_read_error: str = "stop",
    batch_size: int = 1,
    fingerprint: str | None = None,
    source: str = "<items>",
) -> StoreDataset:
    """The training dataset of ``loader#cache`` "disk": this rank's volumes of the store at ``store``, checked
    against the run before anything is read.

    The store must answer the run's deterministic transforms (``fingerprint``, default :func:`run_fingerprint`; a
    WARNING says when none can be computed) and hold the volumes of ``data`` (the run's datalist: every stored
    volume is one of its entries, and stored + skipped + failed count them all). Volumes the preprocessing skipped or
    failed are named in a WARNING, never left out silently. With ``shard``, every rank must get one full batch of
    ``batch_size`` from the stored volumes.

    Raises:
        StoreError: one line naming the store and the command that rebuilds it.
        ValueError: too few stored volumes for the ranks (:func:`~components.data.partition.check_shard_sizes`).
    """
    fingerprint = run_fingerprint() if fingerprint is None else fingerprint
    if fingerprint is None:
        logger.warning("loader#store %s: the transforms it was written with are not compared (no bundle run to read "
                       "them from)", store)  # fmt: skip
    opened = open_store(store, fingerprint=fingerprint, rebuild=_rebuild_for_run(store, source))
    files = {_first_file(entry) for entry in data}
    foreign = [_source(e) for e in opened.entries if _source(e) not in files]
    counted = len(opened.entries) + len(opened.skipped) + len(opened.failed)
    if foreign or counted != len(data):
        raise StoreError(
            f"{opened.root} holds {counted} volume(s) of another datalist than {source} ({len(data)} entries"
            + (f"; e.g. {foreign[0]} is none of them" if foreign else "") + f"): rebuild it with "
            f"`{opened.rebuild_command()}` from this datalist"
        )
    for kind, volumes in (("skipped by the data check", opened.skipped), ("failed", opened.failed)):
        if volumes:
            logger.warning("loader#store %s: %d volume(s) %s at preprocessing are not trained on: %s", opened.root,
                           len(volumes), kind, "; ".join(f"{v['source']} ({v['reason']})" for v in volumes))  # fmt: skip
    if shard:
        check_shard_sizes(len(opened), get_world_size(), batch_size, "disk", list_name="stored", source=opened.root)
    return StoreDataset(opened, transform, shard=shard, seed=seed, on_read_error=on_read_error)


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
