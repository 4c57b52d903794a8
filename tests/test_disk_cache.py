"""loader#cache "disk" in every bundle: the training dataset read from an on-disk store gives the crops of the in-memory
path for the same random state (and of MONAI's original transforms where the bundle caches compactly), ranks split the
store without overlap, and a store that does not answer the run is refused in one line."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from monai.bundle import ConfigParser

from components.data.store import StoreError, bundle_crop_size, bundle_transforms, preprocess, training_store
from components.data.store.crops import StoreRandCropByPosNegLabeld, StoreRandSpatialCropSamplesd
from components.data.synthetic import write_dataset
from components.config.running import run_config_files
from tests.ranks import run_scenario

REPO = Path(__file__).resolve().parents[1]
SSL, MIM, DINO = "swin_unetr_ssl_pretrain", "swin_unetr_mim_pretrain", "swin_unetr_dino_pretrain"
BTCV, BRATS = "swin_unetr_btcv_finetune", "swin_unetr_brats_finetune"
# small crops and settings per bundle; the same for the store and both in-memory paths
SETTINGS = {
    SSL: {"roi_size": [64, 32, 32], "training#num_samples": 2},
    MIM: {"roi_size": [64, 32, 32], "training#num_samples": 2},
    DINO: {"roi_size": [32, 32, 32], "training#context_size": [48, 48, 48], "training#num_samples": 2},
    BTCV: {"roi_size": [64, 32, 32], "spacing": [3.0, 3.0, 4.0], "training#num_samples": 2,
           "training#rotate90_prob": 0.5, "training#flip_prob": 0.5},
    BRATS: {"roi_size": [64, 32, 32], "spacing": [2.0, 2.0, 2.0], "training#num_samples": 2},
}  # fmt: skip
KIND = {SSL: "ct", MIM: "ct", DINO: "ct", BTCV: "ct", BRATS: "mri"}


@pytest.fixture(scope="module")
def datalists(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("disk_cache_data")
    # 6 volumes: 4 training, 1 validation, 1 test
    return {kind: write_dataset(root / kind, kind=kind, num=6, seed=1) for kind in ("ct", "mri")}


def _parser(bundle: str, datalist: Path, **overrides) -> ConfigParser:
    parser = ConfigParser()
    parser.read_config([str(f) for f in run_config_files(REPO / "bundles" / bundle, ["train.json"])])
    parser.update({"datalist": str(datalist), "loader#check_data": False, "loader#num_workers": 0,
                   **SETTINGS[bundle], **overrides})  # fmt: skip
    return parser


def _store(bundle: str, datalist: Path, folder: Path) -> Path:
    if not (folder / "index.json").is_file():
        parser = _parser(bundle, datalist)
        preprocess(datalist, folder, bundle_transforms(parser), channels=parser["in_channels"],
                   patch_size=bundle_crop_size(parser))
    return folder


def _crops(dataset, seed: int = 3) -> list[dict]:
    """Every item's crops for one seeded pass over the dataset (the random transforms' own generator)."""
    dataset.transform.set_random_state(seed)
    out = []
    for index in range(len(dataset)):
        item = dataset[index]
        out += item if isinstance(item, list) else [item]
    return out


def _assert_same(got: list[dict], want: list[dict], keys: tuple[str, ...], atol: dict | None = None) -> None:
    """Crop for crop equal; within ``atol[key]`` for a key stored with bounded error."""
    assert len(got) == len(want) > 0
    for n, (a, b) in enumerate(zip(got, want)):
        for key in keys:
            x, y = torch.as_tensor(a[key]).as_subclass(torch.Tensor), torch.as_tensor(b[key]).as_subclass(torch.Tensor)
            assert x.shape == y.shape and x.dtype == y.dtype, f"crop {n}, {key}: {x.shape} {x.dtype}, {y.shape} {y.dtype}"
            if (atol or {}).get(key) is None:
                assert torch.equal(x, y), f"crop {n}, {key}: not equal"
            else:
                assert float((x - y).abs().max()) <= atol[key], f"crop {n}, {key}: beyond {atol[key]}"


def _largest_error(store: Path, key: str) -> float:
    """The largest quantization error of ``key`` over the stored volumes (0 when stored exactly)."""
    items = [json.loads(p.read_text()) for p in (store / "volumes").glob("*/item.json")]
    return max(item["arrays"][key].get("max_abs_error", 0.0) for item in items)


@pytest.mark.parametrize("bundle", [SSL, MIM, DINO, BTCV, BRATS])
def test_crops_from_the_store_equal_the_in_memory_path(bundle, datalists, tmp_path_factory):
    """For the same random state: the bundle's training dataset with loader#cache "disk" gives, crop for crop, the
    in-memory dataset's crops (and the labels of the finetuning bundles); where the bundle caches compactly (the
    pretraining bundles), also those of MONAI's original transforms on the full float volume. The BraTS image is
    stored quantized: its crops are within the recorded error (times the random intensity scaling's 1.1). BTCV's
    label-centred crops are drawn from the stored foreground locations: equal in distribution, not draw for draw
    (tests/test_store_crops.py), so here only their number, shapes and types are the in-memory path's."""
    datalist = datalists[KIND[bundle]]
    store = _store(bundle, datalist, tmp_path_factory.mktemp(f"store_{bundle}"))
    keys = ("image", "label") if bundle in (BTCV, BRATS) else ("image",)
    memory = _crops(_parser(bundle, datalist, **{"loader#cache": "none"}).get_parsed_content("train#dataset"))
    disk_dataset = _parser(bundle, datalist, **{"loader#cache": "disk", "loader#store": str(store)}).get_parsed_content(
        "train#dataset")  # fmt: skip
    disk = _crops(disk_dataset)
    if bundle == BTCV:
        assert isinstance(disk_dataset.transform.transforms[0], StoreRandCropByPosNegLabeld)
        assert [(c["image"].shape, c["label"].dtype) for c in disk] == [(c["image"].shape, c["label"].dtype) for c in memory]
        return
    atol = {"image": 1.1 * _largest_error(store, "image") + 1e-6} if bundle == BRATS else None
    if bundle == BRATS:
        assert isinstance(disk_dataset.transform.transforms[0], StoreRandSpatialCropSamplesd) and atol["image"] > 1e-6
    _assert_same(disk, memory, keys, atol)
    if bundle in (SSL, MIM, DINO):
        original = _parser(bundle, datalist, **{"loader#cache": "none", "train#transforms": "%train#plain_transforms"})
        _assert_same(disk, _crops(original.get_parsed_content("train#dataset")), keys)


def test_a_store_of_other_transforms_or_without_the_datalists_volumes_is_refused_in_one_line(datalists, tmp_path):
    """The datalist decides: a subset of the store's volumes trains; a volume the store lacks is refused, named."""
    datalist = datalists["ct"]
    store = _store(SSL, datalist, tmp_path / "store")
    data = json.loads(datalist.read_text())
    entries = [{"image": str(datalist.parent / e["image"])} for e in data["training"]]
    other = bundle_transforms(_parser(SSL, datalist, intensity_range=[-500, 500]))
    from components.data.store import transforms_fingerprint

    with pytest.raises(StoreError, match=r"^.*was written by other deterministic transforms .* rebuild it with `.*`$") as err:
        training_store(store, entries, None, fingerprint=transforms_fingerprint(other))
    assert "components.data.store.preprocess(..., out=" in str(err.value)  # written from Python: no command recorded
    assert "\n" not in str(err.value)
    same = transforms_fingerprint(bundle_transforms(_parser(SSL, datalist)))
    subset = training_store(store, entries[1:3], None, fingerprint=same)
    assert [Path(source).name for _, source in subset.data] == ["case_001.nii.gz", "case_002.nii.gz"]
    held_out = {"image": str(datalist.parent / data["validation"][0]["image"])}
    with pytest.raises(StoreError) as err:
        training_store(store, [*entries[:3], held_out], None, fingerprint=same)
    assert str(err.value) == (
        f"{store} has no volume for 1 of the 4 entries of <items> (e.g. entry 3, {held_out['image']}), looking under "
        f"the source root {datalist.parent}: write them into the store with "
        f"`components.data.store.preprocess(<this datalist>, out={str(store)!r})` (the volumes already there are kept)"
    )


def test_the_disk_cache_needs_a_store(datalists):
    parser = _parser(SSL, datalists["ct"], **{"loader#cache": "disk"})
    with pytest.raises(RuntimeError) as err:
        parser.get_parsed_content("train#dataset")
    assert "set loader#store to the folder" in str(err.value.__cause__)


def test_skipped_volumes_of_the_preprocessing_are_named_not_silent(datalists, tmp_path, caplog):
    datalist = datalists["ct"]
    data = json.loads(datalist.read_text())
    broken = tmp_path / "broken.nii.gz"
    broken.write_bytes(b"not a volume")
    entries = [{"image": str(datalist.parent / e["image"])} for e in data["training"]] + [{"image": str(broken)}]
    transforms = bundle_transforms(_parser(SSL, datalist))
    preprocess(entries, tmp_path / "store", transforms, on_error="skip")
    from components.data.store import transforms_fingerprint

    caplog.set_level(logging.WARNING, logger="components.data")
    dataset = training_store(tmp_path / "store", entries, None, fingerprint=transforms_fingerprint(transforms))
    assert len(dataset) == 4
    assert any(str(broken) in r.getMessage() and "not trained on" in r.getMessage() for r in caplog.records)


# ---------------------------------------------------------------- ranks split the store


def _rank_sources(store: str, rank: int) -> dict:
    from components.data.store import StoreDataset

    dataset = StoreDataset(store, shard=True, seed=5)
    return {"sources": [source for _, source in dataset.data]}


def test_two_ranks_read_disjoint_equal_shards_covering_the_store(datalists, tmp_path):
    datalist = datalists["ct"]
    store = _store(SSL, datalist, tmp_path / "store")
    from functools import partial

    (tmp_path / "ranks").mkdir()
    first, second = run_scenario(partial(_rank_sources, str(store)), tmp_path / "ranks", world=2, timeout=120)
    assert len(first["sources"]) == len(second["sources"]) == 2  # the 4 training volumes
    assert not set(first["sources"]) & set(second["sources"])
    stored = {e["image"] for e in json.loads(datalist.read_text())["training"]}
    assert {Path(s).name for s in first["sources"] + second["sources"]} == {Path(s).name for s in stored}


def test_a_store_and_its_data_copied_elsewhere_give_the_same_crops_with_loader_source_root(datalists, tmp_path):
    """The bundle's ids: the data and the store copied to another folder, read with loader#source_root there."""
    import shutil

    datalist = datalists["ct"]
    store = _store(SSL, datalist, tmp_path / "store")
    shutil.copytree(datalist.parent, tmp_path / "moved")
    shutil.copytree(store, tmp_path / "moved_store")
    moved = tmp_path / "moved" / datalist.name
    memory = _crops(_parser(SSL, moved, **{"loader#cache": "none"}).get_parsed_content("train#dataset"))
    disk = _parser(SSL, moved, **{"loader#cache": "disk", "loader#store": str(tmp_path / "moved_store"),
                                  "loader#source_root": str(tmp_path / "moved")}).get_parsed_content("train#dataset")  # fmt: skip
    assert all(source.startswith(str(tmp_path / "moved" / "imagesTr")) for _, source in disk.data)
    _assert_same(_crops(disk), memory, ("image",))
