"""Writes a store: every volume of a datalist read once, through a bundle's deterministic transforms, into
``volumes/<id>/`` (:mod:`~components.data.store.volume`), in parallel processes, resumable and splittable.

- The data check runs first, on this part's entries (headers only): a broken file is named and, by
  ``on_error``, stops the run before any volume is written ("stop") or is skipped and listed ("skip"). The same
  image twice in the datalist is an error of the later entry.
- ``workers`` processes (:mod:`~.workers`, forked from a fork server that imported torch and MONAI once) each
  build the transforms once and write whole volume folders; they die with this process however it ends, and a
  worker that dies (out of memory) fails the volume it was writing, which ``on_error`` then handles as any failed
  volume. 1 runs in this process.
- ``part`` / ``parts`` take every ``parts``-th entry from ``part`` (0-based): n machines writing onto one shared
  folder write the same volume folders as one run, each part writes its index shard, and whichever part finds
  all shards there writes ``index.json`` (the same file as one run's).
- A rerun after a kill finds the volume folders already there (only complete ones exist) and writes the rest. A
  volume folder is kept when its sources are the same files (size and modification time, or else content), wherever
  they are now: a rerun after the sources moved (a new ``source_root``) rewrites the index only, and a volume whose
  source changed is written anew.
- A volume whose transforms fail is, by ``on_error``, the end of the run (the volumes written stay for the rerun)
  or listed as failed in the index and the summary line. Nothing is skipped silently.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing import get_all_start_methods, get_context
from multiprocessing.context import BaseContext
from pathlib import Path
from typing import Any, TextIO

from ...files import sha256_file
from ..check import check_items
from ..check_report import DataCheckError, DataReport
from ..datalists import load_datalist
from .format import FLOATS, FORMAT_VERSION
from .index import COLUMNS, HEADER, INDEX, ITEM, PARTS, VOLUMES, StoreError, default_source_root, merge_parts
from .index import read_json, relative_source, source_key, transforms_fingerprint, volume_id
from .index import write_json, write_part
from .packages import package_versions, version_changes
from .transforms import build_transforms, loaded_keys
from .volume import write_volume
from .workers import run_in_workers

__all__ = ["PreprocessSummary", "VolumeFailedError", "preprocess"]

logger = logging.getLogger("components.data")
ON_ERROR = ("stop", "skip")


class VolumeFailedError(RuntimeError):
    """A volume's transforms or its writing failed with ``on_error="stop"``; the message names the source file."""


@dataclass
class PreprocessSummary:
    """What one run (one part) did: volumes ``written`` now, ``reused`` from an earlier run, ``skipped`` by the data
    check and ``failed`` in the transforms (``{"position", "source", "reason"}`` each), the ``index`` once all parts
    are done (else None), and the wall time."""

    store: Path
    part: int
    parts: int
    written: int = 0
    reused: int = 0
    skipped: list[dict] = field(default_factory=list)
    failed: list[dict] = field(default_factory=list)
    index: Path | None = None
    seconds: float = 0.0

    def line(self) -> str:
        """One line for the log, naming every skipped and failed volume."""
        part = f" (part {self.part} of {self.parts})" if self.parts > 1 else ""
        text = (f"preprocess{part}: {self.written} written, {self.reused} already there, {len(self.skipped)} skipped, "
                f"{len(self.failed)} failed in {timedelta(seconds=round(self.seconds))}; ")  # fmt: skip
        text += f"index {self.index}" if self.index else "index.json follows when every part is done"
        for kind, volumes in (("skipped", self.skipped), ("failed", self.failed)):
            text += "".join(f"; {kind} {v['source']}: {v['reason']}" for v in volumes)
        return text


class _Progress:
    """One line per ``every`` volumes (every volume, rewritten in place, on a terminal) with the elapsed time and
    the ETA of the volumes left."""

    def __init__(self, total: int, every: int | None, stream: TextIO) -> None:
        self.total, self.stream, self.start = total, stream, time.monotonic()
        self.tty = stream.isatty()
        self.every = 1 if self.tty else max(1, every or total // 20)

    def update(self, done: int) -> None:
        if done % self.every and done != self.total:
            return
        elapsed = time.monotonic() - self.start
        eta = "?" if done <= 0 else timedelta(seconds=round(elapsed / done * (self.total - done)))  # at the mean pace
        text = f"preprocess: {done}/{self.total} volumes, elapsed {timedelta(seconds=round(elapsed))}, ETA {eta}"
        self.stream.write(("\r" + text + ("\n" if done == self.total else "")) if self.tty else text + "\n")
        self.stream.flush()


_WORKER: dict[str, Any] = {}


def _init_worker(configs: list[dict]) -> None:
    _WORKER["transform"] = build_transforms(configs)


def _run_one(task: tuple) -> tuple[int, dict | None, str | None]:
    """(position, entry, None) for a written volume, (position, None, reason) for a failed one."""
    position, item, keys, root, volume, fingerprint, tag, layout, source_root = task
    try:
        data = _WORKER["transform"](dict(item))
        entry = write_volume(data, item, keys, root, volume, position, fingerprint, tag, source_root, **layout)
        return position, entry, None
    except Exception as err:  # noqa: BLE001 -- any failure of one volume is reported with its source
        return position, None, _reason(err)


def _reason(err: BaseException) -> str:
    """One line: the innermost error of MONAI's ``applying transform`` chain and the transform that raised it (the
    same text in every run: no object addresses)."""
    where = None
    while err.__cause__ is not None:
        where = re.search(r"applying transform <([\w.]+) object", str(err)) or where
        err = err.__cause__
    text = f"{type(err).__name__}: {' '.join(str(err).split())}"
    return f"{text} (in {where.group(1)})" if where else text


def _read_datalist(datalist: str | os.PathLike | Sequence[Mapping], list_key: str) -> tuple[list[dict], list, str]:
    """(entries with absolute paths, entries as written, sha256 of the list as written)."""
    import hashlib

    if isinstance(datalist, (str, os.PathLike)):
        raw = json.loads(Path(datalist).read_text()).get(list_key) if Path(datalist).is_file() else None
        items = load_datalist(os.path.abspath(datalist), list_key)  # names the file and key on any problem
    else:
        raw = items = [dict(e) if isinstance(e, Mapping) else e for e in datalist]
        if not items:
            raise ValueError("the datalist is empty: nothing to preprocess.")
    digest = hashlib.sha256(json.dumps(raw, sort_keys=True, default=str).encode()).hexdigest()
    return items, raw, digest


def _check(items: list[dict], positions: list[int], ids: list[str], keys: tuple[str, ...], list_key: str,
           channels: int | None, source: str) -> tuple[dict[int, str], DataReport]:  # fmt: skip
    """The data check of the entries at ``positions``: ({position: its problems in one line} for each broken entry,
    the check's report).

    Raises:
        DataCheckError: a problem that belongs to no entry (the list itself).
    """
    problems: dict[int, list[str]] = {}
    first: dict[str, int] = {}
    for position, volume in enumerate(ids):
        if volume in first:
            problems.setdefault(position, []).append(f"the same entry as {list_key}[{first[volume]}]")
        first.setdefault(volume, position)
    report = check_items([items[p] for p in positions], keys=keys, channels=channels, list_name=list_key,
                         duplicates=False, source=source)  # fmt: skip
    for issue in report.errors:
        match = re.match(rf"{re.escape(list_key)}\[(\d+)\]", issue.entry or "")
        if match is None:
            report.raise_if_errors(f"preprocess {source}")
        problems.setdefault(positions[int(match.group(1))], []).append(f"{issue.path}: {issue.message}")
    return {p: "; ".join(problems[p]) for p in positions if p in problems}, report


_IDENTITY = ("format_version", "fingerprint", "datalist_sha256", "list_key", "volumes")


def _prepare_folder(root: Path, header: dict, overwrite: bool, parts: int) -> None:
    """Writes ``store.json``; a store of other transforms is refused (or emptied with ``overwrite``), the shards and
    index of another datalist, or of the index layout of 0.4.0 (no source root), are removed. A header that differs
    only in how the datalist and the command were spelled and where the sources are (parts started from other
    folders or machines) is kept as the first part wrote it, so every part merges one index; a run in one part
    writes its own (after the sources moved: their new root)."""
    old = read_json(root / HEADER, "store header") if (root / HEADER).is_file() else None
    if old is not None:
        if old.get("fingerprint") != header["fingerprint"]:
            if not overwrite:
                changes = version_changes(old.get("packages"))
                what = f"written with other package versions ({changes})" if changes else "of other transforms"
                raise StoreError(f"{root} holds a store {what} (fingerprint {old.get('fingerprint')!s:.12}, now "
                                 f"{header['fingerprint']:.12}): pass --overwrite true to replace it, or another "
                                 "--out.")  # fmt: skip
            for name in (VOLUMES, PARTS):
                shutil.rmtree(root / name, ignore_errors=True)
        if "source_root" in old and all(old.get(field) == header[field] for field in _IDENTITY):
            if parts == 1 and old != header:
                write_json(root / HEADER, header, indent=1)
            return
        for name in (PARTS, COLUMNS):
            shutil.rmtree(root / name, ignore_errors=True)
        (root / INDEX).unlink(missing_ok=True)
    root.mkdir(parents=True, exist_ok=True)
    write_json(root / HEADER, header, indent=1)


def _same_sources(entry: dict, files: list[str]) -> list[dict] | None:
    """The size, modification time and SHA-256 of each of ``files`` when they are the sources ``entry`` was stored
    from, else None: the same size and time, or, where only the time differs (a copy), the same content. An entry of
    0.4.0 (absolute paths and their SHA-256, no size or time) is kept at its own paths, as 0.4.0 kept it, and
    compared by content at others."""
    stored = entry.get("files")
    if stored is None:
        legacy = entry.get("sha256", {})
        same_paths = list(legacy) == [os.path.abspath(f) for f in files]
        stored = [{"size": None, "mtime_ns": None, "sha256": digest} for digest in legacy.values()]
    else:
        same_paths = False
    if len(stored) != len(files):
        return None
    records = []
    for record, path in zip(stored, files):
        try:
            stat = os.stat(path)
        except OSError:
            return None
        unchanged = same_paths or (stat.st_size, stat.st_mtime_ns) == (record["size"], record["mtime_ns"])
        if not unchanged and (record["size"] not in (None, stat.st_size) or sha256_file(path) != record["sha256"]):
            return None
        records.append({"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": record["sha256"]})
    return records


def _reusable(root: Path, volume: str, fingerprint: str, files: list[str], source_root: str) -> dict | None:
    """The index entry of a volume folder a previous run completed with the same transforms from the same sources
    (:func:`_same_sources`), its sources recorded under ``source_root`` (its ``item.json`` updated where that
    changed them); else None, and a folder there is removed to be written anew."""
    folder = root / VOLUMES / volume
    if not (folder / ITEM).is_file():
        return None
    stored = read_json(folder / ITEM, "volume entry")
    records = _same_sources(stored["entry"], files) if stored.get("fingerprint") == fingerprint else None
    if records is None:
        shutil.rmtree(folder)
        return None
    entry = {k: v for k, v in stored["entry"].items() if k not in ("source", "sha256")}  # 0.4.0's fields
    entry["key"] = source_key(files, source_root)
    entry["files"] = [{"path": relative_source(path, source_root), **r} for path, r in zip(files, records)]
    if entry != stored["entry"]:
        write_json(folder / ITEM, {**stored, "entry": entry})
    return entry


def preprocess(
    datalist: str | os.PathLike | Sequence[Mapping],
    out: str | os.PathLike,
    transforms: Sequence[Mapping],
    list_key: str = "training",
    workers: int = 1,
    part: int = 0,
    parts: int = 1,
    on_error: str = "stop",
    overwrite: bool = False,
    channels: int | None = None,
    command: str | None = None,
    progress_every: int | None = None,
    stream: TextIO | None = None,
    patch_size: Sequence[int] | None = None,
    floats: str = "quantized",
    source_root: str | os.PathLike | None = None,
) -> PreprocessSummary:
    """Writes the volumes of ``datalist`` (a Decathlon datalist file and its ``list_key`` list, or a list of
    entries with absolute paths) through ``transforms`` (:func:`~.transforms.bundle_transforms`) into the store
    ``out`` (see the module docstring for checking, workers, parts, resuming and errors).

    Args:
        channels: channels the data check expects (a bundle's ``in_channels``); None: single-channel volumes.
        command: the command that rebuilds this store, recorded for the message that refuses it later.
        progress_every: volumes between progress lines where ``stream`` is no terminal (default: 5% of them).
        stream: where progress goes (default: stderr).
        patch_size: the crop size training reads (e.g. :func:`~.transforms.bundle_crop_size`): chunks and blocks
            follow it (:func:`~.format.layout`); None: 64^3 chunks.
        floats: non-integer floating arrays (a normalised MRI) stored "quantized" (int16 and a scale per channel,
            the error recorded per array) or "exact" (:func:`~.format.write_array`).
        source_root: the folder the sources are recorded under (:func:`~.index.default_source_root` by default:
            the datalist's folder when it holds them all); a training run reads them under another with
            ``loader#source_root``.

    Returns:
        a :class:`PreprocessSummary`; its ``line()`` is logged.

    Raises:
        ValueError: bad arguments, before any work.
        DataCheckError: broken files with ``on_error="stop"`` (each named), before any volume is written.
        StoreError: ``out`` holds a store of other transforms.
        VolumeFailedError: a volume failed with ``on_error="stop"``.

    Example::

        preprocess("data/dataset.json", "store", bundle_transforms("bundles/swin_unetr_ssl_pretrain"), workers=8)
    """
    if on_error not in ON_ERROR:
        raise ValueError(f"on_error must be one of {ON_ERROR}, got {on_error!r}.")
    if isinstance(parts, bool) or int(parts) < 1 or isinstance(part, bool) or not 0 <= int(part) < int(parts):
        raise ValueError(f"part must be in 0..parts-1 and parts >= 1, got part {part!r} of {parts!r}.")
    if int(workers) < 1:
        raise ValueError(f"workers must be >= 1, got {workers!r}.")
    if floats not in FLOATS:
        raise ValueError(f"floats must be one of {FLOATS}, got {floats!r}.")
    if patch_size is not None and not all(isinstance(p, int) and not isinstance(p, bool) and p > 0
                                          for p in patch_size):  # fmt: skip
        raise ValueError(f"patch_size must be positive ints, got {patch_size!r}.")
    started = time.monotonic()
    root, part, parts = Path(out), int(part), int(parts)
    configs = [dict(c) for c in transforms]
    keys = loaded_keys(configs)
    items, raw, datalist_sha256 = _read_datalist(datalist, list_key)
    ids = [volume_id(entry, keys[0]) for entry in raw]
    positions = list(range(part, len(items), parts))
    source = os.fspath(datalist) if isinstance(datalist, (str, os.PathLike)) else "<items>"
    if source_root is None:
        folder = os.path.dirname(os.path.abspath(source)) if source != "<items>" else None
        source_root = default_source_root((f for item in items for f in _files(item, keys)), folder)
    source_root = os.path.abspath(os.fspath(source_root))
    broken, report = _check(items, positions, ids, keys, list_key, channels, source)
    if broken and on_error == "stop":
        raise DataCheckError(f"preprocess: the data check found {len(broken)} broken entr"
                             f"{'y' if len(broken) == 1 else 'ies'}, nothing written (--on_error skip skips them): "
                             + "; ".join(f"{list_key}[{p}] {r}" for p, r in broken.items()), report=report)  # fmt: skip
    packages = package_versions()
    fingerprint = transforms_fingerprint(configs, packages)
    header = {"format_version": FORMAT_VERSION, "fingerprint": fingerprint, "transforms": configs, "packages": packages,
              "datalist": source, "list_key": list_key, "datalist_sha256": datalist_sha256,
              "volumes": len(items), "command": command, "floats": floats,
              "patch_size": None if patch_size is None else list(patch_size), "source_root": source_root}  # fmt: skip
    _prepare_folder(root, header, overwrite, parts)

    summary = PreprocessSummary(root, part, parts)
    summary.skipped = [_left_out(items[p], p, keys, source_root, r) for p, r in broken.items()]
    tag = f"part{part}of{parts}"
    for leftover in (root / VOLUMES).glob(f".*.{tag}.tmp"):  # what a killed run of this part left half-written
        shutil.rmtree(leftover, ignore_errors=True)
    entries: dict[int, dict] = {}
    for position in positions:
        if position in broken:
            continue
        entry = _reusable(root, ids[position], fingerprint, _files(items[position], keys), source_root)
        if entry is not None:
            entries[position] = {**entry, "position": position}
    summary.reused = len(entries)
    left = [p for p in positions if p not in broken and p not in entries]
    layout = {"patch_size": None if patch_size is None else list(patch_size), "floats": floats}
    todo = [(p, items[p], keys, root, ids[p], fingerprint, tag, layout, source_root) for p in left]
    progress = _Progress(len(todo), progress_every, stream or sys.stderr)
    for position, entry, reason in _run(todo, configs, int(workers), progress):
        if entry is not None:
            entries[position] = entry
            summary.written += 1
            continue
        failure = _left_out(items[position], position, keys, source_root, reason)
        if on_error == "stop":
            raise VolumeFailedError(f"preprocess: {failure['source']} ({list_key}[{position}]) failed: {reason}; the "
                                    "volumes written so far are kept, a rerun continues after them.")  # fmt: skip
        summary.failed.append(failure)
    write_part(root, part, parts, {
        "fingerprint": fingerprint, "datalist_sha256": datalist_sha256, "part": part, "parts": parts,
        "source_root": source_root, "skipped": summary.skipped, "failed": summary.failed,
    }, [entries[p] for p in sorted(entries)])  # fmt: skip
    summary.index = merge_parts(root, parts)
    summary.seconds = time.monotonic() - started
    logger.info("%s", summary.line())
    return summary


def _first_file(item: Any, keys: tuple[str, ...]) -> str:
    value = item.get(keys[0]) if isinstance(item, Mapping) else item
    return os.fspath(value[0] if isinstance(value, (list, tuple)) and value else value)


def _files(item: Any, keys: tuple[str, ...]) -> list[str]:
    """The source files of ``keys`` in a datalist entry, in order; the keys it lacks (the data check names them)
    give none."""
    if not isinstance(item, Mapping):
        return [os.fspath(item)]
    values = [item[key] for key in keys if key in item and item[key] is not None]
    return [os.fspath(v) for value in values for v in (value if isinstance(value, (list, tuple)) else [value])]


def _left_out(item: Any, position: int, keys: tuple[str, ...], source_root: str, reason: str) -> dict:
    """The index's record of a volume the run did not store: its position, first source, key and the reason."""
    return {"position": position, "source": _first_file(item, keys), "key": source_key(_files(item, keys), source_root),
            "reason": reason}  # fmt: skip


def _context() -> BaseContext:
    """Where workers come from: a fork server that imported this module (torch, MONAI) once, so each worker starts
    in milliseconds from a process without threads; a plain spawn where there is no fork server (Windows)."""
    if "forkserver" not in get_all_start_methods():
        return get_context("spawn")
    context = get_context("forkserver")
    context.set_forkserver_preload([__name__])
    return context


def _run(todo: list[tuple], configs: list[dict], workers: int, progress: _Progress):
    """Yields ``_run_one``'s result for every task, in this process or in ``workers`` others
    (:func:`~.workers.run_in_workers`: they die with this process; a volume whose worker died fails with the reason,
    and the next volume gets a new worker); leaving early (a failed volume with ``on_error="stop"``) ends them."""
    if not todo:
        return
    if workers == 1:
        _init_worker(configs)
        for done, task in enumerate(todo, 1):
            result = _run_one(task)
            progress.update(done)
            yield result
        return
    build_transforms(configs)  # a config that cannot be built fails here, once, not in every worker
    results = run_in_workers(_run_one, todo, workers, _context(), _init_worker, (configs,))
    for done, (task, result, died) in enumerate(results, 1):
        progress.update(done)
        yield result if died is None else (task[0], None, f"the worker process writing it {died}")
