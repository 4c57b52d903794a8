"""The finetuning crops from the store (components/data/store/crops.py, foreground.py): each crop reads only the
chunks it covers (counted), label-centred crops follow RandCropByPosNegLabeld's statistics (positive share, class
shares, centre distribution, a positive crop holds its class), random crops are RandSpatialCropSamplesd's draw for
draw; and what the store keeps for them: chunks sized from the crop, float images quantized within a recorded
bound, the stored array's affine and spacing in the stored axis order."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
import torch
from monai.data import MetaTensor
from monai.transforms import Compose, RandCropByPosNegLabeld, RandSpatialCropSamplesd, SpatialPadd
from monai.transforms.utils import correct_crop_centers

from components.data.store import StoreDataset, bundle_transforms, open_store, preprocess
from components.data.store.crops import StoreRandCropByPosNegLabeld, StoreRandSpatialCropSamplesd, store_crops
from components.data.store.foreground import sample_locations
from components.data.store.format import chunk_numbers, layout
from components.data.store.handle import StoredArray
from components.data.store.transforms import build_transforms
from components.demo.runner import bundle_dir

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")  # Orientationd's `labels` default notice

SHAPE = (80, 72, 64)
PATCH = [32, 32, 32]
TRANSFORMS = [
    {"_target_": "LoadImaged", "keys": ["image", "label"], "image_only": False},
    {"_target_": "EnsureChannelFirstd", "keys": ["image", "label"]},
    {"_target_": "ScaleIntensityRanged", "keys": ["image"], "a_min": -175, "a_max": 250, "b_min": 0.0, "b_max": 1.0,
     "clip": True},
]  # fmt: skip


def _write_case(root: Path, index: int, shape=SHAPE) -> dict:
    """An int16 CT-like volume (a body ellipsoid in air, so that much of label 0 is air: image 0 after scaling) and
    its uint8 labels: a large organ 1, a small organ 2, a tiny organ 3."""
    rng = np.random.default_rng(index)
    x, y, z = np.meshgrid(*(np.linspace(-1, 1, n) for n in shape), indexing="ij")
    body = (x / 0.85) ** 2 + (y / 0.7) ** 2 < 1.0
    label = np.zeros(shape, np.uint8)
    label[body & ((x + 0.3) ** 2 + y**2 + z**2 < 0.2)] = 1
    label[body & ((x - 0.45) ** 2 + (y - 0.1) ** 2 + (z - 0.3) ** 2 < 0.02)] = 2
    label[body & ((x - 0.2) ** 2 + (y + 0.4) ** 2 + (z + 0.5) ** 2 < 0.004)] = 3
    image = np.where(body, 40.0, -1000.0) + 60.0 * label + rng.normal(0, 10, shape)
    (root / "images").mkdir(parents=True, exist_ok=True)
    (root / "labels").mkdir(exist_ok=True)
    affine = np.diag([0.8, 0.8, 2.0, 1.0])
    nib.save(nib.Nifti1Image(np.rint(image).astype(np.int16), affine), root / "images" / f"case_{index}.nii.gz")
    nib.save(nib.Nifti1Image(label, affine), root / "labels" / f"case_{index}.nii.gz")
    return {"image": str(root / "images" / f"case_{index}.nii.gz"), "label": str(root / "labels" / f"case_{index}.nii.gz")}


@pytest.fixture(scope="module")
def labeled(tmp_path_factory):
    """Two labeled volumes, their store (crops of 32^3, floats exact so that crops compare bit for bit) and their
    in-memory items: (entries, store folder, in-memory items)."""
    root = tmp_path_factory.mktemp("labeled")
    entries = [_write_case(root / "data", i) for i in range(2)]
    preprocess(entries, root / "store", TRANSFORMS, patch_size=PATCH, floats="exact")
    memory = [build_transforms(TRANSFORMS)(dict(e)) for e in entries]
    return entries, root / "store", memory


def _plain(x) -> np.ndarray:
    return np.asarray(x.as_tensor() if isinstance(x, MetaTensor) else x)


class _ReadCounter:
    """Records the chunks of each array file every ``StoredArray`` read covers (``_stored``: where every read of a
    region, ``handle[region]`` or ``read_into``, is checked and decompressed)."""

    def __init__(self, monkeypatch) -> None:
        self.reads: list[tuple[str, list[int]]] = []
        original = StoredArray._stored

        def counting(handle, region):
            self.reads.append((handle.path.name, chunk_numbers(handle.shape, handle.record["chunks"], region)))
            return original(handle, region)

        monkeypatch.setattr(StoredArray, "_stored", counting)

    def chunks(self, name: str) -> list[list[int]]:
        return [numbers for file, numbers in self.reads if file == name]


# ----------------------------------------------------------------------------------------------- what is stored


def test_chunks_and_blocks_follow_the_crop_size():
    assert layout((1, 200, 180, 120), (96, 96, 96)) == ((1, 48, 48, 48), (1, 16, 16, 16))
    assert layout((4, 200, 180, 120), (128, 128, 128)) == ((1, 64, 64, 64), (1, 16, 16, 16))
    assert layout((1, 200, 180, 40), (64, 32, 48)) == ((1, 32, 16, 32), (1, 16, 16, 16))  # half the crop, by 16
    assert layout((1, 200, 10, 40), (96, 96, 96)) == ((1, 48, 10, 40), (1, 16, 10, 16))  # never beyond the array
    assert layout((1, 200, 180, 40)) == ((1, 64, 64, 40), (1, 32, 32, 32))  # no crop size: 64^3 chunks
    with pytest.raises(ValueError, match="patch_size \\[96, 96\\] has 2 axes, the array 3"):
        layout((1, 10, 10, 10), (96, 96))


def test_the_store_keeps_locations_chunks_from_the_crop_size_and_the_stored_affine(labeled):
    entries, store, memory = labeled
    item = json.loads(next((store / "volumes").glob("case_0-*/item.json")).read_text())
    assert item["arrays"]["image"]["chunks"] == [1, 16, 16, 16]
    assert np.allclose(item["arrays"]["image"]["affine"], np.diag([0.8, 0.8, 2.0, 1.0]))
    label = _plain(memory[0]["label"]).astype(int)
    counts = {c: int((label == c).sum()) for c in range(4)}
    recorded = item["locations"]["label"]
    assert {int(c): v["count"] for c, v in recorded["classes"].items()} == counts
    assert recorded["image_key"] == "image" and recorded["spatial_shape"] == list(SHAPE)
    rows = {int(c): v["stop"] - v["start"] for c, v in recorded["classes"].items()}
    assert rows[0] == max(10_000, -(-counts[0] // 100)) < counts[0]  # the background: sampled
    assert all(rows[c] == counts[c] for c in (1, 2, 3) if counts[c] <= 10_000)  # small classes: every voxel
    assert open_store(store).entries[0]["spacing"] == pytest.approx([0.8, 0.8, 2.0])


def test_sampled_locations_are_of_their_class_with_the_image_value_and_the_same_every_time():
    rng = np.random.default_rng(0)
    label = rng.integers(0, 3, (1, 40, 30, 20)).astype(np.float32)
    image = rng.random((2, 40, 30, 20), dtype=np.float32)
    table, classes = sample_locations(label, image, samples=500)
    again, _ = sample_locations(label, image, samples=500)
    assert np.array_equal(table, again)
    for value, rows in classes.items():
        part = table[rows["start"] : rows["stop"]]
        assert len(part) == min(rows["count"], 500) and rows["count"] == int((label == int(value)).sum())
        voxels = tuple(part[:, :3].astype(int).T)
        assert (label[0][voxels] == int(value)).all()
        assert np.array_equal(part[:, 3], image.max(axis=0)[voxels])
        assert len({tuple(v) for v in part[:, :3].tolist()}) == len(part)  # without replacement
    with pytest.raises(ValueError, match="single-channel label"):
        sample_locations(np.zeros((2, 4, 4, 4)))


# ----------------------------------------------------------------------------------------- chunk reads per crop


def _posneg(num_samples: int, size=PATCH, pad=PATCH) -> StoreRandCropByPosNegLabeld:
    return StoreRandCropByPosNegLabeld(["image", "label"], "label", size, 1, 1, num_samples, "image", 0.0, pad_size=pad)


def test_a_label_centred_crop_reads_only_the_chunks_it_covers(labeled, monkeypatch):
    """Counted reads: per crop, each of image and label reads at most the 27 chunks a 32^3 crop can cover of the
    100 of a volume (never the whole label map to find foreground), and the drawn centres read one chunk of the
    locations table each."""
    _, store, _ = labeled
    stored = StoreDataset(store)[0]
    total = len(stored["image"].record["crc32"])
    counter = _ReadCounter(monkeypatch)
    crop = _posneg(4).set_random_state(0)
    for _ in range(5):
        crop(stored)
    assert total == 5 * 5 * 4
    for name in ("image.b2nd", "label.b2nd"):
        reads = counter.chunks(name)
        assert len(reads) == 20 and all(0 < len(numbers) <= 27 for numbers in reads), (name, reads)
    table = counter.chunks("label_locations.b2nd")
    assert table and all(len(numbers) == 1 for numbers in table)
    assert len({n for numbers in counter.chunks("image.b2nd") for n in numbers}) < total


def test_a_random_crop_reads_only_the_chunks_it_covers_and_a_whole_read_is_counted(labeled, monkeypatch):
    _, store, _ = labeled
    stored = StoreDataset(store)[1]
    counter = _ReadCounter(monkeypatch)
    StoreRandSpatialCropSamplesd(["image", "label"], PATCH, 3, pad_size=PATCH).set_random_state(1)(stored)
    assert all(0 < len(numbers) <= 27 for numbers in counter.chunks("image.b2nd"))
    # the counter sees a whole-volume read, as the disk path of 0.4.0 made it (ReadStoredd before the crop)
    stored["image"].read()
    assert len(counter.chunks("image.b2nd")[-1]) == 100


# ------------------------------------------------------------------------------------- crops equal the volume's


def _corner(voxel, size, padded):
    centre = correct_crop_centers(list(voxel), size, padded, False)
    return [max(int(c) - s // 2, 0) for c, s in zip(centre, size)]


def test_label_centred_crops_are_the_padded_volume_at_their_centre_and_positive_ones_hold_their_class(labeled):
    """Every crop equals the in-memory volume (padded as SpatialPadd pads) at the corner its centre gives, as a
    MetaTensor with the crop's affine; a positive crop holds the class of its drawn voxel there, a negative one is
    centred on label 0 with image > image_threshold."""
    _, store, memory = labeled
    stored = StoreDataset(store)[0]
    padder = SpatialPadd(["image", "label"], [96, 32, 32])  # the first axis padded: 80 -> 96
    padded_item = padder(dict(memory[0]))
    crop = _posneg(24, size=[96, 32, 32], pad=[96, 32, 32]).set_random_state(3)
    out = crop(stored)
    padded = tuple(padded_item["label"].shape[1:])
    kinds = [kind for _, kind in crop.last_centres]
    assert len(out) == 24 and {"pos", "neg"} == set(kinds)
    for sample, (voxel, kind) in zip(out, crop.last_centres):
        corner = _corner(voxel, [96, 32, 32], padded)
        region = (slice(None), *(slice(c, c + s) for c, s in zip(corner, [96, 32, 32])))
        for key in ("image", "label"):
            assert isinstance(sample[key], MetaTensor)
            assert torch.equal(sample[key].as_tensor(), padded_item[key][region].as_tensor())
            want_affine = padded_item[key].affine.clone()
            want_affine[:3, 3] += want_affine[:3, :3] @ torch.tensor(corner, dtype=torch.float64)
            assert torch.allclose(sample[key].affine, want_affine)
        inside = (0, *(v - c for v, c in zip(voxel, corner)))
        value = int(padded_item["label"][(0, *voxel)])
        assert int(sample["label"][inside]) == value
        if kind == "pos":
            assert value > 0 and (sample["label"] == value).any()
        else:
            assert value == 0 and float(padded_item["image"][(0, *voxel)]) > 0.0


@pytest.mark.parametrize("floats", ["quantized", "exact"])
def test_a_crop_cut_from_a_handle_is_the_zero_padded_array_bit_for_bit(tmp_path, floats):
    """``_cut`` takes a crop wholly inside the stored array as blosc2 decompresses it, and writes one that reaches
    into the padding into the zeroed crop in one pass (``StoredArray.read_into``): the same values, bit for bit, as
    the decoded array zero-padded and sliced, for crops inside, across and wholly outside the stored region;
    ``read_into`` refuses an array of another shape or dtype."""
    from components.data.store.crops import _cut, _padded
    from components.data.store.format import write_array

    rng = np.random.default_rng(4)
    image = rng.normal(0.3, 0.2, (1, 40, 30, 20)).astype(np.float32)
    label = rng.integers(0, 4, (1, 40, 30, 20)).astype(np.float32)
    for name, array in (("image", image), ("label", label)):
        record = write_array(array, tmp_path / f"{name}.b2nd", patch_size=(16, 16, 16), floats=floats)
        handle = StoredArray(tmp_path / f"{name}.b2nd", record)
        values = handle[...]
        assert values.dtype == np.float32 and ("scales" in record) == (floats == "quantized" and name == "image")
        padded, before = _padded(handle.shape[1:], (48, 40, 32))
        whole = np.pad(values, [(0, 0)] + [(b, p - n - b) for b, p, n in zip(before, padded, handle.shape[1:])])
        for corner in ((0, 0, 0), (4, 5, 6), (20, 10, 16), (0, 0, 31), (47, 39, 0)):
            size = (24, 24, 16)
            crop = _cut(handle, padded, before, corner, size)
            want = whole[(slice(None), *(slice(c, c + z) for c, z in zip(corner, size)))]
            assert crop.dtype == torch.float32 and np.array_equal(crop.numpy(), want), (name, corner)
        with pytest.raises(ValueError, match="out must be float32"):
            handle.read_into((slice(None), slice(0, 2)), np.zeros((1, 2, 30, 20), np.float64))


def test_a_crop_inside_the_stored_array_is_not_copied_again(tmp_path, monkeypatch):
    """A crop that needs no padding is the array the read returns (no second array to copy it into: for an image
    stored in its own dtype, one pass over the crop fewer); a crop that reaches into the padding is written into the
    zeroed crop. Counted: ``read_into`` is called for the padded crops only."""
    from components.data.store.crops import _cut, _padded
    from components.data.store.format import write_array

    image = np.random.default_rng(5).normal(0.3, 0.2, (1, 40, 30, 20)).astype(np.float32)
    record = write_array(image, tmp_path / "image.b2nd", patch_size=(16, 16, 16))
    handle = StoredArray(tmp_path / "image.b2nd", record)
    written: list[tuple] = []
    original = StoredArray.read_into

    def counting(handle_, index, out):
        written.append(index)
        original(handle_, index, out)

    monkeypatch.setattr(StoredArray, "read_into", counting)
    padded, before = _padded(handle.shape[1:], (48, 30, 20))  # 4 voxels of padding before and after on axis 1
    inside = _cut(handle, padded, before, (4, 0, 0), (16, 16, 16))
    assert np.array_equal(inside.numpy(), image[:, 0:16, 0:16, 0:16]) and written == []
    across = _cut(handle, padded, before, (0, 0, 0), (16, 16, 16))
    assert np.array_equal(across.numpy()[:, 4:], image[:, 0:12, 0:16, 0:16]) and not across.numpy()[:, :4].any()
    assert len(written) == 1


def test_random_crops_equal_monais_draw_for_draw_with_virtual_padding(labeled):
    _, store, memory = labeled
    stored = StoreDataset(store)[1]
    pad = [96, 80, 48]  # the first two axes padded, the last cropped
    monai = Compose([SpatialPadd(["image", "label"], pad),
                     RandSpatialCropSamplesd(["image", "label"], [40, 48, 32], 5, random_size=False)])  # fmt: skip
    ours = Compose([StoreRandSpatialCropSamplesd(["image", "label"], [40, 48, 32], 5, pad_size=pad)])
    monai.set_random_state(7), ours.set_random_state(7)  # each Compose seeds its first random transform alike
    for _ in range(3):
        want, got = monai(dict(memory[1])), ours(stored)
        for a, b in zip(got, want):
            for key in ("image", "label"):
                assert torch.equal(a[key].as_tensor(), b[key].as_tensor())
                assert torch.allclose(a[key].affine, b[key].affine)


# ------------------------------------------------------------------------------------- sampling statistics


def _class_shares(label: np.ndarray, centres) -> np.ndarray:
    values = np.array([label[tuple(c)] for c in centres], dtype=int)
    return np.bincount(values, minlength=4) / len(values)


def test_label_centred_crops_follow_rand_crop_by_pos_neg_labels_statistics(labeled):
    """Over 3,000 draws each: the share of positive centres is pos / (pos + neg); the classes of the positive
    centres are in proportion to their voxel counts (MONAI draws uniformly over all foreground voxels); negative
    centres are never on air (image 0); and the class shares and the per-axis mean and spread of the corrected
    centres are MONAI's within a few standard errors."""
    _, store, memory = labeled
    stored = StoreDataset(store)[0]
    label = _plain(memory[0]["label"])[0].astype(int)
    image = _plain(memory[0]["image"])[0]
    size = [8, 8, 8]
    keys = ["image", "label"]
    ours = StoreRandCropByPosNegLabeld(keys, "label", size, 3, 1, 3000, "image", 0.0).set_random_state(5)
    ours(stored)
    kinds = [kind for _, kind in ours.last_centres]
    positive = [v for v, kind in ours.last_centres if kind == "pos"]
    share = kinds.count("pos") / len(kinds)
    assert abs(share - 0.75) < 4 * (0.75 * 0.25 / len(kinds)) ** 0.5
    counts = np.bincount(label.ravel(), minlength=4)[1:]
    got = _class_shares(label, positive)[1:]
    assert np.all(np.abs(got - counts / counts.sum()) < 4 * np.sqrt(counts / counts.sum() / len(positive)) + 1e-3)
    negative = [v for v, kind in ours.last_centres if kind == "neg"]
    assert all(label[tuple(v)] == 0 and image[tuple(v)] > 0 for v in negative)

    monai = RandCropByPosNegLabeld(keys, "label", size, 3, 1, 3000, "image", 0.0)
    monai.set_random_state(5)
    monai(dict(memory[0]))
    want = np.array([list(c) for c in monai.cropper.centers])
    mine = np.array([correct_crop_centers(list(v), size, SHAPE, False) for v, _ in ours.last_centres])
    classes_want, classes_mine = _class_shares(label, want), _class_shares(label, mine)
    assert np.all(np.abs(classes_want - classes_mine) < 4 * np.sqrt(classes_want * (1 - classes_want) * 2 / 3000) + 1e-3)
    spread = want.std(axis=0)
    assert np.all(np.abs(want.mean(axis=0) - mine.mean(axis=0)) < 4 * spread * np.sqrt(2 / 3000))
    assert np.all(np.abs(spread - mine.std(axis=0)) < 0.1 * spread)


def test_a_store_crop_without_locations_reads_whole_volumes_with_a_warning(tmp_path, caplog):
    """A label map of two channels has no stored locations: the crop runs MONAI's transforms on the whole arrays."""
    entry = _write_case(tmp_path / "data", 0, shape=(40, 36, 28))
    two = [*TRANSFORMS, {"_target_": "ConcatItemsd", "keys": ["label", "label"], "name": "label"}]
    preprocess([entry], tmp_path / "store", two, patch_size=[16, 16, 16], floats="exact")
    stored = StoreDataset(open_store(tmp_path / "store"))[0]
    assert stored["label"].shape[0] == 2 and stored["label"].locations is None
    caplog.set_level(logging.WARNING, logger="components.data")
    out = _posneg(2, size=[16, 16, 16], pad=None).set_random_state(0)(stored)
    assert len(out) == 2 and out[0]["image"].shape == (1, 16, 16, 16)
    assert any("read whole volumes" in r.getMessage() and "no stored foreground locations" in r.getMessage()
               for r in caplog.records)  # fmt: skip


def test_the_disk_pipeline_replaces_only_the_crops_it_can_do_alike():
    pad = SpatialPadd(["image", "label"], [32, 32, 32])
    posneg = RandCropByPosNegLabeld(["image", "label"], "label", [32, 32, 32], 2, 1, 4, "image", 0.0)
    spatial = RandSpatialCropSamplesd(["image", "label"], [32, 32, 32], 2, random_size=False)
    replaced = store_crops([pad, posneg, "rest"])
    assert isinstance(replaced[0], StoreRandCropByPosNegLabeld) and replaced[1:] == ["rest"]
    assert replaced[0].pos_ratio == pytest.approx(2 / 3) and replaced[0].pad_size == [32, 32, 32]
    assert isinstance(store_crops([pad, spatial])[0], StoreRandSpatialCropSamplesd)
    assert store_crops([spatial])[0].pad_size is None
    assert store_crops([SpatialPadd(["image", "label"], 32, mode="reflect"), spatial]) is None  # not zeros
    assert store_crops([RandSpatialCropSamplesd(["image"], 32, 2, random_size=True)]) is None
    assert store_crops([pad]) is None


# --------------------------------------------------------------------------------- spacing in the stored order


def test_the_ssl_store_keeps_spacing_and_affine_in_the_stored_axis_order(tmp_path):
    """A volume whose file axes are S, A, R (spacing 3.0, 0.8, 0.5) is stored by the SSL bundle in RAS order: the
    index's spacing is [0.5, 0.8, 3.0], and the stored compact array's affine puts its first voxel where the
    oriented image's voxel at the compact offset is."""
    rng = np.random.default_rng(0)
    volume = np.rint(rng.normal(40, 15, (20, 60, 38))).astype(np.int16)
    affine = np.array([[0, 0, 0.5, -9.0], [0, 0.8, 0, 4.0], [3.0, 0, 0, 7.0], [0, 0, 0, 1]])
    (tmp_path / "images").mkdir()
    nib.save(nib.Nifti1Image(volume, affine), tmp_path / "images" / "sagittal.nii.gz")
    transforms = bundle_transforms(bundle_dir("swin_unetr_ssl_pretrain"), {"roi_size": [16, 16, 16]})
    entry = {"image": str(tmp_path / "images" / "sagittal.nii.gz")}
    preprocess([entry], tmp_path / "store", transforms)
    store = open_store(tmp_path / "store")
    assert store.entries[0]["spacing"] == pytest.approx([0.5, 0.8, 3.0])
    assert "affine" not in json.dumps(store.entries[0]["values"])  # kept with the array, not in the index
    stored = StoreDataset(store)[0]
    in_memory = build_transforms(transforms)(dict(entry))
    geometry = stored["image_compact"]
    assert torch.allclose(geometry["affine"], in_memory["image_compact"]["affine"])
    oriented = build_transforms(transforms[:4])(dict(entry))["image"]  # LoadImaged .. Orientationd
    assert tuple(oriented.shape[1:]) == (38, 60, 20)
    box = [int(v) for v in in_memory["foreground_start_coord"]]  # the recipe's box in padded coordinates
    first = [b - (max(16 - n, 0) // 2) + o for b, n, o in zip(box, oriented.shape[1:], geometry["offset"])]
    world = oriented.affine[:3, :3] @ torch.tensor(first, dtype=torch.float64) + oriented.affine[:3, 3]
    assert torch.allclose(geometry["affine"][:3, 3], world)
    corner = stored["image"][:, :2, :2, :2]
    assert np.array_equal(corner, _plain(oriented)[:, first[0] : first[0] + 2, first[1] : first[1] + 2,
                                                   first[2] : first[2] + 2])  # fmt: skip
