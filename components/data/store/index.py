"""What a store holds and where: its folder layout, the fingerprint of the transforms that wrote it, where its
sources are (a root and paths under it), and the index: the part shards that parts of a run write and their merge
into columns that a reader opens without loading them.

Layout of a store folder::

    store.json                    what wrote it: format version, fingerprint, transforms, datalist, source root, command
    volumes/<id>/<key>.b2nd       one file per stored array of a volume (components.data.store.format)
    volumes/<id>/item.json        the volume's entry, its arrays' records and its metadata
    parts/part-<i>-of-<n>.jsonl   the entries part i of n wrote, one JSON line each, in datalist order
    parts/part-<i>-of-<n>.json    that part's skipped and failed volumes and its count (written after its entries)
    index/entries.jsonl           the entries of all parts, one line each, in datalist order
    index/offsets.npy             where each line starts (uint64; one more than the entries: the file's end)
    index/keys.npy, rows.npy      the entries' source keys hashed (uint64, ascending) and the row of each
    index.json                    the header, the counts, the skipped and failed volumes; written last: what a
                                  reader opens

A reader memory-maps the columns: finding the rows of a datalist's volumes reads pages of ``keys.npy`` and
``rows.npy``, and reading a rank's shard reads only its lines of ``entries.jsonl``, so what a rank holds of the index
grows with its shard, not with the corpus.

Sources are recorded relative to the store's source root (``preprocess --source_root``, by default the datalist's
folder when it holds them all): an entry's ``key`` is the paths of its source files under the root, and its
``files`` keep each one's path, size, modification time and SHA-256. A store whose sources moved is read with
another root (``loader#source_root``) and a changed source is found by its size and time, or by its content.

A volume's folder appears whole or not at all: its files are written into ``volumes/.<id>.part<i>.tmp`` and the
folder is renamed into place (:func:`commit_volume`). ``<id>`` is the image's file name and a hash of its
datalist entry, so the same volume gets the same folder whichever part, machine or run writes it, and the index
is the same for one run and for n parts (it holds no timings, no part numbers).
"""

from __future__ import annotations

import hashlib
import heapq
import json
import os
import re
import shutil
from array import array
from collections.abc import Iterable, Iterator, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

from ...errors import UserError
from ...files import atomic_write, fsync_dir, sha256_file
from .format import FORMAT_VERSION
from .packages import package_versions

__all__ = ["StoreError", "transforms_fingerprint"]

HEADER, INDEX, VOLUMES, PARTS, ITEM = "store.json", "index.json", "volumes", "parts", "item.json"
COLUMNS, ENTRIES, OFFSETS, KEYS, ROWS = "index", "entries.jsonl", "offsets.npy", "keys.npy", "rows.npy"

INDEX_LAYOUT = 2
"""The index's layout: 2, the columns above (0.4.0 wrote layout 1, one ``index.json`` holding every entry)."""


class StoreError(UserError, ValueError):
    """A store that cannot be used as it is: written by other transforms or another format version, not
    finished, or not a store; the message says how to rebuild or finish it."""


def transforms_fingerprint(transforms: Sequence[Mapping], packages: Mapping[str, str] | None = None) -> str:
    """The sha256 of the deterministic transforms' configs (``_target_`` and resolved arguments, in order), the
    store's :data:`~.format.FORMAT_VERSION` and the versions of the packages that compute the stored values
    (``packages``, default :func:`~.packages.package_versions`: MONAI, nibabel, numpy, torch): a store answers one
    fingerprint.

    Example:
        >>> transforms_fingerprint([{"_target_": "LoadImaged", "keys": ["image"]}])[:12]
        '...'
    """
    versions = package_versions() if packages is None else dict(packages)
    text = json.dumps({"format_version": FORMAT_VERSION, "transforms": list(transforms), "packages": versions},
                      sort_keys=True, default=str)  # fmt: skip
    return hashlib.sha256(text.encode()).hexdigest()


def volume_id(entry: Any, image_key: str = "image") -> str:
    """The folder name of a datalist entry: its image file's name (without ``.nii.gz`` etc.) and 12 hex digits of
    the sha256 of the entry as the datalist writes it, e.g. ``case_003-5f1c0e9a2b7d``."""
    image = entry.get(image_key) if isinstance(entry, Mapping) else entry
    first = image[0] if isinstance(image, (list, tuple)) and image else image
    stem = re.sub(r"(\.nii\.gz|\.nii|\.nrrd|\.mha|\.mhd|\.npy|\.npz)$", "", os.path.basename(str(first or "volume")))
    stem = re.sub(r"[^A-Za-z0-9_.-]", "_", stem)[:64] or "volume"
    digest = hashlib.sha256(json.dumps(entry, sort_keys=True, default=str).encode()).hexdigest()[:12]
    return f"{stem}-{digest}"


# ---------------------------------------------------------------------------------------------- sources and keys


def relative_source(path: str | os.PathLike, root: str) -> str:
    """``path`` as the index records it: relative to ``root`` (POSIX separators) when it is under it, else absolute.

    Example:
        >>> relative_source("/data/ct/images/case_0.nii.gz", "/data/ct")
        'images/case_0.nii.gz'
    """
    path = os.path.abspath(os.fspath(path))
    prefix = root if root.endswith(os.sep) else root + os.sep
    return path[len(prefix) :].replace(os.sep, "/") if path.startswith(prefix) else path


def resolve_source(recorded: str, root: str | os.PathLike) -> str:
    """The file a recorded source path names under ``root`` (an absolute record names itself)."""
    return recorded if os.path.isabs(recorded) else os.path.join(os.fspath(root), *recorded.split("/"))


def source_key(files: Sequence[str | os.PathLike], root: str) -> str:
    """What finds a volume in the index: its source files (a datalist entry's, in key order) under ``root``."""
    return "\n".join(relative_source(path, root) for path in files)


def _key_hash(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")


def key_hashes(keys: Iterable[str]) -> np.ndarray:
    """The 64-bit hash of each key (blake2b), as ``keys.npy`` holds them: a uint64 array."""
    return np.fromiter((_key_hash(key) for key in keys), np.uint64)


def default_source_root(files: Iterable[str | os.PathLike], datalist_folder: str | os.PathLike | None) -> str:
    """The source root a store records when none is given: the datalist's folder when every source is under it
    (its relative paths then stay valid wherever the folder moves), else the deepest folder holding them all."""
    folders = {os.path.dirname(os.path.abspath(os.fspath(f))) for f in files}
    if datalist_folder is not None:
        folder = os.path.abspath(os.fspath(datalist_folder))
        if all(f == folder or f.startswith(folder.rstrip(os.sep) + os.sep) for f in folders):
            return folder
    return os.path.commonpath(sorted(folders)) if folders else os.path.abspath(os.fspath(datalist_folder or "."))


def source_records(files: Sequence[str | os.PathLike], root: str) -> list[dict]:
    """What an entry keeps of each source file: ``path`` (:func:`relative_source`), ``size``, ``mtime_ns`` and
    ``sha256``."""
    records = []
    for path in files:
        stat = os.stat(path)
        records.append({"path": relative_source(path, root), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
                        "sha256": sha256_file(path)})  # fmt: skip
    return records


def _time(ns: int) -> str:
    return datetime.fromtimestamp(ns / 1e9).isoformat(sep=" ", timespec="seconds")


def source_change(record: Mapping, path: str | os.PathLike, content: bool = False) -> str | None:
    """What changed in the source file at ``path`` since it was stored as ``record``, in a few words, or None.

    Its size is always compared; then its content (``content``: the SHA-256, which reads the file) or else its
    modification time (a copy without its times looks modified: compare the content then)."""
    try:
        stat = os.stat(path)
    except OSError as err:
        return f"{type(err).__name__}: {err.strerror or err}"
    if stat.st_size != record["size"]:
        return f"{stat.st_size:,} bytes, stored from {record['size']:,}"
    if content:
        digest = sha256_file(path)
        return None if digest == record["sha256"] else f"SHA-256 {digest:.12}, stored from {record['sha256']:.12}"
    if stat.st_mtime_ns != record["mtime_ns"]:
        return f"modified {_time(stat.st_mtime_ns)}, stored from the file of {_time(record['mtime_ns'])}"
    return None


# ------------------------------------------------------------------------------------------------------ writing


def read_json(path: Path, what: str) -> Any:
    """A JSON file of the store; a :class:`StoreError` naming it when it is missing or not JSON."""
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise StoreError(f"{path}: no {what}: the file is missing") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise StoreError(f"{path}: the {what} is unreadable ({type(err).__name__}: {err})") from None


def write_json(path: Path, content: Any, indent: int | None = None) -> None:
    """``content`` as JSON at ``path`` (keys sorted; compact unless ``indent``), atomically
    (:func:`~components.atomic_write`)."""
    with atomic_write(path, "w") as f:
        f.write(json.dumps(content, indent=indent, sort_keys=True, separators=None if indent else (",", ":")) + "\n")


def _line(entry: Mapping) -> str:
    """An entry as one line of a ``.jsonl`` file (keys sorted, compact): the same entry is always the same line."""
    return json.dumps(entry, sort_keys=True, separators=(",", ":")) + "\n"


def part_path(root: Path, part: int, parts: int) -> Path:
    """Where part ``part`` (0-based) of ``parts`` writes its shard's header (its entries: the same name, ``.jsonl``)."""
    return Path(root) / PARTS / f"part-{part:04d}-of-{parts:04d}.json"


def write_part(root: Path, part: int, parts: int, shard: Mapping, entries: Sequence[Mapping]) -> None:
    """Writes part ``part``'s entries (in datalist order), then its header ``shard`` with their ``count``: a
    shard's header is there only once its entries are whole."""
    path = part_path(root, part, parts)
    with atomic_write(path.with_suffix(".jsonl"), "w") as f:
        f.writelines(_line(entry) for entry in entries)
    write_json(path, {**shard, "count": len(entries)})


def _part_lines(path: Path, count: int) -> Iterator[tuple[int, str, bytes]]:
    """(position, key, line) of each entry of a part's ``.jsonl``; a :class:`StoreError` when it does not hold the
    ``count`` entries its header says."""
    seen = 0
    with open(path, "rb") as f:
        for line in f:
            entry = json.loads(line)
            seen += 1
            yield entry["position"], entry["key"], line
    if seen != count:
        raise StoreError(f"{path}: {seen} entries, its header says {count}: rerun that part.")


def _save(path: Path, values: np.ndarray) -> None:
    with atomic_write(path, "wb") as f:
        np.save(f, values)


def merge_parts(root: str | os.PathLike, parts: int) -> Path | None:
    """Writes the index (``index/`` and then ``index.json``) from the shards of all ``parts`` parts once every one is
    there (any part may call it; parts that finish together write the same files); returns the path of
    ``index.json``, or None while a part is missing.

    ``index.json`` is the header (``store.json``) with ``index_layout``, ``count`` (the stored volumes) and
    ``skipped`` and ``failed`` of all parts in datalist order; the entries go to the columns. The parts' entries are
    merged line by line: the merging process holds no more than a line of each part and 16 bytes per entry.

    Raises:
        StoreError: a shard of another fingerprint or datalist than the header's, or one missing entries.
    """
    root = Path(root)
    header = read_json(root / HEADER, "store header")
    shards = []
    for part in range(parts):
        path = part_path(root, part, parts)
        if not path.is_file():
            return None
        shard = read_json(path, "index shard")
        for field in ("fingerprint", "datalist_sha256"):
            if shard.get(field) != header.get(field):
                raise StoreError(f"{path}: its {field} differs from {root / HEADER}'s: written by another run; "
                                 f"remove {root / PARTS} and rerun every part.")  # fmt: skip
        shards.append((path, shard))
    offsets, hashes = array("Q", [0]), array("Q")
    lines = [_part_lines(path.with_suffix(".jsonl"), shard["count"]) for path, shard in shards]
    with atomic_write(root / COLUMNS / ENTRIES, "wb") as out:
        for _, key, line in heapq.merge(*lines, key=lambda item: item[0]):
            out.write(line)
            offsets.append(offsets[-1] + len(line))
            hashes.append(_key_hash(key))
    keys = np.frombuffer(hashes, np.uint64)
    order = np.argsort(keys, kind="stable")
    _save(root / COLUMNS / OFFSETS, np.frombuffer(offsets, np.uint64))
    _save(root / COLUMNS / KEYS, keys[order])
    _save(root / COLUMNS / ROWS, order.astype(np.int64))
    merged = {**header, "index_layout": INDEX_LAYOUT, "count": len(keys)}
    for field in ("skipped", "failed"):
        merged[field] = sorted((e for _, s in shards for e in s[field]), key=lambda e: e["position"])
    write_json(root / INDEX, merged)
    return root / INDEX


def commit_volume(temporary: Path, final: Path) -> None:
    """Makes a volume's folder visible: fsyncs its files and the folder, renames ``temporary`` to ``final`` (atomic
    on one file system) and fsyncs the parent. A ``final`` already there (written by another part that got the same
    volume) is kept and ``temporary`` removed."""
    for file in temporary.iterdir():
        with open(file, "rb") as f:
            os.fsync(f.fileno())
    fsync_dir(temporary)
    try:
        os.rename(temporary, final)
    except OSError:
        if not (final / ITEM).is_file():
            raise
        shutil.rmtree(temporary, ignore_errors=True)
    fsync_dir(final.parent)


# ------------------------------------------------------------------------------------------------------ reading


def _column(root: Path, name: str) -> np.ndarray:
    """A column of the index, memory-mapped read-only."""
    path = Path(root) / COLUMNS / name
    try:
        return np.load(path, mmap_mode="r")
    except (OSError, ValueError) as err:
        raise StoreError(f"{path}: the index column is missing or unreadable ({type(err).__name__}: {err}); "
                         "rerun the preprocessing to rewrite the index") from None  # fmt: skip


def find_rows(root: str | os.PathLike, hashes: np.ndarray) -> np.ndarray:
    """The row of the entry whose key hashes to each of ``hashes`` (:func:`key_hashes`), -1 where the store has
    none: binary searches in the memory-mapped ``keys.npy``."""
    keys, rows = _column(Path(root), KEYS), _column(Path(root), ROWS)
    hashes = np.asarray(hashes, np.uint64)
    if not len(keys):
        return np.full(len(hashes), -1, np.int64)
    at = np.minimum(np.searchsorted(keys, hashes), len(keys) - 1)
    return np.where(keys[at] == hashes, rows[at], -1).astype(np.int64)


def read_entries(root: str | os.PathLike, rows: Sequence[int] | np.ndarray, fields: Sequence[str] | None = None
                 ) -> list[dict]:  # fmt: skip
    """The entries at ``rows`` (in that order), each read from its own line of ``entries.jsonl``; with ``fields``,
    only those of each entry are kept (a rank serving a shard keeps its volumes' ids and sources, not their
    arrays' records and values).

    Raises:
        StoreError: a row beyond the index, or a line that is not an entry (the index was damaged).
    """
    root = Path(root)
    offsets = _column(root, OFFSETS)
    rows = np.asarray(rows, np.int64)
    if len(rows) and (rows.min() < 0 or rows.max() >= len(offsets) - 1):
        raise StoreError(f"{root}: row {int(rows.max())} is beyond the {len(offsets) - 1} entries of its index.")
    read: dict[int, dict] = {}
    path = root / COLUMNS / ENTRIES
    with open(path, "rb") as f:
        for row in np.unique(rows).tolist():  # in file order
            f.seek(int(offsets[row]))
            line = f.read(int(offsets[row + 1] - offsets[row]))
            try:
                entry = json.loads(line)
            except (UnicodeDecodeError, json.JSONDecodeError) as err:
                raise StoreError(f"{path}: line {row + 1} is not an index entry ({err}); rerun the preprocessing "
                                 "to rewrite the index") from None  # fmt: skip
            read[row] = entry if fields is None else {field: entry[field] for field in fields}
    return [read[row] for row in rows.tolist()]
