"""Tests for the synthetic MSD-style datasets written by components.data.synthetic."""

from __future__ import annotations

import json
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
from monai.data import load_decathlon_datalist
from monai.transforms import Compose, EnsureChannelFirstd, LoadImaged, Orientationd

from components.data.synthetic import CT_LABELS, DEMO_ORGANS, MRI_LABELS, split_sizes, write_dataset

KEYS = ("training", "validation", "test")


def _load(path: Path) -> tuple[np.ndarray, np.ndarray]:
    img = nib.load(str(path))
    return np.asarray(img.dataobj), img.affine


def _cases(dataset_json: Path) -> list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
    """(image, image affine, label, label affine) for every case, in case-index order."""
    root = dataset_json.parent
    names = sorted(p.name for p in (root / "imagesTr").glob("case_*.nii.gz"))
    return [(*_load(root / "imagesTr" / n), *_load(root / "labelsTr" / n)) for n in names]


@pytest.fixture(scope="module")
def ct_json(tmp_path_factory) -> Path:
    return write_dataset(tmp_path_factory.mktemp("ct"), kind="ct", num=6, seed=0)


@pytest.fixture(scope="module")
def ct_cases(ct_json):
    return _cases(ct_json)


@pytest.fixture(scope="module")
def mri_json(tmp_path_factory) -> Path:
    return write_dataset(tmp_path_factory.mktemp("mri"), kind="mri", num=3, seed=0)


@pytest.mark.parametrize(
    "num, expected", [(3, (1, 1, 1)), (6, (4, 1, 1)), (7, (5, 1, 1)), (10, (6, 2, 2)), (20, (14, 3, 3))]
)
def test_split_sizes(num, expected):
    assert split_sizes(num) == expected


@pytest.mark.parametrize("fixture, n_cases", [("ct_json", 6), ("mri_json", 3)])
def test_datalist_readable_by_monai(request, fixture, n_cases):
    path = request.getfixturevalue(fixture)
    expected = dict(zip(KEYS, split_sizes(n_cases)))
    seen = set()
    for key in KEYS:
        items = load_decathlon_datalist(str(path), is_segmentation=True, data_list_key=key)
        assert len(items) == expected[key]
        for item in items:
            assert Path(item["image"]).is_file() and Path(item["label"]).is_file()
            seen.add(Path(item["image"]).name)
    assert len(seen) == n_cases  # splits are disjoint and cover every case
    meta = json.loads(path.read_text())
    assert meta["numTraining"] == expected["training"]
    for key in ("name", "description", "modality", "labels", "tensorImageSize"):
        assert meta[key]
    raw_paths = [item["image"] for key in KEYS for item in meta[key]]
    assert all(not Path(p).is_absolute() for p in raw_paths)


def test_ct_datalist_labels(ct_json):
    meta = json.loads(ct_json.read_text())
    assert meta["labels"] == {str(k): v for k, v in CT_LABELS.items()}
    assert meta["labels"]["6"] == "liver" and meta["labels"]["1"] == "spleen"
    assert meta["modality"] == {"0": "CT"} and meta["tensorImageSize"] == "3D"


def test_ct_volumes(ct_cases):
    images = [c[0] for c in ct_cases]
    labels = [c[2] for c in ct_cases]
    assert all(im.dtype == np.int16 for im in images) and all(lb.dtype == np.uint8 for lb in labels)
    assert min(int(im.min()) for im in images) <= -990  # air
    assert max(int(im.max()) for im in images) >= 300  # bone
    for im, im_aff, lb, lb_aff in ct_cases:
        assert im.shape == lb.shape and np.allclose(im_aff, lb_aff)
        assert np.percentile(im, 50) > -1000  # mostly body, not air
        assert int(lb.max()) <= 13
        zooms = np.sqrt((im_aff[:3, :3] ** 2).sum(axis=0))
        assert 0.6 <= zooms.min() <= 1.0 and 1.5 <= zooms.max() <= 5.0  # anisotropic in-plane vs slice
        assert np.any(im_aff[:3, 3] != 0)
        assert all(n % 32 for n in im.shape)
    assert any(min(im.shape) < 64 for im in images)
    assert len({im.shape for im in images}) > 1
    codes = {nib.aff2axcodes(c[1]) for c in ct_cases}
    assert codes != {("R", "A", "S")} and len(codes) >= 3
    present = set().union(*(np.unique(lb).tolist() for lb in labels)) - {0}
    assert len(present) >= 6


def test_ct_organ_intensities(ct_cases):
    """Pooled mean HU per organ follows the portal-venous ordering with clear gaps."""
    sums, counts = np.zeros(14), np.zeros(14)
    for im, _, lb, _ in ct_cases:
        sums += np.bincount(lb.ravel(), weights=im.ravel().astype(np.float64), minlength=14)
        counts += np.bincount(lb.ravel(), minlength=14)
    means = sums / np.maximum(counts, 1)
    gallbladder, pancreas, liver, spleen, kidney, aorta = means[[4, 11, 6, 1, 2, 8]]
    ordered = [gallbladder, pancreas, liver, spleen, kidney, aorta]
    assert all(b - a >= 5 for a, b in zip(ordered, ordered[1:])), ordered
    assert -20 < gallbladder < 40 and 60 < liver < 140 and aorta > 120
    assert abs(means[2] - means[3]) < 30  # both kidneys are the same tissue
    assert means[7] < means[4] + 20  # the stomach holds fluid and gas


def test_ct_monai_loading_and_anatomy(ct_json):
    keys = ("image", "label")
    transform = Compose(
        [LoadImaged(keys=keys), EnsureChannelFirstd(keys=keys), Orientationd(keys=keys, axcodes="RAS")]
    )
    for item in load_decathlon_datalist(str(ct_json), data_list_key="training"):
        data = transform(item)
        image, label = data["image"], data["label"]
        assert image.shape[0] == 1 and image.shape == label.shape
        assert nib.aff2axcodes(image.affine.numpy()) == ("R", "A", "S")
        lb = label[0].numpy()

        def centroid(organ: int) -> np.ndarray:
            return np.argwhere(lb == organ).mean(axis=0)

        # RAS voxel axes: +x patient right, +y anterior, +z superior
        assert centroid(6)[0] > centroid(1)[0]  # liver right of spleen
        assert centroid(4)[1] > centroid(8)[1]  # gallbladder anterior to aorta
        assert centroid(5)[2] > centroid(2)[2]  # esophagus above right kidney


def test_determinism_and_subject_independence(tmp_path, ct_cases):
    again = _cases(write_dataset(tmp_path / "same", kind="ct", num=3, seed=0))
    for (im, aff, lb, _), (im0, aff0, lb0, _) in zip(again, ct_cases[:3]):
        np.testing.assert_array_equal(im, im0)
        np.testing.assert_array_equal(lb, lb0)
        np.testing.assert_array_equal(aff, aff0)
    other = _cases(write_dataset(tmp_path / "other", kind="ct", num=3, seed=1))
    for (im, _, _, _), (im0, _, _, _) in zip(other, ct_cases[:3]):
        assert im.shape != im0.shape or not np.array_equal(im, im0)


def test_mri_volumes(mri_json):
    meta = json.loads(mri_json.read_text())
    assert meta["modality"] == {"0": "T1", "1": "T1ce", "2": "T2", "3": "FLAIR"}
    assert meta["labels"] == {str(k): v for k, v in MRI_LABELS.items()} and set(meta["labels"]) == {"0", "1", "2", "4"}
    keys = ("image", "label")
    transform = Compose([LoadImaged(keys=keys), EnsureChannelFirstd(keys=keys)])
    items = [i for key in KEYS for i in load_decathlon_datalist(str(mri_json), data_list_key=key)]
    shapes = set()
    for item in items:
        data = transform(item)
        image, label = data["image"].numpy(), data["label"][0].numpy().astype(np.int64)
        assert image.shape[0] == 4 and image.shape[1:] == label.shape
        assert all(n % 32 for n in label.shape)
        shapes.add(label.shape)
        assert set(np.unique(label).tolist()) == {0, 1, 2, 4}
        assert image.min() >= 0 and (image[:, label > 0] > 0).all()  # tumour lies inside the brain

        padded = np.pad(label, 1)
        neighbours = [np.roll(padded, s, axis=a)[1:-1, 1:-1, 1:-1] for a in range(3) for s in (-1, 1)]
        for inner, allowed in ((1, {1, 4}), (4, {1, 2, 4})):  # necrosis < enhancing rim < edema
            for nb in neighbours:
                assert set(np.unique(nb[label == inner]).tolist()) <= allowed

        t1, t1ce, t2, flair = image
        healthy = (label == 0) & (t1 > 0)
        assert t1ce[label == 4].mean() > 1.3 * t1ce[label == 2].mean()  # enhancing rim lights up
        assert t1ce[label == 4].mean() > 1.5 * t1[label == 4].mean() * t1ce[healthy].mean() / t1[healthy].mean()
        assert flair[label == 2].mean() > 1.3 * flair[healthy].mean()  # edema bright on FLAIR
        assert t2[label == 1].mean() > t2[healthy].mean()  # necrosis is fluid-like on T2
    assert len(shapes) > 1


@pytest.mark.parametrize(
    "kwargs, culprit",
    [
        ({"kind": "pet"}, "'pet'"),
        ({"kind": "CT"}, "'CT'"),
        ({"num": 2}, "2"),
        ({"num": 0}, "0"),
        ({"num": 4.0}, "4.0"),
        ({"seed": -1}, "-1"),
        ({"organs": ("liver", "lung")}, "lung"),
        ({"organs": ("liver", "liver")}, "liver"),
        ({"kind": "mri", "varied": True}, "kind='ct' only"),
    ],
)
def test_invalid_arguments(tmp_path, kwargs, culprit):
    out = tmp_path / "never"
    with pytest.raises(ValueError, match=culprit):
        write_dataset(out, **kwargs)
    assert not out.exists()  # validated before anything is written


def test_organ_subset_relabels_and_keeps_the_image(tmp_path, ct_cases):
    """organs=DEMO_ORGANS: the same voxels as the full labels, those organs numbered 1..5, the rest background."""
    path = write_dataset(tmp_path / "five", num=6, seed=0, organs=DEMO_ORGANS)
    meta = json.loads(path.read_text())
    assert meta["labels"] == {"0": "background", **{str(i): n for i, n in enumerate(DEMO_ORGANS, start=1)}}
    full = {name: index for index, name in CT_LABELS.items()}
    for (im, aff, lb, _), (im0, aff0, lb0, _) in zip(_cases(path), ct_cases):
        np.testing.assert_array_equal(im, im0)
        np.testing.assert_array_equal(aff, aff0)
        assert set(np.unique(lb).tolist()) == set(range(len(DEMO_ORGANS) + 1))
        for new, name in enumerate(DEMO_ORGANS, start=1):
            np.testing.assert_array_equal(lb == new, lb0 == full[name])
        assert (lb[~np.isin(lb0, [full[n] for n in DEMO_ORGANS])] == 0).all()


def test_varied_unlabeled_set_is_more_diverse(tmp_path, ct_cases):
    """varied=True, labels=False: other subjects, images only, cut fields of view, wider contrast and noise."""
    path = write_dataset(tmp_path / "unlabeled", num=8, seed=0, varied=True, labels=False)
    meta = json.loads(path.read_text())
    items = [i for key in KEYS for i in meta[key]]
    assert len(items) == 8 and all(set(i) == {"image"} for i in items) and meta["labels"] == {}
    assert not (tmp_path / "unlabeled" / "labelsTr").exists()
    images = [_load(tmp_path / "unlabeled" / i["image"]) for i in items]
    plain = [c[0] for c in ct_cases]
    for (im, _), im0 in zip(images, plain):
        assert im.shape != im0.shape or not np.array_equal(im, im0)  # an independent draw, not a copy
        assert min(im.shape) >= 40 and im.dtype == np.int16
    # the field of view is cut: on average the volumes are smaller than the labeled set's
    assert np.mean([im.size for im, _ in images]) < np.mean([im.size for im in plain])
    # soft-tissue level and spread vary more between subjects (scanner contrast, offset, noise)
    def soft_stats(volumes):
        return np.array([(v[(v > -200) & (v < 300)].mean(), v[(v > -200) & (v < 300)].std()) for v in volumes])
    assert soft_stats([im for im, _ in images]).std(axis=0)[1] > soft_stats(plain).std(axis=0)[1]
    again = write_dataset(tmp_path / "again", num=3, seed=0, varied=True, labels=False)
    np.testing.assert_array_equal(_load(again.parent / "imagesTr" / "case_001.nii.gz")[0], images[1][0])
