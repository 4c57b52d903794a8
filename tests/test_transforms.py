"""The compact cache (components/data/compact_cache.py) gives exactly the recipe's crops from a fraction of the memory."""

from __future__ import annotations

import functools
import json
import warnings
from copy import deepcopy

import nibabel as nib
import numpy as np
import pytest
import torch
from monai.data import CacheDataset, DataLoader, MetaTensor
from monai.transforms import (
    Compose,
    CropForegroundd,
    EnsureChannelFirstd,
    EnsureTyped,
    LoadImaged,
    Orientationd,
    RandSpatialCropSamplesd,
    ScaleIntensityRanged,
    SpatialPadd,
)

from components import CompactCropForegroundd, RandCompactSpatialCropSamplesd, compact_nbytes, write_dataset
from components.training.seeding import reseed_data

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")  # Orientationd's `labels` default notice

CT_RANGE = (-1000, 1000)


def _recipe(roi, num_samples, a_range=CT_RANGE, load=True, b_range=(0.0, 1.0)) -> Compose:
    """recipe.md s1, exactly as train.json held it before the compact cache."""
    head = [LoadImaged("image", image_only=True), EnsureChannelFirstd("image"), Orientationd("image", "RAS")]
    (a_min, a_max), (b_min, b_max) = a_range, b_range
    return Compose(
        (head if load else [])
        + [
            ScaleIntensityRanged("image", a_min=a_min, a_max=a_max, b_min=b_min, b_max=b_max, clip=True),
            SpatialPadd("image", spatial_size=roi),
            CropForegroundd("image", source_key="image", k_divisible=roi, allow_smaller=True),
            RandSpatialCropSamplesd("image", roi_size=roi, num_samples=num_samples, random_center=True),
            EnsureTyped("image", track_meta=False),
        ]
    )


def _compact(roi, num_samples, a_range=CT_RANGE, load=True, b_range=(0.0, 1.0)) -> Compose:
    load_raw = LoadImaged("image", image_only=True, dtype=None)  # the file's own dtype
    head = [load_raw, EnsureChannelFirstd("image"), Orientationd("image", "RAS")]
    return Compose(
        (head if load else [])
        + [
            CompactCropForegroundd(
                "image", "image", roi_size=roi, a_min=a_range[0], a_max=a_range[1], b_min=b_range[0], b_max=b_range[1]
            ),
            RandCompactSpatialCropSamplesd("image", roi_size=roi, num_samples=num_samples),
            EnsureTyped("image", track_meta=False),
        ]
    )


def _assert_same_samples(expected: list[dict], actual: list[dict], context) -> None:
    assert len(expected) == len(actual), context
    for want, got in zip(expected, actual):
        assert want.keys() == got.keys(), (context, sorted(want), sorted(got))
        assert type(got["image"]) is type(want["image"]) and got["image"].dtype == want["image"].dtype, context
        assert got["image"].shape == want["image"].shape, (context, got["image"].shape, want["image"].shape)
        assert torch.equal(got["image"], want["image"]), context
        for key in want.keys() - {"image"}:  # foreground coordinates, label paths
            assert type(got[key]) is type(want[key]), (context, key)
            assert np.array_equal(np.asarray(got[key]), np.asarray(want[key])), (context, key, got[key], want[key])
            assert getattr(got[key], "dtype", None) == getattr(want[key], "dtype", None), (context, key)


def _split(pipeline: Compose) -> tuple[Compose, Compose]:
    """(cached part, random part), split where CacheDataset splits: at the first random transform."""
    random = (RandSpatialCropSamplesd, RandCompactSpatialCropSamplesd)
    first = next(i for i, t in enumerate(pipeline.transforms) if isinstance(t, random))
    return Compose(pipeline.transforms[:first]), Compose(pipeline.transforms[first:])


def _compare(recipe: Compose, compact: Compose, recipe_input, compact_input, draws: int, seed: int, context) -> None:
    """Runs the cached part once per pipeline, then ``draws`` random parts on copies, both seeded with ``seed``."""
    (recipe_cached, recipe_random), (compact_cached, compact_random) = _split(recipe), _split(compact)
    recipe_item, compact_item = recipe_cached(recipe_input), compact_cached(compact_input)
    recipe_random.set_random_state(seed)
    compact_random.set_random_state(seed)
    for draw in range(draws):
        want = recipe_random(deepcopy(recipe_item))
        got = compact_random(deepcopy(compact_item))
        _assert_same_samples(want, got, (*context, draw))


@pytest.fixture(scope="module")
def ct_items(tmp_path_factory):
    """Five synthetic CT volumes: LPS, RAS, LAS, PLS, LSP storage orders; shapes 56-120 x 56-120 x 40-80."""
    root = tmp_path_factory.mktemp("ct")
    datalist = json.loads(write_dataset(root, kind="ct", num=5, seed=3).read_text())
    items = datalist["training"] + datalist["validation"] + datalist["test"]
    return [{"image": str(root / item["image"]), "label": item["label"]} for item in items]


@pytest.fixture(scope="module")
def ct_loaded(ct_items):
    """Each volume after LoadImaged -> EnsureChannelFirstd -> Orientationd, as the recipe loads it (float32) and as
    the compact pipeline does (the file's int16); the loading itself is covered by the CacheDataset test."""
    pairs = []
    for item in ct_items:
        recipe = Compose(_recipe([96] * 3, 1).transforms[:3])(dict(item))
        compact = Compose(_compact([96] * 3, 1).transforms[:3])(dict(item))
        assert compact["image"].dtype == torch.int16
        pairs.append((recipe, compact))
    return pairs


@pytest.mark.parametrize("roi", [[96, 96, 96], [64, 32, 32], [48, 64, 40]], ids=["96", "64x32x32", "48x64x40"])
def test_same_crops_as_the_recipe_on_synthetic_ct(ct_items, ct_loaded, roi):
    smaller, orientations = False, set()
    for index, (item, (recipe_input, compact_input)) in enumerate(zip(ct_items, ct_loaded)):
        header = nib.load(item["image"])
        smaller |= any(s < r for s, r in zip(header.shape, roi))
        orientations.add("".join(nib.aff2axcodes(header.affine)))
        recipe, compact = _recipe(roi, 3, load=False), _compact(roi, 3, load=False)
        _compare(recipe, compact, recipe_input, compact_input, draws=3, seed=11 + index, context=(roi, item["image"]))
    assert smaller and len(orientations) >= 4  # volumes smaller than the ROI, and non-RAS storage orders were met


def _edge_volumes() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    shape = (1, 50, 40, 30)
    one_voxel = np.full(shape, -1000, np.int16)
    one_voxel[0, 49, 0, 17] = 5  # at the border: the padded box reaches outside the image
    return {
        "all_air": np.full(shape, -1024, np.int16),  # no foreground: the recipe's crops are empty
        "one_voxel_at_border": one_voxel,
        "float_with_fractions": rng.normal(-500, 400, (1, 70, 50, 33)).astype(np.float32),
        "float64_integer_valued": np.rint(rng.normal(-500, 400, (1, 70, 50, 33))),
        "uint8": rng.integers(0, 255, (1, 40, 70, 20)).astype(np.uint8),
        "int32_beyond_2_24": rng.integers(-(2**25), 2**25, (1, 30, 30, 30)).astype(np.int32),
        "two_channels": rng.integers(-1100, 1200, (2, 61, 33, 97)).astype(np.int16),
    }


@functools.lru_cache(maxsize=1)
def _edge_volumes_cached() -> dict[str, np.ndarray]:
    return _edge_volumes()


@pytest.mark.parametrize("name", sorted(_edge_volumes()))
@pytest.mark.parametrize("roi", [[32, 32, 32], [48, 32, 16]], ids=["32", "48x32x16"])
@pytest.mark.parametrize("a_range", [CT_RANGE, (-175, 250)], ids=["ct", "btcv_window"])
def test_same_crops_as_the_recipe_on_edge_cases(name, roi, a_range):
    """Starting after Orientationd: the recipe gets the float32 its LoadImaged makes, ours the raw dtype."""
    volume = _edge_volumes_cached()[name]
    recipe, compact = _recipe(roi, 2, a_range, load=False), _compact(roi, 2, a_range, load=False)
    recipe_input = {"image": MetaTensor(torch.as_tensor(volume.astype(np.float32)))}
    _compare(recipe, compact, recipe_input, {"image": MetaTensor(torch.as_tensor(volume))}, 3, 5, (name, roi, a_range))


@pytest.mark.parametrize("name", ["one_voxel_at_border", "float_with_fractions", "two_channels"])
def test_same_crops_when_background_scales_to_negative_values(name):
    """b_min < 0: voxels outside the foreground are non-zero inside the padded box, so the stored region is found
    by scanning the scaled values rather than from the foreground box."""
    volume = _edge_volumes_cached()[name]
    recipe = _recipe([32, 32, 32], 2, load=False, b_range=(-1.0, 1.0))
    compact = _compact([32, 32, 32], 2, load=False, b_range=(-1.0, 1.0))
    recipe_input = {"image": MetaTensor(torch.as_tensor(volume.astype(np.float32)))}
    _compare(recipe, compact, recipe_input, {"image": MetaTensor(torch.as_tensor(volume))}, 3, 9, (name, "b=-1..1"))


@pytest.mark.parametrize(
    "name, dtype",
    [
        ("float_with_fractions", torch.float32),  # fallback: the recipe's scaled values, only the padding saved
        ("float64_integer_valued", torch.int16),
        ("uint8", torch.uint8),
        ("int32_beyond_2_24", torch.float32),  # float32 could not hold every value exactly
        ("two_channels", torch.int16),
        ("one_voxel_at_border", torch.uint8),
    ],
)
def test_storage_dtype_is_the_narrowest_exact_one(name, dtype):
    out = CompactCropForegroundd("image", "image", roi_size=32, a_min=-1000, a_max=1000)(
        {"image": torch.as_tensor(_edge_volumes_cached()[name])}
    )
    assert out["image"].dtype == dtype
    assert (out["image_compact"]["scale"] is None) == dtype.is_floating_point
    assert out["image"].is_contiguous() and out["image"].untyped_storage().nbytes() == out["image"].nbytes


def test_the_cache_is_at_most_a_quarter_of_the_recipes(ct_items):
    roi = [96, 96, 96]
    recipe = Compose(_recipe(roi, 1).transforms[:6])  # the cached, deterministic part
    compact = Compose(_compact(roi, 1).transforms[:4])
    recipe_bytes = sum(compact_nbytes(recipe(item)) for item in ct_items)
    compact_items = [compact(item) for item in ct_items]
    assert all(item["image"].dtype == torch.int16 for item in compact_items)  # CT in Hounsfield units
    assert sum(compact_nbytes(item) for item in compact_items) <= 0.25 * recipe_bytes


def test_random_calls_are_monais():
    """Same number and kind of draws as RandSpatialCropSamplesd: the transform's RandomState ends in the same state."""
    volume = {"image": MetaTensor(torch.rand(1, 100, 70, 40))}
    ours = Compose(_compact([32, 32, 32], 2, (0, 1), load=False).transforms[:2])
    theirs = Compose(_recipe([32, 32, 32], 2, (0, 1), load=False).transforms[:4])
    ours.set_random_state(1)
    theirs.set_random_state(1)
    for _ in range(3):
        ours(volume), theirs(volume)
    state_ours, state_theirs = ours.transforms[1].R.get_state(), theirs.transforms[3].R.get_state()
    assert np.array_equal(state_ours[1], state_theirs[1]) and state_ours[2:] == state_theirs[2:]


def test_cached_loader_reseeded_like_the_trainer_gives_the_same_batches(ct_items):
    """CacheDataset caches up to our random transform; reseed_data (the trainer's per-epoch reseeding through
    set_rnd) then draws the same crops in both pipelines, epoch after epoch."""
    roi = [64, 32, 32]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        recipe_ds = CacheDataset(ct_items, _recipe(roi, 2), num_workers=1, progress=False)
        compact_ds = CacheDataset(ct_items, _compact(roi, 2), num_workers=1, progress=False)
    assert all(item["image"].dtype == torch.int16 for item in compact_ds._cache)
    recipe_loader, compact_loader = DataLoader(recipe_ds, batch_size=2), DataLoader(compact_ds, batch_size=2)
    for epoch in range(2):
        reseed_data(recipe_loader, 100 + epoch)
        reseed_data(compact_loader, 100 + epoch)
        for want, got in zip(recipe_loader, compact_loader):
            assert torch.equal(want["image"], got["image"]), epoch


def test_arguments_are_checked():
    with pytest.raises(ValueError, match="num_samples"):
        RandCompactSpatialCropSamplesd("image", roi_size=32, num_samples=0)
    with pytest.raises(ValueError, match="roi_size"):
        bad_roi = CompactCropForegroundd("image", "image", roi_size=[32, 0, 32], a_min=0, a_max=1)
        bad_roi({"image": torch.ones(1, 4, 4, 4)})
    with pytest.raises(KeyError, match="image_compact"):
        RandCompactSpatialCropSamplesd("image", roi_size=32, num_samples=1)({"image": torch.ones(1, 4, 4, 4)})
    with pytest.raises(KeyError, match="source_key"):
        CompactCropForegroundd("image", "ct", roi_size=32, a_min=0, a_max=1)({"image": torch.ones(1, 4, 4, 4)})


@pytest.mark.parametrize(
    "args, fast",
    [((-1000, 1000, 0.0, 1.0, True), True), ((-175, 250, 0.0, 1.0, True), True), ((0, 1, None, None, False), True),
     ((5, 5, 0.0, 1.0, True), False)],  # a_min == a_max: MONAI's special case, so MONAI's transform is used
)
def test_intensity_scaler_reproduces_monai_bit_for_bit(args, fast):
    from monai.transforms import ScaleIntensityRange

    from components.data.compact_cache import IntensityScaler

    values = torch.randint(-3000, 3000, (1, 17, 9, 5), dtype=torch.int16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # MONAI's divide-by-zero warning
        scaler = IntensityScaler(*args)
        assert scaler.fast is fast
        expected = ScaleIntensityRange(*args)(values.to(torch.float32))
        got = scaler(values)
    assert torch.equal(got, expected.as_tensor() if hasattr(expected, "as_tensor") else expected)


def test_crops_still_name_their_file_with_the_loaders_meta_dict(ct_items):
    """With LoadImaged(image_only=False), as the bundles load, a NaN report can name the batch's files in both
    pipelines: the compact transforms keep the image_meta_dict key although they drop the image's own meta data."""
    from components.data import batch_filenames

    names = {}
    for name, make in (("recipe", _recipe), ("compact", _compact)):
        pipeline = make([64, 32, 32], 2)
        load = pipeline.transforms[0]
        pipeline.transforms = (LoadImaged("image", image_only=False, dtype=load._loader.dtype), *pipeline.transforms[1:])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dataset = CacheDataset(ct_items[:2], pipeline, num_workers=1, progress=False)
        batch = next(iter(DataLoader(dataset, batch_size=2)))
        assert not isinstance(batch["image"], MetaTensor)  # the step still gets plain tensors
        names[name] = batch_filenames(batch)
    assert names["compact"] == names["recipe"] == [item["image"] for item in ct_items[:2]]
