"""loader#on_read_error "skip" for real: stored volumes that cannot be read are skipped in the loader's worker
processes, counted in the training process over workers, epochs and ranks, told once per epoch with the run's
total, kept in the trainer's metrics, and capped by loader#max_read_errors (components/data/store/read_errors.py,
components/training/read_errors.py)."""

from __future__ import annotations

import logging
import os
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


def _volumes(store: Path) -> list[tuple[str, str]]:
    """The (id, image source) of every stored volume, in the store's order."""
    opened = open_store(store)
    return [(e["id"], opened.source(e)) for e in opened.entries]


def _sources(store: Path) -> list[str]:
    return [os.path.basename(source) for _, source in _volumes(store)]


@pytest.mark.parametrize("loader, context", [(DataLoader, None), (PersistentWorkerLoader, None),
                                             (PersistentWorkerLoader, "spawn")],
                         ids=["fresh_workers", "persistent_workers", "spawned_workers"])  # fmt: skip
def test_skips_in_two_loader_workers_are_counted_in_the_training_process(store, loader, context):
    """Two workers each skip one broken volume per epoch (fresh forked workers every epoch, forked workers kept for
    the run, or spawned ones, to which the dataset travels pickled); the training process, which read nothing
    itself, counts all 4 skips of the 2 epochs and names both volumes."""
    dataset = _dataset(store)
    names = _sources(store)
    batches = loader(dataset, batch_size=1, num_workers=2, multiprocessing_context=context)
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


# ---------------------------------------------------------------- the SSL bundle under torchrun (slow)

import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

from components import write_dataset  # noqa: E402
from components.data.partition import partition_for_rank  # noqa: E402
from components.demo.runner import read_scalars  # noqa: E402
from tests.probes import read_volumes  # noqa: E402
from tests.test_multi_gpu_bundle import BUNDLE, CONFIGS, TINY, _bundle_args, _env, _launch_all, _torchrun  # noqa: E402
from tests.test_multi_gpu_bundle import _write_datalist  # noqa: E402


@pytest.fixture(scope="module")
def bundle_store(tmp_path_factory) -> tuple[Path, Path, str]:
    """6 synthetic CT volumes (4 training, 2 validation), the SSL bundle's store of the training ones at its tiny
    settings, and the source of the volume made unreadable (a corrupt chunk): the first of rank 1's shard."""
    root = tmp_path_factory.mktemp("bundle_read_errors")
    write_dataset(root / "data", kind="ct", num=6, seed=0)
    datalist = _write_datalist(root / "data", "datalist.json", [0, 1, 2, 3], [4, 5])
    preprocess(datalist, root / "store", bundle_transforms(BUNDLE, {"roi_size": [64, 32, 32]}))
    volume, source = partition_for_rank(_volumes(root / "store"), seed=0, rank=1, world_size=2)[0]  # training#seed 0
    _corrupt_chunk(root / "store" / "volumes" / volume / "image.b2nd", 0)
    return datalist, root / "store", os.path.basename(source)


def _store_overrides(datalist: Path, store: Path, tmp: Path, **extra) -> dict:
    return {**TINY, "dataset_dir": datalist.parent, "datalist": datalist, "ckpt_dir": tmp / "models",
            "output_dir": tmp / "eval", "max_epochs": 2, "speed#use_checkpoint": "false", "loader#cache": "disk",
            "loader#store": store, "loader#on_read_error": "skip", "loader#num_workers": 1, **extra}  # fmt: skip


@pytest.mark.slow
def test_two_ranks_with_loader_workers_train_from_the_store_and_count_the_skips_of_both(bundle_store, tmp_path):
    """torchrun, 2 gloo ranks, one loader worker each, 2 epochs, on_read_error skip: rank 1's worker cannot read one
    volume of its shard; the run ends normally, every batch came from its rank's shard of the store (rank 1 trains
    twice on its other volume), the volume is named once, and rank 0's line of each epoch gives the run's total over
    both ranks, as the TensorBoard metrics do."""
    datalist, store, broken = bundle_store
    order = tmp_path / "order.rank"
    record = f"$probes.record_lr(@train#trainer, {str(order)!r} + str(components.get_rank()))"
    extra = tmp_path / "extra.json"
    extra.write_text(json.dumps({"run": ["$import tests.probes as probes", record, "$@train#trainer.run()"]}))
    overrides = _store_overrides(datalist, store, tmp_path)
    cmd = _torchrun("--standalone", "--nnodes=1", "--nproc_per_node=2", *_bundle_args(CONFIGS + [str(extra)], overrides))
    (launch,) = _launch_all([cmd], _env(None), tmp_path, timeout=420)
    assert launch.code == 0 and not launch.timed_out, launch.ok()
    output = launch.output
    assert output.count("a stored volume cannot be read") == 1 and f"(from {datalist.parent}/imagesTr/{broken})" in output
    for epoch in (1, 2):
        assert (f"loader#on_read_error skip: 1 read(s) of unreadable stored volumes skipped in epoch {epoch}, {epoch} in "
                "the run, of 1 volume(s) over 2 rank(s) (loader#max_read_errors: no limit)") in output, launch.ok()
    shards = {rank: [os.path.basename(s) for _, s in partition_for_rank(
        _volumes(store), seed=0, rank=rank, world_size=2)]
        for rank in (0, 1)}  # fmt: skip
    for rank in (0, 1):
        seen = [os.path.basename(v) for _, volumes in read_volumes(f"{order}{rank}") for v in volumes]
        assert len(seen) == 4 and set(seen) <= set(shards[rank]) - {broken}, (rank, seen, shards)
    assert [os.path.basename(v) for v in seen] == [shards[1][1]] * 4  # rank 1: its readable volume, every time
    scalars = read_scalars(tmp_path / "eval")
    assert scalars["store_skipped_reads"] == [(1, 1.0), (2, 2.0)] and scalars["store_unreadable_volumes"] == [(1, 1.0), (2, 1.0)]


@pytest.mark.slow
def test_a_run_with_more_unreadable_volumes_than_max_read_errors_stops_in_one_line(bundle_store, tmp_path):
    """One process with a loader worker, loader#max_read_errors 0: the first skipped volume stops the run, exit 1,
    with one line on stderr naming the cap, the volume and what to do."""
    datalist, store, broken = bundle_store
    overrides = _store_overrides(datalist, store, tmp_path, **{"loader#max_read_errors": 0})
    overrides.pop("dist_timeout_s")  # an id of multi_gpu_train.json only
    args = _bundle_args(["configs/common.json", "configs/train.json"], overrides)
    proc = subprocess.run([sys.executable, *args], cwd=BUNDLE, env=_env(None), capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(lines) == 1 and lines[0].startswith("swin_unetr_ssl_pretrain: error: StoreError: 1 stored volume(s) "
                                                   "could not be read on rank 0, more than loader#max_read_errors 0 "
                                                   f"(e.g. {datalist.parent}/imagesTr/{broken}): "), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
