"""The bundles' configs and the checkpoints they start from or run: the network each config builds for its weights.

- train.json of every bundle and BrainSegFounder's deeper encoder (2 channels, depths (2, 2, 6, 2), heads
  (4, 8, 16, 32)): ``pretrained_arch`` "config" stops when ``network_def`` is built, with one line of overrides;
  those overrides, as a command line gives them, build the network the bundle's own ``PretrainedLoader`` fills with
  every encoder tensor; so does ``--training#pretrained_arch auto`` alone.

Only the configs are parsed (``monai.bundle.ConfigParser``), at feature size 12: no data, no training.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from monai.bundle import ConfigParser

from components.checkpoint import CheckpointLoadError, PretrainedLoader
from tests.test_checkpoint_layouts import _published, _random

REPO = Path(__file__).resolve().parents[1]
BUNDLES = ["swin_unetr_ssl_pretrain", "swin_unetr_dino_pretrain", "swin_unetr_btcv_finetune",
           "swin_unetr_brats_finetune"]  # fmt: skip
DEEP_DEPTHS, DEEP_HEADS = (2, 2, 6, 2), (4, 8, 16, 32)


def _parser(bundle: str, config: str, overrides: dict) -> ConfigParser:
    """``configs/<config>`` of ``bundle`` with ``overrides``, its imports evaluated, as ``monai.bundle run`` reads it."""
    parser = ConfigParser()
    parser.read_config(str(REPO / "bundles" / bundle / "configs" / config))
    parser.update(overrides)
    parser.get_parsed_content("imports")
    return parser


def _cause(error: BaseException, kind: type[BaseException]) -> BaseException:
    """The ``kind`` exception a config's instantiation wrapped (MONAI raises RuntimeError from it)."""
    while error is not None and not isinstance(error, kind):
        error = error.__cause__
    assert error is not None, f"no {kind.__name__} in the chain"
    return error


def _pretrained_loader(parser: ConfigParser) -> PretrainedLoader:
    """The bundle's own ``components.PretrainedLoader`` handler, built from train.json (it builds the network)."""
    handlers = parser["train#handlers"]
    index = next(i for i, h in enumerate(handlers) if h.get("_target_") == "components.PretrainedLoader")
    return parser.get_parsed_content(f"train#handlers#{index}")


def _command_line_overrides(message: str) -> dict:
    """``--id value`` pairs of a message's ``Run with ...`` as ``monai.bundle run`` parses them (``[2,2,6,2]``: a
    list)."""
    advised = re.search(r"Run with (.*)\.$", message).group(1).split()
    return {flag[2:]: json.loads(value) for flag, value in zip(advised[::2], advised[1::2])}


@pytest.fixture(scope="module")
def brainsegfounder_deep(tmp_path_factory) -> Path:
    """BrainSegFounder's deeper SSL checkpoint (2 channels) at feature 12, as its code saves it."""
    path = tmp_path_factory.mktemp("brainsegfounder") / "brainsegfounder_deep.pt"
    torch.save(_published("brainsegfounder_deep", 12, _random).checkpoint, path)
    return path


def _start_overrides(bundle: str, path: Path) -> dict:
    """The bundle continued or finetuned from ``path``: 2-channel data (the BraTS bundle keeps its 4 channels and
    its ``repeat`` channel policy)."""
    return {"pretrained_path": str(path), **({} if bundle == "swin_unetr_brats_finetune" else {"in_channels": 2})}


def _assert_every_encoder_tensor(loader: PretrainedLoader, path: Path) -> None:
    report = loader()
    network = loader.network.state_dict()
    encoder = [k for k in network if k.startswith("swinViT.")]
    assert report.layout == "ssl_original" and report.source == str(path)
    assert report.encoder_loaded == encoder and report.encoder_missing == [] and report.shape_mismatched == {}
    assert len(loader.network.swinViT.layers3[0].blocks) == 6
    assert [loader.network.swinViT.layers1[0].blocks[0].attn.num_heads, network[
        "swinViT.layers4.0.blocks.1.attn.relative_position_bias_table"].shape[1]] == [4, 32]  # fmt: skip


@pytest.mark.parametrize("bundle", BUNDLES)
def test_train_json_stops_on_a_deeper_encoder_and_its_advised_overrides_load_every_tensor(bundle, brainsegfounder_deep):
    """``pretrained_arch`` "config": one line naming feature size, depths and heads with the overrides; the same
    config with exactly those overrides builds the network (the DINO student included) that the bundle's own
    PretrainedLoader fills with every encoder tensor of the file."""
    path = brainsegfounder_deep
    overrides = _start_overrides(bundle, path)
    with pytest.raises(Exception) as err:
        _pretrained_loader(_parser(bundle, "train.json", overrides))
    message = str(_cause(err.value, CheckpointLoadError))
    assert message == (
        f"checkpoint {path} was trained with another network: feature_size=12 in the checkpoint, 48 in the network; "
        "depths=[2,2,6,2] in the checkpoint, [2,2,2,2] in the network; num_heads=[4,8,16,32] in the checkpoint, "
        "[3,6,12,24] in the network. Run with --feature_size 12 --network_def#depths [2,2,6,2] "
        "--network_def#num_heads [4,8,16,32]."
    )
    advised = _command_line_overrides(message)
    assert advised == {"feature_size": 12, "network_def#depths": [2, 2, 6, 2], "network_def#num_heads": [4, 8, 16, 32]}
    _assert_every_encoder_tensor(_pretrained_loader(_parser(bundle, "train.json", {**overrides, **advised})), path)


@pytest.mark.parametrize("bundle", BUNDLES)
def test_train_json_with_pretrained_arch_auto_builds_the_deeper_encoder(bundle, brainsegfounder_deep):
    overrides = {**_start_overrides(bundle, brainsegfounder_deep), "training#pretrained_arch": "auto"}
    _assert_every_encoder_tensor(_pretrained_loader(_parser(bundle, "train.json", overrides)), brainsegfounder_deep)
