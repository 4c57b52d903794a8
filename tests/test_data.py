"""Datalist reading, rank partitioning and dataset construction."""

from __future__ import annotations

import json
import re
import traceback

import nibabel as nib
import numpy as np
import pytest
import torch
from monai.data import CacheDataset, DataLoader, Dataset, SmartCacheDataset
from monai.transforms import Compose, EnsureChannelFirstd, Lambda, LoadImaged, RandomizableTransform

from components.data import (
    EpochShuffleSampler,
    MissingDatalist,
    ResumableSmartCacheDataset,
    build_dataset,
    check_shard_sizes,
    load_datalist,
    load_split,
    partition_for_rank,
    require_datalist,
    split_for_rank,
)
from components.data.synthetic import split_sizes
from components.data import DataCheckError
from components.data import DataItemError


def _items(n: int) -> list[dict]:
    return [{"image": f"case_{i:03d}.nii.gz"} for i in range(n)]


def test_load_datalist_makes_paths_absolute(tmp_path):
    path = tmp_path / "dataset.json"
    path.write_text(json.dumps({"training": [{"image": "a.nii.gz"}], "validation": [{"image": "b.nii.gz"}]}))
    items = load_datalist(path, "training")
    assert items == [{"image": str(tmp_path / "a.nii.gz")}]
    assert load_datalist(path, "validation", base_dir="/data") == [{"image": "/data/b.nii.gz"}]


def test_load_datalist_errors_name_file_and_key(tmp_path):
    missing = tmp_path / "nope.json"
    with pytest.raises(FileNotFoundError, match="nope.json"):
        load_datalist(missing)
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(ValueError, match="broken.json.*not valid JSON"):
        load_datalist(broken)
    wrong_key = tmp_path / "wrong.json"
    wrong_key.write_text(json.dumps({"train": []}))
    with pytest.raises(KeyError, match="no 'training' list; it has: \\['train'\\]"):
        load_datalist(wrong_key)
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"training": []}))
    with pytest.raises(ValueError, match="'training' list .* is empty"):
        load_datalist(empty)


def test_partition_is_disjoint_equal_and_deterministic():
    data = _items(10)
    shards = [partition_for_rank(data, seed=3, rank=r, world_size=4) for r in range(4)]
    assert [len(s) for s in shards] == [3, 3, 3, 3]  # even_divisible: every rank runs the same iterations
    names = [d["image"] for s in shards for d in s]
    assert set(names) == {d["image"] for d in data}  # every volume is used, 2 of them twice
    assert len(names) - len(set(names)) == 2
    assert shards == [partition_for_rank(data, seed=3, rank=r, world_size=4) for r in range(4)]
    assert shards != [partition_for_rank(data, seed=4, rank=r, world_size=4) for r in range(4)]
    assert partition_for_rank(data, seed=3, rank=0, world_size=1) == data


@pytest.mark.parametrize(
    "num, world, batch, cache, cache_num, match",
    [
        (3, 2, 2, "full", None, "the 'training' list has 3 volume\\(s\\), too few for 2 rank\\(s\\) x batch_size 2"),
        (1, 2, 1, "none", None, "synth --num 10`\\), run at most 1 rank\\(s\\)"),
        (8, 2, 2, "smart", None, "cache_num >= 1"),
        (8, 2, 2, "smart", 1, "cache_num=1 is smaller than batch_size=2"),
        (8, 2, 2, "smart", 5, "cache_num=5 exceeds the 4 volumes of each rank's shard"),
        (8, 2, 2, "memory", None, "cache must be one of"),
        (8, 2, 0, "full", None, "batch_size must be >= 1"),
    ],
)
def test_shard_size_errors_give_numbers_and_fix(num, world, batch, cache, cache_num, match):
    with pytest.raises(ValueError, match=match):
        check_shard_sizes(num, world, batch, cache, cache_num)


def test_shard_sizes_accept_valid_configurations():
    check_shard_sizes(4, 2, 2, "full")
    check_shard_sizes(8, 2, 2, "smart", cache_num=4)


def test_too_small_lists_name_the_list_size_world_and_a_synth_that_fits():
    """Item: the documented 2-rank command on `synth --num 6` data (1 validation volume). The validation split fails
    before any caching in one line; the synth --num it suggests really writes enough volumes for the ranks."""
    with pytest.raises(ValueError) as err:
        split_for_rank(_items(1), "validation", "data/ct/dataset.json", rank=0, world_size=2)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("the 'validation' list of 'data/ct/dataset.json' has 1 volume(s), too few for 2 rank(s)")
    assert "`python -m components synth --num 10`" in message and "run at most 1 rank(s)" in message
    assert split_sizes(10)[1] >= 2 and split_sizes(9)[1] < 2  # the smallest --num that gives 2 validation volumes
    with pytest.raises(ValueError) as err:
        check_shard_sizes(5, 3, 2, list_name="training", source="d.json")
    message = str(err.value)
    assert message.startswith("the 'training' list of 'd.json' has 5 volume(s), too few for 3 rank(s) x batch_size 2")
    num = int(re.search(r"synth --num (\d+)`", message).group(1))  # 6 training and 3 validation volumes
    assert split_sizes(num)[0] >= 6 and split_sizes(num)[1] >= 3
    assert split_sizes(num - 1)[0] < 6 or split_sizes(num - 1)[1] < 3


def test_split_for_rank_interleaves_without_padding():
    items = _items(5)
    parts = [split_for_rank(items, rank=r, world_size=2) for r in range(2)]
    assert parts == [[items[0], items[2], items[4]], [items[1], items[3]]]
    assert split_for_rank(items, rank=0, world_size=1) == items


def test_missing_datalist_parses_to_an_empty_list_and_the_run_stops(tmp_path, caplog):
    """A bundle is checkable without data: a missing datalist is an empty list (one WARNING), datasets built from it
    read nothing, and require_datalist (a run's first step) raises naming the file."""
    missing = tmp_path / "data" / "dataset.json"
    with caplog.at_level("WARNING", logger="components.data"):
        train, val = load_split(missing, "training"), load_split(missing, "validation")
    assert isinstance(train, MissingDatalist) and train == [] and val == []
    assert sum("does not exist" in r.getMessage() for r in caplog.records) == 1
    dataset = build_dataset(train, _double, batch_size=2, progress=False)
    assert len(dataset) == 0
    assert split_for_rank(val, rank=1, world_size=2) is val
    with pytest.raises(FileNotFoundError, match="dataset.json' does not exist"):
        require_datalist(missing)
    missing.parent.mkdir()
    missing.write_text("{}")
    require_datalist(missing)


def test_datalist_without_validation_gets_a_fixed_split(tmp_path, caplog):
    """A plain Decathlon datalist (training + test): a fixed fifth of training is held out for validation, the
    rest trains; the two parts are disjoint, cover the list and do not depend on the call order."""
    path = tmp_path / "dataset.json"
    path.write_text(json.dumps({"training": _items(10), "test": _items(2)}))
    with caplog.at_level("WARNING", logger="components.data"):
        val = load_split(path, "validation")
        train = load_split(path, "training")
    assert len(val) == 2 and len(train) == 8
    names = sorted(d["image"] for d in val + train)
    assert names == sorted(str(tmp_path / d["image"]) for d in _items(10))
    assert load_split(path, "validation") == val  # deterministic
    messages = [r.getMessage() for r in caplog.records if "no 'validation' list" in r.getMessage()]
    assert len(messages) == 1 and "validating on 2 of its 10 'training' volumes" in messages[0]
    assert load_split(path, "test") == load_datalist(path, "test")
    path.write_text(json.dumps({"training": _items(1)}))
    with pytest.raises(ValueError, match="no 'validation' list and only 1 'training' volume"):
        load_split(path, "validation")
    path.write_text(json.dumps({"training": _items(3), "validation": _items(1)}))
    assert load_split(path, "training") == load_datalist(path, "training")  # an explicit list is used as it is


def test_in_channels_that_disagree_with_the_data_stop_before_caching(tmp_path):
    """4-channel MRI given to a 1-channel network: the check before caching names the file, its channels and the
    setting (in_channels), and nothing is cached."""
    from components.data.synthetic import write_dataset

    items = load_datalist(write_dataset(tmp_path, kind="mri", num=3), "training")
    calls = []
    with pytest.raises(DataCheckError) as err:
        build_dataset(items, lambda x: calls.append(x) or x, channels=1, progress=False)
    line = next(line for line in str(err.value).splitlines() if line.startswith("ERROR"))
    assert "is 4D with 4 channels" in line and "expected 1 channel (a bundle's in_channels" in line
    assert calls == []


def _double(item: dict) -> dict:
    return {"image": torch.full((1, 2, 2, 2), float(item["image"]) * 2)}


@pytest.mark.parametrize("cache, cls", [("full", CacheDataset), ("smart", ResumableSmartCacheDataset), ("none", Dataset)])
def test_build_dataset_modes(cache, cls):
    data = [{"image": i} for i in range(6)]
    # in-memory items, not files: the header check is off
    dataset = build_dataset(data, _double, cache=cache, cache_num=3, batch_size=1, num_workers=2, progress=False, check=False)
    assert type(dataset) is cls
    expected = 3 if cache == "smart" else 6
    assert len(dataset) == expected
    values = sorted(float(dataset[i]["image"][0, 0, 0, 0]) for i in range(len(dataset)))
    assert all(v % 2 == 0 for v in values) and len(set(values)) == expected


def test_build_dataset_checks_sizes_before_caching():
    calls = []

    def transform(item):
        calls.append(item)
        return item

    with pytest.raises(ValueError, match="too few"):
        build_dataset([{"image": 0}], transform, batch_size=2, progress=False, check=False)
    assert calls == []  # nothing was cached


def test_build_dataset_checks_files_before_caching(tmp_path):
    calls = []

    def transform(item):
        calls.append(item)
        return item

    missing = str(tmp_path / "case_007.nii.gz")
    with pytest.raises(DataCheckError, match="case_007.nii.gz"):
        build_dataset([{"image": missing}], transform, progress=False)
    assert calls == []  # stopped before caching


class _FailOn(RandomizableTransform):
    """A random (so: after the cache) transform that raises on one volume, as a broken crop would."""

    def __init__(self, bad: str) -> None:
        super().__init__(prob=1.0)
        self.bad = bad

    def __call__(self, data: dict) -> dict:
        self.randomize(None)
        if self.bad in str(data["image"].meta["filename_or_obj"]):
            raise ValueError("crop outside the volume")
        return data


@pytest.mark.parametrize("cache", ["full", "smart", "none"])
def test_transform_errors_in_training_name_the_file(tmp_path, cache):
    """An error in a random transform, raised in a DataLoader worker process, names the volume: MONAI's own
    message names only the transform."""
    paths = []
    for i in range(3):
        paths.append(str(tmp_path / f"case_{i:03d}.nii.gz"))
        nib.save(nib.Nifti1Image(np.full((4, 4, 4), i, np.float32), np.eye(4)), paths[-1])
    transform = Compose([LoadImaged("image", image_only=True), EnsureChannelFirstd("image"), _FailOn("case_001")])
    dataset = build_dataset([{"image": p} for p in paths], transform, cache=cache, cache_num=2, progress=False)
    loader = DataLoader(dataset, batch_size=1, num_workers=1)
    with pytest.raises(DataItemError) as raised:
        list(loader)
    message = str(raised.value)
    # The traceback's frames hold the loader's iterator in a reference cycle: cleared here, its worker is shut down
    # now; left to a later garbage collection, torch waits out its 5 s join timeout in another test.
    traceback.clear_frames(raised.tb)
    stage = "a transform" if cache == "none" else "the transforms after the cache"
    assert f"{stage} failed for image={paths[1]}: _FailOn: ValueError: crop outside the volume" in message
    assert "DataLoader worker process 0" in message


def test_caching_errors_name_the_file(tmp_path):
    good, bad = str(tmp_path / "good.nii.gz"), str(tmp_path / "bad.nii.gz")
    nib.save(nib.Nifti1Image(np.zeros((4, 4, 4), np.float32), np.eye(4)), good)
    (tmp_path / "bad.nii.gz").write_bytes((tmp_path / "good.nii.gz").read_bytes()[:-20])
    items = [{"image": good, "label": good}, {"image": bad, "label": good}]
    transform = Compose([LoadImaged(["image", "label"], image_only=True), _FailOn("nothing")])
    with pytest.raises(DataItemError, match=rf"^caching failed for image={bad}, label={good}: LoadImaged: \w+Error: "):
        build_dataset(items, transform, progress=False, check=False, num_workers=1)


def test_epoch_shuffle_sampler_reshuffles_per_epoch_without_splitting():
    dataset = list(range(12))
    sampler = EpochShuffleSampler(dataset, seed=5)
    orders = []
    for epoch in range(3):
        sampler.set_epoch(epoch)
        orders.append(list(sampler))
    assert all(sorted(o) == dataset for o in orders)  # the whole shard every epoch, no padding, no split
    assert orders[0] != orders[1] != orders[2]
    replay = EpochShuffleSampler(dataset, seed=5)
    replay.set_epoch(1)
    assert list(replay) == orders[1]  # resuming at epoch 1 replays the same order


# ------------------------------------------------------------------------ a restart continues the epoch


class _Killed(Exception):
    """Stands for the process being killed before an iteration: the checkpoint of the one before is the last."""


def _order_run(tmp_path, cache: str, max_epochs: int, kill_at: int | None = None, resume: bool = False) -> list[int]:
    """A MONAI workflow over 7 in-memory volumes (batch 1) with the bundles' sampler, smart-cache handler, saver and
    resume handler; returns the volume ids of every iteration it ran (up to ``kill_at`` exclusive)."""
    from monai.engines import Workflow

    from components import ResumableCheckpointSaver, ResumableSmartCacheHandler, ResumeHandler

    data = [{"image": i} for i in range(7)]
    dataset = build_dataset(data, _double, cache=cache, cache_num=4, replace_rate=0.5, batch_size=1, num_workers=1,
                            progress=False, check=False)  # fmt: skip
    sampler = EpochShuffleSampler(dataset, seed=3)
    loader = DataLoader(dataset, batch_size=1, sampler=sampler, num_workers=0)
    seen: list[int] = []

    def step(engine, batch):
        if engine.state.iteration == kill_at:
            raise _Killed()
        seen.append(int(batch["image"].flatten()[0]) // 2)

    net = torch.nn.Linear(1, 1)
    trainer = Workflow(device="cpu", max_epochs=max_epochs, data_loader=loader, iteration_update=step)
    path = tmp_path / "checkpoint.pt"
    ResumeHandler(path if resume else None, {"model": net, "sampler": sampler}).attach(trainer)
    if cache == "smart":
        ResumableSmartCacheHandler(dataset).attach(trainer)
    ResumableCheckpointSaver(tmp_path, {"model": net, "sampler": sampler}, iteration_interval=1).attach(trainer)
    try:
        trainer.run()
    except _Killed:
        pass
    finally:
        if cache == "smart":
            dataset.shutdown()
    return seen


@pytest.mark.parametrize("cache", ["full", "smart", "none"])
def test_restart_mid_epoch_continues_the_epoch_in_order(tmp_path, cache):
    """Killed at iteration k of epoch 2 (and of epoch 3), restarted each time: the volumes seen, iteration by
    iteration, are those of the uninterrupted run; the smart cache is rotated to its epoch's window."""
    straight = _order_run(tmp_path / "straight", cache, max_epochs=3)
    per_epoch = 4 if cache == "smart" else 7
    assert len(straight) == 3 * per_epoch
    kills = [per_epoch + 2, 2 * per_epoch + 3]  # mid-epoch 2 and mid-epoch 3
    run = tmp_path / "killed"
    seen = _order_run(run, cache, max_epochs=3, kill_at=kills[0])
    seen += _order_run(run, cache, max_epochs=3, kill_at=kills[1], resume=True)
    seen += _order_run(run, cache, max_epochs=3, resume=True)
    assert seen == straight
    state = torch.load(run / "checkpoint.pt", weights_only=True)
    assert state["sampler"]["position"] == 0 and state["trainer"]["iteration"] == 3 * per_epoch


def _window(dataset) -> list[int]:
    return [int(dataset[i]["image"].flatten()[0]) // 2 for i in range(len(dataset))]


@pytest.mark.parametrize("rotations", [1, 3, 7])
def test_rotated_smart_cache_is_monai_window_after_as_many_updates(rotations):
    """``rotate(r)`` caches what ``r`` ``update_cache()`` calls of MONAI's own ``SmartCacheDataset`` (same seed) cache,
    loading the window's 4 items only, and later updates continue MONAI's sequence (7 items, 2 replaced per epoch:
    3 rotations wrap around the end, 7 are a whole period)."""
    data = [{"image": i} for i in range(7)]
    loads: list[int] = []

    def counted(item):
        loads.append(item["image"])
        return _double(item)

    monai_cache = SmartCacheDataset(data, _double, replace_rate=0.5, cache_num=4, seed=3, progress=False)
    cached = Lambda(counted)  # a MONAI transform that is not random: its results are what the cache holds
    ours = ResumableSmartCacheDataset(data, cached, replace_rate=0.5, cache_num=4, seed=3, progress=False)
    assert _window(ours) == _window(monai_cache)  # MONAI's shuffle with the same seed
    for _ in range(rotations):
        monai_cache.update_cache()
    ours.rotate(rotations)
    try:
        assert _window(ours) == _window(monai_cache)
        assert len(loads) == (4 if rotations == 7 else 8)  # the first window, then the rotated one (7: the same)
        for _ in range(2):
            monai_cache.update_cache()
            ours.update_cache()
            assert _window(ours) == _window(monai_cache)
        with pytest.raises(RuntimeError, match="has started"):
            ours.rotate(1)
    finally:
        monai_cache.shutdown()
        ours.shutdown()


def test_resumable_smart_cache_handler_needs_the_resumable_dataset():
    from components import ResumableSmartCacheHandler

    plain = SmartCacheDataset([{"image": i} for i in range(3)], _double, cache_num=2, progress=False)
    with pytest.raises(TypeError, match="needs a ResumableSmartCacheDataset.*got SmartCacheDataset"):
        ResumableSmartCacheHandler(plain)


def test_sampler_position_is_saved_and_another_order_is_refused(tmp_path):
    from ignite.engine import Engine

    from components import CheckpointLoadError, ResumeHandler

    seen = _order_run(tmp_path, "none", max_epochs=1, kill_at=4)
    assert len(seen) == 3
    state = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    assert state["sampler"] == {"seed": 3, "shuffle": True, "num_samples": 7, "epoch": 1, "position": 3}
    assert state["trainer"]["batch_size"] == 1
    other = EpochShuffleSampler(list(range(7)), seed=4)  # another seed: another order of the epoch
    trainer = Engine(lambda e, b: None)
    ResumeHandler(tmp_path / "checkpoint.pt", {"model": torch.nn.Linear(1, 1), "sampler": other}).attach(trainer)
    with pytest.raises(CheckpointLoadError, match=r"checkpoint.pt.*cannot be continued: seed 3 -> 4"):
        trainer.run(list(range(7)), max_epochs=1)
