"""The broken-input corpus of tests/test_check_data.py given to real bundle runs (``python -m monai.bundle run``).

Each input must stop the run with the line ``check-data`` prints for it (the file and what is wrong), raised by
our check before any caching, rather than a traceback from deep inside MONAI; NaN voxels (which only
``check-data --deep`` reads) must stop training at its first step with the file named; and with the check turned
off, a file that breaks a transform while caching must still be named in the error.

The multi-organ CT bundle reads an image and a label per entry, so every case of the corpus applies and each runs
on its own; the pretraining bundle (images only) and the BraTS bundle (4-channel MRI) get every case that applies
to them in one datalist, and must name each broken file in the one report of the data check.
"""

from __future__ import annotations

import json

import pytest

from components.runner import BUNDLES_DIR
from tests.test_check_data import _build_corpus
from tests.test_finetune_bundles import CT, CT_TINY, MRI, MRI_TINY, TRAIN_TINY, _run
from tests.test_pretrain_bundle import TINY as SSL_TINY

HEADER_CASES = ["truncated_gz", "image_2d", "image_4d", "label_shape", "missing", "wrong_keys"]
CACHING = "Loading dataset"  # MONAI's CacheDataset progress bar: must not have started


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("broken")
    _, cases = _build_corpus(root)
    return root, {case.name: case for case in cases}


def _train(root, name: str, tmp_path, **extra) -> tuple[int, str]:
    overrides = {**CT_TINY, **TRAIN_TINY, "datalist": root / f"{name}.json", "dataset_dir": root,
                 "ckpt_dir": tmp_path / "models", "output_dir": tmp_path / "eval", **extra}  # fmt: skip
    code, out, _ = _run(CT, ["train.json"], overrides, tmp_path / "run.log")
    return code, out


@pytest.mark.slow
@pytest.mark.parametrize("name", HEADER_CASES)
def test_bundle_stops_before_caching_with_the_check_data_line(corpus, tmp_path, name):
    root, cases = corpus
    case = cases[name]
    code, out = _train(root, name, tmp_path)
    assert code != 0, out[-3000:]
    lines = [line.strip() for line in out.splitlines()]
    expected = [line for line in lines if line.startswith(f"ERROR {case.path} ") and case.message in line]
    assert expected, f"no line naming {case.path} with {case.message!r}:\n{out[-3000:]}"
    assert "DataCheckError" in out and "data check FAILED" in out
    assert CACHING not in out, "the run started caching before it stopped"


#: bundle -> (its folder, tiny overrides, the header cases that apply: the SSL bundle reads no label)
OTHER_BUNDLES = {
    "ssl_pretrain": (BUNDLES_DIR / "swin_unetr_ssl_pretrain", {**SSL_TINY, "max_epochs": 1},
                     ["truncated_gz", "image_2d", "image_4d", "missing", "wrong_keys"]),
    "brats": (MRI, {**MRI_TINY, **TRAIN_TINY}, HEADER_CASES),
}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("bundle", list(OTHER_BUNDLES))
def test_other_bundles_stop_before_caching_naming_each_broken_file(corpus, tmp_path, bundle):
    root, cases = corpus
    folder, tiny, names = OTHER_BUNDLES[bundle]
    datalist = tmp_path / "broken_inputs.json"
    training = [entry for name in names for entry in cases[name].datalist["training"]]
    datalist.write_text(json.dumps({"training": training, "validation": cases[names[0]].datalist["validation"]}))
    overrides = {**tiny, "datalist": datalist, "dataset_dir": root, "ckpt_dir": tmp_path / "models",
                 "output_dir": tmp_path / "eval"}  # fmt: skip
    code, out, _ = _run(folder, ["train.json"], overrides, tmp_path / "run.log")
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
def test_empty_datalist_is_named(corpus, tmp_path):
    root, _ = corpus
    code, out = _train(root, "empty_list", tmp_path)
    assert code != 0
    assert f"the 'training' list of datalist {str(root / 'empty_list.json')!r} is empty" in out, out[-3000:]
    assert CACHING not in out


@pytest.mark.slow
def test_nan_voxels_stop_the_first_step_naming_the_file(corpus, tmp_path):
    """The header check passes (voxels are not read); the first training loss is NaN and the run stops with the
    iteration and the batch's file, before any checkpoint of NaN weights is written."""
    root, cases = corpus
    code, out = _train(root, "nan_voxels", tmp_path, pretrained_path="null")  # as typed on a command line
    assert code != 0, out[-3000:]
    assert (  # the run said, at WARNING, that it trains from random initialisation
        "components.checkpoint - WARNING - PretrainedLoader: no pretrained weights (pretrained_path is none): "
        "SwinUNETR trains from random initialisation; pretrained_path defaults to the SSL bundle model "
    ) in out, out[-3000:]
    assert "NonFiniteLossError" in out
    assert "non-finite training loss nan at epoch 1, iteration 1" in out, out[-3000:]
    assert f"batch files (rank 0): [{cases['nan_voxels'].path!r}]" in out, out[-3000:]
    assert not (tmp_path / "models" / "model.pt").exists()


@pytest.mark.slow
def test_transform_error_while_caching_names_the_file_when_the_check_is_off(corpus, tmp_path):
    root, cases = corpus
    code, out = _train(root, "truncated_gz", tmp_path, check_data="false")
    assert code != 0
    assert "dataset: data check disabled" in out
    assert f"DataItemError: caching failed for image={cases['truncated_gz'].path}, label=" in out, out[-3000:]
    assert "LoadImaged: " in out  # the transform and the root error follow
