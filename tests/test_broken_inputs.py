"""The broken-input corpus of tests/test_check_data.py given to real bundle runs (``python -m monai.bundle run``).

Each input must stop the run with the line ``check-data`` prints for it (the file and what is wrong), raised by
our check before any caching, rather than a traceback from deep inside MONAI; voxels that only ``check-data --deep``
reads (a block of NaN, an all-Inf image, label values beyond the classes) must stop the run when caching first reads
them, in one line on stderr naming the file and what it holds, before any training iteration; and with the check
turned off, a file that breaks a transform while caching must still be named in the error.

The multi-organ CT bundle reads an image and a label per entry, so every case of the corpus applies and each runs
on its own; the pretraining bundles (images only) and the BraTS bundle (4-channel MRI) get every case that applies
to them in one datalist, and must name each broken file in the one report of the data check. The empty list and a
transform error with the check off go through four bundles, non-finite voxels through all five.
"""

from __future__ import annotations

import json
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest

from components import write_dataset
from components.demo.runner import BUNDLES_DIR, bundle_command
from tests.test_check_data import _build_corpus
from tests.test_dino_bundle import BUNDLE as DINO
from tests.test_dino_bundle import TINY as DINO_TINY
from tests.test_errors import _run as _run_as_user
from tests.test_finetune_bundles import CT, CT_TINY, MRI, MRI_TINY, TRAIN_TINY, _run, _run_at_once
from tests.test_mim_bundle import BUNDLE as MIM
from tests.test_mim_bundle import TINY as MIM_TINY
from tests.test_pretrain_bundle import TINY as SSL_TINY

HEADER_CASES = ["truncated_gz", "image_2d", "image_4d", "label_shape", "missing", "wrong_keys"]
CACHING = "Loading dataset"  # MONAI's CacheDataset progress bar: must not have started


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("broken")
    _, cases = _build_corpus(root)
    return root, {case.name: case for case in cases}


@pytest.fixture(scope="module")
def mri_validation(tmp_path_factory) -> list[dict]:
    """A clean 4-channel validation list for BraTS: the bundles check the validation list before the training list,
    so the corpus's 1-channel CT validation entries would be the first refusal."""
    datalist = write_dataset(tmp_path_factory.mktemp("mri") / "mri", kind="mri", num=3, seed=0)
    return [{k: str(datalist.parent / v) for k, v in entry.items()} for entry in json.loads(datalist.read_text())["validation"]]


def _validation(bundle: str, corpus_validation: list[dict], mri_validation: list[dict]) -> list[dict]:
    return mri_validation if bundle == "brats" else corpus_validation


@pytest.mark.slow
@pytest.mark.parametrize("name", HEADER_CASES)
def test_bundle_stops_before_caching_with_the_check_data_line(corpus, tmp_path, name):
    root, cases = corpus
    case = cases[name]
    code, out = _run_bundle("btcv", root / f"{name}.json", root, tmp_path)
    assert code != 0, out[-3000:]
    lines = [line.strip() for line in out.splitlines()]
    expected = [line for line in lines if line.startswith(f"ERROR {case.path} ") and case.message in line]
    assert expected, f"no line naming {case.path} with {case.message!r}:\n{out[-3000:]}"
    assert "DataCheckError" in out and "data check FAILED" in out
    assert CACHING not in out, "the run started caching before it stopped"


IMAGE_ONLY_CASES = ["truncated_gz", "image_2d", "image_4d", "missing", "wrong_keys"]  # no label read
#: bundle -> (its folder, tiny overrides of one epoch, the header cases that apply)
BUNDLES = {
    "btcv": (CT, {**CT_TINY, **TRAIN_TINY}, HEADER_CASES),
    "ssl_pretrain": (BUNDLES_DIR / "swin_unetr_ssl_pretrain", {**SSL_TINY, "max_epochs": 1}, IMAGE_ONLY_CASES),
    "dino_pretrain": (DINO, {**DINO_TINY, "batch_size": 1, "training#num_samples": 2}, IMAGE_ONLY_CASES),  # KoLeo: 2 crops
    "brats": (MRI, {**MRI_TINY, **TRAIN_TINY}, HEADER_CASES),
}  # fmt: skip
OTHER_BUNDLES = {name: run for name, run in BUNDLES.items() if name != "btcv"}


def _run_bundle(bundle: str, datalist, root, tmp_path, **extra) -> tuple[int, str]:
    folder, tiny, _ = BUNDLES[bundle]
    overrides = {**tiny, "datalist": datalist, "dataset_dir": root, "ckpt_dir": tmp_path / "models",
                 "output_dir": tmp_path / "eval", **extra}  # fmt: skip
    code, out, _ = _run(folder, ["train.json"], overrides, tmp_path / "run.log")
    return code, out


@pytest.fixture(scope="module")
def one_bad_list(corpus, tmp_path_factory) -> dict[str, tuple[Path, int, str]]:
    """By list name: the BTCV bundle run on a truncated label in that list (the other list clean), the label's path,
    the run's exit code and output. Both runs at once: processes of one thread that share nothing."""
    root, cases = corpus
    clean = cases["truncated_gz"].datalist["validation"][0]
    truncated = root / "truncated_label.nii.gz"
    truncated.write_bytes(Path(clean["label"]).read_bytes()[:-40])
    folder, tiny, _ = BUNDLES["btcv"]
    runs = {}
    for list_name in ("training", "validation"):
        work = tmp_path_factory.mktemp(f"bad_{list_name}")
        content = {**cases["truncated_gz"].datalist, "training": [clean], "validation": [clean]}
        content[list_name] = [{"image": clean["image"], "label": str(truncated)}]
        datalist = work / f"bad_{list_name}.json"
        datalist.write_text(json.dumps(content))
        overrides = {**tiny, "datalist": datalist, "dataset_dir": root, "ckpt_dir": work / "models",
                     "output_dir": work / "eval"}  # fmt: skip
        runs[list_name] = (folder, ["train.json"], overrides, work / "run.log")
    return {name: (truncated, code, out) for name, (code, out, _) in _run_at_once(runs).items()}


@pytest.mark.parametrize("list_name", ["training", "validation"])
def test_a_data_check_error_names_the_list_of_the_entry(one_bad_list, list_name):
    """A truncated label in one list (the other list clean) is reported as ``<list>[0] label`` with the list's name
    in the summary: the training set's check labelled its entries ``dataset[0]``, as the validation set's did."""
    truncated, code, out = one_bad_list[list_name]
    assert code != 0, out[-3000:]
    lines = [line.strip() for line in out.splitlines()]
    assert [line for line in lines if line.startswith(f"ERROR {truncated} [{list_name}[0] label]: ")], out[-3000:]
    assert f"{list_name}: data check FAILED" in out, out[-3000:]
    assert "dataset[0]" not in out


@pytest.mark.slow
@pytest.mark.parametrize("bundle", list(OTHER_BUNDLES))
def test_other_bundles_stop_before_caching_naming_each_broken_file(corpus, mri_validation, tmp_path, bundle):
    root, cases = corpus
    names = OTHER_BUNDLES[bundle][2]
    datalist = tmp_path / "broken_inputs.json"
    training = [entry for name in names for entry in cases[name].datalist["training"]]
    validation = _validation(bundle, cases[names[0]].datalist["validation"], mri_validation)
    datalist.write_text(json.dumps({"training": training, "validation": validation}))
    code, out = _run_bundle(bundle, datalist, root, tmp_path)
    assert code != 0, out[-3000:]
    lines = [line.strip() for line in out.splitlines()]
    for name in names:
        case = cases[name]
        path = str(datalist) if case.path == str(root / f"{name}.json") else case.path  # entry problems: the datalist
        assert [line for line in lines if line.startswith(f"ERROR {path} ") and case.message in line], (
            f"{bundle}: no line naming {path} with {case.message!r}:\n{out[-3000:]}"
        )
    assert "DataCheckError" in out and "data check FAILED" in out
    assert CACHING not in out, "the run started caching before it stopped"


@pytest.mark.slow
@pytest.mark.parametrize("bundle", list(BUNDLES))
def test_empty_datalist_is_named(corpus, mri_validation, tmp_path, bundle):
    root, _ = corpus
    empty = json.loads((root / "empty_list.json").read_text())
    (tmp_path / "empty_list.json").write_text(json.dumps({**empty, "validation": _validation(bundle, empty.get("validation", []), mri_validation)}))
    code, out = _run_bundle(bundle, tmp_path / "empty_list.json", root, tmp_path)
    assert code != 0
    assert f"the 'training' list of datalist {str(tmp_path / 'empty_list.json')!r} is empty" in out, out[-3000:]
    assert CACHING not in out


VOXEL_BUNDLES = {**BUNDLES, "mim_pretrain": (MIM, MIM_TINY, IMAGE_ONLY_CASES)}
#: how a volume's voxels are broken: a block of NaN inside the body (today a NaN loss some iterations in), all Inf
#: (today clipped by ScaleIntensityRanged to a constant that trains without a word)
BREAK_IMAGE = {"nan_block": np.nan, "all_inf": np.inf}


def _edited(root, kind: str, key: str, edit) -> tuple:
    """A synthetic ``kind`` ("ct" or "mri") datalist of one training entry whose ``key`` file holds ``edit`` of its
    voxels (its header still passes the check before caching); returns (the datalist, that file)."""
    datalist = write_dataset(root / kind, kind=kind, num=3, seed=0)
    content = json.loads(datalist.read_text())
    content["training"] = content["training"][:1]
    datalist.write_text(json.dumps(content))
    path = str(datalist.parent / content["training"][0][key])
    volume = nib.load(path)
    nib.save(nib.Nifti1Image(edit(np.asarray(volume.dataobj, dtype=np.float32)), volume.affine), path)
    return datalist, path


def _refused_at_first_read(bundle: str, datalist, tmp_path) -> str:
    """Runs ``bundle`` on ``datalist`` as a user does; asserts exit status 1, no traceback and no training iteration;
    returns its one line on stderr."""
    folder, tiny, _ = VOXEL_BUNDLES[bundle]
    overrides = {**tiny, "datalist": datalist, "dataset_dir": datalist.parent, "ckpt_dir": tmp_path / "models",
                 "output_dir": tmp_path / "eval", "pretrained_path": "null"}  # fmt: skip
    code, lines, out = _run_as_user(bundle_command(folder, overrides=overrides), tmp_path)
    assert code == 1, out[-3000:]
    assert "Traceback" not in out and "Epoch: 1/" not in out and "non-finite training loss" not in out, out[-3000:]
    assert len(lines) == 1 and lines[0].startswith(f"{folder.name}: error: DataItemError: "), out[-3000:]
    return lines[0]


@pytest.mark.slow
@pytest.mark.parametrize("bundle", list(VOXEL_BUNDLES))
@pytest.mark.parametrize("broken", list(BREAK_IMAGE))
def test_non_finite_voxels_are_named_when_first_read(tmp_path, bundle, broken):
    def edit(voxels):
        centre = tuple(slice(n // 2 - 2, n // 2 + 2) for n in voxels.shape[:3])
        voxels[centre if broken == "nan_block" else ...] = BREAK_IMAGE[broken]
        return voxels

    datalist, path = _edited(tmp_path, "mri" if bundle == "brats" else "ct", "image", edit)
    size = int(np.prod(nib.load(path).shape))
    counts = f"{64 * (4 if bundle == 'brats' else 1)} NaN, 0 Inf" if broken == "nan_block" else f"0 NaN, {size} Inf"
    line = _refused_at_first_read(bundle, datalist, tmp_path)
    assert f": error: DataItemError: image {path}: has non-finite voxels: {counts} (of {size}); " in line, line


@pytest.mark.slow
def test_btcv_label_beyond_its_classes_is_named_when_first_read(tmp_path):
    """Classes 20 and 255 in a 14-class label: today an index error after caching, 3 times, naming no file."""
    datalist, path = _edited(tmp_path, "ct", "label", lambda v: np.where(v == 1, 20, np.where(v == 2, 255, v)))
    line = _refused_at_first_read("btcv", datalist, tmp_path)
    assert f": error: DataItemError: label {path}: label values [20, 255] are outside the declared classes " in line


@pytest.mark.slow
def test_brats_label_of_another_convention_is_named_when_first_read(tmp_path):
    """Enhancing tumour as 3 (BraTS 2023): today read as background by ConvertToMultiChannelBasedOnBratsClassesd."""
    datalist, path = _edited(tmp_path, "mri", "label", lambda v: np.where(v == 4, 3, v))
    line = _refused_at_first_read("brats", datalist, tmp_path)
    assert f": error: DataItemError: label {path}: label values [3] are outside the declared classes [0, 1, 2, 4] (" in (
        line
    )


@pytest.mark.slow
@pytest.mark.parametrize("bundle", list(BUNDLES))
def test_transform_error_while_caching_names_the_file_when_the_check_is_off(corpus, tmp_path, bundle):
    root, cases = corpus
    code, out = _run_bundle(bundle, root / "truncated_gz.json", root, tmp_path, **{"loader#check_data": "false"})
    assert code != 0
    assert "training: data check disabled" in out
    assert f"DataItemError: caching failed for image={cases['truncated_gz'].path}" in out, out[-3000:]
    assert "LoadImaged: " in out  # the transform and the root error follow
