"""The demo's split by body size (:func:`components.demo.run.split_by_body_size`): areas measured in any stored
orientation, held-out volumes strictly inside the training sizes, every volume kept once."""

from __future__ import annotations

import json

import nibabel as nib
import numpy as np
import pytest

from components.demo.run import body_area_mm2, interior_positions, split_by_body_size


def _body(path, width: int, height: int, spacing: float = 0.8, slices: int = 3, permute: bool = False) -> None:
    """A 24x24x5 CT volume at -1000 HU with a ``width`` x ``height`` voxel body at 0 HU on ``slices`` axial slices;
    ``permute`` stores it with the axial axis first (the affine says so)."""
    image = np.full((24, 24, 5), -1000, dtype=np.int16)
    image[2 : 2 + width, 3 : 3 + height, 1 : 1 + slices] = 0
    affine = np.diag([spacing, spacing, 2.0, 1.0])
    if permute:
        image = np.transpose(image, (2, 0, 1))
        affine = affine[:, [2, 0, 1, 3]]
    nib.save(nib.Nifti1Image(image, affine), str(path))


def test_the_body_area_is_the_mean_axial_cross_section_in_any_stored_orientation(tmp_path):
    _body(tmp_path / "ras.nii.gz", 10, 6)
    _body(tmp_path / "permuted.nii.gz", 10, 6, permute=True)
    assert body_area_mm2(tmp_path / "ras.nii.gz") == pytest.approx(10 * 6 * 0.64)  # the empty slices do not count
    assert body_area_mm2(tmp_path / "permuted.nii.gz") == pytest.approx(10 * 6 * 0.64)
    _body(tmp_path / "air.nii.gz", 0, 0)
    assert body_area_mm2(tmp_path / "air.nii.gz") == 0.0


def test_held_out_and_validation_bodies_lie_strictly_inside_the_training_sizes(tmp_path):
    widths = [7, 3, 12, 9, 5, 14, 4, 10, 6]  # the widest and the narrowest first drawn into validation and test
    items = []
    for i, width in enumerate(widths):
        _body(tmp_path / f"case_{i}.nii.gz", width, 8)
        items.append({"image": f"case_{i}.nii.gz", "label": f"label_{i}.nii.gz"})
    path = tmp_path / "dataset.json"
    path.write_text(json.dumps({"name": "x", "training": items[2:], "validation": items[:1], "test": items[1:2]}))
    areas = split_by_body_size(path)
    data = json.loads(path.read_text())
    assert [len(data[k]) for k in ("training", "validation", "test")] == [7, 1, 1]
    listed = [item["image"] for k in ("training", "validation", "test") for item in data[k]]
    assert sorted(listed) == sorted(item["image"] for item in items)  # each volume once, labels with their images
    assert all(item["label"] == item["image"].replace("case", "label") for k in ("training", "test") for item in data[k])
    low, high = min(areas["training"]), max(areas["training"])
    assert (low, high) == (pytest.approx(3 * 8 * 0.64, abs=0.05), pytest.approx(14 * 8 * 0.64, abs=0.05))  # 0.1 mm^2
    assert all(low < a < high for a in areas["validation"] + areas["test"])
    # sorted widths 3 4 5 6 7 9 10 12 14: interior positions 3 and 5 of 0..8 -> widths 6 (test) and 9 (validation)
    assert areas["test"] == [pytest.approx(6 * 8 * 0.64, abs=0.05)] and areas["validation"] == [pytest.approx(9 * 8 * 0.64, abs=0.05)]
    # training keeps the order of the lists it came from (training, then validation and test)
    assert [item["image"] for item in data["training"]] == [f"case_{i}.nii.gz" for i in (2, 4, 5, 6, 7, 0, 1)]


def test_interior_positions_never_take_the_ends():
    assert interior_positions(14, 4) == [3, 5, 8, 10]
    assert interior_positions(4, 2) == [1, 2]  # the quick budget: 2 train, 1 validates, 1 is held out
    with pytest.raises(ValueError, match="at least 4 volumes, got 3"):
        interior_positions(3, 2)
