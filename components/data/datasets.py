"""Dataset construction: the one place that builds training datasets (this rank's shard, checked, then cached in
memory, or read from an on-disk store), the sampler that shuffles a shard anew every epoch, and a smart cache that
resumes where it was.

Every bundle pipeline runs as a :class:`~components.data.sources.SourceNamingCompose`, so a volume that breaks a
transform at item 700 of caching, or in a loader worker mid-training, is named in the error
(:class:`~components.data.sources.DataItemError`).
"""

from __future__ import annotations

import logging
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import ignite.distributed as idist
import numpy as np
import torch
from ignite.engine import Engine
from monai.data import CacheDataset, Dataset, SmartCacheDataset
from monai.handlers import SmartCacheHandler
from monai.transforms import Compose, LoadImaged, ToDeviced
from torch.utils.data import DistributedSampler

from ..config.values import as_bool, optional_path
from ..distributed import barrier
from .check import check_before_caching
from .datalists import MissingDatalist
from .partition import check_shard_sizes, partition_for_rank
from .sources import SourceNamingCompose

__all__ = [
    "EpochShuffleSampler",
    "ResumableSmartCacheDataset",
    "ResumableSmartCacheHandler",
    "build_dataset",
    "data_pipeline",
]

logger = logging.getLogger("components.data")  # one logger name for the whole package, as the logs show it


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
    check: bool | str = True,
    check_keys: Sequence[str] | None = None,
    roi_size: Sequence[int] | int | None = None,
    channels: int | None = None,
    pixdim: Sequence[float] | float | None = None,
    source: str | Path = "<items>",
    list_name: str = "training",
    store: str | Path | None = None,
    on_read_error: str = "stop",
    source_root: str | Path | None = None,
    source_check: str = "stat",
) -> Dataset:
    """Builds this rank's dataset from ``data``: ``cache`` = "full" (``CacheDataset`` of ``cache_rate`` of the
    shard), "smart" (:class:`ResumableSmartCacheDataset` keeping ``cache_num`` volumes, ``replace_rate`` of them
    replaced each epoch: attach :class:`ResumableSmartCacheHandler`), "none" (plain ``Dataset``) or "disk" (the on-disk
    ``store`` that ``python -m components preprocess`` wrote from ``data``: :func:`~components.data.store.training_store`,
    this rank's volumes, nothing cached and nothing read before the first step; ``transform`` is then the random
    transforms only, see :func:`data_pipeline`; ``on_read_error`` "stop" or "skip" a volume that cannot be read;
    ``source_root`` where the store's sources are now, when they moved; ``source_check`` "stat", "sha256" or "off":
    how this rank's sources are compared with those the store was written from).

    With ``partition`` the list is first split across ranks (``partition_for_rank``); sizes are checked (errors name
    ``list_name`` of ``source``), and with ``check`` every file of the shard is checked from its header
    (``check_before_caching``: missing, truncated, wrong dimensions or ``channels``, image/label mismatch; smaller
    than ``roi_size`` after resampling to ``pixdim`` is a warning; an entry is named by its list, e.g.
    ``validation[0] label``, and an entry's own problems, such as a missing key, name ``source``, e.g. the
    datalist), all before caching, so a bad file stops the run at start-up with one report. The transform is run
    as a :class:`SourceNamingCompose`, so a transform error while caching or in training names the volume. Caching
    runs on ``num_workers`` threads with a progress bar (rank 0), and all ranks meet at a barrier afterwards so none
    enters the first collective while another still caches.
    """
    if isinstance(data, MissingDatalist):  # parsing the bundle without data: nothing to read (see load_split)
        return Dataset(data, transform)
    world_size = idist.get_world_size() if partition else 1
    check_shard_sizes(len(data), world_size, batch_size, cache, cache_num, list_name=list_name, source=source)
    if not isinstance(transform, SourceNamingCompose):
        transform = SourceNamingCompose(transform if isinstance(transform, Compose) else Compose(transform))
    if cache == "disk":
        store = optional_path(store)  # "null" from a command line is None
        if store is None:
            raise ValueError("loader#cache 'disk' reads a store: set loader#store to the folder that `python -m "
                             "components preprocess --datalist LIST --out STORE` wrote.")  # fmt: skip
        from .store import training_store

        dataset = training_store(store, data, transform, shard=partition, seed=seed, on_read_error=on_read_error,
                                 batch_size=batch_size, source=str(source), source_root=source_root,
                                 source_check=source_check)  # fmt: skip
        logger.info("rank %d: %d/%d volumes read from the store %s (cache=disk)", idist.get_rank(), len(dataset), len(data), store)
        return dataset
    shard = partition_for_rank(data, seed=seed) if partition else list(data)
    check_before_caching(shard, keys=check_keys, roi_size=roi_size, enabled=check, channels=channels, pixdim=pixdim,
                         context=list_name, source=str(source))
    show = progress and idist.get_rank() == 0
    workers = max(int(num_workers), 1)
    if cache == "full":
        dataset = CacheDataset(shard, transform, cache_rate=cache_rate, num_workers=workers, progress=show)
    elif cache == "smart":
        dataset = ResumableSmartCacheDataset(
            shard,
            transform,
            replace_rate=replace_rate,
            cache_num=cache_num,
            num_init_workers=workers,
            num_replace_workers=workers,
            progress=show,
            seed=seed + idist.get_rank(),
        )
    else:
        dataset = Dataset(shard, transform)
    logger.info("rank %d: dataset of %d/%d volumes (cache=%s)", idist.get_rank(), len(shard), len(data), cache)
    barrier()
    return dataset


def data_pipeline(
    transforms: Mapping[str, Sequence[Callable]],
    cache: str = "full",
    device: str | torch.device | None = None,
    on_device: bool | str = False,
) -> Compose:
    """A bundle's transforms for its ``loader#cache``: ``transforms["deterministic"]`` then ``transforms["random"]``
    (the bundle's ``train#transforms``), or, with "disk", the random ones alone (the store holds what the
    deterministic ones made), cutting their crops from the store's lazy arrays: the first one does already
    (:class:`~components.data.compact_cache.RandCompactSpatialCropSamplesd`), or a leading ``[SpatialPadd,]
    RandCropByPosNegLabeld`` / ``RandSpatialCropSamplesd`` is replaced by the store crop that does the same
    (:func:`~components.data.store.store_crops`); otherwise :class:`~components.data.store.ReadStoredd` of the
    loaded keys reads whole arrays first.

    With ``on_device`` (``loader#data_on_device``, command-line words accepted) the volumes the deterministic
    transforms made move to ``device`` (``ToDeviced`` of the keys ``LoadImaged`` loads), so a cache holds them there.

    Example (``train#preprocessing`` of a bundle config)::

        {"_target_": "components.data_pipeline", "transforms": "@train#transforms", "cache": "@loader#cache"}
    """
    deterministic, random = list(transforms["deterministic"]), list(transforms.get("random", ()))
    keys = next((t.keys for t in deterministic if isinstance(t, LoadImaged)), ("image",))
    if as_bool(on_device, "data_on_device") and cache != "disk":
        deterministic.append(ToDeviced(keys, device=device))
    if cache != "disk":
        return Compose([*deterministic, *random])
    from .compact_cache import RandCompactSpatialCropSamplesd
    from .store import ReadStoredd, store_crops

    if random and isinstance(random[0], RandCompactSpatialCropSamplesd):
        return Compose(list(random))
    cropped = store_crops(random)
    if cropped is not None:
        return Compose(cropped)
    return Compose([ReadStoredd(keys), *random])


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


class ResumableSmartCacheDataset(SmartCacheDataset):
    """MONAI's ``SmartCacheDataset`` that can start at the cache window of a later epoch (:meth:`rotate`), so a run
    restarted at epoch ``r + 1`` caches and replaces the same volumes as an uninterrupted one.

    After ``r`` calls of ``update_cache()`` MONAI's running window holds the (shuffled) items
    ``r * replace_num ... + cache_num`` (modulo the dataset size), and the replacements continue from there. MONAI
    has no public way to start there but calling ``update_cache()`` ``r`` times, which loads ``r * replace_num``
    items (up to the whole shard); this class shuffles the items itself (as MONAI does: numpy's ``RandomState(seed)``)
    and hands them to MONAI unshuffled, so :meth:`rotate` can give the public ``set_data()`` the same order started
    at the window instead: it loads the window's ``cache_num`` items (dropping the first window, loaded when the
    dataset was built), and every later ``update_cache()`` follows the uninterrupted run.

    Args:
        data, transform, replace_rate, cache_num: as for ``SmartCacheDataset``.
        shuffle: shuffle the items once with ``seed``, as ``SmartCacheDataset`` does.
        seed: the shuffle's seed.
        kwargs: other ``SmartCacheDataset`` arguments (``shuffle`` is handled here).
    """

    def __init__(
        self,
        data: Sequence,
        transform: Callable | None = None,
        replace_rate: float = 0.1,
        cache_num: int = sys.maxsize,
        shuffle: bool = True,
        seed: int = 0,
        **kwargs: Any,
    ) -> None:
        order = list(data)
        if shuffle:
            np.random.RandomState(seed).shuffle(order)
        super().__init__(order, transform, replace_rate=replace_rate, cache_num=cache_num, shuffle=False, **kwargs)
        self.order = order
        # the window's step, as MONAI computes it (R = ceil(N * r), at most the items outside the cache)
        self.replace_num = min(math.ceil(self.cache_num * replace_rate), len(order) - self.cache_num)
        self.window_start = 0

    def rotate(self, rotations: int) -> None:
        """Caches the window that ``rotations`` calls of ``update_cache()`` on a new dataset reach.

        Call it before the first ``update_cache()`` (or ``start()``). The old cache is dropped before the new one is
        filled (``set_data([])``), so memory never holds two caches.

        Raises:
            ValueError: ``rotations`` is negative.
            RuntimeError: the replacement thread has started.
        """
        if rotations < 0:
            raise ValueError(f"rotations must be >= 0, got {rotations}.")
        if self.is_started():
            raise RuntimeError("ResumableSmartCacheDataset.rotate: the replacement thread has started; rotate first.")
        total = len(self.order)
        start = rotations * self.replace_num % total if total else 0
        if start == self.window_start:
            return
        self.set_data([])
        self.set_data(self.order[start:] + self.order[:start])
        self.window_start = start
        logger.info("smart cache: moved to its window after %d rotation(s) (items %d.. of %d)", rotations, start, total)


class ResumableSmartCacheHandler(SmartCacheHandler):
    """MONAI's ``SmartCacheHandler`` that, on a resumed run, first rotates the cache to where the epochs already
    trained left it (:meth:`ResumableSmartCacheDataset.rotate`), so a restart sees the same volumes as an
    uninterrupted run.

    Attach it after :class:`~components.ResumeHandler`, which sets ``engine.state.epoch`` to the completed epochs at
    ``STARTED`` (handlers of one event run in the order they were attached).

    Raises:
        TypeError: ``smartcacher`` is not a :class:`ResumableSmartCacheDataset` (``build_dataset(cache="smart")``).
    """

    def __init__(self, smartcacher: ResumableSmartCacheDataset) -> None:
        if not isinstance(smartcacher, ResumableSmartCacheDataset):
            raise TypeError(
                f"ResumableSmartCacheHandler needs a ResumableSmartCacheDataset (build_dataset(cache='smart')), got "
                f"{type(smartcacher).__name__}."
            )
        super().__init__(smartcacher)

    def started(self, engine: Engine) -> None:
        if engine.state.epoch > 0 and not self.smartcacher.is_started():
            self.smartcacher.rotate(int(engine.state.epoch))
        super().started(engine)
