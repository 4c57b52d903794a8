"""Settings that must agree are checked when a bundle starts, in one line naming both (components.check_settings)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from monai.bundle import ConfigParser

from components import check_settings, rot_rand

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
    """train.json and multi_gpu_train.json run the check in `initialize` (before any data is read)."""
    for files in (["train.json"], ["train.json", "multi_gpu_train.json"]):
        parser = ConfigParser()
        parser.read_config([str(REPO / "bundles" / bundle / "configs" / f) for f in files])
        assert any("components.check_settings(" in step for step in parser["initialize"]), files
        parser["roi_size"] = [64, 48, 48]
        step = next(s for s in parser["initialize"] if "check_settings" in s)
        parser["probe"] = step
        with pytest.raises(RuntimeError) as err:  # MONAI wraps what an expression raises
            parser.get_parsed_content("probe")
        assert isinstance(err.value.__cause__, ValueError)
        assert str(err.value.__cause__).startswith("roi_size [64, 48, 48] does not fit the network")
