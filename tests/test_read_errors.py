"""loader#on_read_error "skip" for real: stored volumes that cannot be read are skipped in the loader's worker
processes, counted in the training process over workers, epochs and ranks, told once per epoch with the run's
total, kept in the trainer's metrics, and capped by loader#max_read_errors (components/data/store/read_errors.py,
components/training/read_errors.py)."""

from __future__ import annotations

import logging
import os
import shutil
from functools import partial
from pathlib import Path

import pytest
from ignite.engine import Engine, Events
from monai.data import DataLoader

from components import PersistentWorkerLoader, SkippedReads, StoreDataset, StoreError, bundle_transforms, open_store
from components import preprocess
from components.demo.runner import bundle_dir
from tests.ranks import run_scenario
from tests.test_store import _corrupt_chunk, write_tiny_ct

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")  # Orientationd's `labels` default notice

BROKEN = (0, 2)  # volumes 0 and 2 cannot be read: the next volume of the shard (1 and 3) takes each one's place


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    """The SSL bundle's store (roi 16) of 4 tiny volumes; volume 0 has a corrupt chunk, volume 2 no item.json."""
    root = tmp_path_factory.mktemp("read_errors")
    datalist = write_tiny_ct(root / "data")
    preprocess(datalist, root / "store", bundle_transforms(bundle_dir("swin_unetr_ssl_pretrain"), {"roi_size": [16] * 3}))
    entries = open_store(root / "store").entries
    _corrupt_chunk(root / "store" / "volumes" / entries[0]["id"] / "image.b2nd", 0)
    (root / "store" / "volumes" / entries[2]["id"] / "item.json").unlink()
    return root / "store"


def _read_source(item: dict) -> str:
    """The whole image read (every chunk checked), then the volume's source: which volume a batch holds."""
    item["image"].read()
    return os.path.basename(item["image"].source)


def _dataset(store: Path) -> StoreDataset:
    return StoreDataset(store, transform=_read_source, on_read_error="skip")


def _sources(store: Path) -> list[str]:
    return [os.path.basename(e["source"]["image"]) for e in open_store(store).entries]


@pytest.mark.parametrize("loader", [DataLoader, PersistentWorkerLoader], ids=["fresh_workers", "persistent_workers"])
def test_skips_in_two_loader_workers_are_counted_in_the_training_process(store, loader):
    """Two workers each skip one broken volume per epoch (fresh workers every epoch, or workers kept for the run);
    the training process, which read nothing itself, counts all 4 skips of the 2 epochs and names both volumes."""
    dataset = _dataset(store)
    names = _sources(store)
    batches = loader(dataset, batch_size=1, num_workers=2)
    for _ in range(2):
        assert [b[0] for b in batches] == [names[1], names[1], names[3], names[3]]  # each broken one replaced
    assert dataset.skipped_reads == 4
    assert [os.path.basename(s) for s in dataset.unreadable_volumes()] == [names[0], names[2]]


def _engine(dataset: StoreDataset, max_read_errors: int | None) -> Engine:
    engine = Engine(lambda engine, batch: batch)
    SkippedReads(dataset, max_read_errors).attach(engine)
    return engine


def test_one_line_per_epoch_gives_the_run_total_and_the_metrics_hold_it(store, caplog):
    dataset = _dataset(store)
    engine = _engine(dataset, max_read_errors=2)  # 2 unreadable volumes: at the cap, not beyond it
    with caplog.at_level(logging.WARNING, logger="components.data"):
        engine.run(DataLoader(dataset, batch_size=1, num_workers=2), max_epochs=3)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("loader#on_read_error skip: ")]
    assert lines == [
        f"loader#on_read_error skip: 2 read(s) of unreadable stored volumes skipped in epoch {epoch}, {2 * epoch} in "
        "the run, of 2 volume(s) over 1 rank(s) (loader#max_read_errors: 2)"
        for epoch in (1, 2, 3)
    ]
    assert engine.state.metrics == {"store_skipped_reads": 6, "store_unreadable_volumes": 2}


def test_more_unreadable_volumes_than_the_cap_stop_the_run_in_one_line(store):
    dataset = _dataset(store)
    engine = _engine(dataset, max_read_errors=1)
    with pytest.raises(StoreError) as caught:
        engine.run(DataLoader(dataset, batch_size=1, num_workers=2), max_epochs=3)
    message = str(caught.value)
    assert "\n" not in message and engine.state.epoch == 1  # stopped in the first epoch, at the second volume
    names = _sources(store)
    assert message.startswith(f"2 stored volume(s) could not be read on rank 0, more than loader#max_read_errors 1 "
                              f"(e.g. {Path(store).parent}/data/images/{names[0]}, ")  # fmt: skip
    assert f"components.open_store('{store}').verify()" in message and "remove their volume folders" in message


def test_the_cap_is_checked_and_nothing_attached_where_nothing_is_skipped(store):
    for bad in (-1, 1.5, True, "3"):
        with pytest.raises(ValueError, match="loader#max_read_errors must be null or an integer >= 0"):
            SkippedReads(_dataset(store), bad)
    for dataset, counted in ((StoreDataset(store, on_read_error="stop"), False), ([1, 2, 3], False),
                             (_dataset(store), True)):  # fmt: skip
        engine, handler = Engine(lambda engine, batch: batch), SkippedReads(dataset, 0)
        handler.attach(engine)
        attached = (engine.has_event_handler(handler.check_rank, Events.ITERATION_COMPLETED),
                    engine.has_event_handler(handler.epoch_completed, Events.EPOCH_COMPLETED))  # fmt: skip
        assert attached == (counted, counted) and handler.active == counted


# ---------------------------------------------------------------- ranks


def _rank_run(store: str, rank: int) -> dict:
    """One rank: its shard of the store (seed 0: one broken volume each), one loader worker, two epochs under
    SkippedReads."""
    dataset = StoreDataset(store, transform=_read_source, shard=True, seed=0, on_read_error="skip")
    engine = _engine(dataset, max_read_errors=None)
    engine.run(DataLoader(dataset, batch_size=1, num_workers=1), max_epochs=2)
    return {"local": dataset.skipped_reads, "shard": [os.path.basename(s) for _, s in dataset.data],
            "metrics": dict(engine.state.metrics)}  # fmt: skip


def test_two_ranks_count_the_run_total_over_both(store, tmp_path):
    """Each rank skips the broken volume of its own shard; both end with the run's totals (an all_reduce at every
    epoch's end)."""
    (tmp_path / "ranks").mkdir()
    first, second = run_scenario(partial(_rank_run, str(store)), tmp_path / "ranks", world=2, timeout=180)
    names = _sources(store)
    broken = {names[i] for i in BROKEN}
    assert sorted(first["shard"] + second["shard"]) == sorted(names)
    for result in (first, second):  # its broken volume is read (and skipped) once per epoch
        assert len(broken & set(result["shard"])) == 1 and result["local"] == 2
    assert first["metrics"] == second["metrics"] == {"store_skipped_reads": 4, "store_unreadable_volumes": 2}
