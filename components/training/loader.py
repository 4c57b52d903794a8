"""A data loader whose worker processes live for the whole run and still draw exactly what fresh ones would.

Starting the loader's workers again at every epoch costs a fork (or a spawn) per worker and the first batches' wait
each epoch, which matters when epochs are short (a finetuning epoch of a few volumes on a GPU). PyTorch's
``persistent_workers=True`` keeps the workers, but then their random state is no longer set per epoch: a fresh
iterator draws a base seed from the loader's generator and every new worker seeds ``random``, ``torch`` and
``numpy`` from it (MONAI's ``worker_init_fn`` then seeds the transforms), while a persistent worker keeps the
stream of its first epoch. Crops would then stop being a function of the seed the trainer sets at each epoch
(``components.training.seeding.reseed_data``), and a resumed run would no longer replay the uninterrupted one.

:class:`PersistentWorkerLoader` keeps the workers and, at each later epoch, draws the base seed exactly as a fresh
iterator would and passes it to the workers through shared memory; before its first batch of the epoch every
worker reseeds itself as a fresh worker with that seed would have been seeded. The batches are then identical to
those of a loader that starts its workers anew every epoch (tested), at none of the start-up cost.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import pydoc
import random
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
from monai.data import DataLoader, SmartCacheDataset
from monai.data.utils import set_rnd
from torch.utils.data import get_worker_info
from torch.utils.data._utils.worker import _generate_state  # a fresh worker's numpy seed: torch has no public route

from ..config.values import as_bool
from ..distributed import get_local_world_size

__all__ = ["PersistentWorkerLoader", "bundle_loader", "default_num_workers"]

logger = logging.getLogger(__name__)

_UNSET = 0  # the shared base seed before the second epoch: workers keep the seed they were started with


class _EpochReseeding:
    """The loader's ``worker_init_fn``: runs the user's (MONAI's) init, then makes the worker's dataset check the
    shared base seed before every batch and reseed when it changed. Picklable for spawned workers."""

    def __init__(self, base_seed: Any, init_fn: Callable[[int], None] | None) -> None:
        self.base_seed, self.init_fn = base_seed, init_fn

    def __call__(self, worker_id: int) -> None:
        if self.init_fn is not None:
            self.init_fn(worker_id)
        info = get_worker_info()
        dataset, state = info.dataset, {"seed": info.seed - worker_id}
        fetch = getattr(dataset, "__getitems__", None) or (lambda indices: [dataset[i] for i in indices])
        shared = self.base_seed

        def getitems(indices: list) -> list:
            current = shared.value
            if current != _UNSET and current != state["seed"]:
                _seed_as_fresh_worker(dataset, current, worker_id)
                state["seed"] = current
            return fetch(indices)

        dataset.__getitems__ = getitems  # the fetcher calls it for every batch (an instance attribute wins)


def _seed_as_fresh_worker(dataset: Any, base_seed: int, worker_id: int) -> None:
    """What PyTorch's worker loop and MONAI's ``worker_init_fn`` do when a worker starts with ``base_seed``."""
    seed = base_seed + worker_id
    random.seed(seed)
    torch.manual_seed(seed)
    np.random.seed(_generate_state(base_seed, worker_id))
    set_rnd(dataset, seed=seed)


class PersistentWorkerLoader(DataLoader):
    """MONAI's ``DataLoader`` with persistent workers that are reseeded at each epoch as fresh workers would be.

    Args:
        dataset: the dataset; not a ``SmartCacheDataset`` when workers persist (its replacement thread updates the
            cache in the main process, which persistent workers would never see).
        num_workers: worker processes; with 0 it is a plain MONAI ``DataLoader``.
        persistent_workers: keep the workers across epochs (only with ``num_workers > 0``).
        kwargs: as ``monai.data.DataLoader`` (``worker_init_fn`` runs first in every worker, as usual).

    Raises:
        ValueError: persistent workers over a ``SmartCacheDataset``.

    Example::

        loader = PersistentWorkerLoader(dataset, batch_size=2, num_workers=4, sampler=sampler)
        for epoch in range(3):
            components.training.seeding.reseed_data(loader, seed + epoch)  # as the trainers do at each epoch start
            for batch in loader: ...
    """

    def __init__(self, dataset: Any, num_workers: int = 0, persistent_workers: bool = True, **kwargs: Any) -> None:
        persistent = bool(persistent_workers) and int(num_workers) > 0
        if persistent and isinstance(dataset, SmartCacheDataset):
            raise ValueError(
                "PersistentWorkerLoader: persistent workers would keep the first cache of a SmartCacheDataset "
                "(it is replaced in the main process every epoch); set persistent_workers false for cache 'smart'."
            )
        context = kwargs.get("multiprocessing_context")
        if context is None or isinstance(context, str):
            context = multiprocessing.get_context(context)
        self._base_seed = context.Value("q", _UNSET)
        if persistent:
            from monai.data.utils import worker_init_fn

            kwargs["worker_init_fn"] = _EpochReseeding(self._base_seed, kwargs.get("worker_init_fn", worker_init_fn))
        super().__init__(dataset, num_workers=num_workers, persistent_workers=persistent, **kwargs)
        self.workers_started = False  # the persistent workers start at the first pass and serve the later ones

    def __iter__(self):
        if self.persistent_workers and self.workers_started:
            # a fresh iterator would draw this base seed from the loader's generator: draw it the same way
            self._base_seed.value = torch.empty((), dtype=torch.int64).random_(generator=self.generator).item()
        self.workers_started = True
        return super().__iter__()


def bundle_loader(dataset: Any, batch_size: int, settings: Mapping[str, Any], training: bool = True,
                  loader_class: str | type | None = None, **kwargs: Any) -> DataLoader:  # fmt: skip
    """A bundle's data loader from its ``loader`` settings (the group, its values as a command line gives them).

    ``num_workers`` worker processes, none with ``data_on_device`` (the cached volumes live on the GPU, which worker
    processes cannot share); pinned host memory with ``pin_memory`` (default: when CUDA is available), never for data
    already on the device; ``prefetch_factor`` batches per worker (PyTorch's default without it). The training loader
    is a :class:`PersistentWorkerLoader` whose workers persist with ``persistent_workers``, except over the "smart"
    ``cache`` (its replacement happens in the main process); another loader is MONAI's ``DataLoader``.

    Args:
        dataset, batch_size: as ``DataLoader``.
        settings: the bundle's ``loader`` group.
        training: the training loader (else, e.g. validation: workers started per pass).
        loader_class: another ``DataLoader`` class, or its name in ``monai.data`` (``"ThreadDataLoader"``: the crops cut
            in a thread beside the GPU work) or a dotted path; it gets the same arguments.
        kwargs: the other ``DataLoader`` arguments (``sampler``, ``shuffle``, ``drop_last`` ...).

    Raises:
        ValueError: a ``loader_class`` name that names no class.

    Example (``train#dataloader`` of a bundle config)::

        {"_target_": "components.bundle_loader", "dataset": "@train#dataset", "batch_size": "@batch_size",
         "settings": "@loader", "sampler": "@train#sampler"}
    """
    on_device = as_bool(settings.get("data_on_device", False), "data_on_device")
    workers = 0 if on_device else int(settings.get("num_workers", 0))
    pin = as_bool(settings.get("pin_memory", torch.cuda.is_available()), "pin_memory") and not on_device
    prefetch = settings.get("prefetch_factor")
    prefetch = None if prefetch is None or not workers else int(prefetch)
    kwargs.update(num_workers=workers, pin_memory=pin, prefetch_factor=prefetch)
    if training:
        persist = as_bool(settings.get("persistent_workers", True), "persistent_workers") and settings.get("cache") != "smart"
        kwargs["persistent_workers"] = persist and workers > 0
    return _loader_class(loader_class, training)(dataset, batch_size=batch_size, **kwargs)


def _loader_class(name: str | type | None, training: bool) -> type:
    """The class :func:`bundle_loader` builds: ``name`` (a class, a name in ``monai.data``, a dotted path), else the
    training loader or MONAI's ``DataLoader``."""
    if name is None:
        return PersistentWorkerLoader if training else DataLoader
    if isinstance(name, type):
        return name
    import monai.data

    found = getattr(monai.data, str(name), None) or pydoc.locate(str(name))
    if not isinstance(found, type):
        raise ValueError(f"bundle_loader: loader_class {name!r} names no class (a name in monai.data or a dotted path).")
    return found


def default_num_workers(max_workers: int = 4) -> int:
    """Data-loader worker processes per rank that this machine has room for: the CPUs this process may run on
    (``os.sched_getaffinity``: a container's or Slurm's CPU set, not the host's count) shared by the ranks of this
    node (``LOCAL_WORLD_SIZE``, set by torchrun: :func:`~components.distributed.get_local_world_size`), less one
    for the training process itself, at most ``max_workers``. On 2 cores: 1 worker for one process, 0 (crops cut in
    the training process) for two ranks.

    Raises:
        ValueError: a ``LOCAL_WORLD_SIZE`` that is not a positive integer.

    Example:
        >>> default_num_workers()  # 16 CPUs, 4 ranks on the node: min(4, 16 // 4 - 1) = 3
        3
    """
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        cpus = os.cpu_count() or 1
    return max(0, min(int(max_workers), cpus // get_local_world_size() - 1))
