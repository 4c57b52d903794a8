"""Data checks before caching (components.data.check and the modules it uses) and the ``check-data`` command.

A corpus of small broken NIfTI files is written once per module; every case must give its own clear line
(naming the file and the datalist entry) from ``check_datalist``, from the CLI in-process (fire parsing
included) and, for the whole corpus at once, from ``python -m components check-data`` in a subprocess.
"""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
from nibabel.arrayproxy import ArrayProxy

from components.data import DataCheckError, DataReport, check_before_caching, check_datalist, check_items
from components.data import check_files as datacheck  # the per-file checks (headers, truncation, RAS shape)
from components.data.synthetic import write_dataset

REPO = Path(__file__).resolve().parents[1]
SHAPE = (16, 16, 12)
AFFINE = np.array([[1.5, 0, 0, -10.0], [0, 1.5, 0, 20.0], [0, 0, 2.0, -50.0], [0, 0, 0, 1]])
LABELS = {"0": "background", "1": "organ", "2": "tumour"}


def _save(path: Path, data: np.ndarray, affine: np.ndarray = AFFINE) -> str:
    img = nib.Nifti1Image(data, affine)
    img.set_sform(affine, code=1)
    img.set_qform(affine, code=1)
    nib.save(img, str(path))
    return str(path)


def _image(rng: np.random.Generator, shape=SHAPE) -> np.ndarray:
    return rng.normal(0.0, 100.0, shape).astype(np.float32)


def _label(shape=SHAPE, values=(0, 1, 2)) -> np.ndarray:
    label = np.zeros(shape, dtype=np.uint8)
    for i, v in enumerate(values):
        label[2 * i : 2 * i + 2] = v
    return label


def _save_raw_gz(path: Path, data: np.ndarray, header: nib.Nifti1Header) -> str:
    """Writes header bytes + data through gzip by hand, for headers nibabel refuses to write (NaN spacing)."""
    with gzip.open(path, "wb") as f:
        header.write_to(f)
        f.write(b"\0" * (int(header["vox_offset"]) - 348))
        f.write(data.tobytes(order="F"))
    return str(path)


@dataclass
class Case:
    """One broken input: its datalist content, the file and message to expect, and how to check it."""

    name: str
    datalist: dict
    path: str  # the file (or datalist) the expected line names
    message: str  # a distinctive part of the expected line
    severity: str = "error"
    n_errors: int = 1
    deep: bool = False
    options: dict = field(default_factory=dict)  # extra check_datalist arguments
    cli: list = field(default_factory=list)  # the same options as CLI flags


def _build_corpus(root: Path) -> tuple[dict, list[Case]]:
    rng = np.random.default_rng(0)
    clean = {
        "image": _save(root / "clean_img.nii.gz", _image(rng)),
        "label": _save(root / "clean_lbl.nii.gz", _label()),
    }
    other = {
        "image": _save(root / "other_img.nii.gz", _image(rng)),
        "label": _save(root / "other_lbl.nii.gz", _label()),
    }

    def dl(training):  # the validation list holds a clean entry: no case may give it an error
        return {"labels": LABELS, "training": training, "validation": [other]}

    cases = []

    def add(name, training, path, message, **kw):
        cases.append(Case(name, kw.pop("datalist", None) or dl(training), str(path), message, **kw))

    # truncated .nii.gz: a valid file with its last 40 bytes cut off; the header still loads
    good = root / "trunc_src.nii.gz"
    _save(good, _image(rng))
    raw = good.read_bytes()
    (root / "truncated.nii.gz").write_bytes(raw[:-40])
    add(
        "truncated_gz",
        [{"image": str(root / "truncated.nii.gz"), "label": clean["label"]}],
        root / "truncated.nii.gz",
        "truncated",
    )
    # truncated .nii (uncompressed): the size check against vox_offset + data bytes
    _save(root / "plain_src.nii", _image(rng))
    (root / "truncated.nii").write_bytes((root / "plain_src.nii").read_bytes()[:-100])
    add(
        "truncated_nii",
        [{"image": str(root / "truncated.nii"), "label": clean["label"]}],
        root / "truncated.nii",
        "100 missing",
    )
    # a gzip file cut inside its header cannot even be opened
    (root / "stub.nii.gz").write_bytes(raw[:30])
    add(
        "truncated_header",
        [{"image": str(root / "stub.nii.gz"), "label": clean["label"]}],
        root / "stub.nii.gz",
        "inside the 348-byte header",
    )
    # 2D image where 3D is expected
    _save(root / "flat2d.nii.gz", _image(rng, (16, 16)))
    add(
        "image_2d",
        [{"image": str(root / "flat2d.nii.gz")}],
        root / "flat2d.nii.gz",
        "is 2D (shape (16, 16)); expected a 3D volume",
        options={"keys": ("image",)},
        cli=["--keys", "image"],
    )
    # 4D image where single-channel 3D is expected
    _save(root / "vol4d.nii.gz", _image(rng, (*SHAPE, 3)))
    add(
        "image_4d",
        [{"image": str(root / "vol4d.nii.gz"), "label": clean["label"]}],
        root / "vol4d.nii.gz",
        "is 4D with 3 channels",
    )
    # label with another shape
    _save(root / "lbl_shape.nii.gz", _label((16, 16, 10)))
    add(
        "label_shape",
        [{"image": clean["image"], "label": str(root / "lbl_shape.nii.gz")}],
        root / "lbl_shape.nii.gz",
        "label spatial shape (16, 16, 10) differs from the image's (16, 16, 12)",
    )
    # label with another affine (shifted by 3 mm)
    shifted = AFFINE.copy()
    shifted[0, 3] += 3.0
    _save(root / "lbl_affine.nii.gz", _label(), shifted)
    add(
        "label_affine",
        [{"image": clean["image"], "label": str(root / "lbl_affine.nii.gz")}],
        root / "lbl_affine.nii.gz",
        "label affine differs from the image's",
    )
    # missing file
    add(
        "missing",
        [{"image": str(root / "nope.nii.gz"), "label": clean["label"]}],
        root / "nope.nii.gz",
        "missing: no such file",
    )
    # non-finite spacing: NaN in pixdim and in the sform
    header = nib.load(clean["image"]).header.copy()
    header["pixdim"][1] = np.nan
    header["srow_x"][0] = np.nan
    _save_raw_gz(root / "nan_spacing.nii.gz", _image(rng), header)
    add(
        "nan_spacing",
        [{"image": str(root / "nan_spacing.nii.gz")}],
        root / "nan_spacing.nii.gz",
        "pixdim (nan, 1.5, 2) must be finite and > 0",
        n_errors=2,
        options={"keys": ("image",)},
        cli=["--keys", "image"],
    )
    # zero spacing along one axis: singular affine
    header = nib.load(clean["image"]).header.copy()
    header["pixdim"][3] = 0.0  # nibabel resets a zero pixdim to 1 on load; the zero affine column remains
    header["srow_z"][2] = 0.0
    _save_raw_gz(root / "zero_spacing.nii.gz", _image(rng), header)
    add(
        "zero_spacing",
        [{"image": str(root / "zero_spacing.nii.gz")}],
        root / "zero_spacing.nii.gz",
        "singular affine: spacing from its columns (1.5, 1.5, 0)",
        options={"keys": ("image",)},
        cli=["--keys", "image"],
    )
    # datalist problems
    add("empty_list", [], "{datalist}", "[training]: the list is empty")
    add(
        "wrong_keys",
        [{"img": clean["image"], "label": clean["label"]}],
        "{datalist}",
        "entry has no 'image' key (it has: 'img', 'label')",
    )
    add(
        "duplicates",
        [clean, dict(clean)],
        clean["image"],
        "[training[1] image]: duplicate entry: the same image as training[0]",
    )
    add(
        "no_validation",
        [clean],
        "{datalist}",
        "datalist has no 'validation' list (its lists: 'training')",
        datalist={"training": [clean]},
        options={"list_keys": ("training", "validation")},  # asked for: by default only a warning
        cli=["--lists", "training,validation"],
    )
    # smaller than the ROI: stored with the short axis first, which RAS reorientation puts on S
    permuted = np.array([[0, 1.5, 0, 0], [0, 0, 1.5, 0], [2.0, 0, 0, 0], [0, 0, 0, 1]])
    _save(root / "small.nii.gz", _image(rng, (8, 16, 16)), permuted)
    _save(root / "small_lbl.nii.gz", _label((8, 16, 16)), permuted)
    add(
        "small_roi",
        [{"image": str(root / "small.nii.gz"), "label": str(root / "small_lbl.nii.gz")}],
        root / "small.nii.gz",
        "along S (8 < 12): shape (16, 16, 8) after reorientation to RAS; it will be padded",
        severity="warning",
        n_errors=0,
        options={"roi_size": (16, 16, 12)},
        cli=["--roi", "16", "16", "12"],
    )
    # deep: NaN voxels, constant image, label values outside the declared classes, empty label
    nan_img = _image(rng)
    nan_img[0, 0, :3] = np.nan
    _save(root / "nan_vox.nii.gz", nan_img)
    add(
        "nan_voxels",
        [{"image": str(root / "nan_vox.nii.gz"), "label": clean["label"]}],
        root / "nan_vox.nii.gz",
        "non-finite voxels: 3 NaN, 0 Inf",
        deep=True,
    )
    _save(root / "constant.nii.gz", np.full(SHAPE, -1000, dtype=np.int16))
    add(
        "constant",
        [{"image": str(root / "constant.nii.gz"), "label": clean["label"]}],
        root / "constant.nii.gz",
        "is constant (every voxel = -1000)",
        deep=True,
    )
    _save(root / "lbl_values.nii.gz", _label(values=(0, 1, 5, 7)))
    add(
        "label_values",
        [{"image": clean["image"], "label": str(root / "lbl_values.nii.gz")}],
        root / "lbl_values.nii.gz",
        "label values [5, 7] are outside the declared classes [0, 1, 2]",
        deep=True,
    )
    _save(root / "lbl_empty.nii.gz", _label(values=(0,)))
    add(
        "label_empty",
        [{"image": clean["image"], "label": str(root / "lbl_empty.nii.gz")}],
        root / "lbl_empty.nii.gz",
        "label is empty",
        severity="warning",
        n_errors=0,
        deep=True,
    )
    for case in cases:
        path = root / f"{case.name}.json"
        path.write_text(json.dumps(case.datalist))
        case.path = case.path.replace("{datalist}", str(path))
    return clean, cases


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    clean, cases = _build_corpus(root)
    return root, clean, {case.name: case for case in cases}


CASES = [
    "truncated_gz", "truncated_nii", "truncated_header", "image_2d", "image_4d", "label_shape", "label_affine",
    "missing", "nan_spacing", "zero_spacing", "empty_list", "wrong_keys", "duplicates", "no_validation", "small_roi",
    "nan_voxels", "constant", "label_values", "label_empty",
]  # fmt: skip


def _line_for(lines: list[str], case: Case) -> str:
    hits = [line for line in lines if line.startswith(f"{case.severity.upper()} {case.path} ") and case.message in line]
    assert hits, f"no {case.severity} line naming {case.path} with {case.message!r} in:\n" + "\n".join(lines)
    return hits[0]


@pytest.mark.parametrize("name", CASES)
def test_each_problem_gives_one_clear_line(corpus, name):
    root, _, cases = corpus
    case = cases[name]
    report = check_datalist(root / f"{name}.json", deep=case.deep, **case.options)
    _line_for(report.lines(), case)
    assert len(report.errors) == case.n_errors, report.format()
    assert report.ok == (case.n_errors == 0)
    if case.severity == "warning":
        assert len(report.warnings) == 1, report.format()


def _cli(monkeypatch, capsys, *args) -> tuple[int, list[str]]:
    """Runs the fire CLI in-process (the same parsing as ``python -m components``); (exit code, lines)."""
    from components.__main__ import main

    monkeypatch.setattr(sys, "argv", ["components", "check-data", *map(str, args)])
    try:
        code = main()  # the exit status python -m components exits with
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    return code, capsys.readouterr().out.splitlines()


@pytest.mark.parametrize("name", CASES)
def test_cli_names_the_file_and_sets_the_exit_code(corpus, monkeypatch, capsys, name):
    root, _, cases = corpus
    case = cases[name]
    code, lines = _cli(monkeypatch, capsys, root / f"{name}.json", *case.cli, *(["--deep"] if case.deep else []))
    assert code == (1 if case.n_errors else 0), lines
    _line_for(lines, case)
    assert lines[-1].startswith("data check " + ("FAILED" if case.n_errors else "OK"))


def test_malformed_datalists(tmp_path, monkeypatch, capsys):
    bad_json = tmp_path / "bad.json"
    bad_json.write_text('{"training": [')
    not_object = tmp_path / "list.json"
    not_object.write_text("[]")
    for path, message in (
        (bad_json, "datalist is not valid JSON: Expecting value: line 1"),
        (not_object, "datalist must be a JSON object with lists ['training', 'validation'], got a list"),
        (tmp_path / "absent.json", "datalist does not exist"),
    ):
        report = check_datalist(path)
        assert report.lines() == [f"ERROR {path}: {message}"] or message in report.lines()[0]
        code, lines = _cli(monkeypatch, capsys, path)
        assert code == 1 and lines[0].startswith(f"ERROR {path}: ") and message in lines[0]


def test_every_problem_at_once_and_raise_lists_them_all(corpus):
    root, clean, cases = corpus
    header_cases = [c for c in cases.values() if not c.deep and not c.path.endswith(".json") and c.name != "duplicates"]
    training = [entry for c in header_cases for entry in c.datalist["training"]]
    report = check_items(training, keys=("image", "label"), list_name="training", roi_size=(16, 16, 12))
    for case in header_cases:
        _line_for(report.lines(), case)
    with pytest.raises(DataCheckError) as info:
        report.raise_if_errors("training list")
    message = str(info.value).splitlines()
    assert message[0].startswith(f"training list: data check FAILED (headers only): {len(training)} entries")
    assert [line for line in message[1:] if line.startswith("ERROR")] == [
        e.format().splitlines()[0] for e in report.errors
    ]
    assert info.value.report is report
    assert isinstance(info.value, ValueError)


def test_clean_synthetic_datasets_pass(tmp_path, monkeypatch, capsys):
    ct = write_dataset(tmp_path / "ct", kind="ct", num=3)
    report = check_datalist(ct, roi_size=64, deep=True)
    assert report.ok and report.checked == 2 and report.files == 4, report.format()
    assert all("smaller than roi_size" in w.message for w in report.warnings)  # short CT slabs get padded
    mri = write_dataset(tmp_path / "mri", kind="mri", num=3)
    assert check_datalist(mri, channels=4, deep=True).ok
    assert check_datalist(mri).ok  # 4 channels taken from the datalist's "4D" modality list
    assert not check_datalist(mri, channels=1).ok
    code, lines = _cli(monkeypatch, capsys, mri, "--channels", "4", "--deep")
    assert code == 0 and lines == ["data check OK (headers and voxels): 2 entries, 4 files; 0 errors, 0 warnings"]


def test_decathlon_datalist_without_validation_passes_by_default(tmp_path, monkeypatch, capsys):
    """A plain Decathlon dataset.json (training + test) is not broken: by default check-data checks training (and
    validation only when there is one), with a warning that the bundles hold part of training out; asking for
    --lists training,validation still requires the list."""
    path = write_dataset(tmp_path / "ct", kind="ct", num=4)
    content = json.loads(path.read_text())
    del content["validation"]
    path.write_text(json.dumps(content))
    report = check_datalist(path)
    assert report.ok and report.checked == len(content["training"]), report.format()
    assert [w.message for w in report.warnings] == [
        "datalist has no 'validation' list: the bundles validate on a fixed part of 'training' "
        "(--lists training,validation requires one)"
    ]
    code, lines = _cli(monkeypatch, capsys, path)
    assert code == 0 and lines[-1].endswith("0 errors, 1 warning"), lines
    code, lines = _cli(monkeypatch, capsys, path, "--lists", "training,validation")
    assert code == 1 and "datalist has no 'validation' list (its lists: 'training', 'test')" in lines[0], lines


@pytest.mark.filterwarnings("ignore::FutureWarning")  # MONAI 1.6 Orientation `labels` default notice
def test_roi_warning_follows_monai_ras_orientation(tmp_path):
    """The RAS shape compared with the ROI is the shape MONAI's Orientationd gives, for all 5 CT orientations."""
    from monai.transforms import Compose, EnsureChannelFirst, LoadImage, Orientation

    datalist = write_dataset(tmp_path, kind="ct", num=5)
    load = Compose([LoadImage(image_only=True), EnsureChannelFirst(), Orientation(axcodes="RAS")])
    for item in json.loads(datalist.read_text())["training"] + json.loads(datalist.read_text())["validation"]:
        path = str(tmp_path / item["image"])
        header = nib.load(path)
        info = datacheck.FileHeader(tuple(header.shape), header.affine, header, True)
        assert datacheck.ras_geometry(info, 3)[0] == tuple(load(path).shape[1:]), path
    report = check_datalist(datalist, keys="image", roi_size=(1, 1, 64), list_keys="training")
    for warning in report.warnings:
        assert "along S (" in warning.message and "R (" not in warning.message


def test_pixdim_scales_the_shape_compared_with_the_roi(corpus):
    root, clean, _ = corpus
    # 16 x 16 x 12 voxels of 1.5 x 1.5 x 2 mm resampled to 1 mm: 24 x 24 x 24
    assert check_items([clean], roi_size=24, pixdim=1.0).warnings == []
    report = check_items([clean], roi_size=24)
    assert len(report.warnings) == 1 and "R (16 < 24), A (16 < 24), S (12 < 24)" in report.warnings[0].message


def test_header_mode_reads_no_voxels(tmp_path, monkeypatch):
    datalist = write_dataset(tmp_path, kind="ct", num=3)

    def refuse(*args, **kwargs):
        raise AssertionError("voxel data was read")

    for name in ("__array__", "__getitem__", "get_unscaled", "_get_scaled", "_get_unscaled"):
        monkeypatch.setattr(ArrayProxy, name, refuse)
    monkeypatch.setattr(datacheck, "_gzip_stream_size", refuse)  # not even the compressed stream
    report = check_datalist(datalist, roi_size=64)
    assert report.ok and report.files == 4, report.format()
    deep = check_datalist(datalist, deep=True)  # proves the patch bites: deep mode now fails to read
    assert len(deep.errors) == 4 and all("cannot read the voxel data: AssertionError" in e.message for e in deep.errors)


def test_truncation_is_found_without_reading_voxels(corpus, monkeypatch):
    """Header mode finds truncated files with voxel access disabled (only the gzip trailer / stream is read)."""
    root, _, cases = corpus

    def refuse(*args, **kwargs):
        raise AssertionError("voxel data was read")

    for name in ("__array__", "get_unscaled", "_get_scaled", "_get_unscaled"):
        monkeypatch.setattr(ArrayProxy, name, refuse)
    for name in ("truncated_gz", "truncated_nii", "truncated_header"):
        report = check_datalist(root / f"{name}.json")
        _line_for(report.lines(), cases[name])
        assert len(report.errors) == 1, report.format()
    report = check_datalist(root / "truncated_gz.json")
    assert "the compressed stream ends after" in report.errors[0].message


def test_valid_multi_member_gzip_is_not_called_truncated(tmp_path, corpus):
    """A gzip trailer covers only its own member; a mismatch is confirmed by streaming before it is reported."""
    _, clean, _ = corpus
    data = gzip.decompress(Path(clean["image"]).read_bytes())
    path = tmp_path / "two_members.nii.gz"
    path.write_bytes(gzip.compress(data[:1000]) + gzip.compress(data[1000:]))
    assert nib.load(str(path)).shape == SHAPE
    assert check_items([{"image": str(path)}], keys="image").ok
    path.write_bytes(gzip.compress(data[:1000]) + gzip.compress(data[1000:])[:-30])
    report = check_items([{"image": str(path)}], keys="image")
    assert len(report.errors) == 1 and "truncated" in report.errors[0].message


@pytest.mark.parametrize(
    "flags",
    [
        ["--keys", "image", "label", "--roi", "16", "16", "12"],
        ["--roi", "16", "16", "12", "--keys", "image", "label", "--deep"],
        ["--keys", "image,label", "--roi", "16,16,12"],
        ["--keys", "[image,label]", "--roi", "[16,16,12]"],
        ["--keys=image,label", "--roi=12"],
        ["--keys", "image", "--roi", "12", "--base-dir", "{root}"],
    ],
)
def test_cli_forms_of_multi_value_flags(corpus, monkeypatch, capsys, flags):
    root, _, cases = corpus
    flags = [f.replace("{root}", str(root)) for f in flags]
    code, lines = _cli(monkeypatch, capsys, root / "small_roi.json", *flags)
    assert code == 0, lines
    _line_for(lines, cases["small_roi"])
    assert "0 errors, 1 warning" in lines[-1]


def test_cli_rejects_ambiguous_or_stray_values(corpus, monkeypatch, capsys):
    root, _, _ = corpus
    datalist = root / "small_roi.json"
    code, lines = _cli(monkeypatch, capsys, datalist, "--keys", "image", "label", "--lists", "training", "validation")
    assert code == 2 and "cannot tell which flag" in lines[0] and "--keys image,label" in lines[0]
    code, lines = _cli(monkeypatch, capsys, datalist, "96")
    assert code == 2 and "no flag that takes several values" in lines[0]
    code, lines = _cli(monkeypatch, capsys, datalist, "--roi", "16,16")
    assert code == 2 and "roi_size must have 1 or 3 values" in lines[0]


def test_cli_subprocess_reports_the_whole_corpus_at_once(corpus, tmp_path):
    """``python -m components check-data`` with the issue's spaced flags: every broken file gets its line."""
    root, clean, cases = corpus
    wanted = [
        c
        for c in cases.values()
        if c.datalist.get("training")
        and "--keys" not in c.cli
        and c.name not in ("duplicates", "no_validation", "wrong_keys")
    ]
    datalist = tmp_path / "all.json"
    training = [entry for c in wanted for entry in c.datalist["training"]]
    datalist.write_text(json.dumps({"labels": LABELS, "training": training, "validation": [clean, {"img": "x"}]}))
    flags = ["--keys", "image", "label", "--roi", "16", "16", "12", "--deep"]  # the spaced form
    command = [sys.executable, "-m", "components", "check-data", str(datalist), *flags]
    run = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    lines = run.stdout.splitlines()
    assert run.returncode == 1, run.stdout + run.stderr
    for case in wanted:
        _line_for(lines, case)
    assert any("[validation[1]]: entry has no 'image', 'label' key (it has: 'img')" in line for line in lines)
    images = [e["image"] for e in training] + [clean["image"]]
    expected_errors = sum(c.n_errors for c in wanted) + 1 + len(images) - len(set(images))  # + duplicates
    assert lines[-1].startswith(f"data check FAILED (headers and voxels): {len(training) + 2} entries")
    assert f"{expected_errors} errors" in lines[-1], run.stdout


def test_cli_subprocess_warnings_only_exit_zero(tmp_path):
    datalist = write_dataset(tmp_path, kind="ct", num=3)
    command = [sys.executable, "-m", "components", "check-data", str(datalist), "--roi", "96", "96", "96"]
    run = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    lines = run.stdout.splitlines()
    assert run.returncode == 0, run.stdout + run.stderr
    assert lines and all(
        line.startswith("WARNING ") and "smaller than roi_size (96, 96, 96)" in line for line in lines[:-1]
    )
    assert lines[-1] == f"data check OK (headers only): 2 entries, 4 files; 0 errors, {len(lines) - 1} warning" + (
        "s" if len(lines) != 2 else ""
    )


def test_check_before_caching(corpus, caplog):
    root, clean, cases = corpus
    shard = [clean, clean, dict(clean)]  # shards repeat entries on purpose: not duplicates here
    report = check_before_caching(shard, keys=("image", "label"), roi_size=(16, 16, 12), context="training")
    assert isinstance(report, DataReport) and report.ok and report.checked == 1 and report.warnings == []
    small = cases["small_roi"].datalist["training"]
    with caplog.at_level("WARNING", logger="components.data"):
        assert check_before_caching(small, roi_size=16).ok  # keys inferred from the entry's paths
    assert "smaller than roi_size" in caplog.text
    broken = [clean, *cases["missing"].datalist["training"], *cases["truncated_gz"].datalist["training"]]
    with pytest.raises(DataCheckError) as info:
        check_before_caching(broken, keys=("image", "label"), context="training")
    lines = str(info.value).splitlines()
    assert lines[0].startswith("training: data check FAILED (headers only): 3 entries") and "2 errors" in lines[0]
    assert any(str(root / "nope.nii.gz") in line and "missing" in line for line in lines[1:])
    assert any(str(root / "truncated.nii.gz") in line and "truncated" in line for line in lines[1:])
    assert check_before_caching(broken, enabled=False) is None


def test_argument_validation():
    with pytest.raises(ValueError, match="roi_size must have 1 or 3 values"):
        check_items([], roi_size=(96, 96))
    with pytest.raises(ValueError, match="give num_classes or label_values, not both"):
        check_items([], num_classes=3, label_values=(0, 1))
    with pytest.raises(ValueError, match="channels must be a positive integer"):
        check_items([], channels=0)
    with pytest.raises(ValueError, match="pixdim must be 1 or 3 positive numbers"):
        check_items([], pixdim=(1.0, -1.0, 1.0))
    report = check_items([])
    assert report.lines() == ["ERROR <items> [items]: the list is empty: nothing to train / validate on"]
    assert os.path.basename(__file__) == "test_check_data.py"


def test_padding_warnings_of_a_shard_are_one_line(tmp_path, caplog):
    """Quiet by default: every thin synthetic CT slab is smaller than a 64^3 ROI; the shard check says so in one
    line (how many, and the first one), not one line per volume."""
    path = write_dataset(tmp_path / "ct", kind="ct", num=5)
    from components.data import load_datalist

    items = load_datalist(path, "training")
    with caplog.at_level("WARNING", logger="components.data"):
        report = check_before_caching(items, keys=("image", "label"), roi_size=(64, 64, 64))
    assert len(report.warnings) == len(items) == 3
    lines = [r.getMessage() for r in caplog.records if r.name == "components.data"]
    assert len(lines) == 1, lines
    assert lines[0].startswith("rank 0: 3 of 3 volumes are smaller than roi_size and will be padded, e.g. WARNING ")
