"""Datalists, rank partitioning and dataset construction: the one place that builds training datasets.

Under DDP every rank must cache only its own shard (a cache of the whole list on
every rank multiplies the memory by the world size): the datalist is
partitioned with a fixed seed into equal shards before any caching, each rank builds one dataset of its
shard, and sizes are validated before the (possibly hour-long) caching starts.

Every bundle pipeline runs as a :class:`SourceNamingCompose`, so a volume that breaks a transform at item 700 of
caching, or in a loader worker mid-training, is named in the error (:class:`DataItemError`).
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from ignite.engine import Engine
from monai.data import (
    CacheDataset,
    Dataset,
    MetaTensor,
    SmartCacheDataset,
    load_decathlon_datalist,
    partition_dataset,
)
from monai.handlers import SmartCacheHandler
from monai.transforms import Compose
from torch.utils.data import DistributedSampler

from .datacheck import check_before_caching
from .distributed import barrier, get_rank, get_world_size
from .synthetic import split_sizes

__all__ = [
    "DataItemError",
    "SourceNamingCompose",
    "batch_filenames",
    "item_sources",
    "load_datalist",
    "load_split",
    "MissingDatalist",
    "require_datalist",
    "partition_for_rank",
    "split_for_rank",
    "check_shard_sizes",
    "build_dataset",
    "EpochShuffleSampler",
    "ResumableSmartCacheHandler",
    "rotate_smart_cache",
]

logger = logging.getLogger(__name__)

CACHE_MODES = ("full", "smart", "none")
VALIDATION_FRACTION = 0.2  # of the training list, held out when a datalist has no validation list
_ANNOUNCED: set[tuple[str, str]] = set()  # (datalist, what) already logged: each message once per process


def load_datalist(datalist: str | Path, key: str = "training", base_dir: str | Path | None = None) -> list[dict]:
    """Reads the ``key`` list of a Decathlon-format datalist, with paths made absolute against ``base_dir``
    (default: the datalist's folder). Errors name the file and the key, and an empty list is an error."""
    path = Path(datalist)
    if not path.is_file():
        raise _missing(path)
    try:
        content = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"datalist {str(path)!r} is not valid JSON: {err}") from err
    if not isinstance(content, dict) or key not in content:
        keys = sorted(content) if isinstance(content, dict) else type(content).__name__
        raise KeyError(f"datalist {str(path)!r} has no {key!r} list; it has: {keys}.")
    items = load_decathlon_datalist(str(path), data_list_key=key, base_dir=str(base_dir or path.parent))
    if not items:
        raise ValueError(f"the {key!r} list of datalist {str(path)!r} is empty.")
    return items


class MissingDatalist(list):
    """The empty list :func:`load_split` stands in for a datalist file that does not exist, so that a bundle can be
    parsed and checked without its data (``ConfigWorkflow.check_properties()``, the Model Zoo's verification).

    :func:`build_dataset` and :func:`split_for_rank` pass it through as an empty dataset without reading or checking
    anything; :func:`require_datalist`, the first step of a bundle's ``run``, stops a run naming the file.
    """

    def __init__(self, path: str | Path, key: str) -> None:
        super().__init__()
        self.path, self.key = str(path), key


def _missing(path: str | Path) -> FileNotFoundError:
    return FileNotFoundError(f"datalist {str(path)!r} does not exist (set `datalist` or `dataset_dir`).")


def _announce(path: str, what: str, message: str, *args) -> None:
    """Logs ``message`` at WARNING once per process for (``path``, ``what``): the train and validation ids of a
    config read the same datalist and would say it twice."""
    if (path, what) not in _ANNOUNCED:
        _ANNOUNCED.add((path, what))
        logger.warning(message, *args)


def require_datalist(datalist: str | Path) -> None:
    """The first step of a bundle's ``run``: raises ``FileNotFoundError`` naming ``datalist`` when it is not a file
    (parsing the bundle without it, e.g. to check its properties, only warns: :class:`MissingDatalist`)."""
    if not Path(datalist).is_file():
        raise _missing(datalist)


def load_split(
    datalist: str | Path,
    key: str = "training",
    base_dir: str | Path | None = None,
    val_fraction: float = VALIDATION_FRACTION,
) -> list[dict]:
    """The ``key`` list of a datalist as the bundles read it: :func:`load_datalist`, with two differences.

    - A datalist file that does not exist gives an empty :class:`MissingDatalist` and a WARNING, so the bundle can
      be parsed and checked without data; the run itself stops at :func:`require_datalist`.
    - A datalist without a ``validation`` list (a plain Decathlon ``dataset.json``: ``training`` and ``test``) gives
      a fixed split of its ``training`` list for ``key`` "training" / "validation": ``val_fraction`` of it (at
      least one volume) is held out for validation, chosen by a permutation with a fixed seed (the same whatever the
      run's seed, so a resumed run validates on the same volumes), and a WARNING says so.

    Raises:
        ValueError: a datalist without a validation list whose training list is too short to hold one out; and
            everything :func:`load_datalist` raises.

    Example:
        >>> train = load_split("data/dataset.json", "training")  # all of it, or the part not held out
    """
    path = Path(datalist)
    if not path.is_file():
        _announce(str(path), "missing", "datalist %r does not exist: the %r list is empty (enough to check the "
                  "bundle; a run stops at its start)", str(path), key)  # fmt: skip
        return MissingDatalist(path, key)
    if key not in ("training", "validation"):
        return load_datalist(path, key, base_dir)
    try:
        has_validation = "validation" in json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError, TypeError):
        has_validation = True  # load_datalist reports the file's problem
    if has_validation:
        return load_datalist(path, key, base_dir)
    items = load_datalist(path, "training", base_dir)
    num_val = max(1, round(val_fraction * len(items)))
    if len(items) - num_val < 1:
        raise ValueError(
            f"datalist {str(path)!r} has no 'validation' list and only {len(items)} 'training' volume(s), too few to "
            "hold one out for validation: add a 'validation' list or more training volumes."
        )
    held_out = set(np.random.default_rng(0).permutation(len(items))[:num_val].tolist())
    _announce(str(path), "split", "datalist %r has no 'validation' list: validating on %d of its %d 'training' "
              "volumes (a fixed split), training on the other %d; add a 'validation' list to choose them.",
              str(path), num_val, len(items), len(items) - num_val)  # fmt: skip
    return [item for i, item in enumerate(items) if (i in held_out) == (key == "validation")]


def _synth_hint(world_size: int, batch_size: int = 1) -> str:
    """The smallest ``synth --num`` whose lists fit ``world_size`` ranks: a training batch and a validation volume
    for every rank."""
    def fits(num: int) -> bool:
        train, val, _ = split_sizes(num)
        return train >= world_size * batch_size and val >= world_size

    num = next(n for n in range(3, 100_000) if fits(n))
    return f"python -m components synth --num {num}"


def _list_label(list_name: str, source: str | Path | None) -> str:
    named = source is not None and str(source) != "<items>"
    return f"the {list_name!r} list" + (f" of {str(source)!r}" if named else "")


def check_shard_sizes(
    num_items: int,
    world_size: int,
    batch_size: int,
    cache: str = "full",
    cache_num: int | None = None,
    list_name: str = "training",
    source: str | Path | None = None,
) -> None:
    """Fails before any caching when some rank would get less than one full batch per epoch, in one line naming the
    list, its size, the world size and the fixes. Shards are equal (``even_divisible``); a smart cache serves
    ``cache_num`` items per epoch."""
    if cache not in CACHE_MODES:
        raise ValueError(f"cache must be one of {CACHE_MODES}, got {cache!r}.")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}.")
    if num_items < world_size * batch_size:
        raise ValueError(
            f"{_list_label(list_name, source)} has {num_items} volume(s), too few for {world_size} rank(s) x "
            f"batch_size {batch_size} (each rank needs one full batch per epoch): add volumes (synthetic data: "
            f"`{_synth_hint(world_size, batch_size)}`), run at most {max(num_items // batch_size, 1)} rank(s), "
            f"or use a batch_size of at most {max(num_items // world_size, 1)}."
        )
    shard = math.ceil(num_items / world_size)
    if cache == "smart":
        if cache_num is None or cache_num < 1:
            raise ValueError(f"cache='smart' needs cache_num >= 1 (volumes kept per rank), got {cache_num}.")
        if cache_num < batch_size:
            raise ValueError(f"cache_num={cache_num} is smaller than batch_size={batch_size}; use cache_num >= {batch_size}.")
        if cache_num > shard:
            raise ValueError(
                f"cache_num={cache_num} exceeds the {shard} volumes of each rank's shard "
                f"({num_items} volumes over {world_size} ranks); use cache_num <= {shard}."
            )


def partition_for_rank(
    data: Sequence[dict], seed: int = 0, rank: int | None = None, world_size: int | None = None
) -> list[dict]:
    """This rank's shard: a seeded shuffle split into equal parts (short shards repeat an item), so every rank
    runs the same number of iterations. The whole list on one process."""
    world_size = get_world_size() if world_size is None else world_size
    rank = get_rank() if rank is None else rank
    if world_size == 1:
        return list(data)
    return partition_dataset(data, num_partitions=world_size, shuffle=True, seed=seed, even_divisible=True)[rank]


def split_for_rank(
    data: Sequence[dict],
    list_name: str = "validation",
    source: str | Path | None = None,
    rank: int | None = None,
    world_size: int | None = None,
) -> list[dict]:
    """This rank's part of an evaluation list: every ``world_size``-th item from ``rank`` on, without padding (as
    ``monai.data.DistributedSampler(even_divisible=False, shuffle=False)``), so a gathered metric counts each volume
    once (a padded sampler would count some twice).

    Raises:
        ValueError: before any caching, in one line naming the list, its size, the world size and the fixes, when
            some rank would get no item (MONAI's sampler fails there with "dataset length is less than the number of
            participating ranks").
    """
    world_size = get_world_size() if world_size is None else world_size
    rank = get_rank() if rank is None else rank
    if isinstance(data, MissingDatalist):
        return data
    if len(data) < world_size:
        raise ValueError(
            f"{_list_label(list_name, source)} has {len(data)} volume(s), too few for {world_size} rank(s) (each rank "
            f"evaluates at least one): add volumes (synthetic data: `{_synth_hint(world_size)}`) or run at most "
            f"{max(len(data), 1)} rank(s)."
        )
    return partition_dataset(list(data), num_partitions=world_size, shuffle=False, even_divisible=False)[rank]


def build_dataset(
    data: Sequence[dict],
    transform: Callable,
    cache: str = "full",
    cache_rate: float = 1.0,
    cache_num: int | None = None,
    replace_rate: float = 0.2,
    num_workers: int = 4,
    batch_size: int = 1,
    partition: bool = True,
    seed: int = 0,
    progress: bool = True,
    check: bool = True,
    check_keys: Sequence[str] | None = None,
    roi_size: Sequence[int] | int | None = None,
    channels: int | None = None,
    pixdim: Sequence[float] | float | None = None,
    source: str | Path = "<items>",
    list_name: str = "training",
) -> Dataset:
    """Builds this rank's dataset from ``data``: ``cache`` = "full" (``CacheDataset`` of ``cache_rate`` of the
    shard), "smart" (``SmartCacheDataset`` keeping ``cache_num`` volumes, ``replace_rate`` of them replaced
    each epoch: attach ``monai.handlers.SmartCacheHandler``) or "none" (plain ``Dataset``).

    With ``partition`` the list is first split across ranks (``partition_for_rank``); sizes are checked (errors name
    ``list_name`` of ``source``), and with ``check`` every file of the shard is checked from its header
    (``check_before_caching``: missing, truncated, wrong dimensions or ``channels``, image/label mismatch; smaller
    than ``roi_size`` after resampling to ``pixdim`` is a warning; an entry's own problems, such as a missing key,
    name ``source``, e.g. the datalist), all before caching, so a bad file stops the run at start-up with one
    report. The transform is run as a :class:`SourceNamingCompose`, so a transform error while
    caching or in training names the volume. Caching runs on ``num_workers`` threads with a progress bar (rank 0),
    and all ranks meet at a barrier afterwards so none enters the first collective while another still caches.
    """
    if isinstance(data, MissingDatalist):  # parsing the bundle without data: nothing to read (see load_split)
        return Dataset(data, transform)
    world_size = get_world_size() if partition else 1
    check_shard_sizes(len(data), world_size, batch_size, cache, cache_num, list_name=list_name, source=source)
    shard = partition_for_rank(data, seed=seed) if partition else list(data)
    check_before_caching(shard, keys=check_keys, roi_size=roi_size, enabled=check, channels=channels, pixdim=pixdim,
                         source=str(source))
    show = progress and get_rank() == 0
    if not isinstance(transform, SourceNamingCompose):
        transform = SourceNamingCompose(transform if isinstance(transform, Compose) else Compose(transform))
    workers = max(int(num_workers), 1)
    if cache == "full":
        dataset = CacheDataset(shard, transform, cache_rate=cache_rate, num_workers=workers, progress=show)
    elif cache == "smart":
        dataset = SmartCacheDataset(
            shard,
            transform,
            replace_rate=replace_rate,
            cache_num=cache_num,
            num_init_workers=workers,
            num_replace_workers=workers,
            progress=show,
            seed=seed + get_rank(),
        )
    else:
        dataset = Dataset(shard, transform)
    logger.info("rank %d: dataset of %d/%d volumes (cache=%s)", get_rank(), len(shard), len(data), cache)
    barrier()
    return dataset


class EpochShuffleSampler(DistributedSampler):
    """Shuffles one rank's own shard anew every epoch from ``(seed, epoch)``; it never splits the data again.

    It is a ``DistributedSampler`` fixed to a single replica only so that MONAI's workflows call its
    ``set_epoch`` at each epoch start: resuming at an epoch boundary then replays the same order.

    A restart in the middle of an epoch continues that epoch: :meth:`load_state_dict` (called by
    :class:`~components.ResumeHandler` with the ``sampler`` entry that :class:`~components.ResumableCheckpointSaver`
    wrote) sets a start ``position``, and the next pass yields that epoch's order from there on, once: the remaining
    batches in the same order as an uninterrupted run. ``len()`` stays the full epoch (ignite counts the
    iterations of the epoch from the checkpoint's iteration).
    """

    def __init__(self, dataset: Dataset, shuffle: bool = True, seed: int = 0) -> None:
        super().__init__(dataset, num_replicas=1, rank=0, shuffle=shuffle, seed=seed, drop_last=False)
        self.start = 0

    def __iter__(self):
        indices = list(super().__iter__())
        start, self.start = self.start, 0  # only the first pass after a restart starts late
        return iter(indices[start:])

    def state_dict(self, position: int = 0) -> dict:
        """What identifies this rank's order, and ``position``: the samples of the current epoch already used."""
        return {"seed": int(self.seed), "shuffle": bool(self.shuffle), "num_samples": int(self.num_samples),
                "epoch": int(self.epoch), "position": int(position)}  # fmt: skip

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state`` (see :meth:`state_dict`): the next pass starts at ``state["position"]``.

        Raises:
            ValueError: the seed, shuffling or shard size differ (the order could not be continued), naming both.
        """
        own = self.state_dict()
        keys = ("seed", "shuffle", "num_samples")
        changed = [f"{k} {state.get(k)!r} -> {own[k]!r}" for k in keys if state.get(k) != own[k]]
        if changed:
            raise ValueError(
                f"EpochShuffleSampler: the checkpoint's data order cannot be continued: {', '.join(changed)} "
                "(checkpoint -> this run). Resume with the same seed and data, or start a new run (another ckpt_dir)."
            )
        position = int(state.get("position", 0))
        if not 0 <= position < self.num_samples:
            raise ValueError(
                f"EpochShuffleSampler: position {position} is outside the epoch of {self.num_samples} samples."
            )
        self.set_epoch(int(state.get("epoch", self.epoch)))
        self.start = position


def rotate_smart_cache(dataset: SmartCacheDataset, rotations: int) -> None:
    """Puts a ``SmartCacheDataset`` that has not started where ``rotations`` calls of ``update_cache()`` leave it.

    After ``r`` rotations MONAI's cache holds the (shuffled) items ``r * replace_num ... + cache_num`` (modulo the
    dataset size) in that order. This loads only the items of that window that are not cached yet, instead of
    replaying ``r`` rounds of replacements, so a run restarted at epoch ``r + 1`` sees the same cache as an
    uninterrupted one. It sets the dataset's window fields of MONAI 1.6's ``SmartCacheDataset``.
    """
    if rotations < 0:
        raise ValueError(f"rotations must be >= 0, got {rotations}.")
    if dataset.is_started():
        raise RuntimeError("rotate_smart_cache: the SmartCacheDataset has started; rotate it before start().")
    total, num = dataset._total_num, dataset.cache_num
    start = (rotations * dataset._replace_num) % total
    if start == dataset._start_pos:
        return
    cached = {(dataset._start_pos + i) % total: item for i, item in enumerate(dataset._cache)}
    window = [(start + i) % total for i in range(num)]
    dataset._cache = [cached[pos] if pos in cached else dataset._load_cache_item(pos) for pos in window]
    dataset._start_pos = start
    dataset._compute_data_idx()
    logger.info("smart cache: moved to its window after %d rotation(s) (items %d.. of %d)", rotations, start, total)


class ResumableSmartCacheHandler(SmartCacheHandler):
    """MONAI's ``SmartCacheHandler`` that, on a resumed run, first rotates the cache to where the epochs already
    trained left it (:func:`rotate_smart_cache`), so a restart sees the same volumes as an uninterrupted run.

    Attach it after :class:`~components.ResumeHandler`, which sets ``engine.state.epoch`` to the completed epochs at
    ``STARTED`` (handlers of one event run in the order they were attached).
    """

    def started(self, engine: Engine) -> None:
        if engine.state.epoch > 0 and not self.smartcacher.is_started():
            rotate_smart_cache(self.smartcacher, int(engine.state.epoch))
        super().started(engine)


# ---------------------------------------------------------------------------------------------------------------
# errors that name the data item's files
# ---------------------------------------------------------------------------------------------------------------

#: the message part used when the batch carries no file names
NOT_TRACKED = (
    "not tracked (the batch has no image meta data: load with LoadImaged(image_only=False), as the bundles do, "
    "or keep track_meta=True in the last EnsureTyped)"
)


def _filenames_from(value: Any) -> list[str] | None:
    if value is None:
        return None
    if isinstance(value, (str, os.PathLike)):
        return [str(value)]
    if isinstance(value, Sequence):
        names: list[str] = []
        for v in value:
            names.extend(_filenames_from(v) or [])
        return names
    return [str(value)]


def batch_filenames(batch: Any, image_key: str = "image") -> list[str] | None:
    """The source files of a batch, in order and without repeats (crops of one volume name it once): from the
    image's MetaTensor meta (``filename_or_obj``), else from ``<image_key>_meta_dict``; None when not tracked.
    ``batch`` is a collated dict or, as MONAI's trainers leave it after decollating, a list of per-sample dicts."""
    if isinstance(batch, Sequence) and not isinstance(batch, (str, bytes)):
        per_sample = [batch_filenames(item, image_key) for item in batch if isinstance(item, Mapping)]
        if not per_sample or any(names is None for names in per_sample):
            return None
        return list(dict.fromkeys(name for names in per_sample for name in names))
    if not isinstance(batch, Mapping):
        return None
    names = None
    image = batch.get(image_key)
    if isinstance(image, MetaTensor):
        names = _filenames_from(image.meta.get("filename_or_obj"))
    if not names:
        meta = batch.get(f"{image_key}_meta_dict")
        if isinstance(meta, Mapping):
            names = _filenames_from(meta.get("filename_or_obj"))
    if not names:
        return None
    return list(dict.fromkeys(names))


def item_sources(item: Any) -> dict[str, str]:
    """``{key: source file}`` of one data item, before or after transforms: path strings of a datalist entry,
    ``filename_or_obj`` of MetaTensors and of ``<key>_meta_dict``. Lists (the crops of one item) are merged."""
    if isinstance(item, Sequence) and not isinstance(item, (str, bytes)):
        merged: dict[str, str] = {}
        for element in item:
            merged.update(item_sources(element))
        return merged
    if not isinstance(item, Mapping):
        return {}
    sources: dict[str, str] = {}
    for key, value in item.items():
        name, key = None, str(key)
        if isinstance(value, (str, os.PathLike)):
            name = value
        elif isinstance(value, MetaTensor):
            name = value.meta.get("filename_or_obj")
        elif isinstance(value, Mapping) and key.endswith("_meta_dict"):  # LoadImaged(image_only=False)
            name, key = value.get("filename_or_obj"), key.removesuffix("_meta_dict")
        names = _filenames_from(name)
        if names:
            sources.setdefault(key, ", ".join(names))
    return sources


class DataItemError(RuntimeError):
    """A transform failed on a data item; the message names the item's files, the transform and the root error."""


_TRANSFORM_IN_MESSAGE = re.compile(r"applying transform <?([\w.]+)")


def _describe_failure(err: BaseException) -> str:
    """``"<Transform>: <RootType>: <root message>"`` from MONAI's chain of "applying transform ..." errors."""
    chain, seen = [err], {id(err)}
    while (cause := chain[-1].__cause__ or chain[-1].__context__) is not None and id(cause) not in seen:
        chain.append(cause)
        seen.add(id(cause))
    transforms = [m.group(1).split(".")[-1] for e in chain if (m := _TRANSFORM_IN_MESSAGE.search(str(e)))]
    root = chain[-1]
    where = f"{transforms[-1]}: " if transforms else ""
    return f"{where}{type(root).__name__}: {root}"


class SourceNamingCompose(Compose):
    """The transforms of ``compose`` (the same objects, settings and random state: nothing is re-seeded), with
    errors that name the data item's files.

    MONAI's ``Compose`` reports only the transform ("applying transform <LoadImaged object ...>"), so an error
    while caching a thousand volumes, or in a data-loader worker mid-training, does not say which volume caused
    it. This raises :class:`DataItemError` (chained to the original) naming the stage (caching: the transforms
    before the first random one; after the cache: the rest), the item's files (:func:`item_sources`), the
    transform and the root error. ``CacheDataset`` and ``SmartCacheDataset`` call it with ``start`` / ``end`` like
    any ``Compose``.
    """

    def __init__(self, compose: Compose) -> None:
        if not isinstance(compose, Compose):
            raise TypeError(f"SourceNamingCompose wraps a monai.transforms.Compose, got {type(compose).__name__}.")
        self.__dict__.update(vars(compose))

    def __call__(self, input_, start=0, end=None, threading=False, lazy: bool | None = None):
        try:
            return super().__call__(input_, start=start, end=end, threading=threading, lazy=lazy)
        except DataItemError:
            raise
        except Exception as err:
            stage = "the transforms after the cache" if start else "caching" if end is not None else "a transform"
            sources = item_sources(input_)
            named = ", ".join(f"{k}={v}" for k, v in sources.items()) if sources else "an item with no file names"
            raise DataItemError(f"{stage} failed for {named}: {_describe_failure(err)}") from err
