"""Settings that must agree are checked when a bundle starts, in one line naming both (components.check_settings)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from monai.bundle import ConfigParser

from components import ConfigError, check_overrides, check_settings, defined_overrides, rot_rand, rotation_axes
from components.config.running import RunningBundle, parse_command_line, running_bundle
from components.config.running import run_config_files

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("bundle", ["swin_unetr_btcv_finetune", "swin_unetr_brats_finetune"])
@pytest.mark.parametrize("config", ["train.json", "inference.json"])
def test_the_output_channels_are_the_label_names(bundle, config):
    """A user sets label_names only: the network's outputs (and the metric's one-hot) follow their number."""
    parser = ConfigParser()
    parser.read_config(str(REPO / "bundles" / bundle / "configs" / config))
    assert "out_channels" not in parser.config
    parser["label_names"] = ["background", "liver", "tumour"]
    parser["feature_size"] = 12
    network = parser.get_parsed_content("network_def")
    assert network.out.conv.conv.out_channels == 3
    if bundle == "swin_unetr_btcv_finetune" and config == "train.json":
        assert parser.get_parsed_content("validate#postprocessing").transforms[-1].to_onehot == [3, 3]


@pytest.mark.parametrize(
    "roi, rotation, match",
    [
        ([64, 48, 48], False, r"roi_size \[64, 48, 48\] does not fit the network \(SwinUNETR\): every spatial "
                              r"size must be divisible by 32"),
        ([32, 32, 32], False, r"roi_size \[32, 32, 32\] does not fit the network \(SwinUNETR\): .* 1 token"),
        ([64, 32, 64], True, r"roi_size \[64, 32, 64\] and the SSL rotation views disagree: .* got 32 and 64; e.g. "
                             r"--roi_size \"\[64,64,64\]\""),
    ],
)
def test_roi_size_must_fit_the_network_and_the_rotation_views(roi, rotation, match):
    with pytest.raises(ValueError, match=match) as err:
        check_settings(roi_size=roi, network="SwinUNETR", rotation=rotation)
    assert "\n" not in str(err.value)


def test_the_rotation_rule_is_what_rot_rand_needs():
    """The SSL rule is real: rot_rand refuses a crop whose last two axes differ (at the first iteration, without the
    start-up check) and takes it once they are equal."""
    check_settings(roi_size=[64, 32, 32], rotation=True)
    with pytest.raises(ValueError, match="must be equal, got W=32, D=64"):
        rot_rand(torch.zeros(2, 1, 64, 32, 64))
    assert rot_rand(torch.zeros(2, 1, 64, 32, 32))[0].shape == (2, 1, 64, 32, 32)


@pytest.mark.parametrize("bundle", ["swin_unetr_ssl_pretrain", "swin_unetr_btcv_finetune", "swin_unetr_brats_finetune"])
def test_bundles_check_their_settings_at_start(bundle):
    """train.json and multi_gpu_train.json run the check at the start of `run` (before any data is read)."""
    for files in (["train.json"], ["train.json", "multi_gpu_train.json"]):
        parser = ConfigParser()
        parser.read_config([str(f) for f in run_config_files(REPO / "bundles" / bundle, files)])
        steps = [s for s in parser["run"] if isinstance(s, str)]
        assert any("components.check_settings(" in step for step in steps[:5]), files
        parser["roi_size"] = [64, 48, 48]
        step = next(s for s in steps if "check_settings" in s)
        parser["probe"] = step
        with pytest.raises(RuntimeError) as err:  # MONAI wraps what an expression raises
            parser.get_parsed_content("probe")
        assert isinstance(err.value.__cause__, ValueError)
        assert str(err.value.__cause__).startswith("roi_size [64, 48, 48] does not fit the network")


# ------------------------------------------------------------------ overrides of ids the configs do not define

TRAIN = REPO / "bundles" / "swin_unetr_ssl_pretrain" / "configs" / "train.json"
#: what a run of train.json reads: the shared config, then train.json
FILES = tuple(run_config_files(TRAIN.parents[1], ["train.json"]))


def _check(overrides: dict, *files: Path) -> None:
    check_overrides(RunningBundle(files or FILES, overrides))


@pytest.mark.parametrize(
    "old, moved, new",
    [
        ("val_interval", "val_interval moved to training#val_interval", "training#val_interval"),
        ("amp", "amp moved to speed#amp", "speed#amp"),
        ("num_workers", "num_workers moved to loader#num_workers", "loader#num_workers"),
        ("seed", "seed moved to training#seed", "training#seed"),
        ("ckpt_time_interval_s", "ckpt_time_interval_s moved to checkpointing#time_interval_s",
         "checkpointing#time_interval_s"),
        ("window_size", "window_size moved to network_def#window_size", "network_def#window_size"),
        ("optimizer#lr", "optimizer moved to train#optimizer", "train#optimizer#lr"),
    ],
)
def test_an_id_that_0_2_0_moved_stops_the_run_naming_its_new_name(old, moved, new):
    """0.2.0 moved these ids into groups; their old names were accepted as new ids that nothing read."""
    with pytest.raises(ValueError) as err:
        _check({old: 1})
    assert str(err.value) == (f"--{old} names no id of {FILES[0]} + {TRAIN}, so MONAI would add it as a new id that "
                              f"nothing reads: {moved}; run with --{new} instead.")  # fmt: skip


@pytest.mark.parametrize(
    "old, moved, new",
    [
        ("network", "network moved to train#network", "train#network"),
        ("speed#upsample", "speed#upsample moved to network_def#upsample", "network_def#upsample"),
        ("speed#step_inputs", "speed#step_inputs moved to train#network#step_inputs", "train#network#step_inputs"),
        ("train#deterministic_transforms#0#keys", "train#deterministic_transforms moved to train#transforms#deterministic",
         "train#transforms#deterministic#0#keys"),
    ],
)
def test_an_id_that_0_5_0_moved_stops_the_run_naming_its_new_name(old, moved, new):
    """0.5.0 moved these ids (the Model Zoo-style configs); the old command lines are refused naming the new id."""
    with pytest.raises(ValueError) as err:
        _check({old: 1})
    assert str(err.value).endswith(f"nothing reads: {moved}; run with --{new} instead.")


def test_an_id_that_0_5_0_replaced_stops_the_run_saying_what_to_run_instead():
    """loader#compact_cache was a switch inside the transforms; the cache mode is now the pipeline train#transforms
    names, which the message gives."""
    with pytest.raises(ValueError) as err:
        _check({"loader#compact_cache": False, "loader#loader_workers": 0})
    first, second = str(err.value).splitlines()
    assert first.endswith("loader#compact_cache was replaced; the cache mode is the pipeline train#transforms names: "
                          "--train#transforms %train#plain_transforms for false, nothing for true.")  # fmt: skip
    assert second.startswith("--loader#loader_workers names no id") and "loader#num_workers" in second


def test_members_of_every_group_are_checked_and_component_arguments_are_open():
    """A misspelt member of a group of components (train, validate) names nothing, as one of a group of knobs does;
    the arguments of a component, list items and a free keyword dict (speed#compile_kwargs) may be added."""
    with pytest.raises(ValueError, match=r"^--train#transfroms names no id .*did you mean --train#transforms"):
        _check({"train#transfroms": "%train#plain_transforms"})
    _check({"train#transforms": "%train#plain_transforms", "train#trainer#foo": 1, "roi_size#0": 64,
            "speed#compile_kwargs#mode": "max-autotune", "train#handlers#0#hint": "x"})  # fmt: skip


def test_a_misspelt_id_stops_the_run_naming_the_closest_ids():
    with pytest.raises(ValueError, match=r"^--training#val_intervl names no id of .*; did you mean "
                                         r"--training#val_interval( or --\S+)*\?$"):
        _check({"training#val_intervl": 1})
    with pytest.raises(ValueError, match=r"^--max_epoch names no id .*did you mean --max_epochs\?$"):
        _check({"max_epoch": 1})


def test_overrides_of_defined_ids_and_component_arguments_pass():
    """Ids the configs define, at any depth, and new arguments of a component (the loader's advice
    --network_def#depths) are what overrides are for."""
    _check({"max_epochs": 2, "training#seed": 1, "loader#cache": "none", "network_def#window_size": 4,
            "network_def#depths": [2, 2, 6, 2], "train#optimizer#lr": 1e-3})  # fmt: skip


def test_defined_overrides_keep_the_ids_a_config_defines():
    """One set of settings for a bundle's training and inference runs: each run gets the ids its configs define."""
    inference = TRAIN.parents[2] / "swin_unetr_btcv_finetune" / "configs" / "inference.json"
    overrides = {"device": "cpu", "network_def#depths": [2, 2, 2, 2], "max_epochs": 3, "training#class_weights": [1.0]}
    assert defined_overrides(overrides, [inference]) == {"device": "cpu", "network_def#depths": [2, 2, 2, 2]}
    assert defined_overrides(overrides, run_config_files(inference.parents[1], ["train.json"])) == overrides


def test_ids_of_every_config_file_given_are_known():
    """An id that only a later config file defines (multi_gpu_train.json's dist_backend) is known when that file is
    part of the run, and unknown without it."""
    multi = TRAIN.with_name("multi_gpu_train.json")
    _check({"dist_backend": "gloo"}, *FILES, multi)
    with pytest.raises(ValueError, match="names no id"):
        _check({"dist_backend": "gloo"}, *FILES)


MONAI_MAIN = str(Path(__import__("monai.bundle").bundle.__file__).with_name("__main__.py"))


def _monai_run(argv: list[str], monkeypatch) -> BaseException:
    """What the bundle raises under ``python -m monai.bundle run <argv>``: its command line in sys.argv, MONAI's
    ``run`` called with the arguments python-fire gives it."""
    from monai.bundle.scripts import run

    monkeypatch.setattr("sys.argv", [MONAI_MAIN, "run", *argv])
    monkeypatch.setattr("sys.path", list(sys.path))  # initialize puts bundle_root first on it
    bundle = parse_command_line(sys.argv)
    with pytest.raises(RuntimeError) as err:  # MONAI wraps what an expression raises
        run(config_file=[str(f) for f in bundle.config_files], logging_file=False, **bundle.overrides)
    return err.value.__cause__


def test_a_bundle_run_stops_at_its_start_on_a_moved_id(tmp_path, monkeypatch):
    """Where the defect showed: ``python -m monai.bundle run ... --val_interval 1`` with a 0.2.0 override; the
    bundle stops at the start of its run, before any data is read."""
    files = json.dumps([str(f) for f in FILES])
    cause = _monai_run(["--config_file", files, "--dataset_dir", str(tmp_path), "--val_interval", "1"], monkeypatch)
    assert str(cause).startswith("--val_interval names no id of")
    assert "run with --training#val_interval instead" in str(cause)


def test_a_command_line_without_the_shared_config_is_refused_with_the_one_that_reads_it(tmp_path, monkeypatch):
    """0.4.0's command line (``--config_file configs/train.json``) leaves out the settings the bundles share; the run
    stops at its start, before MONAI fails on an id it cannot find, giving the command line with both files."""
    cause = _monai_run(["--config_file", str(TRAIN), "--dataset_dir", str(tmp_path)], monkeypatch)
    assert isinstance(cause, ConfigError)
    assert str(cause) == (f"--config_file {TRAIN} leaves out {FILES[0]}, which holds the settings all the bundles "
                          f"share: run with --config_file \"['{FILES[0]}','{TRAIN}']\".")  # fmt: skip


def test_the_command_line_gives_the_files_in_order_and_only_the_overrides(tmp_path):
    """parse_command_line reads MONAI's ``run`` command line as python-fire hands it over: a list of config files,
    values parsed (JSON lists, numbers, bare flags True), MONAI's own arguments left out of the overrides."""
    files = [str(tmp_path / "configs" / "a.json"), str(tmp_path / "configs" / "b.json")]
    argv = [MONAI_MAIN, "run", "--config_file", json.dumps(files), "--meta_file", "m.json", "--logging_file=l.conf",
            "--roi_size", "[64,32,32]", "--training#seed", "3", "--intensity_range", "[-175, 250]", "--debug",
            "--speed#amp", "false", "--nocheck"]  # fmt: skip
    bundle = parse_command_line(argv)
    assert bundle.config_files == tuple(Path(f) for f in files) and bundle.tracking is None
    assert dict(bundle.overrides) == {"roi_size": [64, 32, 32], "training#seed": 3, "intensity_range": [-175, 250],
                                      "debug": True, "speed#amp": "false", "check": False}  # fmt: skip
    assert bundle.folder == tmp_path.resolve()
    assert parse_command_line([MONAI_MAIN, "verify_metadata", "--meta_file", "m.json"]) is None
    assert parse_command_line(["/usr/bin/pytest", "run", "--config_file", files[0]]) is None
    assert running_bundle() is None  # this process is pytest, no bundle run


def test_an_args_file_gives_defaults_the_command_line_overrides(tmp_path):
    """``--args_file``: its pairs are the defaults MONAI merges the command line onto (config_file among them)."""
    args = tmp_path / "args.json"
    args.write_text(json.dumps({"config_file": "configs/train.json", "max_epochs": 5, "batch_size": 2}))
    bundle = parse_command_line([MONAI_MAIN, "run", "--args_file", str(args), "--max_epochs", "7"])
    assert bundle.config_files == (Path("configs/train.json"),)
    assert dict(bundle.overrides) == {"max_epochs": 7, "batch_size": 2}


def test_the_tracking_settings_ids_pass(tmp_path):
    """``--tracking mlflow --experiment_name e``: MONAI adds the tracking settings' ids (experiment_name, run_name,
    ...) to the config, so the check knows them; without the tracking they name no id."""
    bundle = parse_command_line([MONAI_MAIN, "run", "--config_file", str(TRAIN), "--tracking", "mlflow",
                                 "--experiment_name", "e"])  # fmt: skip
    assert bundle.tracking == "mlflow" and dict(bundle.overrides) == {"experiment_name": "e"}
    check_overrides(bundle)
    check_overrides(RunningBundle((TRAIN,), {"experiment_name": "e", "run_name": "r"}, "mlflow"))
    check_overrides(RunningBundle((TRAIN,), {"experiment_name": "e"}, {"configs": {"experiment_name": "x"}}))
    with pytest.raises(ValueError, match="^--experiment_name names no id"):
        _check({"experiment_name": "e"})


# ------------------------------------------------------------------ 90-degree rotations keep the crop shape


@pytest.mark.parametrize("roi, axes", [([96, 96, 96], (0, 1)), ([64, 32, 32], (1, 2)), ([32, 64, 32], (0, 2)),
                                       ([64, 64, 32], (0, 1))])  # fmt: skip
def test_rotation_axes_are_a_plane_of_equal_sides(roi, axes):
    assert rotation_axes(roi) == axes


def test_a_roi_without_equal_axes_and_the_rotation_on_stops_at_start():
    with pytest.raises(ValueError, match=r"^roi_size \[96, 64, 32\] and training#rotate90_prob 0.1 disagree: .* "
                                         r"or run with --training#rotate90_prob 0\.$"):
        check_settings(roi_size=[96, 64, 32], network="SwinUNETR", rotate90_prob=0.1)
    check_settings(roi_size=[96, 64, 32], network="SwinUNETR", rotate90_prob=0)


def test_ct_crops_of_a_non_cubic_roi_keep_their_shape_and_collate():
    """The CT bundle at roi_size [64,32,32] (the docs' CPU size) with its default 4 crops per volume: RandRotate90d
    turned some crops into [32,64,32] and the first batch failed to collate; now every crop keeps the ROI's shape."""
    from monai.data import list_data_collate

    parser = ConfigParser()
    parser.read_config([str(f) for f in run_config_files(REPO / "bundles" / "swin_unetr_btcv_finetune", ["train.json"])])
    parser["roi_size"] = [64, 32, 32]
    parser["training#rotate90_prob"] = 1.0
    random = parser.get_parsed_content("train#transforms#random")
    from monai.transforms import Compose

    pipeline = Compose(random)
    image = torch.rand(1, 80, 70, 60)
    label = (image > 0.5).to(torch.float32)
    for seed in range(4):
        pipeline.set_random_state(seed)
        crops = pipeline({"image": image.clone(), "label": label.clone()})
        assert len(crops) == parser["training#num_samples"] == 4
        assert {tuple(c["image"].shape) for c in crops} == {(1, 64, 32, 32)}
        assert list_data_collate(crops)["image"].shape == (4, 1, 64, 32, 32)


# ------------------------------------------------------------------ files a config needs


@pytest.mark.parametrize(
    "bundle, configs",
    [(b, ["inference.json"]) for b in ("swin_unetr_ssl_pretrain", "swin_unetr_dino_pretrain", "swin_unetr_btcv_finetune",
                                       "swin_unetr_brats_finetune")]
    + [(b, ["train.json", "evaluate.json"]) for b in ("swin_unetr_btcv_finetune", "swin_unetr_brats_finetune")],
)  # fmt: skip
def test_a_missing_trained_model_is_one_line_naming_the_file_and_the_command(bundle, configs, tmp_path):
    """Inference (and evaluation) without models/model.pt used to fail in CheckpointLoader with a long traceback;
    `run` now stops first, naming the file and the training command that writes it."""
    folder = REPO / "bundles" / bundle / "configs"
    datalist = tmp_path / "dataset.json"
    datalist.write_text(json.dumps({"training": [], "test": []}))
    parser = ConfigParser()
    parser.read_config([str(f) for f in run_config_files(folder.parent, configs)])
    parser.update({"datalist": str(datalist), "ckpt_dir": str(tmp_path / "models")})
    steps = parser["run"]
    index = next(i for i, s in enumerate(steps) if "require_file" in s)
    assert index < next(i for i, s in enumerate(steps) if ".run()" in s)
    with pytest.raises(RuntimeError) as err:
        parser.get_parsed_content(f"run#{index}")
    assert str(err.value.__cause__) == (
        f"{tmp_path / 'models' / 'model.pt'} not found: it is written by `python -m monai.bundle run --config_file "
        "\"['configs/common.json','configs/train.json']\" --meta_file configs/metadata.json --logging_file "
        "configs/logging.conf --dataset_dir DATA`, run in the bundle folder first."
    )
