"""
Synthetic stand-ins for the public datasets the bundles are built for.

Real datasets (BTCV abdominal CT, BraTS brain-tumour MRI) cannot be downloaded where this project is
built and tested, so :func:`write_dataset` writes small phantoms in the Medical Segmentation Decathlon
layout instead: NIfTI images and labels under ``imagesTr``/``labelsTr`` plus a ``dataset.json``
datalist that :func:`monai.data.load_decathlon_datalist` reads. The phantoms keep the properties that
make real data awkward for a pipeline: varied volume shapes that are not multiples of the network's
patch sizes (some smaller than a 64-voxel ROI), anisotropic spacing, LPS / RAS / permuted orientations
with non-zero origins, and realistic intensity ranges (Hounsfield units for CT, an arbitrary positive
scale with per-modality contrast for MRI).

Every subject is generated from its own child seed of ``seed``, so subject ``i`` is the same whatever
``num`` is, and the same ``seed`` always gives the same voxel arrays and affines.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import nibabel as nib
import numpy as np
from nibabel.orientations import apply_orientation, axcodes2ornt, inv_ornt_aff, ornt_transform

__all__ = ["write_dataset"]

CT_LABELS: dict[int, str] = {
    0: "background",
    1: "spleen",
    2: "right kidney",
    3: "left kidney",
    4: "gallbladder",
    5: "esophagus",
    6: "liver",
    7: "stomach",
    8: "aorta",
    9: "IVC",
    10: "portal and splenic vein",
    11: "pancreas",
    12: "right adrenal gland",
    13: "left adrenal gland",
}
"""BTCV label indices and names; every CT phantom contains all 13 organs."""

MRI_LABELS: dict[int, str] = {
    0: "background",
    1: "necrotic and non-enhancing tumour core",
    2: "peritumoral edema",
    4: "GD-enhancing tumour",
}
"""BraTS 2018-2021 label convention (there is no label 3)."""

MRI_MODALITIES: dict[int, str] = {0: "T1", 1: "T1ce", 2: "T2", 3: "FLAIR"}
"""Channel order of the 4D MRI images."""

DEMO_ORGANS: tuple[str, ...] = ("spleen", "right kidney", "left kidney", "liver", "stomach")
"""The large CT organs the demo and the low-data benchmark segment (``write_dataset(organs=...)``)."""

_KINDS = ("ct", "mri")
_MIN_NUM = 3

# Portal-venous phase CT, mean Hounsfield units per label (index = label); per-subject contrast
# timing scales the enhancement above 40 HU. The values are well apart so that classes are separable.
_CT_HU = np.array([0, 125, 175, 175, 10, 50, 105, 25, 190, 135, 150, 85, 60, 60], dtype=np.float32)
_CT_NON_ENHANCING = (4, 7)  # gallbladder bile and stomach fluid do not take up contrast
_HU_AIR, _HU_FAT, _HU_SOFT, _HU_VISCERAL_FAT, _HU_GAS = -1000.0, -100.0, 40.0, -90.0, -850.0
_HU_CORTICAL, _HU_CANCELLOUS, _HU_DISC, _HU_ARCH, _HU_RIB, _HU_CANAL = 900.0, 320.0, 90.0, 700.0, 650.0, 15.0
_HU_CLIP = (-1024.0, 3071.0)  # the range a 12-bit CT scanner stores

# Organ ellipsoids: label, centre (a, b, w), radii (a, b, w). a and b are fractions of the abdominal
# cavity's half-width (+a = patient right) and half-depth (+b = anterior); w is the normalised
# superior-inferior coordinate of the scanned slab (+w = superior). Painted in this order.
_CT_BLOBS = (
    (1, (-0.62, -0.30, 0.40), (0.17, 0.30, 0.35)),  # spleen: left, posterior, upper
    (6, (0.42, 0.05, 0.45), (0.48, 0.70, 0.60)),  # liver: right upper quadrant
    (2, (0.42, -0.45, -0.25), (0.14, 0.20, 0.35)),  # right kidney sits lower than the left
    (3, (-0.42, -0.42, -0.12), (0.14, 0.20, 0.35)),
    (12, (0.24, -0.36, 0.28), (0.05, 0.09, 0.12)),  # adrenals: above and medial to the kidneys
    (13, (-0.24, -0.33, 0.35), (0.05, 0.09, 0.12)),
    (7, (-0.32, 0.30, 0.45), (0.28, 0.32, 0.35)),  # stomach: left anterior, upper
    (4, (0.30, 0.38, 0.02), (0.09, 0.13, 0.15)),  # gallbladder: under the anterior liver
    (11, (-0.05, 0.02, 0.08), (0.40, 0.09, 0.12)),  # pancreas: elongated, anterior to the vessels
)
# Vertical vessels / tubes: label, centre (a, b), radii (a, b), w range. Painted after the blobs.
_CT_TUBES = (
    (5, (-0.12, -0.12), (0.05, 0.06), (0.55, 1.0)),  # esophagus, only in the upper slices
    (9, (0.16, -0.24), (0.08, 0.09), (-1.0, 0.7)),  # IVC, ends inside the liver
    (8, (-0.10, -0.30), (0.075, 0.11), (-1.0, 1.0)),  # aorta, left of midline, in front of the spine
)
# CT orientations cycle with the subject index: DICOM-like LPS, RAS, radiological LAS and two with
# permuted axes (in-plane axes swapped; slice axis second, as in a coronal acquisition).
_CT_ORIENTATIONS = ("LPS", "RAS", "LAS", "PLS", "LSP")
_MRI_ORIENTATIONS = ("LPS", "RAS", "LAS")

# MRI tissue classes and their intensities per modality (rows: T1, T1ce, T2, FLAIR).
_BG, _CSF, _GM, _WM, _NECROSIS, _EDEMA, _ENHANCING = range(7)
_MRI_CONTRAST = np.array(
    [
        # bg   CSF    GM     WM   necrosis edema enhancing
        [0.0, 300.0, 650.0, 850.0, 350.0, 550.0, 700.0],  # T1
        [0.0, 320.0, 680.0, 870.0, 380.0, 580.0, 1500.0],  # T1ce: gadolinium lights up the ring
        [0.0, 1900.0, 900.0, 650.0, 1700.0, 1450.0, 1100.0],  # T2: fluid bright
        [0.0, 250.0, 800.0, 600.0, 900.0, 1500.0, 1100.0],  # FLAIR: free water suppressed, edema bright
    ],
    dtype=np.float32,
)


def split_sizes(num: int) -> tuple[int, int, int]:
    """
    Number of (training, validation, test) cases for ``num`` subjects.

    Validation and test each get ``max(1, round(0.15 * num))`` cases and training the rest, so every
    split is non-empty, which needs ``num >= 3``.
    """
    if isinstance(num, bool) or not isinstance(num, (int, np.integer)) or num < _MIN_NUM:
        raise ValueError(f"num must be an integer >= {_MIN_NUM} (one case per split), got {num!r}.")
    held_out = max(1, round(0.15 * int(num)))
    return int(num) - 2 * held_out, held_out, held_out


def write_dataset(
    out: str | Path,
    kind: str = "ct",
    num: int = 6,
    seed: int = 0,
    organs: Sequence[str] | None = None,
    varied: bool = False,
    labels: bool = True,
) -> Path:
    """
    Write a synthetic dataset in the Medical Segmentation Decathlon layout and return its ``dataset.json``.

    Images go to ``out/imagesTr/case_XXX.nii.gz`` and labels to ``out/labelsTr/case_XXX.nii.gz``;
    ``dataset.json`` lists them (paths relative to ``out``) under ``training``, ``validation`` and ``test``
    (see :func:`split_sizes`), with the usual MSD keys (``name``, ``labels``, ``modality``, ...).

    Args:
        out: output directory, created if needed; existing case files are overwritten.
        kind: ``"ct"`` for BTCV-like abdominal CT in Hounsfield units (int16 image, 13 organ labels),
            ``"mri"`` for BraTS-like brain-tumour MRI (4D int16 image with channels T1, T1ce, T2, FLAIR,
            labels 0/1/2/4).
        num: number of subjects, at least 3.
        seed: non-negative seed; the same seed gives identical voxel arrays and affines.
        organs: CT only: the organs to label, by name (``CT_LABELS``), numbered 1.. in this order; the other
            organs stay in the image but are background in the label (e.g. :data:`DEMO_ORGANS`).
        varied: CT only: a pretraining-style set with more variety than the labeled one: each subject is an
            independent draw (another subject than the same index without ``varied``), with a random field of
            view cut out of the slab (organs cut at the border), scanner contrast and offset, noise level,
            and lesions (cysts, hyperdense nodules) painted into organs.
        labels: write label maps and list them; ``False`` writes images only (an unlabeled set).

    Example::

        write_dataset("data/labeled", num=10, organs=DEMO_ORGANS)      # 6 training, 2 validation, 2 test
        write_dataset("data/unlabeled", num=40, varied=True, labels=False)

    Raises:
        ValueError: for an unknown ``kind`` or organ, ``num < 3``, a negative / non-integer ``seed``, or
            ``organs`` / ``varied`` with ``kind="mri"``.
    """
    if kind not in _KINDS:
        raise ValueError(f"kind must be one of {_KINDS}, got {kind!r}.")
    n_train, n_val, n_test = split_sizes(num)
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}.")

    if kind == "mri" and (organs is not None or varied):
        raise ValueError("organs and varied apply to kind='ct' only.")
    names = {name: index for index, name in CT_LABELS.items() if index}
    unknown = [o for o in organs or () if o not in names]
    if unknown or (organs is not None and (not organs or len(set(organs)) != len(organs))):
        raise ValueError(f"organs must be distinct names from {sorted(names)}, got {organs!r}.")
    relabel = None
    if organs is not None:
        relabel = np.zeros(len(CT_LABELS), dtype=np.uint8)
        relabel[[names[o] for o in organs]] = np.arange(1, len(organs) + 1, dtype=np.uint8)

    out = Path(out)
    (out / "imagesTr").mkdir(parents=True, exist_ok=True)
    if labels:
        (out / "labelsTr").mkdir(parents=True, exist_ok=True)
    make_subject = _ct_subject if kind == "ct" else _mri_subject
    items = []
    for index in range(num):
        key = (index, 1) if varied else (index,)
        rng = np.random.default_rng(np.random.SeedSequence(int(seed), spawn_key=key))
        image, label, affine = make_subject(rng, index)
        if varied:
            image, label, affine = _vary_ct(rng, image, label, affine)
        name = f"case_{index:03d}.nii.gz"
        _save_nifti(image, affine, out / "imagesTr" / name)
        items.append({"image": f"imagesTr/{name}"})
        if labels:
            _save_nifti(label if relabel is None else relabel[label], affine, out / "labelsTr" / name)
            items[-1]["label"] = f"labelsTr/{name}"

    if kind == "ct":
        label_names = CT_LABELS if organs is None else {0: "background", **dict(enumerate(organs, start=1))}
        header = {
            "name": "SyntheticAbdomenCT",
            "description": "Synthetic BTCV-like abdominal CT phantoms in Hounsfield units (portal-venous phase)"
            + ("; varied fields of view, contrast, noise and lesions." if varied else "."),
            "tensorImageSize": "3D",
            "modality": {"0": "CT"},
            "labels": {str(k): v for k, v in label_names.items()} if labels else {},
        }
    else:
        header = {
            "name": "SyntheticBrainTumourMRI",
            "description": "Synthetic BraTS-like multi-parametric brain MRI with gliomas; "
            "labels follow the BraTS 2018-2021 convention (0, 1, 2, 4).",
            "tensorImageSize": "4D",
            "modality": {str(k): v for k, v in MRI_MODALITIES.items()},
            "labels": {str(k): v for k, v in MRI_LABELS.items()},
        }
    datalist = {
        **header,
        "reference": f"components.data.synthetic.write_dataset(kind={kind!r}, num={num}, seed={seed}"
        + (f", organs={tuple(organs)!r}" if organs is not None else "")
        + (", varied=True" if varied else "")
        + ("" if labels else ", labels=False")
        + ")",
        "numTraining": n_train,
        "numValidation": n_val,
        "numTest": n_test,
        "training": items[:n_train],
        "validation": items[n_train : n_train + n_val],
        "test": items[n_train + n_val :],
    }
    path = out / "dataset.json"
    path.write_text(json.dumps(datalist, indent=2) + "\n")
    return path


def _save_nifti(array: np.ndarray, affine: np.ndarray, path: Path) -> None:
    """Save with the affine in both sform and qform (scanner code), as converters of DICOM do."""
    img = nib.Nifti1Image(array, affine, dtype=array.dtype)
    img.set_sform(affine, code=1)
    img.set_qform(affine, code=1)
    img.header.set_xyzt_units(xyz="mm")
    nib.save(img, str(path))


def _draw_size(rng: np.random.Generator, low: int, high: int) -> int:
    """An integer in [low, high] that is not a multiple of 16, so that 32/64/96-voxel ROIs never tile it."""
    while True:
        n = int(rng.integers(low, high + 1))
        if n % 16:
            return n


def _norm_axes(shape: Sequence[int]) -> list[np.ndarray]:
    """Open grid of voxel-centre coordinates normalised to [-1, 1] along each of the three axes."""
    return [
        ((np.arange(n, dtype=np.float32) + 0.5) * (2.0 / n) - 1.0).reshape([-1 if i == axis else 1 for i in range(3)])
        for axis, n in enumerate(shape)
    ]


def _to_voxels(
    shape: Sequence[int], centre: Sequence[float], radii: Sequence[float], min_radii: Sequence[float]
) -> tuple[np.ndarray, np.ndarray]:
    """Convert a normalised centre and radii to voxel units (radii at least ``min_radii`` voxels)."""
    n = np.asarray(shape, dtype=np.float64)
    c = (np.asarray(centre) + 1.0) * n / 2.0 - 0.5
    r = np.maximum(np.asarray(radii) * n / 2.0, min_radii)
    return c, r


def _rotation(rng: np.random.Generator, max_angle: float) -> np.ndarray:
    """A random rotation matrix made of three rotations by at most ``max_angle`` radians."""
    rot = np.eye(3)
    for axis, angle in enumerate(rng.uniform(-max_angle, max_angle, 3)):
        i, j = [a for a in range(3) if a != axis]
        r = np.eye(3)
        r[i, i] = r[j, j] = np.cos(angle)
        r[i, j], r[j, i] = -np.sin(angle), np.sin(angle)
        rot = rot @ r
    return rot


def _blob(
    shape: Sequence[int],
    centre: np.ndarray,
    radii: np.ndarray,
    rng: np.random.Generator,
    tilt: float = 0.3,
    wobble: float = 0.15,
    extent: float = 1.0,
) -> tuple[tuple[slice, ...], np.ndarray]:
    """
    Normalised-radius field of a randomly rotated, smoothly deformed ellipsoid (voxel units).

    The field is below 1 inside the blob and below ``l`` inside the blob grown by ``l``, so nested
    shapes (organ + surrounding fat, tumour compartments) share one field. The deformation is a sum of
    three random low-frequency sinusoids of relative amplitude ``wobble`` (< 1). Only the bounding box of
    the blob grown by ``extent`` is computed; it is returned as slices into the volume.
    """
    reach = float(radii.max()) * extent * (1.0 + wobble)
    lo = np.clip(np.floor(centre - reach).astype(int), 0, shape)
    hi = np.clip(np.ceil(centre + reach).astype(int) + 1, 0, shape)
    box = tuple(slice(int(a), int(b)) for a, b in zip(lo, hi))
    offsets = [
        (np.arange(a, b, dtype=np.float32) - np.float32(c)).reshape([-1 if i == axis else 1 for i in range(3)])
        for axis, (a, b, c) in enumerate(zip(lo, hi, centre))
    ]
    rot = _rotation(rng, tilt).astype(np.float32)
    local = [sum(rot[j, k] * offsets[j] for j in range(3)) / np.float32(radii[k]) for k in range(3)]
    dist = np.sqrt(local[0] ** 2 + local[1] ** 2 + local[2] ** 2)
    freqs = rng.normal(0.0, 2.0, (3, 3)).astype(np.float32)
    phases = rng.uniform(0.0, 2.0 * np.pi, 3).astype(np.float32)
    amps = (rng.dirichlet(np.ones(3)) * wobble).astype(np.float32)
    deform = np.float32(1.0) + sum(
        amps[m] * np.sin(freqs[m, 0] * local[0] + freqs[m, 1] * local[1] + freqs[m, 2] * local[2] + phases[m])
        for m in range(3)
    )
    return box, dist / deform


def _tube(
    shape: Sequence[int], axis: int, span: tuple[int, int], path: np.ndarray, radii: Sequence[float]
) -> tuple[tuple[slice, ...], np.ndarray]:
    """
    Mask of an elliptical tube running along ``axis`` over indices ``span`` (voxel units).

    ``path`` has one row per index in ``span`` with the cross-section centre on the two other axes.
    Returns the bounding-box slices and the mask inside them.
    """
    others = [a for a in range(3) if a != axis]
    box = [slice(0, 0)] * 3
    box[axis] = slice(*span)
    inside = np.float32(0.0)
    along = [-1 if i == axis else 1 for i in range(3)]
    for j, a in enumerate(others):
        lo = int(np.clip(np.floor(path[:, j].min() - radii[j]), 0, shape[a]))
        hi = int(np.clip(np.ceil(path[:, j].max() + radii[j]) + 1, 0, shape[a]))
        box[a] = slice(lo, hi)
        coord = np.arange(lo, hi, dtype=np.float32).reshape([-1 if i == a else 1 for i in range(3)])
        inside = inside + ((coord - path[:, j].astype(np.float32).reshape(along)) / np.float32(radii[j])) ** 2
    return tuple(box), inside < 1.0


def _smooth(array: np.ndarray, axes: Sequence[int]) -> np.ndarray:
    """Separable [1, 2, 1] / 4 blur with edge replication: a mild scanner point-spread function."""
    for axis in axes:
        moved = np.moveaxis(array, axis, 0)
        padded = np.concatenate([moved[:1], moved, moved[-1:]], axis=0)
        blurred = 0.25 * padded[:-2] + 0.5 * padded[1:-1] + 0.25 * padded[2:]
        array = np.moveaxis(blurred, 0, axis)
    return array


def _reorient(arrays: Sequence[np.ndarray], ras_affine: np.ndarray, codes: str) -> tuple[list[np.ndarray], np.ndarray]:
    """Re-store RAS-ordered arrays in the axis order ``codes`` and return the affine that keeps anatomy in place."""
    transform = ornt_transform(axcodes2ornt(("R", "A", "S")), axcodes2ornt(tuple(codes)))
    affine = ras_affine @ inv_ornt_aff(transform, arrays[0].shape[:3])
    return [np.ascontiguousarray(apply_orientation(a, transform)) for a in arrays], affine


def _ras_affine(
    rng: np.random.Generator, shape: Sequence[int], spacing: Sequence[float], shift: Sequence[float]
) -> np.ndarray:
    """RAS affine with the given spacing whose origin puts the volume centre near ``shift`` (mm)."""
    affine = np.diag([*spacing, 1.0])
    centre = (np.asarray(shape) - 1) / 2.0 * np.asarray(spacing)
    affine[:3, 3] = np.round(np.asarray(shift) - centre + rng.uniform(-15.0, 15.0, 3), 2)
    return affine


def _ct_subject(rng: np.random.Generator, index: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One abdominal CT phantom: int16 HU image, uint8 BTCV label map, affine (orientation cycles with ``index``)."""
    # every other subject is a short scan with fewer than 64 slices
    shape = (_draw_size(rng, 56, 120), _draw_size(rng, 56, 120), _draw_size(rng, 40, 63 if index % 2 == 0 else 80))
    spacing = (round(float(rng.uniform(0.6, 1.0)), 4),) * 2 + (float(rng.choice([1.5, 2.0, 2.5, 3.0, 4.0, 5.0])),)
    u, v, w = _norm_axes(shape)
    shape_xy = shape[:2]

    # body: a slightly boxy ellipse (superellipse) whose width changes along the slab; fat under the skin
    u0, v0 = rng.uniform(-0.04, 0.04), rng.uniform(-0.10, 0.0)
    ru, rv = rng.uniform(0.82, 0.95), rng.uniform(0.62, 0.78)
    fat = rng.uniform(0.06, 0.14)
    power = rng.uniform(2.0, 2.6)
    taper = np.float32(1.0) + np.float32(rng.uniform(-0.05, 0.05)) * w

    def body_radius(scale_u: float, scale_v: float) -> np.ndarray:
        """Superellipse 'radius' (to the power ``power``) of the body outline scaled to the given half-axes."""
        return (np.abs(u - u0) / (scale_u * taper)) ** power + (np.abs(v - v0) / (scale_v * taper)) ** power

    body = body_radius(ru, rv) < 1.0
    ru_in, rv_in = ru - fat, rv - fat * 0.8
    cavity_r = body_radius(ru_in, rv_in) ** (1.0 / power)
    inner = cavity_r < 1.0
    core = cavity_r < 0.9  # organs stay inside the ribs / abdominal wall

    def place(a: float | np.ndarray, b: float | np.ndarray) -> tuple[float | np.ndarray, float | np.ndarray]:
        """Cavity-relative (a, b) to normalised (u, v) volume coordinates; scalars or arrays."""
        return u0 + a * ru_in, v0 + b * rv_in

    label = np.zeros(shape, dtype=np.uint8)
    visceral_fat = np.zeros(shape, dtype=bool)
    for _ in range(8):
        centre = (*place(*rng.uniform(-0.7, 0.7, 2)), rng.uniform(-0.9, 0.9))
        radii = (rng.uniform(0.1, 0.25) * ru_in, rng.uniform(0.1, 0.25) * rv_in, rng.uniform(0.2, 0.5))
        box, field = _blob(shape, *_to_voxels(shape, centre, radii, (1.5, 1.5, 1.0)), rng)
        visceral_fat[box] |= field < 1.0

    gas = np.zeros(shape, dtype=bool)
    for organ, (a, b, wc), (ra, rb, rw) in _CT_BLOBS:
        a, b, wc = np.array([a, b, wc]) + rng.uniform(-0.06, 0.06, 3)
        scale = rng.uniform(0.85, 1.15, 3)
        centre, radii = _to_voxels(shape, (*place(a, b), wc), (ra * ru_in, rb * rv_in, rw) * scale, (1.5, 1.5, 1.0))
        extent = 1.35 if organ in (2, 3) else 1.0  # kidneys sit in perirenal fat
        box, field = _blob(shape, centre, radii, rng, wobble=rng.uniform(0.08, 0.2), extent=extent)
        if organ in (2, 3):
            visceral_fat[box] |= field < extent
        label[box][field < 1.0] = organ
        if organ == 7:  # gas floats anteriorly in the stomach of a supine patient
            rel = (np.arange(box[1].start, box[1].stop) - centre[1]).reshape(1, -1, 1) / radii[1]
            gas[box] |= (field < 1.0) & (rel > rng.uniform(0.5, 0.75))

    # splenic vein from the splenic hilum across to the portal vein at the liver hilum
    n_u = shape[0]
    a_left, a_right = -0.55 + rng.uniform(-0.05, 0.05), 0.3 + rng.uniform(-0.05, 0.05)
    i_lo, i_hi = (int(np.clip(round((place(a, 0)[0] + 1) * n_u / 2), 0, n_u)) for a in (a_left, a_right))
    t = np.linspace(0.0, 1.0, i_hi - i_lo)
    vein_b = place(0, -0.08 + 0.05 * np.sin(np.pi * t + rng.uniform(0, np.pi)))[1]
    vein_w = 0.12 + rng.uniform(-0.05, 0.05) + 0.1 * t
    path = np.stack([(vein_b + 1) * shape[1] / 2 - 0.5, (vein_w + 1) * shape[2] / 2 - 0.5], axis=1)
    radii_vox = (max(0.05 * rv_in * shape[1] / 2, 1.5), max(0.06 * shape[2] / 2, 1.0))
    box, mask = _tube(shape, 0, (i_lo, i_hi), path, radii_vox)
    label[box][mask] = 10

    for organ, (a, b), (ra, rb), (w_lo, w_hi) in _CT_TUBES:
        k_lo, k_hi = (int(np.clip(round((x + 1) * shape[2] / 2), 0, shape[2])) for x in (w_lo, w_hi))
        ks = (np.arange(k_lo, k_hi) + 0.5) * 2 / shape[2] - 1
        wiggle = [0.03 * np.sin(rng.uniform(1, 3) * ks + rng.uniform(0, 2 * np.pi)) for _ in range(2)]
        cu, cv = place(a + wiggle[0], b + wiggle[1])
        path = np.stack([(cu + 1) * shape[0] / 2 - 0.5, (cv + 1) * shape[1] / 2 - 0.5], axis=1)
        size = rng.uniform(0.85, 1.15)
        radii_vox = [max(r * s * size * n / 2, 1.5) for r, s, n in zip((ra, rb), (ru_in, rv_in), shape_xy)]
        box, mask = _tube(shape, 2, (k_lo, k_hi), path, radii_vox)
        label[box][mask] = organ
    label[~core] = 0

    # spine: vertebral bodies (cortical rim, cancellous core) separated by discs, canal, posterior arch
    cu, cv = place(rng.uniform(-0.03, 0.03), -0.62)
    vb_r = np.sqrt(((u - cu) / (0.13 * ru_in)) ** 2 + ((v - cv) / (0.21 * rv_in)) ** 2)
    period, phase = rng.uniform(0.45, 0.6), rng.uniform(0.0, 1.0)
    disc = np.mod(w / period + phase, 1.0) < 0.22
    canal_v = cv - 0.30 * rv_in
    canal_r = np.sqrt(((u - cu) / (0.05 * ru_in)) ** 2 + ((v - canal_v) / (0.07 * rv_in)) ** 2)
    arch = (np.sqrt(((u - cu) / (0.10 * ru_in)) ** 2 + ((v - canal_v) / (0.12 * rv_in)) ** 2) < 1.0) & (
        v < canal_v + 0.03
    )
    spinous = (np.abs(u - cu) < max(0.025 * ru_in, 1.6 / shape[0])) & (v < canal_v - 0.1 * rv_in)
    spinous &= v > canal_v - 0.25 * rv_in
    # ribs: segments of a ring just inside the abdominal wall, sweeping around as w changes
    theta = np.arctan2(u - u0, v - v0)
    ribs = (cavity_r > 0.91) & (cavity_r < 0.97) & (np.abs(theta) > 0.7)
    ribs = ribs & (w > rng.uniform(-0.5, -0.2)) & (np.cos(7 * theta + 10 * w + rng.uniform(0, 2 * np.pi)) > 0.6)

    hu = _CT_HU.copy()
    enhancing = np.setdiff1d(np.arange(1, len(hu)), _CT_NON_ENHANCING)
    hu[enhancing] = _HU_SOFT + (hu[enhancing] - _HU_SOFT) * rng.uniform(0.85, 1.15)
    hu[1:] += rng.uniform(-3.0, 3.0, len(hu) - 1).astype(np.float32)
    image = np.where(body, np.float32(_HU_FAT), np.float32(_HU_AIR))
    image = np.where(inner, np.float32(_HU_SOFT), image)
    image[visceral_fat & core & (label == 0)] = _HU_VISCERAL_FAT
    image = np.where(label > 0, hu[label], image)
    image[gas] = _HU_GAS
    bone = np.zeros(shape, dtype=bool)
    for mask, value in (
        ((vb_r < 1.0) & ~disc, _HU_CANCELLOUS),
        ((vb_r < 1.0) & (vb_r > 0.82) & ~disc, _HU_CORTICAL),
        ((vb_r < 1.0) & disc, _HU_DISC),
        (arch | spinous, _HU_ARCH),
        (canal_r < 1.0, _HU_CANAL),
        (ribs, _HU_RIB),
    ):
        mask = np.broadcast_to(mask, shape)
        image[mask] = value
        bone |= mask
    label[bone] = 0

    sigma = rng.uniform(10.0, 20.0) / 0.375  # the in-plane blur divides white-noise std by 0.375
    image = _smooth(image + rng.standard_normal(shape, dtype=np.float32) * np.float32(sigma), axes=(0, 1))
    image = np.rint(np.clip(image, *_HU_CLIP)).astype(np.int16)

    shift = (rng.uniform(-30, 30), rng.uniform(-40, 40), rng.uniform(-400, 0))
    affine = _ras_affine(rng, shape, spacing, shift)
    (image, label), affine = _reorient((image, label), affine, _CT_ORIENTATIONS[index % len(_CT_ORIENTATIONS)])
    return image, label, affine


def _vary_ct(
    rng: np.random.Generator, image: np.ndarray, label: np.ndarray, affine: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """More variety for a pretraining set: lesions in organs, scanner contrast / offset / extra noise, and a
    random field of view (60-100 % of each axis, at least 40 voxels) that cuts organs at its border."""
    image = image.astype(np.float32)
    organ_voxels = np.argwhere(label > 0)
    for _ in range(int(rng.integers(0, 4))):
        if not len(organ_voxels):
            break
        centre = organ_voxels[rng.integers(len(organ_voxels))].astype(np.float64)
        radii = rng.uniform(2.0, 6.0, 3)
        box, field = _blob(image.shape, centre, radii, rng, tilt=np.pi, wobble=0.2)
        inside = (field < 1.0) & (label[box] > 0)
        image[box][inside] = rng.choice([rng.uniform(-10.0, 20.0), rng.uniform(180.0, 300.0)])
    soft = image > -200.0  # tissue, not air or lung: its contrast and level vary between scanners
    image[soft] = _HU_SOFT + (image[soft] - _HU_SOFT) * np.float32(rng.uniform(0.8, 1.2)) + np.float32(rng.uniform(-25, 25))
    image += rng.standard_normal(image.shape, dtype=np.float32) * np.float32(rng.uniform(0.0, 25.0))
    size = [min(n, max(40, int(n * f))) for n, f in zip(image.shape, rng.uniform(0.6, 1.0, 3))]
    box = tuple(slice(a, a + s) for a, s in ((int(rng.integers(0, n - s + 1)), s) for n, s in zip(image.shape, size)))
    affine = affine.copy()
    affine[:3, 3] = affine[:3, :3] @ np.array([b.start for b in box]) + affine[:3, 3]
    image = np.rint(np.clip(image[box], *_HU_CLIP)).astype(np.int16)
    return image, np.ascontiguousarray(label[box]), affine


def _mri_subject(rng: np.random.Generator, index: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One brain-tumour MRI phantom: (H, W, D, 4) int16 image, uint8 BraTS label map, affine."""
    shape = tuple(_draw_size(rng, 56, 96) for _ in range(3))
    in_plane = round(float(rng.uniform(0.9, 1.0)), 4)
    spacing = (in_plane, in_plane, round(float(rng.uniform(1.0, 1.3)), 4))
    u, v, w = _norm_axes(shape)

    # skull-stripped brain: an ellipsoid whose outer layer is CSF, then folded cortex, then white matter
    brain_c = np.array([0.0, 0.02, -0.05]) + rng.uniform(-0.03, 0.03, 3)
    brain_r = rng.uniform([0.72, 0.82, 0.70], [0.80, 0.90, 0.78])
    centre, radii = _to_voxels(shape, brain_c, brain_r, (1.0, 1.0, 1.0))
    box, field = _blob(shape, centre, radii, rng, tilt=0.08, wobble=0.04, extent=1.0)
    brain_field = np.full(shape, np.inf, dtype=np.float32)
    brain_field[box] = field
    brain = brain_field < 1.0
    freq = rng.uniform(12.0, 18.0, 3)
    gyri = np.sin(freq[0] * u + rng.uniform(0, 6.3)) * np.sin(freq[1] * v + rng.uniform(0, 6.3))
    gyri = gyri * np.sin(freq[2] * w + rng.uniform(0, 6.3))
    tissue = np.where(brain, np.uint8(_WM), np.uint8(_BG))
    tissue[brain & (brain_field > 0.78 + 0.06 * gyri)] = _GM
    tissue[brain & ((brain_field > 0.95) | ((brain_field > 0.85) & (gyri > 0.75)))] = _CSF
    fissure = (np.abs(u - brain_c[0]) < 1.0 / shape[0]) & (brain_field > 0.4) & (w > brain_c[2] - 0.2)
    tissue[brain & fissure] = _CSF
    deep_structures = (  # class, centre offset from the brain centre, radii (normalised units)
        (_GM, (0.20, -0.05, 0.0), (0.08, 0.12, 0.10)),  # basal ganglia / thalamus
        (_CSF, (0.09, 0.05, 0.12), (0.05, 0.28, 0.09)),  # lateral ventricles
    )
    for sign in (-1.0, 1.0):
        for cls, offset, size in deep_structures:
            c = brain_c + np.array([sign * offset[0], offset[1], offset[2]]) + rng.uniform(-0.02, 0.02, 3)
            c_vox, r_vox = _to_voxels(shape, c, np.asarray(size) * rng.uniform(0.85, 1.15, 3), (1.5, 1.5, 1.5))
            box, field = _blob(shape, c_vox, r_vox, rng, tilt=0.15, wobble=0.1)
            tissue[box][field < 1.0] = cls

    # glioma in one hemisphere: necrotic core inside an enhancing rim inside edema; grown from one field
    # so the compartments are nested; the centre is redrawn (and the size shrunk) until it lies well
    # inside the brain
    side = rng.choice([-1.0, 1.0])
    half = min(shape) / 2.0
    scale = 1.0
    while True:
        r_core = half * rng.uniform(0.1, 0.16) * scale
        r_rim = r_core + max(2.0, half * rng.uniform(0.05, 0.08) * scale)
        r_edema = r_rim + max(2.5, half * rng.uniform(0.12, 0.22) * scale)
        offset = (side * rng.uniform(0.3, 0.5), rng.uniform(-0.35, 0.35), rng.uniform(-0.2, 0.35))
        c = brain_c + brain_r * np.array(offset)
        c_vox = (c + 1.0) * np.asarray(shape) / 2.0 - 0.5
        r_vox = r_edema * rng.uniform(0.85, 1.15, 3)
        box, field = _blob(shape, c_vox, r_vox, rng, tilt=np.pi, wobble=0.25)
        edema = field < 1.0
        if edema.any() and brain_field[box][edema].max() < 0.9:
            break
        scale *= 0.9
    core = field < r_core / r_edema
    rim = (field < r_rim / r_edema) & ~core
    label = np.zeros(shape, dtype=np.uint8)
    label[box][edema] = 2
    label[box][rim] = 4
    label[box][core] = 1
    tissue[label == 2] = _EDEMA
    tissue[label == 4] = _ENHANCING
    tissue[label == 1] = _NECROSIS

    channels = []
    basis = (u, v, w, u * v, v * w, u * w, u * u, v * v)
    for contrast in _MRI_CONTRAST:
        gain = rng.uniform(0.7, 1.4)
        bias = np.exp(sum(np.float32(c) * b for c, b in zip(rng.normal(0.0, 0.08, len(basis)), basis)))
        signal = _smooth(contrast[tissue] * np.float32(gain) * bias, axes=(0, 1, 2))
        sigma = np.float32(0.025 * contrast[_WM] * gain)
        noise_re = rng.standard_normal(shape, dtype=np.float32) * sigma
        noise_im = rng.standard_normal(shape, dtype=np.float32) * sigma
        magnitude = np.sqrt((signal + noise_re) ** 2 + noise_im**2)  # Rician magnitude noise
        channels.append(np.where(brain, np.rint(magnitude), 0).astype(np.int16))
    image = np.stack(channels, axis=-1)

    affine = _ras_affine(rng, shape, spacing, (0.0, -15.0, 20.0))
    (image, label), affine = _reorient((image, label), affine, _MRI_ORIENTATIONS[index % len(_MRI_ORIENTATIONS)])
    return image, label, affine
