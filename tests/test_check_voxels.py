"""CheckVoxelsd: NaN / Inf voxels and label values outside the classes, named with the file where a volume is first
read, by each bundle's deterministic transforms as the cache runs them (the bundle runs themselves are in
tests/test_broken_inputs.py), and by the on-disk store's preprocessing."""

from __future__ import annotations

from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
import torch
from monai.transforms import Compose, LoadImaged

from components import CheckVoxelsd, DataItemError, SourceNamingCompose, bundle_transforms, preprocess
from components.demo.runner import bundle_dir
from components.data.store import VolumeFailedError, build_transforms

SHAPE = (24, 24, 16)
FINETUNING = ("swin_unetr_btcv_finetune", "swin_unetr_brats_finetune")
PRETRAINING = ("swin_unetr_ssl_pretrain", "swin_unetr_mim_pretrain", "swin_unetr_dino_pretrain")
BTCV_CLASSES = "[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13] (num_classes=14)"


def _save(path: Path, array: np.ndarray) -> str:
    nib.save(nib.Nifti1Image(array, np.diag([1.5, 1.5, 2.0, 1.0])), path)
    return str(path)


def _image(channels: int = 1) -> np.ndarray:
    shape = SHAPE if channels == 1 else (*SHAPE, channels)
    return np.random.default_rng(0).normal(0.0, 100.0, shape).astype(np.float32)


def _label(*values: int) -> np.ndarray:
    label = np.zeros(SHAPE, dtype=np.float32)
    for i, value in enumerate(values):
        label[8:16, 8:16, 2 * i : 2 * i + 2] = value
    return label


def _first_read(bundle: str, item: dict) -> dict:
    """``item`` through ``bundle``'s deterministic transforms as its cache runs them (a SourceNamingCompose)."""
    transforms = build_transforms(bundle_transforms(bundle_dir(bundle)))
    return SourceNamingCompose(transforms)(item)


def _refusal(bundle: str, item: dict) -> str:
    with pytest.raises(DataItemError) as raised:
        _first_read(bundle, item)
    return str(raised.value)


def test_btcv_label_values_beyond_its_classes_are_named_with_the_file(tmp_path):
    """Classes 20 and 255 in a 14-class label: today an index error after caching that names no file."""
    label = _save(tmp_path / "label.nii.gz", _label(1, 20, 255))
    item = {"image": _save(tmp_path / "image.nii.gz", _image()), "label": label}
    assert _refusal("swin_unetr_btcv_finetune", item) == (
        f"label {label}: label values [20, 255] are outside the declared classes {BTCV_CLASSES}; correct the file or "
        "leave it out of the datalist"
    )


def test_brats_label_in_the_2023_convention_is_named_with_the_file(tmp_path):
    """Enhancing tumour as 3 (BraTS 2023, MSD) is background to ConvertToMultiChannelBasedOnBratsClassesd: refused
    before that transform reads it."""
    label = _save(tmp_path / "label.nii.gz", _label(1, 2, 3))
    item = {"image": _save(tmp_path / "image.nii.gz", _image(channels=4)), "label": label}
    message = _refusal("swin_unetr_brats_finetune", item)
    assert message.startswith(f"label {label}: label values [3] are outside the declared classes [0, 1, 2, 4] ")


@pytest.mark.parametrize("bundle", FINETUNING + PRETRAINING)
@pytest.mark.parametrize("kind", ["nan_block", "all_inf"])
def test_non_finite_images_are_named_before_any_scaling(tmp_path, bundle, kind):
    """A block of NaN inside the body (today: a NaN loss some iterations in) and an all-Inf image (today: clipped
    by the intensity scaling to a constant that trains without a word), in every bundle."""
    channels = 4 if bundle == "swin_unetr_brats_finetune" else 1
    image = _image(channels)
    if kind == "nan_block":
        image[8:12, 8:12, 6:10] = np.nan
    else:
        image[...] = np.inf
    path = _save(tmp_path / "image.nii.gz", image)
    item = {"image": path}
    if bundle in FINETUNING:
        item["label"] = _save(tmp_path / "label.nii.gz", _label(1))
    message = _refusal(bundle, item)
    counts = f"{64 * channels} NaN, 0 Inf" if kind == "nan_block" else f"0 NaN, {image.size} Inf"
    assert message.startswith(f"image {path}: has non-finite voxels: {counts} (of {image.size});"), message
    assert "\n" not in message


@pytest.mark.parametrize("bundle", FINETUNING + PRETRAINING)
def test_clean_volumes_pass_every_bundle(tmp_path, bundle):
    channels = 4 if bundle == "swin_unetr_brats_finetune" else 1
    item = {"image": _save(tmp_path / "image.nii.gz", _image(channels))}
    if bundle in FINETUNING:
        item["label"] = _save(tmp_path / "label.nii.gz", _label(1, 2, 4))
    assert "image" in _first_read(bundle, item)


def test_a_file_it_finds_wrong_is_named_in_its_own_words_through_the_cache_pipeline(tmp_path):
    """SourceNamingCompose leaves the check's one line as it is, rather than naming the item's files around it."""
    image = _image()
    image[0, 0, 0] = np.inf
    path = _save(tmp_path / "image.nii.gz", image)
    pipeline = SourceNamingCompose(Compose([LoadImaged("image", image_only=False), CheckVoxelsd("image")]))
    with pytest.raises(DataItemError) as raised:
        pipeline({"image": path})
    assert str(raised.value) == (
        f"image {path}: has non-finite voxels: 0 NaN, 1 Inf (of {image.size}); correct the file or leave it out of the "
        "datalist"
    )


def test_passing_data_is_returned_as_is_and_every_class_type_is_read():
    data = {"image": torch.zeros(1, 4, 4, 4), "label": torch.tensor([[[[0, 1, 2, 4]]]], dtype=torch.uint8)}
    assert CheckVoxelsd("image", label_key="label", label_values=(0, 1, 2, 4))(data) is data
    two = CheckVoxelsd("image", label_key="label", num_classes=2)
    for dtype in (torch.uint8, torch.int16, torch.float32, torch.bool):
        two({"image": data["image"], "label": torch.ones(4, dtype=dtype)})
    with pytest.raises(DataItemError, match=r"^label \(no file name\): label has non-integer values \(e.g. \(0.5\)\)"):
        two({"image": data["image"], "label": torch.tensor([0.5])})
    with pytest.raises(DataItemError, match=r"^label \(no file name\): label has 1 non-finite voxels"):
        two({"image": data["image"], "label": torch.tensor([np.nan])})
    inference = CheckVoxelsd("image", label_key="label", num_classes=2, allow_missing_keys=True)
    assert inference({"image": data["image"]})  # an inference item has no label


@pytest.mark.parametrize(
    "arguments",
    [{"label_key": "label"}, {"num_classes": 3}, {"label_key": "label", "num_classes": 3, "label_values": [0]}],
)
def test_classes_and_label_key_go_together(arguments):
    with pytest.raises(ValueError):
        CheckVoxelsd("image", **arguments)


def test_the_store_preprocessing_names_a_non_finite_volume(tmp_path):
    """The store runs the bundle's deterministic transforms once per volume: the check comes with them."""
    good = _save(tmp_path / "good.nii.gz", _image())
    image = _image()
    image[8:12, 8:12, 6:10] = np.nan
    bad = _save(tmp_path / "bad.nii.gz", image)
    transforms = bundle_transforms(bundle_dir("swin_unetr_ssl_pretrain"))
    with pytest.raises(VolumeFailedError, match=rf"{bad} \(training\[1\]\) failed: DataItemError: image {bad}: has "
                                                r"non-finite voxels: 64 NaN, 0 Inf"):  # fmt: skip
        preprocess([{"image": good}, {"image": bad}], tmp_path / "store", transforms)
    summary = preprocess([{"image": good}, {"image": bad}], tmp_path / "skipped", transforms, on_error="skip")
    assert [failure["source"] for failure in summary.failed] == [bad] and summary.written == 1
