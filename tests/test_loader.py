"""PersistentWorkerLoader: workers kept across epochs draw exactly what workers started anew every epoch draw."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch
from monai.data import Dataset, SmartCacheDataset
from monai.transforms import Randomizable, Transform

from components import EpochShuffleSampler, PersistentWorkerLoader
from components.training.seeding import epoch_seed, reseed_data


class RandomDraws(Randomizable, Transform):
    """Returns draws of every random source a transform may use (its own RandomState, numpy's, torch's, Python's)
    and the process that made them."""

    def randomize(self, data=None) -> None:
        self.value = self.R.randint(10**9)

    def __call__(self, item: dict) -> dict:
        self.randomize()
        return {"index": item["index"], "own": self.value, "numpy": int(np.random.randint(10**9)),
                "torch": int(torch.randint(10**9, (1,))), "python": random.randrange(10**9), "pid": os.getpid()}  # fmt: skip


def _dataset() -> Dataset:
    return Dataset([{"index": i} for i in range(8)], transform=RandomDraws())


def _epochs(persistent: bool, epochs: range, reseed: bool = True, workers: int = 2) -> list[list[dict]]:
    dataset = _dataset()
    sampler = EpochShuffleSampler(dataset, seed=3)
    loader = PersistentWorkerLoader(dataset, batch_size=2, sampler=sampler, num_workers=workers,
                                    persistent_workers=persistent)  # fmt: skip
    torch.manual_seed(0)
    out = []
    for epoch in epochs:
        sampler.set_epoch(epoch)
        if reseed:
            reseed_data(loader, epoch_seed(0, epoch, 0))  # what the trainers do at each epoch start
        out.append([{k: v.tolist() for k, v in batch.items()} for batch in loader])
    return out


def _draws(epochs: list[list[dict]]) -> list:
    return [[{k: v for k, v in batch.items() if k != "pid"} for batch in epoch] for epoch in epochs]


def _pids(epoch: list[dict]) -> set[int]:
    return {pid for batch in epoch for pid in batch["pid"]}


@pytest.mark.parametrize("reseed", [True, False])
def test_persistent_workers_draw_what_fresh_workers_draw(reseed):
    persistent, fresh = _epochs(True, range(1, 4), reseed), _epochs(False, range(1, 4), reseed)
    assert _draws(persistent) == _draws(fresh)
    assert _draws(persistent)[0] != _draws(persistent)[1]  # the epochs differ
    assert _pids(persistent[0]) == _pids(persistent[2]) and len(_pids(persistent[0])) == 2  # the same two workers
    assert not _pids(fresh[0]) & _pids(fresh[2])  # fresh ones each epoch


def test_a_resumed_run_replays_the_uninterrupted_epoch():
    """A new loader (new workers) started at epoch 3 draws what the uninterrupted loader drew in its epoch 3."""
    assert _draws(_epochs(True, range(3, 4))) == _draws(_epochs(True, range(1, 4)))[2:]


def test_smart_cache_needs_fresh_workers():
    smart = SmartCacheDataset([{"index": i} for i in range(4)], transform=RandomDraws(), cache_num=2, progress=False)
    with pytest.raises(ValueError, match="persistent_workers false for cache 'smart'"):
        PersistentWorkerLoader(smart, num_workers=1)
    assert not PersistentWorkerLoader(smart, num_workers=1, persistent_workers=False).persistent_workers


def test_without_workers_it_is_a_plain_loader():
    loader = PersistentWorkerLoader(_dataset(), num_workers=0)
    assert not loader.persistent_workers and len(list(loader)) == 8
