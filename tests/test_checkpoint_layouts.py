"""Tests of the published checkpoint layouts (components.checkpoint.layouts) and of the architecture read from a
checkpoint's tensors (components.checkpoint.architecture).

Every source file is built the way its publisher's code saves it (the public file is named at each builder): the
publisher's network is assembled from MONAI's blocks at the published size, its state dict is wrapped in the
published container and prefixes. The published sizes go up to VoCo H (feature 192, over a billion parameters in
VoComni H), so those networks are built with their parameters on the ``meta`` device and every tensor of the file is
a distinct constant expanded from one element: the shapes are the real ones, the memory a few bytes per tensor, and
a tensor equal to its source proves it came from the right key. Loading into real models is tested at feature 12.
"""

from __future__ import annotations

import itertools
import logging
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import pytest
import torch
from ignite.engine import Engine
from monai.handlers import CheckpointSaver
from monai.networks.nets import SwinUNETR
from monai.networks.nets.swin_unetr import SwinTransformer
from torch import nn

from components.checkpoint import (
    LAYOUTS,
    OVERRIDE_IDS,
    CheckpointLoadError,
    PretrainedLoader,
    ResumableCheckpointSaver,
    SwinArchitecture,
    adopt_architecture,
    build_for_weights,
    check_architecture,
    convert_state_dict,
    detect_layout,
    infer_architecture,
    load_pretrained,
)
from components.recipes.inpainting_contrast import SSLHead
from components.recipes.self_distillation import SelfDistillationNetwork

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from encoder_sizes import parameters_on_meta

V1_HEADS = (3, 6, 12, 24)
V1_DEPTHS = (2, 2, 2, 2)


# ------------------------------------------------------------------------------------------------------------
# networks without their memory, files of distinct constants
# ------------------------------------------------------------------------------------------------------------


def _constants(state: dict) -> dict:
    """Tensor ``i`` becomes the constant ``i + 0.5`` expanded to its shape (integer buffers: shifted by ``1000 i``),
    so no two tensors of a file are equal and the file costs a few bytes per tensor."""
    out = {}
    for i, (k, v) in enumerate(state.items()):
        if v.is_floating_point():
            out[k] = torch.full((1,) * v.ndim, i + 0.5).expand(v.shape)
        else:
            out[k] = v.clone() + 1000 * (i + 1)
    return out


def _random(state: dict) -> dict:
    """Real random values (LayerNorm ones/zeros would equal a fresh model's without being loaded)."""
    return {k: torch.randn(v.shape) if v.is_floating_point() else v.flip(0).clone() for k, v in state.items()}


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal tensors; two constants expanded from one element compare by that element (not 10^9 times)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if not any(a.stride()) and not any(b.stride()):
        return torch.equal(a.as_strided((1,), (1,)), b.as_strided((1,), (1,)))
    return torch.equal(a, b)


# ------------------------------------------------------------------------------------------------------------
# the publishers' networks, from MONAI's blocks
# ------------------------------------------------------------------------------------------------------------


def _swinunetr(feature_size: int, use_v2: bool = False, in_channels: int = 1, out_channels: int = 14,
               depths: tuple = V1_DEPTHS, num_heads: tuple = V1_HEADS, window_size: int = 7) -> SwinUNETR:  # fmt: skip
    return SwinUNETR(
        in_channels=in_channels,
        out_channels=out_channels,
        feature_size=feature_size,
        use_v2=use_v2,
        depths=depths,
        num_heads=num_heads,
        window_size=window_size,
    )


def _projection_head(in_dim: int) -> nn.Module:
    """VoCo's ``projection_head`` (Large-Scale-Medical ``Self-supervised/models/voco_head.py``): three linear layers,
    BatchNorm1d without affine parameters or running statistics between them (so without state)."""
    head = nn.Module()
    head.layer1 = nn.Sequential(nn.Linear(in_dim, 1024), nn.BatchNorm1d(1024, affine=False, track_running_stats=False))
    head.layer2 = nn.Sequential(nn.Linear(1024, 1024), nn.BatchNorm1d(1024, affine=False, track_running_stats=False))
    head.layer3 = nn.Sequential(nn.Linear(1024, 1024))
    return head


def _voco_swin(feature_size: int) -> SwinUNETR:
    """VoCo's ``Swin`` backbone (Large-Scale-Medical ``Self-supervised/models/voco_head.py``): a ``use_v2=True``
    encoder ``swinViT`` with SwinUNETR's ``encoder1..4`` / ``encoder10`` blocks and no decoder or output layer."""
    backbone = _swinunetr(feature_size, use_v2=True)
    for name in ("decoder5", "decoder4", "decoder3", "decoder2", "decoder1", "out"):
        delattr(backbone, name)
    return backbone


def _voco_head(feature_size: int, omni: bool) -> nn.Module:
    """VoCo's ``VoCoHead``: ``backbone`` is ``Swin`` (a v2 encoder with ``encoder1..4`` / ``encoder10``, no decoder:
    ``Self-supervised/models/voco_head.py``) or, omni-supervised, a whole SwinUNETR v2 of 21 outputs
    (``Omni-supervised/models/voco_head.py``); ``student`` / ``teacher`` project the pooled features of the five
    encoders (``24 * feature_size`` values: 1152 / 2304 / 4608)."""
    model = nn.Module()
    model.backbone = _swinunetr(feature_size, use_v2=True, out_channels=21) if omni else _voco_swin(feature_size)
    model.student = _projection_head(24 * feature_size)
    model.teacher = _projection_head(24 * feature_size)
    return model


def _universal_model(feature_size: int = 48, classes: int = 25) -> nn.Module:
    """SuPreM's ``Universal_model`` with the Swin UNETR backbone and word embeddings (MrGiovanni/SuPreM
    ``supervised_pretraining/backbone/Universal_model.py``; its ``swinunetr.py`` has no ``out`` layer)."""
    model = nn.Module()
    model.backbone = _swinunetr(feature_size, out_channels=classes)
    del model.backbone.out
    groups = math.gcd(16, feature_size)  # GroupNorm(16, 48) as published; 4 groups at the tests' feature 12
    model.precls_conv = nn.Sequential(nn.GroupNorm(groups, feature_size), nn.ReLU(), nn.Conv3d(feature_size, 8, 1))
    model.GAP = nn.Sequential(
        nn.GroupNorm(16, 16 * feature_size), nn.ReLU(), nn.AdaptiveAvgPool3d(1), nn.Conv3d(16 * feature_size, 256, 1)
    )
    model.controller = nn.Conv3d(512, 153, 1)  # 8*8 + 8*8 + 8*1 weights and 8 + 8 + 1 biases of the dynamic head
    model.register_buffer("organ_embedding", torch.randn(classes, 512))
    model.text_to_vision = nn.Linear(512, 256)
    return model


def _research_ssl_head(feature_size: int, in_channels: int = 1, depths: tuple = V1_DEPTHS,
                       num_heads: tuple = V1_HEADS) -> nn.Module:  # fmt: skip
    """``SSLHead`` of research-contributions ``SwinUNETR/Pretrain/models/ssl_head.py`` (upsample "vae"), which
    BrainSegFounder's ``pretrain/models/ssl_head.py`` reuses with configurable channels, depths and heads."""
    dim = 16 * feature_size
    model = nn.Module()
    model.swinViT = SwinTransformer(
        in_chans=in_channels, embed_dim=feature_size, window_size=(7, 7, 7), patch_size=(2, 2, 2), depths=depths,
        num_heads=num_heads, mlp_ratio=4.0, qkv_bias=True, norm_layer=nn.LayerNorm, spatial_dims=3,
    )  # fmt: skip
    model.rotation_head = nn.Linear(dim, 4)
    model.contrastive_head = nn.Linear(dim, 512)
    widths = [dim, dim // 2, dim // 4, dim // 8, dim // 16, dim // 16]
    layers: list[nn.Module] = []
    for a, b in itertools.pairwise(widths):
        layers += [nn.Conv3d(a, b, 3, padding=1), nn.InstanceNorm3d(b), nn.LeakyReLU(), nn.Upsample(scale_factor=2)]
    model.conv = nn.Sequential(*layers, nn.Conv3d(dim // 16, in_channels, 1))
    return model


def _fc(key: str) -> str:
    return key.replace(".mlp.linear1.", ".mlp.fc1.").replace(".mlp.linear2.", ".mlp.fc2.")


def _autoencoder_key(key: str) -> str | None:
    """Where MONAI's disruptive autoencoder keeps a SwinUNETR encoder key: ``encoder.layersN.0.0.*``."""
    if not key.startswith("swinViT."):
        return None
    rest = key[len("swinViT.") :]
    if rest.startswith("patch_embed."):
        return "encoder." + rest
    layer, tail = rest.split(".0.", 1)
    return f"encoder.{layer}.0.0.{tail}"


# ------------------------------------------------------------------------------------------------------------
# the published files
# ------------------------------------------------------------------------------------------------------------


@dataclass
class Published:
    """A published checkpoint: the object its code saves, the flat state dict in it, where each key of the target
    SwinUNETR is in that state dict (a function returning a file key or None), the layout it must be detected as,
    and the arguments of the SwinUNETR it is finetuned in."""

    checkpoint: dict
    state: dict
    locate: Callable[[str], str | None]
    layout: str
    network: dict = field(default_factory=dict)

    def file_key(self, key: str) -> str | None:
        found = self.locate(key)
        return found if found in self.state else None


def _build(materialise: Callable[[dict], dict], make: Callable[[], nn.Module]) -> dict:
    if materialise is _constants:
        with parameters_on_meta():
            return materialise(make().state_dict())
    torch.manual_seed(0)
    return materialise(make().state_dict())


def _prefixed(prefix: str) -> Callable[[str], str]:
    return lambda key: prefix + key


def _release_key(key: str) -> str | None:
    return "module." + _fc(key[len("swinViT.") :]) if key.startswith("swinViT.") else None


def _published(name: str, fs: int, materialise: Callable[[dict], dict] = _constants) -> Published:
    """The file ``name`` at feature size ``fs``, as its publisher's code writes it."""
    if name == "model_swinvit":
        # the CVPR release model_swinvit.pt, read by research-contributions SwinUNETR/BTCV/main.py via load_from
        enc = {k: v for k, v in _build(materialise, lambda: _swinunetr(fs)).items() if k.startswith("swinViT.")}
        sd = {"module." + _fc(k[len("swinViT.") :]): v for k, v in enc.items()}
        sd["module.norm.weight"], sd["module.norm.bias"] = torch.randn(16 * fs), torch.randn(16 * fs)
        return Published({"state_dict": sd}, sd, _release_key, "model_swinvit", {"feature_size": fs})
    if name in ("ssl_original", "ssl_original_swin_vit"):
        # research-contributions SwinUNETR/Pretrain/main.py: save_ckp({"global_step", "state_dict", "optimizer"})
        # of the DDP-wrapped SSLHead; older versions spelled swin_vit
        old = name.endswith("swin_vit")

        def spelled(key: str) -> str:
            return "module." + (key.replace("swinViT.", "swin_vit.", 1) if old else key)

        sd = {spelled(k): v for k, v in _build(materialise, lambda: _research_ssl_head(fs)).items()}
        checkpoint = {"global_step": 450000, "state_dict": sd, "optimizer": {"state": {}, "param_groups": []}}
        return Published(checkpoint, sd, spelled, "ssl_original", {"feature_size": fs})
    if name == "ssl_original_one_gpu":
        # the same save_ckp without DDP (one GPU, research-contributions main.py without --distributed): no module.
        sd = _build(materialise, lambda: _research_ssl_head(fs))
        checkpoint = {"global_step": 3000, "state_dict": sd, "optimizer": {"state": {}, "param_groups": []}}
        return Published(checkpoint, sd, _prefixed(""), "ssl_original", {"feature_size": fs})
    if name.startswith("brainsegfounder"):
        # lab-smile/BrainSegFounder pretrain/main_T1T2.py (stage 1, T1+T2: 2 channels) and
        # downstream/BraTS/ssl/main_T1T2.py (stage 2, BraTS: 4 channels); --num_swin_block 6 and
        # --num_heads_first_stage 4 give depths (2, 2, 6, 2) and heads (4, 8, 16, 32)
        arch = {
            "brainsegfounder_stage1": {"in_channels": 2},
            "brainsegfounder_stage2": {"in_channels": 4},
            "brainsegfounder_deep": {"in_channels": 2, "depths": (2, 2, 6, 2), "num_heads": (4, 8, 16, 32)},
        }[name]
        sd = {"module." + k: v for k, v in _build(materialise, lambda: _research_ssl_head(fs, **arch)).items()}
        checkpoint = {"global_step": 5000, "epoch": 3, "state_dict": sd, "optimizer": {"state": {}}}
        return Published(checkpoint, sd, _prefixed("module."), "ssl_original", {"feature_size": fs, **arch})
    if name == "monai_ssl_autoencoder":
        # ssl_pretrained_weights.pth as Project-MONAI/tutorials swinunetr_pretrained/swinunetr_finetune.ipynb reads it
        net = _build(materialise, lambda: _swinunetr(fs))
        sd = {_autoencoder_key(k): v for k, v in net.items() if k.startswith("swinViT.")}
        sd.update({"encoder.mask_token": torch.randn(1, 1, fs), "encoder.norm.weight": torch.randn(16 * fs),
                   "encoder.norm.bias": torch.randn(16 * fs), "out.conv.conv.weight": torch.randn(1, fs, 1, 1, 1),
                   "out.conv.conv.bias": torch.randn(1)})  # fmt: skip
        return Published({"model": sd}, sd, _autoencoder_key, "monai_ssl_autoencoder", {"feature_size": fs})
    if name == "voco_ssl_head":
        # the released VoCo_B_SSL_head.pt / _L_ / _H_ (huggingface Luffy503/VoCo): the bare state dict of VoCo's Swin
        # backbone, which the downstream code loads with load_state_dict(strict=True)
        state = _build(materialise, lambda: _voco_swin(fs))
        return Published(dict(state), state, _prefixed(""), "voco", {"feature_size": fs, "use_v2": True})
    if name.startswith("voco"):
        # Large-Scale-Medical Self-supervised/voco_train.py: {"global_step", "state_dict"} of the DDP-wrapped VoCoHead
        # (model_current_epoch.pt) and final_model.pt = model.module.state_dict(); Omni-supervised/voco_train.py alike
        omni = name == "voco_omni"
        state = _build(materialise, lambda: _voco_head(fs, omni))
        network = {"feature_size": fs, "use_v2": True, "out_channels": 21}
        if name == "voco_final":
            return Published(dict(state), state, _prefixed("backbone."), "voco", network)
        sd = {"module." + k: v for k, v in state.items()}
        return Published({"global_step": 100000, "state_dict": sd}, sd, _prefixed("module.backbone."), "voco", network)
    if name == "suprem":
        # MrGiovanni/SuPreM supervised_pretraining/train.py: {"net": DDP(Universal_model).state_dict(), ...}
        sd = {"module." + k: v for k, v in _build(materialise, lambda: _universal_model(fs)).items()}
        checkpoint = {"net": sd, "optimizer": {"state": {}}, "scheduler": {"last_epoch": 2100}, "epoch": 2100}
        network = {"feature_size": fs, "out_channels": 25}
        return Published(checkpoint, sd, _prefixed("module.backbone."), "suprem", network)
    if name == "model_zoo":
        # Model Zoo swin_unetr_btcv_segmentation configs/train.json: CheckpointSaver {"model": network}, key metric
        sd = _build(materialise, lambda: _swinunetr(fs))
        return Published(dict(sd), sd, _prefixed(""), "swinunetr", {"feature_size": fs})
    if name == "ssl_collection":  # the SSL bundle's models/model.pt: CheckpointSaver {"model": SSLHead}
        sd = _build(materialise, lambda: SSLHead(feature_size=fs))
        return Published(dict(sd), sd, _prefixed(""), "ssl_collection", {"feature_size": fs})
    if name == "dino_collection":  # the self-distillation bundle's resumable checkpoint of its student
        sd = _build(materialise, lambda: SelfDistillationNetwork(feature_size=fs))
        return Published({"model": sd, "epoch": 1}, sd, _prefixed(""), "dino_collection", {"feature_size": fs})
    if name == "dino_export":  # the self-distillation bundle's models/model.pt: {"swinViT": teacher encoder}
        sd = {k: v for k, v in _build(materialise, lambda: SelfDistillationNetwork(feature_size=fs)).items()
              if k.startswith("swinViT.")}  # fmt: skip
        return Published(dict(sd), sd, _prefixed(""), "swinvit_encoder", {"feature_size": fs})
    raise KeyError(name)


PUBLISHED_SIZES = {
    "model_swinvit": (48,),
    "ssl_original": (48,),
    "ssl_original_swin_vit": (48,),
    "ssl_original_one_gpu": (48,),
    "brainsegfounder_stage1": (48,),
    "brainsegfounder_stage2": (48,),
    "brainsegfounder_deep": (48,),
    "monai_ssl_autoencoder": (48,),
    "voco_ssl": (48, 96, 192),
    "voco_ssl_head": (48, 96, 192),
    "voco_final": (48, 96, 192),
    "voco_omni": (48, 96, 192),
    "suprem": (48,),
    "model_zoo": (48,),
    "ssl_collection": (48,),
    "dino_collection": (48,),
    "dino_export": (48,),
}
MATRIX = [(name, fs) for name, sizes in PUBLISHED_SIZES.items() for fs in sizes]


@cache
def _meta_network(**network) -> SwinUNETR:
    """A SwinUNETR with its parameters on ``meta`` (cached: convert_state_dict only reads it)."""
    with parameters_on_meta():
        return _swinunetr(**network)


def _architecture(network: dict) -> SwinArchitecture:
    return SwinArchitecture(
        feature_size=network["feature_size"],
        use_v2=network.get("use_v2", False),
        window_size=7,
        depths=tuple(network.get("depths", V1_DEPTHS)),
        num_heads=tuple(network.get("num_heads", V1_HEADS)),
        patch_size=2,
        in_channels=network.get("in_channels", 1),
    )


# ------------------------------------------------------------------------------------------------------------
# every published layout, at every published size
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name, fs", MATRIX, ids=[f"{n}-{fs}" for n, fs in MATRIX])
def test_published_file_maps_every_encoder_tensor_onto_its_source(name, fs, tmp_path):
    published = _published(name, fs)
    path = tmp_path / f"{name}_{fs}.pt"
    torch.save(published.checkpoint, path)
    network = _meta_network(**published.network)
    target_keys = list(network.state_dict())

    state, report = convert_state_dict(path, network)

    assert report.layout == published.layout
    assert infer_architecture(path) == _architecture(published.network)
    located = {k: published.file_key(k) for k in target_keys if published.file_key(k) is not None}
    encoder = [k for k in target_keys if k.startswith("swinViT.")]
    assert set(encoder) <= set(located)  # the whole encoder is in the file ...
    assert report.loaded == list(located) and sorted(state) == sorted(located)  # ... and loads, with all else found
    for key, file_key in located.items():
        assert _same(state[key], published.state[file_key]), (key, file_key)
    assert report.encoder_loaded == encoder and report.encoder_missing == []
    assert report.missing == [k for k in target_keys if k not in located] == report.allowed_missing
    assert report.unknown == {} and report.shape_mismatched == {} and report.adapted == {}
    assert set(report.dropped) == set(published.state) - set(located.values())
    assert f"loaded {len(encoder)}/{len(encoder)} encoder tensors" in report.summary()


def test_published_files_hold_the_published_sizes():
    """The files built here have the parameter counts their publishers state: VoComni B / L / H (a whole SwinUNETR
    v2) 72M / 290M / 1.2B, the encoder of VoCo B's SSL head (swinViT + encoder1..4, encoder10) 53M, SuPreM's and
    the CVPR Swin UNETR (feature 48) 62.19M."""

    def millions(state: dict, keep=lambda k: True) -> float:
        return sum(v.numel() for k, v in state.items() if v.is_floating_point() and keep(k)) / 1e6

    omni = [millions(_published("voco_omni", fs).state, lambda k: ".backbone." in k) for fs in (48, 96, 192)]
    assert [int(m) for m in omni] == [72, 290, 1160]
    assert int(millions(_published("voco_ssl", 48).state, lambda k: ".backbone." in k)) == 53
    suprem = millions(_published("suprem", 48).state, lambda k: ".backbone." in k)
    assert round(suprem + millions(_published("model_zoo", 48).state, lambda k: k.startswith("out.")), 2) == 62.19


@pytest.mark.parametrize(
    "name", ["model_swinvit", "ssl_original_swin_vit", "ssl_original_one_gpu", "brainsegfounder_deep",
             "monai_ssl_autoencoder", "voco_ssl", "voco_ssl_head", "voco_final", "voco_omni", "suprem", "model_zoo",
             "ssl_collection", "dino_collection", "dino_export"],
)  # fmt: skip
def test_published_layout_loads_into_a_real_network(name, tmp_path, caplog):
    """At feature 12 with random values: load_pretrained writes every located tensor into the model and leaves the
    others as they were."""
    published = _published(name, 12, _random)
    path = tmp_path / f"{name}.pt"
    torch.save(published.checkpoint, path)
    torch.manual_seed(1)
    model = _swinunetr(**published.network)
    before = {k: v.clone() for k, v in model.state_dict().items()}

    with caplog.at_level(logging.INFO, logger="components.checkpoint"):
        report = load_pretrained(model, path)

    assert report.layout == published.layout
    after = model.state_dict()
    n_encoder = sum(k.startswith("swinViT.") for k in after)
    assert len(report.encoder_loaded) == n_encoder
    for key, value in after.items():
        file_key = published.file_key(key)
        expected = published.state[file_key] if file_key is not None else before[key]
        assert torch.equal(value, expected), key
    assert len(report.loaded) == sum(published.file_key(k) is not None for k in after)
    assert len(report.loaded) + len(report.dropped) == len(published.state)
    assert report.summary() in caplog.text


def test_backbone_and_module_prefixes_and_containers_are_reported():
    voco = _published("voco_ssl", 12, _random)
    report = load_pretrained(_swinunetr(12, use_v2=True), voco.checkpoint)
    assert report.container == "state_dict" and report.stripped_prefixes == ["backbone.", "module."]
    assert all("student / teacher" in reason for reason in report.dropped.values())
    assert len(report.dropped) == 12  # two heads x three layers x (weight, bias)
    suprem = _published("suprem", 12, _random)
    report = load_pretrained(_swinunetr(12, out_channels=25), suprem.checkpoint)
    assert report.container == "net" and report.layout == "suprem"
    assert set(report.dropped) == {k for k in suprem.state if not k.startswith("module.backbone.")}
    assert "out.conv.conv.weight" in report.missing  # SuPreM's Swin UNETR has no output layer
    # nnU-Net style container (read by Large-Scale-Medical's loader); swin_vit under backbone.
    zoo = _published("model_zoo", 12, _random)
    renamed = {"backbone." + k.replace("swinViT.", "swin_vit.", 1): v for k, v in zoo.state.items()}
    model = _swinunetr(12)
    report = load_pretrained(model, {"network_weights": renamed, "optimizer_state": {}})
    assert report.container == "network_weights" and report.stripped_prefixes == ["backbone."]
    assert report.missing == [] and torch.equal(model.swinViT.layers4[0].downsample.norm.bias, zoo.state[
        "swinViT.layers4.0.downsample.norm.bias"])  # fmt: skip


def test_released_voco_ssl_head_is_voco_and_a_swinunetr_takes_its_encoder_blocks(tmp_path):
    """VoCo_B_SSL_head.pt as released: the bare state dict of VoCo's Swin backbone (it loads strictly into that
    backbone). It is layout voco; a SwinUNETR takes swinViT.* and encoder1..4 / encoder10 from it, as from a full
    SwinUNETR file, and reports its decoder and output layer missing; an SSLHead takes the encoder and reports the
    encoder blocks dropped."""
    voco = _published("voco_ssl_head", 12, _random)
    path = tmp_path / "VoCo_B_SSL_head.pt"
    torch.save(voco.checkpoint, path)
    assert {k.split(".")[0] for k in voco.state} == {"swinViT", "encoder1", "encoder2", "encoder3", "encoder4",
                                                     "encoder10"}  # fmt: skip
    assert any(k.startswith("swinViT.layers4c.") for k in voco.state)
    _voco_swin(12).load_state_dict(torch.load(path, weights_only=True), strict=True)

    model = _swinunetr(12, use_v2=True)
    report = load_pretrained(model, path)
    assert (report.layout, report.container, report.stripped_prefixes) == ("voco", "", [])
    assert sorted(report.loaded) == sorted(voco.state) and report.unexpected == {}
    assert "encoder10.layer.conv1.conv.weight" in report.loaded and "encoder1.layer.conv3.conv.weight" in report.loaded
    head = [k for k in model.state_dict() if k.startswith(("decoder", "out."))]
    assert report.missing == head == report.allowed_missing
    assert all(torch.equal(model.state_dict()[k], v) for k, v in voco.state.items())

    ssl = SSLHead(feature_size=12, use_v2=True)
    report = load_pretrained(ssl, path)
    assert report.layout == "voco" and report.loaded == [k for k in ssl.state_dict() if k.startswith("swinViT.")]
    assert sorted(report.dropped) == sorted(k for k in voco.state if not k.startswith("swinViT."))
    assert report.unknown == {}


def test_original_ssl_code_on_one_gpu_is_ssl_original_and_our_files_stay_ssl_collection(tmp_path):
    """The original SSL code trained without DDP writes {"global_step" | "epoch", "state_dict", "optimizer"} with no
    module. prefix: layout ssl_original. This collection's SSL files (the bare state dict of models/model.pt, the
    resumable {"model": ...}) stay ssl_collection."""
    one_gpu = _published("ssl_original_one_gpu", 12, _random)
    ssl = SSLHead(feature_size=12)
    report = load_pretrained(ssl, one_gpu.checkpoint)
    assert (report.layout, report.container, report.stripped_prefixes) == ("ssl_original", "state_dict", [])
    assert report.loaded == list(ssl.state_dict()) == list(one_gpu.state) and report.missing == []
    assert all(torch.equal(ssl.state_dict()[k], v) for k, v in one_gpu.state.items())
    by_epoch = {"epoch": 12, "state_dict": one_gpu.state, "optimizer": {"state": {}}}
    assert convert_state_dict(by_epoch, SSLHead(feature_size=12))[1].layout == "ssl_original"

    resumable = ResumableCheckpointSaver(tmp_path / "resume", {"model": ssl, "optimizer": torch.optim.SGD(ssl.parameters(), lr=0.1)})
    resumable.save(Engine(lambda e, b: None))
    final = CheckpointSaver(str(tmp_path / "final"), {"model": ssl}, save_final=True, final_filename="model.pt")
    engine = Engine(lambda e, b: None)
    final.attach(engine)
    engine.run([0], max_epochs=1)
    for path, container in ((resumable.path, "model"), (tmp_path / "final" / "model.pt", "")):
        report = convert_state_dict(path, SSLHead(feature_size=12))[1]
        loaded = (report.layout, report.container, len(report.loaded))
        assert loaded == ("ssl_collection", container, len(one_gpu.state))


def test_model_zoo_swinunetr_into_other_classes_reinitialises_the_output_layer(tmp_path, caplog):
    zoo = _published("model_zoo", 48)
    path = tmp_path / "model.pt"
    torch.save(zoo.checkpoint, path)
    _, report = convert_state_dict(path, _meta_network(feature_size=48, out_channels=3))
    assert report.shape_mismatched == {
        "out.conv.conv.weight": ((14, 48, 1, 1, 1), (3, 48, 1, 1, 1)),
        "out.conv.conv.bias": ((14,), (3,)),
    }
    assert report.missing == ["out.conv.conv.weight", "out.conv.conv.bias"] == report.allowed_missing
    assert len(report.loaded) == len(zoo.state) - 2 and report.unexpected == {}
    assert "shape mismatched, the model's initialisation kept (2)" in report.details()
    # the same at feature 12 with real tensors: decoder and encoder from the file, the output layer as initialised
    zoo = _published("model_zoo", 12, _random)
    model = _swinunetr(12, out_channels=3)
    out_before = model.out.conv.conv.weight.clone()
    with caplog.at_level(logging.WARNING, logger="components.checkpoint"):
        report = load_pretrained(model, zoo.checkpoint)
    assert torch.equal(model.out.conv.conv.weight, out_before)
    key = "decoder1.conv_block.conv1.conv.weight"
    assert torch.equal(model.state_dict()[key], zoo.state[key])
    assert "2 tensors not loaded for their shape, the model keeps its own initialisation" in caplog.text
    assert report.summary().endswith("2 shape-mismatched, 0 adapted")


def test_our_exports_through_the_bundles_savers(tmp_path):
    """The self-distillation bundle writes its student with ResumableCheckpointSaver and its teacher encoder with
    MONAI's CheckpointSaver (one object: a bare state dict); both load into a SwinUNETR, the DINO head dropped."""
    torch.manual_seed(0)
    student = SelfDistillationNetwork(feature_size=12, out_dim=64, hidden_dim=32, bottleneck_dim=16)
    resumable = ResumableCheckpointSaver(tmp_path / "resume", {"model": student,
                                                                    "optimizer": torch.optim.SGD(student.parameters(), lr=0.1)})
    resumable.save(Engine(lambda e, b: None))
    final = CheckpointSaver(str(tmp_path / "final"), {"model": nn.ModuleDict({"swinViT": student.swinViT})},
                            save_final=True, final_filename="model.pt")  # fmt: skip
    engine = Engine(lambda e, b: None)
    final.attach(engine)
    engine.run([0], max_epochs=1)
    exports = [(resumable.path, "dino_collection", 8), (tmp_path / "final" / "model.pt", "swinvit_encoder", 0)]
    for path, layout, dropped in exports:
        model = _swinunetr(12)
        report = load_pretrained(model, path)
        assert (report.layout, len(report.dropped), report.unknown) == (layout, dropped, {})
        assert all("self-distillation projection head" in r for r in report.dropped.values())
        for key, value in student.state_dict().items():
            if key.startswith("swinViT."):
                assert torch.equal(model.state_dict()[key], value), key


def test_detect_layout_names_the_new_layouts():
    enc = ["swinViT.patch_embed.proj.weight", "swinViT.layers1c.0.layer.conv1.conv.weight"]
    assert detect_layout(enc + ["encoder1.layer.conv1.conv.weight", "student.layer1.0.weight"]) == "voco"
    assert detect_layout(enc + ["decoder1.transp_conv.conv.weight", "GAP.3.weight", "organ_embedding"]) == "suprem"
    assert detect_layout(enc + ["head.mlp.0.weight"]) == "dino_collection"
    assert detect_layout(["swin_vit.patch_embed.proj.weight", "teacher.layer3.0.bias"]) == "voco"
    assert detect_layout(["patch_embed.proj.weight", "layers1c.0.layer.conv1.conv.weight"]) == "model_swinvit"
    assert detect_layout(enc + ["out.conv.conv.weight"]) == "swinunetr"
    assert detect_layout(enc + ["encoder10.layer.conv1.conv.weight"]) == "voco"  # VoCo_*_SSL_head.pt
    assert detect_layout(enc + ["encoder10.layer.conv1.conv.weight", "decoder1.transp_conv.conv.weight"]) == "swinunetr"
    ssl = ["swinViT.patch_embed.proj.weight", "rotation_head.weight"]
    assert (detect_layout(ssl), detect_layout(ssl, training_progress=True)) == ("ssl_collection", "ssl_original")


def test_unknown_layout_shows_the_first_keys_and_the_layouts_known():
    state = {f"stages.{i}.conv.weight": torch.zeros(1) for i in range(9)}
    with pytest.raises(CheckpointLoadError) as err:
        load_pretrained(_swinunetr(12), {"state_dict": state})
    msg = str(err.value)
    assert "unknown layout" in msg and "'stages.5.conv.weight'" in msg and "'stages.6.conv.weight'" not in msg
    assert "9 keys in all" in msg and all(layout in msg for layout in LAYOUTS)
    with pytest.raises(CheckpointLoadError, match="unknown layout"):
        infer_architecture(state)


# ------------------------------------------------------------------------------------------------------------
# the architecture from the tensors
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("use_v2", [False, True], ids=["v1", "v2"])
@pytest.mark.parametrize("fs", [48, 96, 192])
def test_architecture_is_read_from_the_shapes(fs, use_v2):
    found = infer_architecture(_meta_network(feature_size=fs, use_v2=use_v2).state_dict())
    assert found == SwinArchitecture(fs, use_v2, 7, V1_DEPTHS, V1_HEADS, 2, 1)


@pytest.mark.parametrize(
    "network, expected",
    [
        ({"window_size": 5}, {"window_size": 5}),
        ({"window_size": 4, "in_channels": 4}, {"window_size": 4, "in_channels": 4}),
        ({"depths": (2, 2, 6, 2), "num_heads": (4, 8, 16, 32)}, {"depths": (2, 2, 6, 2), "num_heads": (4, 8, 16, 32)}),
        ({"in_channels": 4, "use_v2": True}, {"in_channels": 4, "use_v2": True}),
    ],
)
def test_window_channels_depths_and_heads_are_read_from_the_shapes(network, expected):
    found = infer_architecture(_meta_network(feature_size=24, **network).state_dict())
    assert found == SwinArchitecture(**{**_architecture({"feature_size": 24}).as_dict(), **expected})


def test_architecture_of_every_published_layout_and_of_a_truncated_encoder():
    release = _published("model_swinvit", 48).checkpoint  # bare MONAI SwinTransformer keys, fc1/fc2
    assert infer_architecture(release) == _architecture({"feature_size": 48})
    truncated = {k: v for k, v in release["state_dict"].items() if not k.startswith("module.layers4")}
    found = infer_architecture(truncated)
    assert (found.feature_size, found.window_size, found.depths, found.num_heads) == (48, 7, None, None)
    no_embedding = {k: v for k, v in release["state_dict"].items() if "patch_embed" not in k}
    assert infer_architecture(no_embedding).feature_size == 48  # from the first block's norm
    assert infer_architecture(no_embedding).in_channels is None
    with pytest.raises(CheckpointLoadError, match="no Swin ViT patch embedding"):
        infer_architecture({"swinViT.layers2.0.blocks.0.norm1.weight": torch.zeros(96)})


@pytest.mark.parametrize("zip_format", [True, False], ids=["zip", "legacy"])
def test_architecture_of_a_file_is_read_memory_mapped(tmp_path, monkeypatch, zip_format):
    """Only the shapes are read, so a multi-GB encoder's data is read once, by the loader, not twice."""
    path = tmp_path / "release.pt"
    torch.save(_published("model_swinvit", 48).checkpoint, path, _use_new_zipfile_serialization=zip_format)
    mmap_flags = []
    load = torch.load

    def recording_load(*args, **kwargs):
        mmap_flags.append(kwargs.get("mmap", False))
        return load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", recording_load)
    assert infer_architecture(path) == _architecture({"feature_size": 48})
    assert mmap_flags == [zip_format]  # a legacy-format file cannot be mapped and is read whole


def test_mismatch_is_one_line_naming_each_difference_and_the_overrides():
    found = _architecture({"feature_size": 96, "use_v2": True, "depths": (2, 2, 6, 2), "in_channels": 1})
    configured = {"feature_size": "48", "use_v2": "false", "window_size": [7, 7, 7], "depths": [2, 2, 2, 2],
                  "num_heads": [3, 6, 12, 24], "in_channels": 4}  # fmt: skip
    with pytest.raises(ValueError) as err:
        check_architecture(found, configured, "VoCo_L.pt")
    assert str(err.value) == (
        "checkpoint VoCo_L.pt was trained with another network: feature_size=96 in the checkpoint, 48 in the network; "
        "use_v2=true in the checkpoint, false in the network; depths=[2,2,6,2] in the checkpoint, [2,2,2,2] in the "
        "network; in_channels=1 in the checkpoint, 4 in the network. Run with --feature_size 96 --network_def#use_v2 true "
        "--network_def#depths [2,2,6,2] --in_channels 1."
    )
    assert isinstance(err.value, CheckpointLoadError) and "\n" not in str(err.value)
    with pytest.raises(CheckpointLoadError, match=r"--network_def#use_v2 true"):
        check_architecture(found, {"use_v2": False}, override_ids={"use_v2": "network_def#use_v2"})
    check_architecture(found, {"feature_size": 96, "window_size": 7, "use_v2": "true"})  # matches: no error
    with pytest.raises(ValueError, match=r"unknown architecture field\(s\) \['embed_dim'\]"):
        check_architecture(found, {"embed_dim": 96})
    assert set(OVERRIDE_IDS) == set(found.as_dict())


WRONG_NETWORK = {48: {"feature_size": 48}, 96: {"feature_size": 48}, 192: {"feature_size": 96, "use_v2": True}}
OVERRIDES = {48: "--network_def#use_v2 true.", 96: "--feature_size 96 --network_def#use_v2 true.", 192: "--feature_size 192."}


@pytest.mark.parametrize("fs", [48, 96, 192])
def test_voco_into_a_network_of_another_size_or_v1_fails_with_the_overrides(fs, tmp_path):
    path = tmp_path / f"VoCo_{fs}_SSL_head.pt"
    torch.save(_published("voco_ssl", fs).checkpoint, path)
    with pytest.raises(CheckpointLoadError) as err:
        convert_state_dict(path, _meta_network(**WRONG_NETWORK[fs], out_channels=21))
    msg = str(err.value)
    assert msg.startswith(f"checkpoint {path} was trained with another network: ") and "\n" not in msg
    assert f"Run with {OVERRIDES[fs]}" in msg
    # the bundles' loader fails the same way when the trainer starts
    trainer = Engine(lambda e, b: None)
    PretrainedLoader(path, _meta_network(**WRONG_NETWORK[fs], out_channels=21)).attach(trainer)
    with pytest.raises(CheckpointLoadError, match=f"Run with {OVERRIDES[fs]}"):
        trainer.run([0], max_epochs=1)


@pytest.mark.parametrize("fs", [48, 96, 192])
def test_pretrained_arch_auto_adopts_the_checkpoints_architecture(fs, tmp_path, caplog):
    path = tmp_path / f"VoComni_{fs}.pt"
    torch.save(_published("voco_omni", fs).checkpoint, path)
    configured = {"feature_size": 48, "use_v2": "false", "window_size": 7, "in_channels": 4}
    overrides = "--network_def#use_v2 true." if fs == 48 else f"--feature_size {fs} --network_def#use_v2 true."
    with pytest.raises(CheckpointLoadError, match=f"Run with {overrides}"):
        adopt_architecture(path, configured)  # pretrained_arch="config": the configured network must fit

    with caplog.at_level(logging.INFO, logger="components.checkpoint"):
        adopted = adopt_architecture(path, configured, "auto")

    assert adopted == {"feature_size": fs, "use_v2": True, "window_size": 7, "in_channels": 4, "depths": V1_DEPTHS,
                       "num_heads": V1_HEADS, "patch_size": 2}  # fmt: skip
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    changed = [f"feature_size={fs}"] * (fs != 48) + ["use_v2=true"]
    assert warnings == [f"pretrained_arch='auto': {value} from the checkpoint {path} instead of the configured {was}"
                        for value, was in zip(changed, ["48", "false"][-len(changed):])]  # fmt: skip
    assert (
        f"pretrained_arch='auto': the network takes the architecture of the checkpoint {path}: feature_size={fs}, "
        "use_v2=true, window_size=7, depths=[2,2,2,2], num_heads=[3,6,12,24], patch_size=2\n"
    ) in caplog.text
    # the network built from the adopted values takes every tensor (4 channels: the patch embedding is repeated)
    network = {k: v for k, v in adopted.items() if k != "patch_size"}
    _, report = convert_state_dict(path, _meta_network(**network, out_channels=21), channel_policy="skip")
    assert report.encoder_missing == ["swinViT.patch_embed.proj.weight"] and report.shape_mismatched == {
        "encoder1.layer.conv1.conv.weight": ((fs, 1, 3, 3, 3), (fs, 4, 3, 3, 3)),
        "encoder1.layer.conv3.conv.weight": ((fs, 1, 1, 1, 1), (fs, 4, 1, 1, 1)),
    }  # fmt: skip


@pytest.mark.parametrize("fs", [48, 96, 192])
def test_build_for_weights_fails_on_another_network_or_builds_the_checkpoints(fs, tmp_path):
    """The bundles' network_def: a feature-48 v1 config fails on VoCo's v2 encoder of each size with the overrides
    ("config"), or builds the checkpoint's network ("auto"), for SwinUNETR and for SSLHead."""
    path = tmp_path / f"VoCo_{fs}.pt"
    torch.save(_published("voco_ssl", fs).checkpoint, path)
    overrides = "--network_def#use_v2 true." if fs == 48 else f"--feature_size {fs} --network_def#use_v2 true."
    config = {"in_channels": 1, "out_channels": 14, "feature_size": 48, "use_v2": False}
    with parameters_on_meta():
        with pytest.raises(CheckpointLoadError, match=f"Run with {overrides}"):
            build_for_weights(SwinUNETR, path, **config)
        networks = {"swinunetr": build_for_weights(SwinUNETR, path, "auto", **config),
                    "sslhead": build_for_weights(SSLHead, path, "auto", feature_size=48)}  # fmt: skip
    for network in networks.values():
        assert network.swinViT.patch_embed.proj.weight.shape == (fs, 1, 2, 2, 2)
        assert hasattr(network.swinViT, "layers4c")  # v2
    _, report = convert_state_dict(path, networks["swinunetr"])
    assert report.encoder_missing == [] and report.shape_mismatched == {}


DEEP = {"depths": (2, 2, 6, 2), "num_heads": (4, 8, 16, 32)}
DEEP_NETWORKS = {
    "SSLHead": (SSLHead, {}),
    "SelfDistillationNetwork": (SelfDistillationNetwork, {"out_dim": 32, "hidden_dim": 32, "bottleneck_dim": 16}),
    "SwinUNETR": (SwinUNETR, {"out_channels": 3}),
}


@pytest.mark.parametrize("name", list(DEEP_NETWORKS))
def test_build_for_weights_takes_brainsegfounders_depths_and_heads(name, tmp_path):
    """BrainSegFounder's deeper encoder (2 channels, depths (2, 2, 6, 2), heads (4, 8, 16, 32)) into each network:
    "config" fails when the network is built, with the overrides; the network built with those overrides, or with
    "auto", takes every encoder tensor of the file."""
    deep = _published("brainsegfounder_deep", 12, _random)
    path = tmp_path / "brainsegfounder_deep.pt"
    torch.save(deep.checkpoint, path)
    network, extra = DEEP_NETWORKS[name]
    config = {"in_channels": 2, "feature_size": 12, **extra}
    with pytest.raises(CheckpointLoadError) as err:
        build_for_weights(network, path, **config)
    assert str(err.value) == (
        f"checkpoint {path} was trained with another network: depths=[2,2,6,2] in the checkpoint, [2,2,2,2] in the "
        "network; num_heads=[4,8,16,32] in the checkpoint, [3,6,12,24] in the network. Run with --network_def#depths "
        "[2,2,6,2] --network_def#num_heads [4,8,16,32]."
    )
    built = {"config": build_for_weights(network, path, **config, depths=[2, 2, 6, 2], num_heads=[4, 8, 16, 32]),
             "auto": build_for_weights(network, path, "auto", **config)}  # fmt: skip
    for model in built.values():
        report = load_pretrained(model, path)
        encoder = [k for k in model.state_dict() if k.startswith("swinViT.")]
        assert report.layout == "ssl_original" and report.encoder_loaded == encoder and report.encoder_missing == []
        assert "swinViT.layers3.0.blocks.5.mlp.linear2.weight" in encoder
        assert all(torch.equal(model.state_dict()[k], deep.state["module." + k]) for k in encoder)


def _fixed_encoder(in_channels: int = 1, feature_size: int = 48, use_v2: bool = False) -> nn.Module:
    """A network that takes no depths, heads or window: it always builds (2, 2, 2, 2), (3, 6, 12, 24), window 7."""
    network = nn.Module()
    network.swinViT = _swinunetr(feature_size, use_v2, in_channels).swinViT
    return network


@pytest.mark.parametrize("arch", ["config", "auto"])
def test_build_for_weights_names_an_architecture_value_the_network_cannot_take(arch, tmp_path):
    """Nothing is dropped silently: a checkpoint whose depths and heads a network class has no argument for fails
    when it is built, naming each value and the class; a checkpoint the class builds as is passes."""
    path = tmp_path / "brainsegfounder_deep.pt"
    torch.save(_published("brainsegfounder_deep", 12, _random).checkpoint, path)
    with pytest.raises(CheckpointLoadError) as err:
        build_for_weights(_fixed_encoder, path, arch, in_channels=2, feature_size=12)
    assert str(err.value) == (
        f"checkpoint {path} needs depths=[2,2,6,2], which _fixed_encoder cannot take (it has no 'depths' argument "
        "and builds [2,2,2,2]); num_heads=[4,8,16,32], which _fixed_encoder cannot take (it has no 'num_heads' "
        "argument and builds [3,6,12,24])."
    )
    plain = tmp_path / "ssl_original.pt"
    torch.save(_published("ssl_original", 12, _random).checkpoint, plain)
    assert build_for_weights(_fixed_encoder, plain, arch, feature_size=12).swinViT.embed_dim == 12


def test_build_for_weights_without_weights_is_the_plain_network():
    torch.manual_seed(0)
    expected = SwinUNETR(in_channels=1, out_channels=3, feature_size=12).state_dict()
    for none in (None, "null"):
        torch.manual_seed(0)
        built = build_for_weights(SwinUNETR, none, "auto", in_channels=1, out_channels=3, feature_size=12).state_dict()
        assert built.keys() == expected.keys() and all(torch.equal(built[k], expected[k]) for k in expected)


def test_adopt_architecture_without_a_checkpoint_or_when_it_fits(tmp_path, caplog):
    configured = {"feature_size": 48, "use_v2": False}
    for none in (None, "", "null", "None"):
        assert adopt_architecture(none, configured, "auto") == configured
    with pytest.raises(ValueError, match=r"pretrained_arch must be one of \['config', 'auto'\], got 'yes'"):
        adopt_architecture(None, configured, "yes")
    path = tmp_path / "model.pt"
    torch.save(_published("model_zoo", 48).checkpoint, path)
    assert adopt_architecture(path, configured) == configured
    with caplog.at_level(logging.INFO, logger="components.checkpoint"):
        assert adopt_architecture(path, configured, "auto")["depths"] == V1_DEPTHS
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
