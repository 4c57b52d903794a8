"""The store's index (components/data/store/index.py and dataset.py): a store read where its sources moved (a
symlinked or copied folder and ``source_root``), any subset of its volumes trained on (the datalist decides), a
changed source named and rewritten, the index of 0.4.0 refused in one line and rewritten by the same command, and a
rank that reads only its shard's entries of the index, not the corpus's."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch

from components import StoreError, bundle_transforms, open_store, preprocess, transforms_fingerprint
from components.data.datalists import load_datalist
from components.data.partition import partition_for_rank, shard_indices
from components.data.store import StoreDataset, training_store
from components.data.store.format import FORMAT_VERSION
from components.data.store.index import HEADER, find_rows, key_hashes, merge_parts, read_entries, write_part
from components.data.store.transforms import build_transforms
from components.data.store.values import encode_value
from tests.ranks import run_scenario
from tests.test_store import ROI, SSL, write_tiny_ct

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")  # Orientationd's `labels` default notice

TRANSFORMS = bundle_transforms(SSL, {"roi_size": ROI})
FINGERPRINT = transforms_fingerprint(TRANSFORMS)


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Path, Path]:
    """Four tiny CT volumes and their SSL store (roi 16): (datalist, store). Tests that change them copy them."""
    root = tmp_path_factory.mktemp("index")
    datalist = write_tiny_ct(root / "data")
    preprocess(datalist, root / "store", TRANSFORMS)
    return datalist, root / "store"


def _copy(built: tuple[Path, Path], to: Path, reindex: bool = False) -> tuple[Path, Path]:
    """The data and the store copied under ``to`` with their files' times (``shutil.copy2``); with ``reindex`` the
    copy's index rewritten for the copied data (nothing decoded: every volume is kept)."""
    datalist, store = built
    shutil.copytree(datalist.parent, to / "data")
    shutil.copytree(store, to / "store")
    if reindex:
        assert preprocess(to / "data" / "dataset.json", to / "store", TRANSFORMS).reused == 4
    return to / "data" / "dataset.json", to / "store"


def _image(dataset: StoreDataset, index: int) -> torch.Tensor:
    return dataset[index]["image"].read()


# ---------------------------------------------------------------------------------------------- stores that move


def test_a_store_is_read_where_its_sources_are_now_with_source_root(built, tmp_path):
    """The same files through a symlinked folder, then the data and the store copied elsewhere: without
    ``source_root`` the run is refused naming the folder to set; with it, every volume is served and read."""
    datalist, store = built
    expected = [_image(StoreDataset(store), i) for i in range(4)]
    link = tmp_path / "mounted"
    link.symlink_to(datalist.parent, target_is_directory=True)
    through_link = load_datalist(link / "dataset.json")
    with pytest.raises(StoreError) as err:
        training_store(store, through_link, None, fingerprint=FINGERPRINT)
    assert str(err.value) == (
        f"{store} has no volume for 4 of the 4 entries of <items> (e.g. entry 0, {link}/images/case_0.nii.gz), looking "
        f"under the source root {datalist.parent}: the store's sources are these files under {link}: set "
        f"loader#source_root {link} (the store was written from {datalist.parent})"
    )
    served = training_store(store, through_link, None, fingerprint=FINGERPRINT, source_root=link)
    assert [source for _, source in served.data] == [str(link / "images" / f"case_{i}.nii.gz") for i in range(4)]
    assert all(torch.equal(_image(served, i), expected[i]) for i in range(4))

    copied_list, copied_store = _copy(built, tmp_path / "elsewhere")
    served = training_store(copied_store, load_datalist(copied_list), None, fingerprint=FINGERPRINT,
                            source_root=copied_list.parent)  # fmt: skip
    assert [source for _, source in served.data] == [str(copied_list.parent / f"images/case_{i}.nii.gz") for i in range(4)]
    assert all(torch.equal(_image(served, i), expected[i]) for i in range(4))
    assert all(str(copied_store) in str(served[i]["image"].path) for i in range(4))  # the copy's files are read


def test_any_subset_of_the_store_trains_in_the_datalists_order(built):
    datalist, store = built
    items = load_datalist(datalist)
    subset = training_store(store, [items[3], items[1]], None, fingerprint=FINGERPRINT)
    assert [Path(source).name for _, source in subset.data] == ["case_3.nii.gz", "case_1.nii.gz"]
    assert torch.equal(_image(subset, 0), _image(StoreDataset(store), 3))


def test_preprocess_after_the_sources_moved_rewrites_the_index_and_keeps_the_volumes(built, tmp_path):
    """The issue's case: the data reached through a symlink, ``--overwrite true`` rewrote nothing and training was
    refused again. Now the rerun keeps the 4 volumes, records the new root, and a run from there needs no setting."""
    datalist, store = _copy(built, tmp_path)
    link = tmp_path / "mounted"
    link.symlink_to(datalist.parent, target_is_directory=True)
    summary = preprocess(link / "dataset.json", store, TRANSFORMS, overwrite=True)
    assert (summary.written, summary.reused) == (0, 4)
    assert open_store(store).source_root == str(link)
    served = training_store(store, load_datalist(link / "dataset.json"), None, fingerprint=FINGERPRINT)
    assert [source for _, source in served.data] == [str(link / f"images/case_{i}.nii.gz") for i in range(4)]


def test_the_preprocess_command_records_the_source_root_it_is_given(tmp_path, capsys):
    from components.__main__ import preprocess as command

    datalist = write_tiny_ct(tmp_path / "data" / "ct", num=2)
    command(str(datalist), str(tmp_path / "store"), bundle=str(SSL), overrides={"roi_size": ROI},
            source_root=str(tmp_path / "data"))  # fmt: skip
    assert "2 written" in capsys.readouterr().out
    store = open_store(tmp_path / "store")
    assert store.source_root == str(tmp_path / "data") and store.entries[1]["key"] == "ct/images/case_1.nii.gz"
    assert store.index["command"].endswith(f"--source_root {tmp_path / 'data'}")


# ---------------------------------------------------------------------------------------------- stale sources


def test_a_changed_source_is_named_in_one_line_and_only_its_volume_is_rewritten(built, tmp_path):
    datalist, store = _copy(built, tmp_path, reindex=True)
    items = load_datalist(datalist)
    image = datalist.parent / "images" / "case_2.nii.gz"
    other = write_tiny_ct(tmp_path / "other", seed=7).parent / "images" / "case_2.nii.gz"
    before = image.stat().st_size
    assert other.stat().st_size != before
    shutil.copyfile(other, image)  # rewritten in place: another size and time
    with pytest.raises(StoreError) as err:
        training_store(store, items, None, fingerprint=FINGERPRINT)
    line = str(err.value)
    assert "\n" not in line
    assert re.fullmatch(
        rf"{store}: 1 of this rank's 4 volume\(s\) were stored from sources that changed since, e\.g\. volume "
        rf"case_2-[0-9a-f]{{12}}: {image}: {image.stat().st_size:,} bytes, stored from {before:,}: rewrite them with "
        rf"`components\.data\.store\.preprocess\(.*overwrite=True\) as it was written` \(it writes the changed volumes "
        r"only\), or train on the store as it is with loader#source_check off; a copy without its files' times looks "
        r"modified: loader#source_check sha256 compares their content",
        line,
    ), line
    summary = preprocess(datalist, store, TRANSFORMS)
    assert (summary.written, summary.reused) == (1, 3)
    served = training_store(store, items, None, fingerprint=FINGERPRINT)
    fresh = build_transforms(TRANSFORMS)({"image": str(image)})["image"]
    assert torch.equal(_image(served, 2), fresh)


def test_a_copy_without_its_times_is_told_by_content(built, tmp_path):
    datalist, store = built
    copy = tmp_path / "copy"
    shutil.copytree(datalist.parent, copy, copy_function=shutil.copyfile)  # new times, the same bytes
    items = load_datalist(copy / "dataset.json")
    with pytest.raises(StoreError, match=r"case_0.nii.gz: modified .*, stored from the file of .*: rewrite them with"):
        training_store(store, items, None, fingerprint=FINGERPRINT, source_root=copy)
    assert len(training_store(store, items, None, fingerprint=FINGERPRINT, source_root=copy, source_check="sha256")) == 4
    assert len(training_store(store, items, None, fingerprint=FINGERPRINT, source_root=copy, source_check="off")) == 4
    (copy / "images" / "case_1.nii.gz").write_bytes(b"x" * (copy / "images" / "case_1.nii.gz").stat().st_size)
    with pytest.raises(StoreError, match=r"volume case_1-\w+: .*case_1.nii.gz: SHA-256 \w{12}, stored from \w{12}"):
        training_store(store, items, None, fingerprint=FINGERPRINT, source_root=copy, source_check="sha256")


def _stale_on_one_rank(store: str, items: list, rank: int) -> dict:
    try:
        training_store(store, items, None, fingerprint=FINGERPRINT, seed=2)
    except StoreError as err:
        return {"error": str(err)}
    return {"error": None}


def test_a_source_changed_in_one_ranks_shard_stops_every_rank(built, tmp_path):
    """Each rank checks only its shard's sources; one collective makes the refusal every rank's (no rank goes on
    to wait in the first training collective)."""
    datalist, store = _copy(built, tmp_path, reindex=True)
    items = load_datalist(datalist)
    (datalist.parent / "images" / "case_1.nii.gz").write_bytes(b"changed")
    (tmp_path / "ranks").mkdir()
    results = run_scenario(partial(_stale_on_one_rank, str(store), items), tmp_path / "ranks", world=2, timeout=180)
    errors = sorted(r["error"] or "" for r in results)
    assert errors[0].startswith(f"{store}: 1 of this rank's 2 volume(s) were stored from sources that changed since")
    assert "case_1.nii.gz: 7 bytes" in errors[0]
    assert errors[1].startswith(f"{store}: another rank found volumes stored from sources that changed since")


# ---------------------------------------------------------------------------------------------- 0.4.0's index


def _as_040(store: Path) -> None:
    """Rewrites a store's index and item files as 0.4.0 wrote them: one index.json holding every entry, entries with
    the datalist entry (``source``) and the absolute sources' SHA-256, no source root, no columns."""
    index = json.loads((store / "index.json").read_text())
    root = index.pop("source_root")
    entries = []
    for path in (store / "volumes").glob("*/item.json"):
        stored = json.loads(path.read_text())
        entry = stored["entry"]
        files = [str(Path(root) / f["path"]) for f in entry.pop("files")]
        entry.pop("key")
        entry["source"] = encode_value({"image": files[0]})
        entry["sha256"] = {f: hashlib.sha256(Path(f).read_bytes()).hexdigest() for f in files}
        path.write_text(json.dumps({**stored, "entry": entry}))
        entries.append(entry)
    entries.sort(key=lambda entry: entry["position"])
    for field in ("index_layout", "count"):
        index.pop(field)
    (store / "index.json").write_text(json.dumps({**index, "entries": entries}))
    header = json.loads((store / HEADER).read_text())
    header.pop("source_root")
    (store / HEADER).write_text(json.dumps(header))
    shutil.rmtree(store / "index")


def test_the_index_of_040_is_refused_in_one_line_and_rewritten_keeping_the_volumes(built, tmp_path):
    datalist, store = _copy(built, tmp_path, reindex=True)
    _as_040(store)
    with pytest.raises(StoreError) as err:
        open_store(store)
    assert str(err.value) == (
        f"{store} has the index of 0.4.0 (one index.json that every rank loads whole): rewrite it with "
        f"`components.data.store.preprocess(..., out={str(store)!r}, overwrite=True) as it was written`, which keeps "
        "the stored volumes and writes the index this version reads"
    )
    summary = preprocess(datalist, store, TRANSFORMS)
    assert (summary.written, summary.reused) == (0, 4)
    assert [e["files"][0]["path"] for e in open_store(store).entries] == [f"images/case_{i}.nii.gz" for i in range(4)]
    assert len(training_store(store, load_datalist(datalist), None, fingerprint=FINGERPRINT)) == 4


# ---------------------------------------------------------------------------------------------- a rank's shard


def _synthetic_store(root: Path, count: int, parts: int = 3) -> list[dict]:
    """A store's index of ``count`` entries and no volumes, written in ``parts`` parts and merged as preprocessing
    does; returns the datalist its sources make (files under /sources that do not exist)."""
    root.mkdir(parents=True)
    header = {"format_version": FORMAT_VERSION, "fingerprint": FINGERPRINT, "transforms": TRANSFORMS, "datalist_sha256": "d",
              "source_root": "/sources", "command": None}  # fmt: skip
    (root / HEADER).write_text(json.dumps(header))
    entries = [{"id": f"case_{i}-0", "position": i, "key": f"images/case_{i}.nii.gz",
                "files": [{"path": f"images/case_{i}.nii.gz", "size": 1, "mtime_ns": 1, "sha256": "0"}],
                "arrays": {}, "spacing": None, "values": {}} for i in range(count)]  # fmt: skip
    for part in range(parts):
        write_part(root, part, parts, {"fingerprint": FINGERPRINT, "datalist_sha256": "d", "skipped": [], "failed": []},
                   entries[part::parts])  # fmt: skip
    merge_parts(root, parts)
    return [{"image": f"/sources/images/case_{i}.nii.gz"} for i in range(count)]


def test_a_rank_reads_its_shards_entries_of_the_index_not_the_corpus(tmp_path, monkeypatch):
    """1,000 indexed volumes on 4 ranks: each rank's StoreDataset and training dataset read 250 entries of the index
    (counted where entries are read) and hold 250; index.json, what every rank reads whole, holds no entry."""
    from components.data.store import dataset as module

    data = _synthetic_store(tmp_path / "store", 1000)
    assert (tmp_path / "store" / "index.json").stat().st_size < len(json.dumps(TRANSFORMS)) + 1000
    read = []
    monkeypatch.setattr(module, "read_entries",
                        lambda root, rows, fields=None: read.append(len(rows)) or read_entries(root, rows, fields))  # fmt: skip
    served = {}
    for rank in range(4):
        monkeypatch.setattr("ignite.distributed.get_rank", lambda rank=rank: rank)
        monkeypatch.setattr("ignite.distributed.get_world_size", lambda: 4)
        read.clear()
        dataset = StoreDataset(tmp_path / "store", shard=True, seed=1)
        assert read == [250] and len(dataset.data) == 250
        read.clear()
        trained = training_store(tmp_path / "store", data, None, seed=1, fingerprint=FINGERPRINT, source_check="off")
        assert read == [250] and len(trained.data) == 250
        served[rank] = [volume for volume, _ in trained.data]
    assert sorted(v for shard in served.values() for v in shard) == sorted(f"case_{i}-0" for i in range(1000))
    ids = [f"case_{i}-0" for i in range(1000)]
    assert served[2] == partition_for_rank(ids, seed=1, rank=2, world_size=4)


def test_shard_indices_select_what_partition_for_rank_gives(tmp_path):
    for count, world, seed in ((7, 2, 0), (10, 3, 5), (1000, 8, 1), (9, 9, 2)):
        items = list(range(count))
        for rank in range(world):
            got = [items[i] for i in shard_indices(count, seed, rank, world)]
            assert got == partition_for_rank(items, seed=seed, rank=rank, world_size=world), (count, world, rank)
    assert shard_indices(5, 0, 0, 1).tolist() == [0, 1, 2, 3, 4]


def test_keys_are_found_by_hash_and_an_empty_index_finds_none(tmp_path):
    _synthetic_store(tmp_path / "some", 10)
    hashes = key_hashes(["images/case_7.nii.gz", "images/case_10.nii.gz", "images/case_0.nii.gz"])
    assert find_rows(tmp_path / "some", hashes).tolist() == [7, -1, 0]
    _synthetic_store(tmp_path / "none", 0, parts=1)
    assert len(open_store(tmp_path / "none")) == 0 and find_rows(tmp_path / "none", hashes).tolist() == [-1] * 3
    assert np.load(tmp_path / "some" / "index" / "offsets.npy").shape == (11,)


@pytest.mark.slow
def test_the_ssl_bundle_trains_on_a_subset_of_a_store_that_moved_with_its_data(tmp_path):
    """A store and its data written in one folder and moved (the first folder is gone): the SSL bundle trains one
    epoch on two of its four training volumes with loader#source_root naming the new folder."""
    from components.data.synthetic import write_dataset
    from tests.test_pretrain_bundle import TINY, _bundle_copy, _run

    datalist = write_dataset(tmp_path / "built" / "ct", kind="ct", num=6, seed=0)
    bundle = _bundle_copy(tmp_path)
    preprocess(datalist, tmp_path / "built" / "store", bundle_transforms(bundle, {"roi_size": TINY["roi_size"]}))
    shutil.move(tmp_path / "built", tmp_path / "moved")
    data = tmp_path / "moved" / "ct"
    lists = json.loads((data / "dataset.json").read_text())
    (data / "subset.json").write_text(json.dumps({**lists, "training": lists["training"][:2]}))
    output = _run(bundle, {**TINY, "network_def#window_size": 4, "max_epochs": 1, "datalist": str(data / "subset.json"),
                           "loader#cache": "disk", "loader#store": str(tmp_path / "moved" / "store"),
                           "loader#source_root": str(data)})  # fmt: skip
    assert f"rank 0: 2/2 volumes read from the store {tmp_path / 'moved' / 'store'}" in output
    assert "Epoch: 1/1, Iter: 1/2" in output and (bundle / "models" / "model.pt").is_file()
