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

from components import CheckVoxelsd, DataItemError, SourceNamingCompose

SHAPE = (24, 24, 16)


def _save(path: Path, array: np.ndarray) -> str:
    nib.save(nib.Nifti1Image(array, np.diag([1.5, 1.5, 2.0, 1.0])), path)
    return str(path)


def _image(channels: int = 1) -> np.ndarray:
    shape = SHAPE if channels == 1 else (*SHAPE, channels)
    return np.random.default_rng(0).normal(0.0, 100.0, shape).astype(np.float32)


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
