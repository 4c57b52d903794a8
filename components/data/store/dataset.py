"""Reading a store: :func:`open_store` (refuses a store of other transforms, an unfinished or corrupt one),
:class:`StoreDataset`, a MONAI ``Dataset`` over its volumes whose items hold lazy array handles
(:class:`~components.data.store.handle.StoredArray`) for the random transforms to crop from, and
:func:`training_store`, a training run's dataset: the volumes its datalist names, this rank's shard of them.

The datalist decides, the store serves: a run trains on the volumes of its datalist, any subset of the store's,
found by their source files under the store's source root (or ``source_root``, where the sources are now), and
checked against those files (size and modification time, or content) before anything is read.

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

import ignite.distributed as idist
import numpy as np
from monai.config import KeysCollection
from monai.data import Dataset, MetaTensor
from monai.transforms import MapTransform, apply_transform

from ...config.running import running_bundle
from ...errors import ConfigError
from ..partition import check_shard_sizes, shard_indices
from .format import FORMAT_VERSION, chunk_checksums, frame_problem
from .handle import StoredArray, StoreReadError
from .index import HEADER, INDEX, INDEX_LAYOUT, PARTS, StoreError, find_rows, key_hashes, read_entries, read_json
from .index import resolve_source, source_change, source_key, transforms_fingerprint
from .packages import version_changes
from .read_errors import ReadErrors
from .transforms import loaded_keys
from .volume import read_item, source_files

__all__ = [
    "ON_READ_ERROR",
    "SOURCE_CHECKS",
    "ReadStoredd",
    "Store",
    "StoreDataset",
    "open_store",
    "run_fingerprint",
    "training_store",
]

logger = logging.getLogger("components.data")  # one logger name for the whole package, as the logs show it

#: what a training run does with a stored volume it cannot read: stop, or skip it (logged and counted).
ON_READ_ERROR: tuple[str, ...] = ("stop", "skip")
#: how a training run checks that its volumes' sources are those the store was written from: their size and
#: modification time, their size and content (SHA-256: reads every source of the rank's shard), or not at all.
SOURCE_CHECKS: tuple[str, ...] = ("stat", "sha256", "off")
_BLOCK = 4096  # entries read at once where many are gone through
_SERVED = ("id", "key", "files")  # what a dataset needs of an entry: its folder, and its sources to name and check


class Store:
    """An opened store: its ``root`` folder and ``index`` (the header ``index.json``: ``count`` stored volumes,
    ``source_root``, ``skipped`` and ``failed``: the volumes the preprocessing could not store, with the reason).
    The entries stay on disk: :meth:`read` reads those of some rows, :meth:`find` the rows of some keys."""

    def __init__(self, root: str | os.PathLike, index: Mapping[str, Any]) -> None:
        self.root = Path(root)
        self.index = dict(index)

    @property
    def fingerprint(self) -> str:
        return self.index["fingerprint"]

    @property
    def source_root(self) -> str:
        """The folder the sources were under when they were stored."""
        return self.index["source_root"]

    @property
    def skipped(self) -> list[dict]:
        return self.index["skipped"]

    @property
    def failed(self) -> list[dict]:
        return self.index["failed"]

    @property
    def entries(self) -> list[dict]:
        """Every entry, in datalist order: the whole index read into memory (for a tool or a small store; a training
        rank reads only its rows)."""
        return self.read(np.arange(len(self)))

    def __len__(self) -> int:
        return int(self.index["count"])

    def read(self, rows: Sequence[int] | np.ndarray, fields: Sequence[str] | None = None) -> list[dict]:
        """The entries at ``rows``, whole or only their ``fields`` (:func:`~.index.read_entries`)."""
        return read_entries(self.root, rows, fields)

    def volumes(self, rows: np.ndarray) -> list[tuple[str, str | None]]:
        """The (id, first source) of the volumes at ``rows``, read a block of entries at a time: what a dataset
        serving them holds."""
        volumes = []
        for start in range(0, len(rows), _BLOCK):
            volumes += [(e["id"], self.source(e)) for e in self.read(rows[start : start + _BLOCK], _SERVED)]
        return volumes

    def find(self, hashes: np.ndarray) -> np.ndarray:
        """The row of the entry of each key hash (:func:`~.index.key_hashes`), -1 where the store has none."""
        return find_rows(self.root, hashes)

    def source(self, entry: Mapping, root: str | os.PathLike | None = None) -> str | None:
        """The first source file of ``entry`` under ``root`` (default: :attr:`source_root`): what errors name."""
        files = entry["files"]
        return resolve_source(files[0]["path"], root or self.source_root) if files else None

    def item(self, index: int) -> dict:
        """The stored item of the ``index``-th volume: values, metadata and a lazy handle per array."""
        entry = self.read([index])[0]
        return read_item(self.root, entry["id"], self.source(entry))

    def verify(self) -> None:
        """Reads every stored file whole and checks its size and every chunk's CRC-32 (minutes for a large store;
        a training run checks only the chunks it reads).

        Raises:
            StoreError: naming every corrupt file and its source volume.
        """
        bad = []
        for start in range(0, len(self), _BLOCK):
            for entry in self.read(np.arange(start, min(start + _BLOCK, len(self)))):
                for handle in read_item(self.root, entry["id"], self.source(entry)).values():
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
    """The store at ``path``, checked against the transforms it is read for. Reads ``index.json`` only (the
    header, not the entries).

    Args:
        path: the store folder (``preprocess --out``).
        fingerprint: :func:`~components.data.store.transforms_fingerprint` of the transforms the reader would run;
            None skips the comparison.
        rebuild: the command to name when the store is refused (default: the one recorded when it was written).

    Raises:
        StoreError: in one line, naming the store and how to rebuild or finish it: no index (not a store, or a
            split run not finished: the missing parts are named), another format version, the index layout of
            0.4.0 (rewritten by the same preprocessing command, which keeps the stored volumes), another fingerprint
            (the packages whose versions changed are named).
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
    if store.index.get("index_layout") != INDEX_LAYOUT:
        raise StoreError(f"{root} has the index of 0.4.0 (one {INDEX} that every rank loads whole): rewrite it "
                         f"with `{command}`, which keeps the stored volumes and writes the index this version "
                         "reads")  # fmt: skip
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
        shard: only this rank's volumes (:func:`~components.data.partition.shard_indices` with ``seed``: equal
            shards, as the in-memory caches split a datalist); only their entries are read from the index.
        seed: the partition's seed.
        on_read_error: ``"stop"``: a volume that cannot be read raises
            :class:`~components.data.store.handle.StoreReadError` naming the store file and the source volume;
            ``"skip"``: the next volume of the shard takes its place (a batch keeps its size; all volumes
            unreadable still raises), the skip is counted in :attr:`skipped_reads` and the volume's first failure
            is logged at WARNING, naming it and the error. ``components.SkippedReads`` tells the counts once per
            epoch, summed over ranks, and caps them.
        volumes: the (id, source file) of the volumes to serve, in order (:func:`training_store` passes a rank's
            shard of its datalist); default: every stored volume, or this rank's shard of them with ``shard``.

    It holds the store's folder, the volumes' ids and sources and the skip counts (in memory shared with the
    loader's workers, :class:`~components.data.store.read_errors.ReadErrors`); files are opened by the worker that
    reads them. It is handed to spawned workers as they start, and shared with forked ones.
    """

    def __init__(self, store: Store | str | os.PathLike, transform: Callable | None = None, shard: bool = False,
                 seed: int = 0, on_read_error: str = "stop",
                 volumes: Sequence[tuple[str, str | None]] | None = None) -> None:  # fmt: skip
        if on_read_error not in ON_READ_ERROR:
            raise ValueError(f"on_read_error must be one of {ON_READ_ERROR}, got {on_read_error!r}.")
        store = store if isinstance(store, Store) else open_store(store)
        if volumes is None:
            rows = np.arange(len(store))
            volumes = store.volumes(rows[shard_indices(len(rows), seed)] if shard else rows)
        self.root = store.root
        self.rebuild_command = store.rebuild_command()
        self.on_read_error = on_read_error
        super().__init__(list(volumes), transform)
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
    parser.resolve_macro_and_relative_ids()
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


def _datalist_keys(data: Sequence[Mapping], keys: tuple[str, ...], root: str, source: str) -> np.ndarray:
    """The key hash of every entry of ``data`` (its files of ``keys`` under ``root``), one pass, no key kept.

    Raises:
        StoreError: an entry without one of ``keys``, naming it.
    """

    def each():
        for position, item in enumerate(data):
            try:
                yield source_key(source_files(item, keys), root)
            except (KeyError, TypeError) as err:
                raise StoreError(f"{source}: entry {position} has no {err} file, which the store's transforms "
                                 f"read (keys {list(keys)})") from None  # fmt: skip

    return key_hashes(each())


def _moved_to(store: Store, files: list[str]) -> str | None:
    """The folder under which ``files`` (a datalist entry's) are the sources of a stored volume, searched among
    their folder's parents: where the store's sources are now, when they moved; None if under none."""
    folder = os.path.dirname(os.path.abspath(files[0]))
    while True:
        if store.find(key_hashes([source_key(files, folder)]))[0] >= 0:
            return folder
        parent = os.path.dirname(folder)
        if parent == folder:
            return None
        folder = parent


def _missing(store: Store, data: Sequence[Mapping], absent: np.ndarray, keys: tuple[str, ...], root: str,
             source: str, command: str) -> StoreError:  # fmt: skip
    """The refusal of a datalist naming volumes the store lacks: which, how many, and the fix."""
    files = source_files(data[int(absent[0])], keys)
    text = (f"{store.root} has no volume for {len(absent)} of the {len(data)} entries of {source} (e.g. entry "
            f"{int(absent[0])}, {files[0]}), looking under the source root {root}")  # fmt: skip
    moved = _moved_to(store, files)
    if moved is not None:
        return StoreError(f"{text}: the store's sources are these files under {moved}: set loader#source_root "
                          f"{moved} (the store was written from {store.source_root})")  # fmt: skip
    return StoreError(f"{text}: write them into the store with `{command}` (the volumes already there are kept)")


def _changed(entries: Sequence[Mapping], root: str, check: str, seen: set[str]) -> list[str]:
    """One line per volume of ``entries`` (but those ``seen`` before, which it adds to) whose sources under ``root``
    changed since they were stored (``check``: :data:`SOURCE_CHECKS`), naming the volume, the file and what
    changed."""
    if check == "off":
        return []
    changed = []
    for entry in entries:
        if entry["id"] in seen:
            continue
        seen.add(entry["id"])
        for record in entry["files"]:
            path = resolve_source(record["path"], root)
            change = source_change(record, path, content=check == "sha256")
            if change:
                changed.append(f"volume {entry['id']}: {path}: {change}")
                break
    return changed


def _refuse_changed(store: Store, changed: list[str], volumes: int, check: str) -> None:
    """Stops every rank when any rank found changed sources (one collective), naming them where they were found."""
    anywhere = bool(changed)
    if idist.get_world_size() > 1:
        anywhere = int(idist.all_reduce(int(anywhere))) > 0
    if not anywhere:
        return
    fix = (f"rewrite them with `{store.rebuild_command()}` (it writes the changed volumes only), or train on the "
           "store as it is with loader#source_check off")  # fmt: skip
    if not changed:
        raise StoreError(f"{store.root}: another rank found volumes stored from sources that changed since (named in "
                         f"its log): {fix}")  # fmt: skip
    copied = "; a copy without its files' times looks modified: loader#source_check sha256 compares their content"
    raise StoreError(f"{store.root}: {len(changed)} of this rank's {volumes} volume(s) were stored from sources that "
                     f"changed since, e.g. {changed[0]}: {fix}" + (copied if check == "stat" else ""))  # fmt: skip


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
    source_root: str | os.PathLike | None = None,
    source_check: str = "stat",
) -> StoreDataset:
    """The training dataset of ``loader#cache`` "disk": this rank's share of the volumes of ``data`` (the run's
    datalist) from the store at ``store``, checked against the run before anything is read.

    - The store must answer the run's deterministic transforms (``fingerprint``, default :func:`run_fingerprint`; a
      WARNING says when none can be computed).
    - The datalist decides: each entry is found in the store by its source files under ``source_root`` (default:
      the store's own), so the datalist may name any subset of the store's volumes, and a store whose sources moved
      is read with their new root. An entry the store has no volume for stops the run, naming it and the fix (the
      root the store's sources are under now, when they are found there). Entries the preprocessing skipped or
      failed are named in a WARNING and left out.
    - Only this rank's entries are read from the index, and their sources checked (``source_check``: size and
      modification time, "sha256": size and content, "off"); a changed source stops every rank, naming the volume.
    - With ``shard``, every rank must get one full batch of ``batch_size``.

    Raises:
        StoreError: one line naming the store, the volume and the command or setting that fixes it.
        ConfigError: an unknown ``source_check``; too few volumes for the ranks
            (:func:`~components.data.partition.check_shard_sizes`).
    """
    if source_check not in SOURCE_CHECKS:
        raise ConfigError(f"loader#source_check must be one of {SOURCE_CHECKS}, got {source_check!r}.")
    fingerprint = run_fingerprint() if fingerprint is None else fingerprint
    if fingerprint is None:
        logger.warning("loader#store %s: the transforms it was written with are not compared (no bundle run to read "
                       "them from)", store)  # fmt: skip
    rebuild = _rebuild_for_run(store, source)
    opened = open_store(store, fingerprint=fingerprint, rebuild=rebuild)
    root = os.path.abspath(os.fspath(source_root)) if source_root else opened.source_root
    keys = loaded_keys(opened.index["transforms"])
    rows = opened.find(_datalist_keys(data, keys, root, source))
    absent = np.flatnonzero(rows < 0)
    if len(absent):
        left_out = opened.skipped + opened.failed
        reasons = dict(zip(key_hashes(v["key"] for v in left_out).tolist(), left_out))
        named = [reasons.get(h) for h in _datalist_keys([data[i] for i in absent], keys, root, source).tolist()]
        missing = absent[[v is None for v in named]]
        if len(missing):
            write = rebuild or f"components.data.store.preprocess(<this datalist>, out={str(opened.root)!r})"
            raise _missing(opened, data, missing, keys, root, source, write)
        logger.warning("loader#store %s: %d volume(s) of %s skipped or failed at preprocessing are not trained on: "
                       "%s", opened.root, len(named), source,
                       "; ".join(f"{v['source']} ({v['reason']})" for v in named))  # fmt: skip
    positions = np.flatnonzero(rows >= 0)
    if shard:
        check_shard_sizes(len(positions), idist.get_world_size(), batch_size, "disk", list_name="stored", source=opened.root)
        positions = positions[shard_indices(len(positions), seed)]
    volumes, changed, seen = [], [], set()
    for start in range(0, len(positions), _BLOCK):  # a block of entries at a time: the rank keeps (id, source)
        block = positions[start : start + _BLOCK]
        entries = opened.read(rows[block], _SERVED)
        for position, entry in zip(block.tolist(), entries):  # a hash shared by two keys would pair other files
            if entry["key"] != source_key(source_files(data[position], keys), root):
                raise StoreError(f"{opened.root}: entry {position} of {source} and stored volume {entry['id']} share "
                                 "a key hash; rebuild the store into a new folder")  # fmt: skip
            volumes.append((entry["id"], opened.source(entry, root)))
        changed += _changed(entries, root, source_check, seen)
    _refuse_changed(opened, changed, len(volumes), source_check)
    return StoreDataset(opened, transform, on_read_error=on_read_error, volumes=volumes)


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
