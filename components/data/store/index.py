"""What a store holds and where: its folder layout, the fingerprint of the transforms that wrote it, the index
(one JSON entry per volume) and the merge of the index shards that parts of a run write.

Layout of a store folder::

    store.json                    what wrote it: format version, fingerprint, transforms, datalist, command
    volumes/<id>/<key>.b2nd       one file per stored array of a volume (components.data.store.format)
    volumes/<id>/item.json        the volume's entry, its arrays' records and its metadata
    parts/part-<i>-of-<n>.json    the entries, skipped and failed volumes of part i of n
    index.json                    all parts merged, in datalist order: what a reader opens

A volume's folder appears whole or not at all: its files are written into ``volumes/.<id>.part<i>.tmp`` and the
folder is renamed into place (:func:`commit_volume`). ``<id>`` is the image's file name and a hash of its
datalist entry, so the same volume gets the same folder whichever part, machine or run writes it, and
``index.json`` is the same for one run and for n parts (it holds no timings, no part numbers).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ...errors import UserError
from ...files import atomic_write, fsync_dir
from .format import FORMAT_VERSION
from .packages import package_versions

__all__ = [
    "StoreError",
    "commit_volume",
    "merge_parts",
    "part_path",
    "read_json",
    "transforms_fingerprint",
    "volume_id",
    "write_json",
]

HEADER, INDEX, VOLUMES, PARTS, ITEM = "store.json", "index.json", "volumes", "parts", "item.json"


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


def read_json(path: Path, what: str) -> Any:
    """A JSON file of the store; a :class:`StoreError` naming it when it is missing or not JSON."""
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise StoreError(f"{path}: no {what}: the file is missing") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise StoreError(f"{path}: the {what} is unreadable ({type(err).__name__}: {err})") from None


def write_json(path: Path, content: Any, indent: int | None = None) -> None:
    """``content`` as JSON at ``path`` (keys sorted; compact unless ``indent``: an index of 100k volumes is read by
    every loader), atomically (:func:`~components.atomic_write`)."""
    with atomic_write(path, "w") as f:
        f.write(json.dumps(content, indent=indent, sort_keys=True, separators=None if indent else (",", ":")) + "\n")


def part_path(root: Path, part: int, parts: int) -> Path:
    """Where part ``part`` (0-based) of ``parts`` writes its index shard."""
    return Path(root) / PARTS / f"part-{part:04d}-of-{parts:04d}.json"


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


def merge_parts(root: str | os.PathLike, parts: int) -> Path | None:
    """Writes ``index.json`` from the shards of all ``parts`` parts once every one is there (any part may call it;
    parts that finish together write the same content); returns its path, or None while a part is missing.

    The merged index is the header (``store.json``) with ``entries``, ``skipped`` and ``failed`` of all parts in
    datalist order.

    Raises:
        StoreError: a shard of another fingerprint or datalist than the header's.
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
        shards.append(shard)
    merged = dict(header)
    for field in ("entries", "skipped", "failed"):
        merged[field] = sorted((e for s in shards for e in s[field]), key=lambda e: e["position"])
    if (root / INDEX).is_file() and read_json(root / INDEX, "index") == merged:
        return root / INDEX
    write_json(root / INDEX, merged)
    return root / INDEX
