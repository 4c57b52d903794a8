"""The two finetuning bundles (BTCV CT, BraTS MRI) end to end on tiny synthetic data, on CPU.

Every bundle run is a real ``python -m monai.bundle run`` in a subprocess (``torchrun`` for the 2-process
evaluation), shared between assertions through module-scoped fixtures:

- a tiny SSL checkpoint (``SSLHead(feature_size=12, window_size=4)`` state dict, the layout the pretraining bundle
  writes to ``models/model.pt``) and one of feature size 24 that must not load into a feature-12 model;
- CT: train (1 epoch, 3 volumes) -> evaluate on 3 validation volumes (odd) -> the same evaluation with
  ``torchrun --nproc_per_node=2`` and multi_gpu_evaluate.json -> inference on the test volume (permuted LSP axes,
  anisotropic spacing); and a training run whose pretrained checkpoint does not fit;
- MRI: train with the 1 -> 4 channel policy -> evaluate -> inference on an RAS and an LPS volume;
- CT with ``--training#pretrained_arch auto`` from a SwinUNETR v2 checkpoint -> its evaluation.

The runs share nothing but their inputs, so they start in two waves (:func:`_run_at_once`): the four trainings, then
everything that reads a trained model; each process has one thread, and several at once keep every core busy.

Sizes: crops of 64x32x32 (SwinUNETR's bottleneck InstanceNorm needs more than one voxel in training, so 32^3
fails; 64x32x32 leaves 2x1x1), feature size 12, attention windows of 4 (the crop's 32x16x16 and 16x8x8 tokens fill
whole windows; the bundles' 7 pads them and makes a CPU step several times as long), coarse spacing so whole volumes
stay small. Subprocesses run
with one OpenMP thread: on a shared 2-core machine two threads per process oversubscribe the cores and a
training step becomes ~10x slower. Each run has a wall-clock limit; its whole process group is killed past it.
"""

from __future__ import annotations

import csv
import json
import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
import torch
from monai.bundle import ConfigParser
from monai.networks.nets import SwinUNETR

import components
from components.checkpoint import PATCH_EMBED_WEIGHT
from components.config import defined_overrides
from components.demo.runner import bundle_command
from components.data.synthetic import CT_LABELS
from components.config.running import run_config_files

REPO = Path(__file__).resolve().parent.parent
CT = REPO / "bundles" / "swin_unetr_btcv_finetune"
MRI = REPO / "bundles" / "swin_unetr_brats_finetune"
BRATS_NAMES = ["TC", "WT", "ET"]
RUN_TIMEOUT_S = 300
PG_TIMEOUT_S = 120  # process-group timeout of the torchrun evaluation: a collective mismatch fails, not hangs

WINDOW = 4
TINY = {
    "roi_size": [64, 32, 32],
    "feature_size": 12,
    "network_def#window_size": WINDOW,
    "training#num_samples": 1,
    "batch_size": 1,
    "loader#num_workers": 0,
    "speed#amp": "false",  # the string, as a shell user types it: read through components.as_bool
    "speed#use_checkpoint": "false",
    "speed#tune_allocator": "false",
    "device": "cpu",
}
CT_TINY = {**TINY, "spacing": [3.0, 3.0, 4.0]}
MRI_TINY = {**TINY, "spacing": [2.0, 2.0, 2.0]}
TRAIN_TINY = {"max_epochs": 1, "training#val_interval": 1, "training#log_interval": 1}

SUMMARY = re.compile(
    r"layout=(\w+) target=(\w+): loaded (\d+)/(\d+) encoder tensors .*?\((\d+) encoder;.*?(\d+) adapted"
)


def _env() -> dict[str, str]:
    env = os.environ.copy()
    env.update({"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"})
    return env


def _run(bundle: Path, configs, overrides: dict, log: Path, nproc: int = 1) -> tuple[int, str, float]:
    """Runs a bundle (under torchrun when ``nproc`` > 1); returns (exit code, output, seconds)."""
    cmd = bundle_command(bundle, configs, overrides)
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1",
               f"--nproc_per_node={nproc}", *cmd[1:]]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(),
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        log.write_text(out)
        pytest.fail(f"{bundle.name} {configs} ran past {RUN_TIMEOUT_S}s; output in {log}\n{out[-3000:]}")
    log.write_text(out)
    return proc.returncode, out, time.perf_counter() - start


def _run_at_once(runs: dict[str, tuple]) -> dict[str, tuple[int, str, float]]:
    """``_run(*args)`` for every entry of ``runs``, by name, as many at a time as the machine has cores (a torchrun
    entry counts once): each a process of one thread that shares nothing with the others."""
    with ThreadPoolExecutor(min(len(runs), os.cpu_count() or 1)) as pool:
        started = {name: pool.submit(_run, *args) for name, args in runs.items()}
        return {name: run.result() for name, run in started.items()}


def _ok(result: tuple[int, str, float], what: str) -> str:
    code, out, _ = result
    assert code == 0, f"{what} failed (exit {code}):\n{out[-4000:]}"
    return out


def _summary(out: str) -> tuple:
    found = SUMMARY.findall(out)
    assert found, f"no load report of components.checkpoint in the log:\n{out[-3000:]}"
    layout, target, loaded, total, enc_missing, adapted = found[0]
    return layout, target, int(loaded), int(total), int(enc_missing), int(adapted)


def _datalist(src: Path, dst: Path, **lists) -> Path:
    """A copy of ``src`` (same folder, so relative paths still resolve) with some lists replaced."""
    content = json.loads(src.read_text())
    content.update(lists)
    dst.write_text(json.dumps(content, indent=2))
    return dst


def _read_csv(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


# ---------------------------------------------------------------------------------------------------------------
# shared data and runs
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("finetune")


@pytest.fixture(scope="module")
def ssl_ckpts(work) -> dict[str, Path]:
    """SSL-bundle-layout checkpoints (bare SSLHead state dicts): feature 12 (fits) and 24 (does not)."""
    paths = {}
    for size in (12, 24):
        torch.manual_seed(size)
        paths[size] = work / f"ssl_f{size}.pt"
        torch.save(components.SSLHead(feature_size=size, window_size=WINDOW).state_dict(), paths[size])
    return paths


@pytest.fixture(scope="module")
def ct_data(work) -> dict[str, Path]:
    root = work / "ct"
    datalist = components.write_dataset(root, kind="ct", num=5, seed=0)  # 3 train, 1 validation, 1 test
    content = json.loads(datalist.read_text())
    val3 = _datalist(datalist, root / "dataset_val3.json", validation=content["training"][:2] + content["validation"])
    return {"root": root, "datalist": datalist, "val3": val3}


@pytest.fixture(scope="module")
def mri_data(work) -> dict[str, Path]:
    root = work / "mri"
    datalist = components.write_dataset(root, kind="mri", num=5, seed=0)
    content = json.loads(datalist.read_text())
    # the test case is RAS; add an LPS one so the inversion of Orientationd is exercised on MRI too
    test2 = _datalist(datalist, root / "dataset_test2.json", test=content["test"] + content["training"][:1])
    return {"root": root, "datalist": datalist, "test2": test2}


@pytest.fixture(scope="module")
def v2_swinunetr(work) -> Path:
    """A full SwinUNETR v2 of feature size 24 (as a finetuned v2 model is saved), for a feature-12 v1 config."""
    torch.manual_seed(3)
    path = work / "swinunetr_v2_f24.pt"
    network = SwinUNETR(in_channels=1, out_channels=14, feature_size=24, window_size=WINDOW, use_v2=True)
    torch.save(network.state_dict(), path)
    return path


@pytest.fixture(scope="module")
def trainings(work, ct_data, mri_data, ssl_ckpts, v2_swinunetr) -> dict[str, tuple[tuple[int, str, float], Path]]:
    """The module's training runs, by name, with their output folders: CT and MRI from the feature-12 SSL encoder,
    CT from the feature-24 one (which does not fit) and CT with pretrained_arch auto from the v2 SwinUNETR."""
    ct = {**CT_TINY, **TRAIN_TINY, "dataset_dir": str(ct_data["root"])}
    mri = {**MRI_TINY, **TRAIN_TINY, "dataset_dir": str(mri_data["root"])}
    runs = {
        "ct_run": (CT, ct, ssl_ckpts[12], {}),
        "mri_run": (MRI, mri, ssl_ckpts[12], {}),
        "ct_bad": (CT, ct, ssl_ckpts[24], {"loader#cache_rate": 0.0}),
        "ct_auto": (CT, ct, v2_swinunetr, {"loader#cache_rate": 0.0, "training#pretrained_arch": "auto"}),
    }
    args = {}
    for name, (bundle, tiny, pretrained, more) in runs.items():
        overrides = {**tiny, **more, "output_dir": str(work / name / "eval"), "ckpt_dir": str(work / name / "models"),
                     "pretrained_path": str(pretrained)}  # fmt: skip
        args[name] = (bundle, ["train.json"], overrides, work / f"{name}.log")
    results = _run_at_once(args)
    return {name: (result, work / name) for name, result in results.items()}


@pytest.fixture(scope="module")
def ct_train(trainings):
    return trainings["ct_run"]


@pytest.fixture(scope="module")
def mri_train(trainings):
    return trainings["mri_run"]


@pytest.fixture(scope="module")
def followups(work, ct_data, mri_data, trainings) -> dict[str, tuple[tuple[int, str, float], Path]]:
    """What runs on the trained models, by name, with their output folders: CT evaluation on 3 volumes in one process
    and under torchrun with 2, CT inference, MRI evaluation and inference, the evaluation of the auto-arch model."""
    ct = {**CT_TINY, "dataset_dir": str(ct_data["root"]), "ckpt_dir": str(work / "ct_run" / "models")}
    mri = {**MRI_TINY, "dataset_dir": str(mri_data["root"]), "ckpt_dir": str(work / "mri_run" / "models")}
    ct_auto = {**CT_TINY, "dataset_dir": str(ct_data["root"]), "ckpt_dir": str(work / "ct_auto" / "models")}
    val3 = {**ct, "datalist": str(ct_data["val3"])}
    evaluate, ddp = ["train.json", "evaluate.json"], ["train.json", "evaluate.json", "multi_gpu_evaluate.json"]
    # TINY's training ids (batch_size, training#num_samples, ...) would stop an inference run (check_overrides)
    infer = lambda bundle, overrides: defined_overrides(overrides, [bundle / "configs" / "inference.json"])  # noqa: E731
    runs = {
        "ct_eval": (CT, evaluate, val3, 1),
        "ct_eval_ddp": (CT, ddp, {**val3, "dist_timeout_s": PG_TIMEOUT_S}, 2),
        "ct_seg": (CT, ["inference.json"], infer(CT, ct), 1),
        "mri_eval": (MRI, evaluate, mri, 1),
        "mri_seg": (MRI, ["inference.json"], infer(MRI, {**mri, "datalist": str(mri_data["test2"])}), 1),
        "ct_auto_eval": (CT, evaluate, ct_auto, 1),
    }
    args = {name: (bundle, configs, {**overrides, "output_dir": str(work / name)}, work / f"{name}.log", nproc)
            for name, (bundle, configs, overrides, nproc) in runs.items()}  # fmt: skip
    results = _run_at_once(args)
    return {name: (result, work / name) for name, result in results.items()}


def _followup(name: str, fixture: str, training: str, what: str):
    """A module fixture ``fixture``: the follow-up run ``name``, once ``training`` (``what``) is known to have passed."""

    @pytest.fixture(scope="module", name=fixture)
    def run(trainings, followups):
        _ok(trainings[training][0], what)
        return followups[name]

    return run


ct_eval = _followup("ct_eval", "ct_eval", "ct_run", "CT training")
ct_eval_ddp = _followup("ct_eval_ddp", "ct_eval_ddp", "ct_run", "CT training")
ct_infer = _followup("ct_seg", "ct_infer", "ct_run", "CT training")
mri_eval = _followup("mri_eval", "mri_eval", "mri_run", "MRI training")
mri_infer = _followup("mri_seg", "mri_infer", "mri_run", "MRI training")


# ---------------------------------------------------------------------------------------------------------------
# helpers of components.training.segmentation (no bundle run)
# ---------------------------------------------------------------------------------------------------------------


def test_brats_labels_round_trip():
    from monai.data import MetaTensor
    from monai.transforms import ConvertToMultiChannelBasedOnBratsClasses

    label = torch.tensor([0, 1, 2, 4, 2, 0], dtype=torch.uint8).reshape(1, 1, 1, 6)
    regions = ConvertToMultiChannelBasedOnBratsClasses()(label)
    back = components.brats_labels_from_regions(MetaTensor(regions.float(), affine=torch.eye(4) * 2))
    assert back.dtype == torch.uint8 and tuple(back.shape) == (1, 1, 1, 6)
    assert torch.equal(back.as_tensor(), label)
    assert isinstance(back, MetaTensor) and float(back.affine[0, 0]) == 2.0
    with pytest.raises(ValueError, match="3 region channels"):
        components.brats_labels_from_regions(torch.zeros(2, 4, 4, 4))


def test_balanced_class_weights_from_physical_volumes(tmp_path):
    """sqrt(median / volume) per class, in mm^3: a file at twice the voxel volume counts twice; bad labels fail."""
    from components.training.segmentation import balanced_class_weights

    def save(array: np.ndarray, spacing: float, name: str) -> Path:
        path = tmp_path / name
        nib.save(nib.Nifti1Image(array.astype(np.uint8), np.diag([spacing, 1.0, 1.0, 1.0])), str(path))
        return path

    first = np.zeros((10, 10, 10))
    first[:2, :2, :2], first[5:, 5:, 5:] = 1, 2  # 8 and 125 voxels of 1 mm^3
    second = np.zeros((4, 4, 4))
    second[0, 0, :2] = 1  # 2 voxels of 2 mm^3
    paths = [save(first, 1.0, "a.nii.gz"), save(second, 2.0, "b.nii.gz")]
    volumes = np.array([867 + 62 * 2, 8 + 2 * 2, 125], dtype=np.float64)
    expected = np.sqrt(np.median(volumes) / volumes)
    assert balanced_class_weights(paths, 3) == pytest.approx(expected.tolist(), abs=1e-4)
    with pytest.raises(ValueError, match=r"classes \[3\] appear in none"):
        balanced_class_weights(paths, 4)
    with pytest.raises(ValueError, match=r"a.nii.gz: label values must be in 0 .. 1, found 0 .. 2"):
        balanced_class_weights(paths, 2)


def test_per_class_means_ignore_missing_classes():
    details = torch.tensor([[1.0, float("nan")], [0.5, 0.25]])
    assert components.per_class_means(details) == [0.75, 0.25]
    with pytest.raises(ValueError, match="expected 3 classes"):
        components.per_class_means(details, num_classes=3)


# ---------------------------------------------------------------------------------------------------------------
# configs and metadata
# ---------------------------------------------------------------------------------------------------------------

VOCABULARY = ["bundle_root", "dataset_dir", "datalist", "output_dir", "ckpt_dir", "device", "roi_size", "feature_size",
              "in_channels", "batch_size", "training#num_samples", "loader#num_workers", "loader#cache_rate",
              "learning_rate", "max_epochs", "training#val_interval", "speed#amp", "speed#use_checkpoint",
              "checkpointing#resume", "training#seed", "pretrained_path", "training#channel_policy",
              "label_names"]


@pytest.mark.parametrize("bundle", [CT, MRI], ids=["ct", "mri"])
def test_metadata_ids_and_label_names(bundle):
    from monai.bundle import verify_metadata

    meta_file = bundle / "configs" / "metadata.json"
    verify_metadata(meta_file=str(meta_file), filepath=str(components.metadata_schema()))  # raises on a violation
    meta = json.loads(meta_file.read_text())
    assert "swin-ssl-bundles" not in meta["required_packages_version"]  # no index serves it: the code travels inside
    assert {"nibabel", "pytorch-ignite", "einops"} <= set(meta["required_packages_version"])
    assert meta["version"] in meta["changelog"]
    train = ConfigParser.load_config_files([str(f) for f in run_config_files(bundle, ["train.json"])])
    assert [k for k in VOCABULARY if k.split("#")[-1] not in (train[k.split("#")[0]] if "#" in k else train)] == []
    names = train["label_names"]
    expected = [CT_LABELS[i] for i in range(14)] if bundle == CT else BRATS_NAMES
    assert names == expected
    channel_def = meta["network_data_format"]["outputs"]["pred"]["channel_def"]
    assert [channel_def[str(i)] for i in range(len(channel_def))] == names
    assert meta["network_data_format"]["outputs"]["pred"]["num_channels"] == len(names)
    assert meta["network_data_format"]["inputs"]["image"]["num_channels"] == train["in_channels"]
    assert train["training"]["channel_policy"] == ("error" if bundle == CT else "repeat")
    for name in ("multi_gpu_train.json", "multi_gpu_evaluate.json"):
        layer = json.loads((bundle / "configs" / name).read_text())
        # each rank validates its own part of the list, in order and without padding (components.split_for_rank)
        assert layer["validate#datalist"].startswith("$components.split_for_rank(@validate#full_datalist")
    assert (bundle / "LICENSE").read_text() == (REPO / "LICENSE").read_text()


def test_ct_class_weights_reach_both_loss_terms():
    """class_weights: null keeps DiceCELoss unweighted; a list weighs the CE and Dice terms per class."""
    from monai.bundle import ConfigParser
    from monai.losses import DiceCELoss

    parser = ConfigParser()
    parser.read_config([str(f) for f in run_config_files(CT, ["train.json"])])
    parser["device"] = "$torch.device('cpu')"
    assert parser.get_parsed_content("train#loss").cross_entropy.weight is None
    parser["out_channels"], parser["training#class_weights"] = 3, [0.1, 1.0, 2.0]
    loss = parser.get_parsed_content("train#loss", lazy=False)
    expected = torch.tensor([0.1, 1.0, 2.0])
    assert torch.equal(loss.cross_entropy.weight, expected) and torch.equal(loss.dice.class_weight, expected)
    logits, label = torch.zeros(1, 3, 4, 4, 4), torch.zeros(1, 1, 4, 4, 4)
    label[..., :2] = 2
    unweighted = DiceCELoss(to_onehot_y=True, softmax=True)
    assert float(loss(logits, label)) != pytest.approx(float(unweighted(logits, label)))


def test_ct_flip_and_rotate90_probabilities_reach_the_transforms():
    """flip_prob and rotate90_prob (0.1 as in the recipe) set every random flip and 90-degree rotation; at 0 the
    training crops keep their left and right (a volume whose left half is labeled 1 stays so)."""
    from monai.bundle import ConfigParser
    from monai.transforms import RandFlipd, RandRotate90d

    def spatial_randoms(parser: ConfigParser) -> list:
        transforms = parser.get_parsed_content("train#preprocessing", lazy=False).transforms
        return [t for t in transforms if isinstance(t, (RandFlipd, RandRotate90d))]

    parser = ConfigParser()
    parser.read_config([str(f) for f in run_config_files(CT, ["train.json"])])
    assert [t.prob for t in spatial_randoms(parser)] == [0.1] * 4
    parser["training#flip_prob"], parser["training#rotate90_prob"] = 0.0, 0.0
    randoms = spatial_randoms(parser)
    assert len(randoms) == 4 and [t.prob for t in randoms] == [0.0] * 4
    label = torch.zeros(1, 8, 8, 8)
    label[:, :4] = 1
    for seed in range(20):
        out = {"image": label.clone(), "label": label.clone()}
        for t in randoms:
            t.set_random_state(seed)
            out = t(out)
        assert torch.equal(out["label"], label)


@pytest.mark.parametrize("bundle", [CT, MRI], ids=["ct", "mri"])
def test_pretrained_path_defaults_to_the_ssl_bundle_model(bundle, tmp_path):
    from monai.bundle import ConfigParser

    root = tmp_path / "bundles" / bundle.name
    root.mkdir(parents=True)
    parser = ConfigParser()
    parser.read_config([str(f) for f in run_config_files(bundle, ["train.json"])])
    parser["bundle_root"] = str(root)
    parser.parse()
    assert parser.get_parsed_content("pretrained_path", lazy=False) is None  # no SSL model: from scratch
    ssl_model = tmp_path / "bundles" / "swin_unetr_ssl_pretrain" / "models" / "model.pt"
    ssl_model.parent.mkdir(parents=True)
    ssl_model.touch()
    assert Path(parser.get_parsed_content("pretrained_path", lazy=False)).resolve() == ssl_model.resolve()


@pytest.mark.parametrize("value", ["null", None, ""], ids=["null", "None", "empty"])
def test_pretrained_path_none_trains_from_scratch_with_a_warning(value, tmp_path, caplog):
    """``--pretrained_path null`` / ``None`` / ``""``: the bundle's loader keeps the random initialisation and says
    so at WARNING, naming where the default SSL model is looked for (the load itself is tested in test_checkpoint)."""
    import logging

    from monai.bundle import ConfigParser

    parser = ConfigParser()
    parser.read_config([str(f) for f in run_config_files(CT, ["train.json"])])
    parser.update({"bundle_root": str(tmp_path), "pretrained_path": value, "feature_size": 12, "device": "cpu"})
    loader = parser.get_parsed_content("train#handlers#0", lazy=False)
    assert isinstance(loader, components.PretrainedLoader) and loader.path is None
    before = {k: v.clone() for k, v in loader.network.state_dict().items()}
    with caplog.at_level(logging.INFO, logger="components.checkpoint"):
        assert loader() is None
    assert all(torch.equal(v, before[k]) for k, v in loader.network.state_dict().items())
    (record,) = [r for r in caplog.records if r.name == "components.checkpoint"]
    assert record.levelno == logging.WARNING and "SwinUNETR trains from random initialisation" in record.getMessage()
    default = Path(tmp_path, "..", "swin_unetr_ssl_pretrain", "models", "model.pt")
    assert f"defaults to the SSL model {os.path.normpath(default)}" in record.getMessage()


@pytest.mark.parametrize("bundle", [CT, MRI], ids=["ct", "mri"])
def test_workflow_properties(bundle, ct_data, mri_data, tmp_path):
    from monai.bundle import ConfigWorkflow

    data = ct_data if bundle == CT else mri_data
    configs = bundle / "configs"
    overrides = {"bundle_root": str(bundle), "dataset_dir": str(data["root"]), "feature_size": 12,
                 "loader#cache_rate": 0.0, "loader#num_workers": 0, "device": "cpu", "speed#tune_allocator": False,
                 "pretrained_path": None, "output_dir": str(tmp_path / "eval"), "ckpt_dir": str(tmp_path / "models")}  # nothing in the repo
    skip = ("loader#cache_rate", "speed#tune_allocator", "pretrained_path")  # ids of train.json only
    cases = {
        "train": (run_config_files(bundle, ["train.json"]), "train", overrides),
        "train+evaluate": (run_config_files(bundle, ["train.json", "evaluate.json"]), "train", overrides),
        "inference": ([configs / "inference.json"], "infer", {k: v for k, v in overrides.items() if k not in skip}),
    }
    for name, (files, kind, ov) in cases.items():
        workflow = ConfigWorkflow(config_file=[str(f) for f in files], meta_file=str(configs / "metadata.json"),
                                  workflow_type=kind, **ov)
        workflow.initialize()
        assert workflow.check_properties() == [], name


# ---------------------------------------------------------------------------------------------------------------
# CT bundle
# ---------------------------------------------------------------------------------------------------------------


def test_ct_train_starts_from_ssl_encoder(ct_train, ssl_ckpts):
    result, out_dir = ct_train
    out = _ok(result, "CT training")
    layout, target, loaded, total, enc_missing, adapted = _summary(out)
    assert (layout, target) == ("ssl_collection", "swinunetr")
    assert loaded == total > 100 and enc_missing == 0 and adapted == 0
    # per-class Dice with class names at the validation
    assert re.search(r"val_mean_dice \S+ per class \(1 images\): spleen [0-9.]+, right kidney", out)
    assert "val_dice_left_adrenal_gland" in out  # scalar entries for StatsHandler / TensorBoard
    # the weights really came from the SSL checkpoint: a warm-up of 50 epochs moves them by ~1e-6 in 3 steps
    ssl = torch.load(ssl_ckpts[12], weights_only=True)
    best = torch.load(out_dir / "models" / "model.pt", weights_only=True)
    resumable = torch.load(out_dir / "models" / "checkpoint.pt", weights_only=True)
    assert {"model", "optimizer", "lr_scheduler", "trainer", "best_metric"} <= set(resumable)
    assert resumable["trainer"]["iteration"] == 3
    encoder = [k for k in best if k.startswith("swinViT.") and not k.endswith("relative_position_index")]
    diffs = [float((best[k] - ssl[k]).abs().max()) for k in encoder]
    assert max(diffs) < 1e-3
    SwinUNETR(in_channels=1, out_channels=14, feature_size=12, window_size=WINDOW).load_state_dict(best)  # strict


def test_ct_checkpoint_that_does_not_fit_stops_the_run(trainings):
    (code, out, _), out_dir = trainings["ct_bad"]
    assert code != 0
    assert "CheckpointLoadError" in out
    assert "feature_size=24 in the checkpoint, 12 in the network. Run with --feature_size 24." in out
    assert "dataset of" not in out  # it fails when network_def is built, before any data is read or cached
    assert not (out_dir / "models" / "model.pt").exists()


def test_ct_pretrained_arch_auto_builds_the_checkpoints_network_and_evaluation_follows_it(
    trainings, followups, v2_swinunetr
):
    """``--training#pretrained_arch auto``: the feature-12 v1 config builds the checkpoint's feature-24 v2 network
    (each change logged), every encoder tensor loads, and the trained model is v2 at 24; evaluate.json then builds
    the network of the checkpoint it evaluates, with the same feature-12 overrides."""
    result, out_dir = trainings["ct_auto"]
    out = _ok(result, "training with pretrained_arch auto")
    assert "pretrained_arch='auto': feature_size=24 from the checkpoint" in out
    assert "pretrained_arch='auto': use_v2=true from the checkpoint" in out
    source = torch.load(v2_swinunetr, weights_only=True)
    encoder = [k for k in source if k.startswith("swinViT.")]
    assert _summary(out)[2:4] == (len(encoder), len(encoder))
    trained = torch.load(out_dir / "models" / "model.pt", weights_only=True)
    assert trained[PATCH_EMBED_WEIGHT].shape[0] == 24 and any(k.startswith("swinViT.layers1c.") for k in trained)

    result, evaluated = followups["ct_auto_eval"]
    eval_out = _ok(result, "evaluation")
    assert "feature_size=24 from the checkpoint" in eval_out
    assert json.loads((evaluated / "metrics.json").read_text())


def test_ct_evaluate_writes_per_class_and_mean_dice(ct_eval):
    result, out_dir = ct_eval
    _ok(result, "CT evaluation")
    summary = json.loads((out_dir / "metrics.json").read_text())
    assert summary["metric"] == "val_mean_dice" and summary["num_images"] == 3
    assert list(summary["per_class"]) == [CT_LABELS[i] for i in range(1, 14)]
    rows = _read_csv(out_dir / "val_mean_dice_raw.csv")  # MONAI MetricsSaver: per image, per class
    assert len(rows) == 3 and len({r["filename"] for r in rows}) == 3
    assert len(rows[0]) == 1 + 13 + 1  # filename, 13 organs, mean
    # MeanDice = mean over images of each image's class mean; the JSON, the CSVs and the log agree
    assert summary["mean"] == pytest.approx(np.mean([float(r["mean"]) for r in rows]), abs=1e-6)
    metrics = dict(line.split(",") for line in (out_dir / "metrics.csv").read_text().splitlines())
    assert float(metrics["val_mean_dice"]) == pytest.approx(summary["mean"], abs=1e-6)
    assert float(metrics["val_dice_spleen"]) == pytest.approx(summary["per_class"]["spleen"], abs=1e-6)
    assert (out_dir / "val_mean_dice_summary.csv").is_file()
    log = _ok(result, "CT evaluation")  # per-volume progress with elapsed time and ETA (not a terminal: lines)
    assert [int(n) for n in re.findall(r"volume (\d)/3 done \([0-9.]+ s\) -- elapsed \d:\d\d:\d\d, ETA \d:\d\d:\d\d", log)] == [1, 2, 3]


def test_two_process_evaluation_equals_single_process(ct_eval, ct_eval_ddp):
    _ok(ct_eval[0], "CT evaluation")
    out = _ok(ct_eval_ddp[0], "CT 2-process evaluation")
    single = json.loads((ct_eval[1] / "metrics.json").read_text())
    ddp = json.loads((ct_eval_ddp[1] / "metrics.json").read_text())
    # 3 volumes on 2 ranks: 2 + 1, no padding duplicate (a duplicate would make 4 and shift the mean)
    assert ddp["num_images"] == 3
    assert ddp["mean"] == pytest.approx(single["mean"], abs=1e-6)
    for name, value in single["per_class"].items():
        assert ddp["per_class"][name] == pytest.approx(value, abs=1e-6, nan_ok=True)
    rows = {r["filename"]: r for r in _read_csv(ct_eval_ddp[1] / "val_mean_dice_raw.csv")}
    reference = {r["filename"]: r for r in _read_csv(ct_eval[1] / "val_mean_dice_raw.csv")}
    assert set(rows) == set(reference) and len(rows) == 3
    for name, row in reference.items():
        assert float(rows[name]["mean"]) == pytest.approx(float(row["mean"]), abs=1e-6)
    # both ranks evaluated their part (2 + 1); engine progress is printed by rank 0 alone (log_per_rank false)
    assert "rank 0: dataset of 2/2 volumes" in out and "rank 1: dataset of 1/1 volumes" in out
    assert out.count("Engine run finished") == 1


def test_ct_inference_keeps_input_geometry(ct_infer, ct_data):
    result, out_dir = ct_infer
    _ok(result, "CT inference")
    case = json.loads(ct_data["datalist"].read_text())["test"][0]
    source = nib.load(ct_data["root"] / case["image"])
    assert nib.aff2axcodes(source.affine) != ("R", "A", "S")  # the case is meaningful: not RAS,
    assert len(set(np.round(source.header.get_zooms()[:3], 3))) > 1  # and not isotropic
    stem = Path(case["image"]).name.split(".")[0]
    seg = nib.load(out_dir / f"{stem}_seg.nii.gz")
    assert seg.shape == source.shape
    np.testing.assert_allclose(seg.affine, source.affine, atol=1e-4)
    assert seg.get_data_dtype() == np.uint8
    values = np.unique(np.asarray(seg.dataobj))
    assert values.min() >= 0 and values.max() <= 13


# ---------------------------------------------------------------------------------------------------------------
# MRI bundle
# ---------------------------------------------------------------------------------------------------------------


def test_mri_train_adapts_ssl_patch_embedding(mri_train, ssl_ckpts):
    result, out_dir = mri_train
    out = _ok(result, "MRI training")
    layout, target, loaded, total, enc_missing, adapted = _summary(out)
    assert (layout, target) == ("ssl_collection", "swinunetr")
    assert loaded == total and enc_missing == 0 and adapted == 1
    assert f"adapted {PATCH_EMBED_WEIGHT}: repeat: input channels 1 -> 4" in out  # named in the run's log
    # the one adapted tensor is the patch embedding, as the loader reports it for this model and policy
    channel_policy = json.loads((MRI / "configs" / "train.json").read_text())["training"]["channel_policy"]
    network = SwinUNETR(in_channels=4, out_channels=3, feature_size=12, window_size=WINDOW)
    report = components.load_pretrained(network, ssl_ckpts[12], channel_policy=channel_policy)
    assert list(report.adapted) == [PATCH_EMBED_WEIGHT]
    assert report.adapted[PATCH_EMBED_WEIGHT].startswith("repeat: input channels 1 -> 4")
    # ... and the trained-from weights are the 1-channel kernel repeated over 4 channels / 4
    ssl = torch.load(ssl_ckpts[12], weights_only=True)[PATCH_EMBED_WEIGHT]
    trained = torch.load(out_dir / "models" / "model.pt", weights_only=True)[PATCH_EMBED_WEIGHT]
    assert tuple(trained.shape) == (12, 4, 2, 2, 2)
    torch.testing.assert_close(trained, ssl.repeat(1, 4, 1, 1, 1) / 4, atol=1e-3, rtol=0)
    assert re.search(r"val_mean_dice \S+ per class \(1 images\): TC [0-9.]+, WT [0-9.]+, ET [0-9.]+", out)


def test_mri_evaluate_reports_regions(mri_eval):
    result, out_dir = mri_eval
    _ok(result, "MRI evaluation")
    summary = json.loads((out_dir / "metrics.json").read_text())
    assert list(summary["per_class"]) == BRATS_NAMES and summary["num_images"] == 1
    rows = _read_csv(out_dir / "val_mean_dice_raw.csv")
    assert len(rows) == 1 and len(rows[0]) == 1 + 3 + 1
    assert summary["mean"] == pytest.approx(float(rows[0]["mean"]), abs=1e-6)


def test_mri_inference_writes_brats_labels_in_input_geometry(mri_infer, mri_data):
    result, out_dir = mri_infer
    _ok(result, "MRI inference")
    cases = json.loads(mri_data["test2"].read_text())["test"]
    orientations = set()
    for case in cases:
        source = nib.load(mri_data["root"] / case["image"])
        orientations.add(nib.aff2axcodes(source.affine))
        seg = nib.load(out_dir / f"{Path(case['image']).name.split('.')[0]}_seg.nii.gz")
        assert source.ndim == 4 and seg.shape == source.shape[:3]
        np.testing.assert_allclose(seg.affine, source.affine, atol=1e-4)
        assert seg.get_data_dtype() == np.uint8
        assert set(np.unique(np.asarray(seg.dataobj)).tolist()) <= {0, 1, 2, 4}
    assert len(orientations) == 2


def test_finetuning_logs_the_learning_rate_to_tensorboard_and_the_log(ct_train):
    """The schedule is visible, as in the pretraining bundles: ``lr`` next to ``train_loss`` every logged iteration,
    equal to the warm-up cosine schedule of this run (50 warm-up epochs of 3 iterations each here)."""
    from monai.optimizers import WarmupCosineSchedule
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    result, out_dir = ct_train
    out = _ok(result, "CT training")
    events = EventAccumulator(str(out_dir / "eval")).Reload()
    assert {"train_loss", "lr"} <= set(events.Tags()["scalars"])
    logged = [(e.step, e.value) for e in events.Scalars("lr")]
    per_epoch = len(logged)  # TRAIN_TINY: one epoch, every iteration logged
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1e-4)
    schedule = WarmupCosineSchedule(optimizer, warmup_steps=50 * per_epoch, t_total=1 * per_epoch)  # max_epochs 1
    expected = []
    for _ in logged:
        schedule.step()
        expected.append(optimizer.param_groups[0]["lr"])
    assert [v for _, v in logged] == pytest.approx(expected, rel=1e-6)
    assert re.search(r"lr: [0-9.e-]+", out)
    assert re.search(r"Epoch: 1/1, Iter: \d+/\d+ -- .*lr: [0-9.e-]+ .* -- elapsed \d:\d\d:\d\d, ETA \d:\d\d:\d\d", out)
