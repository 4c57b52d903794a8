"""Rank partitioning: which items of a list each rank caches, trains or validates on, and the size checks that fail
before any caching.

Under DDP every rank must cache only its own shard (a cache of the whole list on
every rank multiplies the memory by the world size): the datalist is
partitioned with a fixed seed into equal shards before any caching, each rank builds one dataset of its
shard, and sizes are validated before the (possibly hour-long) caching starts.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import ignite.distributed as idist
import numpy as np
from monai.data import partition_dataset

from ..errors import ConfigError
from .synthetic import split_sizes
from .datalists import MissingDatalist

__all__ = ["check_shard_sizes", "partition_for_rank", "split_for_rank"]

CACHE_MODES = ("full", "smart", "none", "disk")


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
        raise ConfigError(f"cache must be one of {CACHE_MODES}, got {cache!r}.")
    if batch_size < 1:
        raise ConfigError(f"batch_size must be >= 1, got {batch_size}.")
    if num_items < world_size * batch_size:
        raise ConfigError(
            f"{_list_label(list_name, source)} has {num_items} volume(s), too few for {world_size} rank(s) x "
            f"batch_size {batch_size} (each rank needs one full batch per epoch): add volumes (synthetic data: "
            f"`{_synth_hint(world_size, batch_size)}`), run at most {max(num_items // batch_size, 1)} rank(s), "
            f"or use a batch_size of at most {max(num_items // world_size, 1)}."
        )
    shard = math.ceil(num_items / world_size)
    if cache == "smart":
        if cache_num is None or cache_num < 1:
            raise ConfigError(f"cache='smart' needs cache_num >= 1 (volumes kept per rank), got {cache_num}.")
        if cache_num < batch_size:
            raise ConfigError(f"cache_num={cache_num} is smaller than batch_size={batch_size}; use cache_num >= {batch_size}.")
        if cache_num > shard:
            raise ConfigError(
                f"cache_num={cache_num} exceeds the {shard} volumes of each rank's shard "
                f"({num_items} volumes over {world_size} ranks); use cache_num <= {shard}."
            )


def partition_for_rank(
    data: Sequence[dict], seed: int = 0, rank: int | None = None, world_size: int | None = None
) -> list[dict]:
    """This rank's shard: a seeded shuffle split into equal parts (short shards repeat an item), so every rank
    runs the same number of iterations. The whole list on one process."""
    world_size = idist.get_world_size() if world_size is None else world_size
    rank = idist.get_rank() if rank is None else rank
    if world_size == 1:
        return list(data)
    return partition_dataset(data, num_partitions=world_size, shuffle=True, seed=seed, even_divisible=True)[rank]


def shard_indices(count: int, seed: int = 0, rank: int | None = None, world_size: int | None = None) -> np.ndarray:
    """The positions, in a list of ``count`` items, of the items :func:`partition_for_rank` gives this rank, in its
    order, without the list: a numpy array of ``ceil(count / world_size)`` indices (8 bytes per item while it is
    drawn), for a list too long to hold as Python objects.

    Example:
        >>> [data[i] for i in shard_indices(len(data), seed=3)] == partition_for_rank(data, seed=3)
        True
    """
    world_size = idist.get_world_size() if world_size is None else world_size
    rank = idist.get_rank() if rank is None else rank
    indices = np.arange(count)
    if world_size == 1:
        return indices
    if count < world_size:
        raise ValueError(f"{count} item(s) cannot be split into {world_size} shards.")
    np.random.RandomState(seed).shuffle(indices)  # the shuffle of monai.data.partition_dataset, on an array
    total = math.ceil(count / world_size) * world_size
    indices = np.concatenate([indices, indices[: total - count]])  # short shards repeat an item
    return indices[rank:total:world_size]


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
    world_size = idist.get_world_size() if world_size is None else world_size
    rank = idist.get_rank() if rank is None else rank
    if isinstance(data, MissingDatalist):
        return data
    if len(data) < world_size:
        raise ConfigError(
            f"{_list_label(list_name, source)} has {len(data)} volume(s), too few for {world_size} rank(s) (each rank "
            f"evaluates at least one): add volumes (synthetic data: `{_synth_hint(world_size)}`) or run at most "
            f"{max(len(data), 1)} rank(s)."
        )
    return partition_dataset(list(data), num_partitions=world_size, shuffle=False, even_divisible=False)[rank]
