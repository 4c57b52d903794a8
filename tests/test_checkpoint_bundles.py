"""The bundles' configs and the checkpoints they start from or run: the network each config builds for its weights.

- train.json of every bundle and BrainSegFounder's deeper encoder (2 channels, depths (2, 2, 6, 2), heads
  (4, 8, 16, 32)): ``pretrained_arch`` "config" stops when ``network_def`` is built, with one line of overrides;
  those overrides, as a command line gives them, build the network the bundle's own ``PretrainedLoader`` fills with
  every encoder tensor; so does ``--training#pretrained_arch auto`` alone.
- inference.json of every bundle and a trained model of another architecture than the config's (feature 24, v2,
  window 4), saved as the bundle saves ``models/model.pt``: ``network_def`` is that model's network, with no size
  override, at ``models/model.pt`` or wherever ``checkpoint`` points; an unreadable file stops it with one line.
- train.json of the pretraining bundles and BrainSegFounder's 2-channel encoder on 1-channel data:
  ``training#channel_policy`` reaches the bundle's ``PretrainedLoader`` (default "error", as the CT finetuning
  bundle's).

Only the configs are parsed (``monai.bundle.ConfigParser``), with tiny networks (feature size 12 or 24): no data,
no training.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from monai.bundle import ConfigParser
from monai.networks.nets import SwinUNETR
from torch import nn

import components
from components.checkpoint import CheckpointLoadError, PretrainedLoader
from components.config.running import run_config_files
from tests.test_checkpoint_layouts import _published, _random

REPO = Path(__file__).resolve().parents[1]
BUNDLES = ["swin_unetr_ssl_pretrain", "swin_unetr_dino_pretrain", "swin_unetr_btcv_finetune",
           "swin_unetr_brats_finetune"]  # fmt: skip


def _parser(bundle: str, config: str, overrides: dict) -> ConfigParser:
    """``configs/<config>`` of ``bundle`` with ``overrides`` and its imports evaluated, as ``monai.bundle run``
    reads it."""
    parser = ConfigParser()
    parser.read_config([str(f) for f in run_config_files(REPO / "bundles" / bundle, [config])])
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


# a model each bundle's training writes to models/model.pt, of another architecture than its configs' (feature 48,
# v1, window 7); the self-distillation bundle's is its teacher's encoder
TRAINED = {
    "swin_unetr_ssl_pretrain": lambda: components.SSLHead(feature_size=24, window_size=4, use_v2=True),
    "swin_unetr_dino_pretrain": lambda: components.SwinViTEmbedding(feature_size=24, window_size=4, use_v2=True),
    "swin_unetr_btcv_finetune": lambda: SwinUNETR(1, 14, feature_size=24, window_size=4, use_v2=True),
    "swin_unetr_brats_finetune": lambda: SwinUNETR(4, 3, feature_size=24, window_size=4, use_v2=True),
}


def _trained_model(bundle: str) -> tuple[nn.Module, dict]:
    """The model and its state dict, shifted away from any fresh initialisation."""
    torch.manual_seed(0)
    model = TRAINED[bundle]().eval()
    with torch.no_grad():
        for value in model.state_dict().values():
            if value.is_floating_point():
                value.add_(0.05 * torch.randn(value.shape))
    return model, {k: v.clone() for k, v in model.state_dict().items()}


def _output(network: nn.Module, bundle: str) -> torch.Tensor:
    channels = 4 if bundle == "swin_unetr_brats_finetune" else 1
    x = torch.rand(1, channels, 64, 32, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = network(x)
    return out[-1] if isinstance(out, tuple) else out


@pytest.mark.parametrize("where", ["models/model.pt", "checkpoint"])
@pytest.mark.parametrize("bundle", BUNDLES)
def test_inference_json_builds_the_network_of_the_model_it_runs(bundle, where, tmp_path, caplog):
    """A feature-24 v2 window-4 model at the default models/model.pt, or at another file named by ``checkpoint``:
    inference.json's network_def is its network with no size override (logged), takes its state dict strictly and
    computes what the model computes (the SSL bundle's reconstruction, as ``output`` says)."""
    model, state = _trained_model(bundle)
    path = tmp_path / "models" / "model.pt" if where == "models/model.pt" else tmp_path / "finetuned" / "best.pt"
    path.parent.mkdir()
    torch.save(state, path)
    overrides = {"bundle_root": str(tmp_path), **({"checkpoint": str(path)} if where == "checkpoint" else {})}
    with caplog.at_level("INFO", logger="components.checkpoint"):
        network = _parser(bundle, "inference.json", overrides).get_parsed_content("network_def").eval()
    assert (f"the network takes the architecture of the checkpoint {path}: feature_size=24, use_v2=true, "
            "window_size=4") in caplog.text  # fmt: skip
    result = network.load_state_dict(state, strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    if bundle == "swin_unetr_ssl_pretrain":
        assert network.output == "reconstruction"
        model.output = "reconstruction"
    assert torch.equal(_output(network, bundle), _output(model, bundle))


@pytest.mark.parametrize("bundle", BUNDLES)
def test_inference_json_without_a_model_builds_the_configured_network(bundle, tmp_path):
    """No models/model.pt (``verify_net_in_out``, a fresh bundle): the configured feature-48 v1 network."""
    network = _parser(bundle, "inference.json", {"bundle_root": str(tmp_path)}).get_parsed_content("network_def")
    assert network.swinViT.embed_dim == 48 and not hasattr(network.swinViT, "layers1c")


@pytest.mark.parametrize("bundle", BUNDLES)
def test_inference_json_stops_on_an_unreadable_model_with_one_line(bundle, tmp_path):
    path = tmp_path / "models" / "model.pt"
    path.parent.mkdir()
    path.write_bytes(b"not a torch file")
    with pytest.raises(Exception) as err:
        _parser(bundle, "inference.json", {"bundle_root": str(tmp_path)}).get_parsed_content("network_def")
    message = str(_cause(err.value, CheckpointLoadError))
    assert message.startswith(f"checkpoint '{path}' is not a readable torch checkpoint (corrupt, truncated or another "
                              "format): ") and "\n" not in message  # fmt: skip


@pytest.mark.parametrize("bundle", BUNDLES[:2])
def test_pretraining_train_json_passes_its_channel_policy_to_the_loader(bundle, tmp_path):
    """A 2-channel encoder into the 1-channel pretraining network: the default policy "error" stops with one line
    naming ``--training#channel_policy repeat``; ``repeat`` loads every encoder tensor, the patch embedding adapted."""
    path = tmp_path / "brainsegfounder_T1T2.pt"
    torch.save(_published("brainsegfounder_stage1", 12, _random).checkpoint, path)
    overrides = {"pretrained_path": str(path), "feature_size": 12}
    assert _parser(bundle, "train.json", {})["training"]["channel_policy"] == "error"
    loader = _pretrained_loader(_parser(bundle, "train.json", overrides))
    assert loader.channel_policy == "error"
    with pytest.raises(CheckpointLoadError) as err:
        loader()
    assert ("but the model has 1 (shape [12, 1, 2, 2, 2]). Run with --training#channel_policy repeat (channel_policy="
            "'repeat': the kernel repeated over the 1 channels") in str(err.value)  # fmt: skip
    loader = _pretrained_loader(_parser(bundle, "train.json", {**overrides, "training#channel_policy": "repeat"}))
    report = loader()
    encoder = [k for k in loader.network.state_dict() if k.startswith("swinViT.")]
    assert report.encoder_loaded == encoder and list(report.adapted) == ["swinViT.patch_embed.proj.weight"]
