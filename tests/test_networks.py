"""Tests of components.recipes.inpainting_contrast.network.SSLHead: layout, parameter counts, shapes, input checks, gradients;
and of the encoder's arguments written once (components.networks.swin.SwinViTSettings, which every network builds its
encoder from), the SwinUNETR v2 encoder (``use_v2``) in it, SSLHead, the self-distillation networks and
components.release.conversion.convert_checkpoint.

CPU budget: forward passes use feature_size 12 and the smallest valid ROIs (64^3, or 32x32x64 which gives
the minimum of 2 final tokens; 64x32x32 at window 4 for v2); parameter counts at feature_size 48 need no forward pass.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch
from monai.networks.nets import SwinUNETR
from torch import nn

from components.__main__ import main
from components.checkpoint import CheckpointLoadError, infer_architecture
from components.release.conversion import convert_checkpoint
from components.checkpoint.architecture import build_for_weights
from components.networks.probe import LinearProbe
from components.networks.swin import SwinViTSettings, check_roi_size, network_parameters
from components.recipes.inpainting_contrast.network import SSLHead
from components.recipes.masked_image.network import MaskedImageModel
from components.recipes.self_distillation import SelfDistillationNetwork, SwinViTEmbedding

DECODERS = ("vae", "deconv", "large_kernel_deconv")
SMALL_3D = (32, 32, 64)  # anisotropic, the smallest 3D ROI with 2 final tokens


@pytest.fixture(autouse=True, scope="module")
def _one_cpu_thread():
    """Small CPU tensors on a shared 2-core box: one intra-op thread is 2-3x faster than two threads that
    compete with other processes (measured: ~23 s against ~80 s for this file). Restored afterwards."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def n_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def weighted_loss(outputs, seed: int = 0) -> torch.Tensor:
    """A scalar that depends on every output element with fixed random weights."""
    g = torch.Generator().manual_seed(seed)
    return sum((o * torch.randn(o.shape, generator=g)).sum() for o in outputs)


# ---------------------------------------------------------------- layout


def test_attribute_names_and_key_prefixes():
    net = SSLHead(feature_size=12)
    assert isinstance(net.swinViT, nn.Module)
    assert isinstance(net.rotation_head, nn.Linear)
    assert isinstance(net.contrastive_head, nn.Linear)
    assert isinstance(net.conv, nn.Sequential)
    prefixes = {k.split(".")[0] for k in net.state_dict()}
    assert prefixes == {"swinViT", "rotation_head", "contrastive_head", "conv"}
    assert net.rotation_head.in_features == 16 * 12 and net.rotation_head.out_features == 4
    assert net.contrastive_head.in_features == 16 * 12 and net.contrastive_head.out_features == 512


def test_window_size_sets_the_encoder_window_and_loads_into_swinunetr():
    net = SSLHead(feature_size=12, window_size=4)
    tables = [v for k, v in net.state_dict().items() if k.endswith("relative_position_bias_table")]
    assert len(tables) == 8 and all(t.shape[0] == (2 * 4 - 1) ** 3 for t in tables)
    target = SwinUNETR(in_channels=1, out_channels=2, feature_size=12, window_size=4).swinViT
    target.load_state_dict(net.swinViT.state_dict(), strict=True)
    assert net(torch.randn(1, 1, 64, 32, 32))[2].shape == (1, 1, 64, 32, 32)


def test_vae_decoder_keys_and_layers():
    net = SSLHead(in_channels=1, feature_size=48)
    conv_keys = [k for k in net.state_dict() if k.startswith("conv.")]
    expected = [f"conv.{i}.{p}" for i in (0, 4, 8, 12, 16, 20) for p in ("weight", "bias")]
    assert conv_keys == expected
    shapes = {k: tuple(net.state_dict()[k].shape) for k in expected if k.endswith("weight")}
    assert shapes == {
        "conv.0.weight": (384, 768, 3, 3, 3),
        "conv.4.weight": (192, 384, 3, 3, 3),
        "conv.8.weight": (96, 192, 3, 3, 3),
        "conv.12.weight": (48, 96, 3, 3, 3),
        "conv.16.weight": (48, 48, 3, 3, 3),
        "conv.20.weight": (1, 48, 1, 1, 1),
    }
    for i in (1, 5, 9, 13, 17):
        assert isinstance(net.conv[i], nn.InstanceNorm3d) and not net.conv[i].affine
        assert isinstance(net.conv[i + 1], nn.LeakyReLU)
        assert isinstance(net.conv[i + 2], nn.Upsample) and net.conv[i + 2].mode == "trilinear"
    assert len(net.conv) == 21


def test_deconv_and_large_kernel_keys():
    deconv = SSLHead(in_channels=2, feature_size=12, upsample="deconv")
    keys = [k for k in deconv.state_dict() if k.startswith("conv.")]
    assert keys == [f"conv.{i}.{p}" for i in range(5) for p in ("weight", "bias")]
    assert all(isinstance(m, nn.ConvTranspose3d) for m in deconv.conv)
    assert deconv.conv[4].out_channels == 2
    lk = SSLHead(feature_size=12, upsample="large_kernel_deconv")
    assert isinstance(lk.conv, nn.ConvTranspose3d)
    assert lk.conv.kernel_size == (32, 32, 32) and lk.conv.stride == (32, 32, 32)
    assert [k for k in lk.state_dict() if k.startswith("conv.")] == ["conv.weight", "conv.bias"]


def test_encoder_state_dict_loads_into_swinunetr():
    """The point of the attribute names: swinViT weights move to SwinUNETR unchanged (strict load)."""
    net = SSLHead(in_channels=1, feature_size=12)
    seg = SwinUNETR(in_channels=1, out_channels=3, feature_size=12)
    result = seg.swinViT.load_state_dict(net.swinViT.state_dict(), strict=True)
    assert not result.missing_keys and not result.unexpected_keys


# ---------------------------------------------------------------- parameter counts (recipe.md s1)


def test_parameter_counts_feature_48():
    f, dim = 48, 16 * 48
    vae = SSLHead(in_channels=1, feature_size=f, upsample="vae")
    encoder = n_params(vae.swinViT)
    heads = n_params(vae.rotation_head) + n_params(vae.contrastive_head)
    assert encoder == 8_062_002
    assert round(encoder / 1e6, 2) == 8.06
    assert heads == (dim * 4 + 4) + (dim * 512 + 512) == 396_804

    widths = [dim, dim // 2, dim // 4, dim // 8, f, f]
    vae_dec = sum(ci * co * 27 + co for ci, co in zip(widths[:-1], widths[1:])) + (f * 1 + 1)
    assert n_params(vae.conv) == vae_dec == 10_638_385
    assert n_params(vae) == 19_097_191
    assert round(n_params(vae) / 1e6, 2) == 19.10

    deconv = SSLHead(in_channels=1, feature_size=f, upsample="deconv")
    widths = [dim, dim // 2, dim // 4, dim // 8, f, 1]
    deconv_dec = sum(ci * co * 8 + co for ci, co in zip(widths[:-1], widths[1:]))
    assert n_params(deconv.conv) == deconv_dec == 3_134_545
    assert n_params(deconv) == 11_593_351

    lk = SSLHead(in_channels=1, feature_size=f, upsample="large_kernel_deconv")
    assert n_params(lk.conv) == dim * 1 * 32**3 + 1 == 25_165_825
    assert n_params(lk) == 33_624_631


# ---------------------------------------------------------------- forward shapes


def _check_outputs(outputs, batch: int, in_channels: int, spatial: tuple[int, ...]):
    assert isinstance(outputs, tuple) and len(outputs) == 3
    rot, contrastive, rec = outputs
    assert rot.shape == (batch, 4)
    assert contrastive.shape == (batch, 512)
    assert rec.shape == (batch, in_channels, *spatial)
    assert all(torch.isfinite(o).all() for o in outputs)


@pytest.mark.parametrize("upsample", DECODERS)
def test_forward_3d_64_cubed_batch_2(upsample):
    torch.manual_seed(0)
    net = SSLHead(in_channels=1, feature_size=12, upsample=upsample)
    x = torch.rand(2, 1, 64, 64, 64)
    with torch.no_grad():
        outputs = net(x)
    _check_outputs(outputs, 2, 1, (64, 64, 64))
    assert outputs[2].shape == x.shape


def test_forward_3d_anisotropic_two_channels():
    """The smallest valid 3D ROI (2 final tokens), non-cubic, with 2 input channels."""
    torch.manual_seed(0)
    net = SSLHead(in_channels=2, feature_size=12, upsample="deconv")
    with torch.no_grad():
        outputs = net(torch.rand(1, 2, *SMALL_3D))
    _check_outputs(outputs, 1, 2, SMALL_3D)


@pytest.mark.parametrize("upsample", DECODERS)
def test_forward_2d_all_decoders(upsample):
    torch.manual_seed(0)
    net = SSLHead(in_channels=1, feature_size=12, spatial_dims=2, upsample=upsample)
    if upsample == "vae":
        assert isinstance(net.conv[0], nn.Conv2d) and net.conv[3].mode == "bilinear"
    x = torch.rand(2, 1, 64, 64)
    with torch.no_grad():
        outputs = net(x)
    _check_outputs(outputs, 2, 1, (64, 64))
    assert outputs[2].shape == x.shape


# ---------------------------------------------------------------- input checks (before the encoder runs)


@pytest.fixture
def net_no_encoder(monkeypatch):
    """A small model whose encoder raises if called: proves the input checks run first."""
    net = SSLHead(in_channels=1, feature_size=12)

    def _boom(*args, **kwargs):
        raise AssertionError("the encoder ran before the input was validated")

    monkeypatch.setattr(net.swinViT, "forward", _boom)
    return net


def test_roi_32_cubed_one_token(net_no_encoder):
    with pytest.raises(ValueError) as err:
        net_no_encoder(torch.zeros(1, 1, 32, 32, 32))
    msg = str(err.value)
    assert "token" in msg and "(32, 32, 32)" in msg and "1 token" in msg and "(64, 64, 64)" in msg


def test_roi_not_divisible_by_32(net_no_encoder):
    with pytest.raises(ValueError) as err:
        net_no_encoder(torch.zeros(1, 1, 80, 80, 80))
    msg = str(err.value)
    assert "divisible by 32" in msg and "(80, 80, 80)" in msg and "reconstruction" in msg
    assert "(64, 64, 64)" in msg and "(96, 96, 96)" in msg
    with pytest.raises(ValueError, match=r"dim 2 = 70"):
        net_no_encoder(torch.zeros(1, 1, 64, 64, 70))


def test_wrong_dims_and_channels(net_no_encoder):
    with pytest.raises(ValueError, match=r"5-dimensional.*got 4"):
        net_no_encoder(torch.zeros(1, 64, 64, 64))
    with pytest.raises(ValueError, match=r"in_channels=1.*got 2"):
        net_no_encoder(torch.zeros(1, 2, 64, 64, 64))


def test_check_roi_size():
    assert check_roi_size((96, 96, 96)) == 27
    assert check_roi_size((64, 64, 64), spatial_dims=3) == 8
    assert check_roi_size((32, 64)) == 2
    with pytest.raises(ValueError, match="1 token"):
        check_roi_size((32, 32))
    with pytest.raises(ValueError, match="2 dimensions"):
        check_roi_size((64, 64, 64), spatial_dims=2)
    with pytest.raises(ValueError, match=r"Nearest valid size: \(32, 64, 64\)"):
        check_roi_size((16, 64, 64))


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"upsample": "bilinear"}, "'bilinear'"),
        ({"upsample": "VAE"}, "'VAE'"),
        ({"spatial_dims": 1}, "spatial_dims must be 2 or 3, got 1"),
        ({"spatial_dims": 4}, "got 4"),
        ({"in_channels": 0}, "in_channels must be >= 1, got 0"),
        ({"in_channels": 1.5}, "in_channels must be an integer"),
        ({"feature_size": 40}, "multiple of 12, got 40"),
        ({"feature_size": 0}, "feature_size must be >= 1, got 0"),
        ({"dropout_path_rate": 1.5}, "dropout_path_rate must be in [0, 1], got 1.5"),
        ({"window_size": 1}, "window_size must be >= 2, got 1"),
    ],
)
def test_bad_constructor_arguments(kwargs, fragment):
    with pytest.raises(ValueError) as err:
        SSLHead(**kwargs)
    assert fragment in str(err.value)


# ---------------------------------------------------------------- the encoder's arguments, written once

NETWORKS = {
    "SSLHead": SSLHead,
    "MaskedImageModel": MaskedImageModel,
    "SwinViTEmbedding": SwinViTEmbedding,
    "SelfDistillationNetwork": SelfDistillationNetwork,
    "LinearProbe": lambda **encoder: LinearProbe(out_channels=2, **encoder),
}


@pytest.mark.parametrize("name", list(NETWORKS))
def test_every_network_takes_the_encoder_arguments_through_one_declaration(name):
    """No network spells the encoder's nine arguments again: each takes them as ``**encoder`` for SwinViTSettings, and
    network_parameters (what build_for_weights reads) shows them with SwinViTSettings' defaults; its encoder is the one
    SwinViTSettings builds, tensor for tensor, from the same seed."""
    network = {"LinearProbe": LinearProbe}.get(name, NETWORKS[name])
    fields = inspect.signature(SwinViTSettings).parameters
    own = inspect.signature(network.__init__).parameters
    assert set(own) & set(fields) <= {"in_channels"}, name  # the probe names in_channels: it is positional there
    taken = network_parameters(network)
    assert {f: taken[f].default for f in fields if f != "in_channels" or name != "LinearProbe"} == {
        f: p.default for f, p in fields.items() if f != "in_channels" or name != "LinearProbe"
    }
    encoder = {"in_channels": 2, "feature_size": 12, "window_size": 4, "use_v2": True, "depths": [2, 2, 4, 2]}
    torch.manual_seed(3)
    built = NETWORKS[name](**encoder).swinViT.state_dict()
    torch.manual_seed(3)
    expected = SwinViTSettings(**encoder).build().state_dict()
    assert list(built) == list(expected)
    assert all(torch.equal(built[k], expected[k]) for k in expected)
    with pytest.raises(TypeError, match="feature_sise"):
        NETWORKS[name](in_channels=1, feature_sise=12)


def test_build_for_weights_sees_the_encoder_arguments_of_a_network_that_takes_them_as_keywords(tmp_path):
    """A checkpoint of window 4 into SSLHead with the window left at its default: build_for_weights names the default
    (7, SwinViTSettings') in the mismatch with pretrained_arch "config", and takes the checkpoint's with "auto"."""
    torch.save(SSLHead(feature_size=12, window_size=4).state_dict(), tmp_path / "w4.pt")
    with pytest.raises(CheckpointLoadError, match="window_size"):
        build_for_weights(SSLHead, tmp_path / "w4.pt", "config", feature_size=12)
    assert build_for_weights(SSLHead, tmp_path / "w4.pt", "auto", feature_size=12).window_size == 4
    assert network_parameters(MaskedImageModel)["decoder"].default == "linear"  # the class's own arguments stay


# ---------------------------------------------------------------- depths and heads (BrainSegFounder's deeper encoders)

DEEP = {"depths": (2, 2, 6, 2), "num_heads": (4, 8, 16, 32)}  # --num_swin_block 6 --num_heads_first_stage 4
DEEP_ENCODERS = {
    "SwinViTSettings": lambda **deep: nn.ModuleDict({"swinViT": SwinViTSettings(2, 12, window_size=4, **deep).build()}),
    "SSLHead": lambda **deep: SSLHead(in_channels=2, feature_size=12, window_size=4, **deep),
    "SwinViTEmbedding": lambda **deep: SwinViTEmbedding(in_channels=2, feature_size=12, window_size=4, **deep),
    "SelfDistillationNetwork": lambda **deep: SelfDistillationNetwork(
        in_channels=2, feature_size=12, out_dim=32, hidden_dim=32, bottleneck_dim=16, window_size=4, **deep
    ),
}


@pytest.mark.parametrize("name", list(DEEP_ENCODERS))
def test_depths_and_heads_reach_the_encoder_and_load_into_swinunetr(name):
    """Every recipe's encoder takes depths (2, 2, 6, 2) and heads (4, 8, 16, 32), reads them back from its tensors
    (six blocks in stage 3, 4 .. 32 bias-table columns) and loads strictly into SwinUNETR's encoder of the same
    depths and heads; lists from a config do as tuples; the defaults stay (2, 2, 2, 2) and (3, 6, 12, 24)."""
    network = DEEP_ENCODERS[name](depths=[2, 2, 6, 2], num_heads=[4, 8, 16, 32])
    found = infer_architecture(network.state_dict())
    assert (found.depths, found.num_heads) == (DEEP["depths"], DEEP["num_heads"])
    assert "swinViT.layers3.0.blocks.5.attn.relative_position_bias_table" in network.state_dict()
    target = SwinUNETR(in_channels=2, out_channels=2, feature_size=12, window_size=4, **DEEP).swinViT
    result = target.load_state_dict(network.swinViT.state_dict(), strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    default = infer_architecture(DEEP_ENCODERS[name]().state_dict())
    assert (default.depths, default.num_heads) == ((2, 2, 2, 2), (3, 6, 12, 24))


def test_deep_encoder_forward():
    """BrainSegFounder's deepest variant, depths (2, 2, 18, 2) and heads from 6 (feature 12 here): a forward pass."""
    net = SSLHead(in_channels=2, feature_size=12, window_size=4, depths=(2, 2, 18, 2), num_heads=(6, 12, 24, 48))
    with torch.no_grad():
        rot, contrastive, rec = net(torch.rand(1, 2, *SMALL_3D))
    assert (rot.shape, contrastive.shape, rec.shape) == ((1, 4), (1, 512), (1, 2, *SMALL_3D))


@pytest.mark.parametrize("name", list(DEEP_ENCODERS))
@pytest.mark.parametrize(
    "stages, message",
    [
        ({"num_heads": (5, 10, 20, 40)}, "num_heads=(5, 10, 20, 40): stage 1 has 12 channels (feature_size 12), "
                                         "which 5 heads do not divide (each head takes an equal share)"),
        ({"num_heads": (4, 8, 16, 36)}, "num_heads=(4, 8, 16, 36): stage 4 has 96 channels (feature_size 12), "
                                        "which 36 heads do not divide (each head takes an equal share)"),
        ({"depths": (2, 2, 2)}, "depths must be 4 positive integers, one per Swin stage (MONAI's SwinTransformer "
                                "has layers1 .. layers4), got (2, 2, 2)"),
        ({"depths": (2, 0, 6, 2)}, "depths must be 4 positive integers, one per Swin stage (MONAI's "
                                   "SwinTransformer has layers1 .. layers4), got (2, 0, 6, 2)"),
        ({"num_heads": "4,8,16,32"}, "num_heads must be 4 positive integers, one per Swin stage (MONAI's "
                                     "SwinTransformer has layers1 .. layers4), got '4,8,16,32'"),
        ({"num_heads": (4.0, 8, 16, 32)}, "num_heads must be 4 positive integers, one per Swin stage (MONAI's "
                                          "SwinTransformer has layers1 .. layers4), got (4.0, 8, 16, 32)"),
    ],
    ids=["first-stage", "last-stage", "three-stages", "empty-stage", "string", "float"],
)
def test_depths_and_heads_are_checked_before_the_encoder_is_built(name, stages, message, monkeypatch):
    """One line naming the value at fault, before MONAI's SwinTransformer is built (heads that do not divide a
    stage's channels would otherwise fail only in the first forward pass)."""
    import components.networks.swin

    def not_built(**kwargs):
        raise AssertionError("the encoder was built")

    monkeypatch.setattr(components.networks.swin, "SwinTransformer", not_built)
    with pytest.raises(ValueError) as err:
        DEEP_ENCODERS[name](**stages)
    assert str(err.value) == message


# ---------------------------------------------------------------- gradients


def test_gradients_reach_every_parameter():
    """No unused parameters (DDP would need find_unused_parameters otherwise)."""
    torch.manual_seed(0)
    net = SSLHead(in_channels=1, feature_size=12)
    outputs = net(torch.rand(2, 1, *SMALL_3D))
    _check_outputs(outputs, 2, 1, SMALL_3D)
    sum(o.sum() for o in outputs).backward()
    for name, p in net.named_parameters():
        assert p.grad is not None, f"{name} received no gradient"
        assert torch.isfinite(p.grad).all(), name
        # conv biases right before an InstanceNorm get a mathematically zero gradient: only require
        # non-zero gradients in the encoder and the two heads
        if not name.startswith("conv."):
            assert p.grad.abs().sum() > 0, f"{name} has an all-zero gradient"


def test_activation_checkpointing_matches():
    torch.manual_seed(0)
    plain = SSLHead(in_channels=1, feature_size=12, use_checkpoint=False)
    ckpt = SSLHead(in_channels=1, feature_size=12, use_checkpoint=True)
    ckpt.load_state_dict(plain.state_dict())
    assert all(blk.use_checkpoint for blk in ckpt.swinViT.layers1[0].blocks)
    x = torch.rand(1, 1, *SMALL_3D)

    out_plain = plain(x)
    weighted_loss(out_plain).backward()
    out_ckpt = ckpt(x)
    weighted_loss(out_ckpt).backward()

    for a, b in zip(out_plain, out_ckpt):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    grads_ckpt = dict(ckpt.named_parameters())
    for name, p in plain.named_parameters():
        torch.testing.assert_close(p.grad, grads_ckpt[name].grad, atol=1e-5, rtol=0, msg=name)


def test_reconstruction_output_mode_returns_the_same_reconstruction():
    torch.manual_seed(0)
    full = SSLHead(feature_size=12)
    recon_only = SSLHead(feature_size=12, output="reconstruction")
    recon_only.load_state_dict(full.state_dict())  # same keys: strict load works
    x = torch.rand(1, 1, 64, 64, 32)
    with torch.no_grad():
        expected = full(x)[2]
        got = recon_only(x)
    assert isinstance(got, torch.Tensor)
    assert torch.allclose(got, expected)
    with pytest.raises(ValueError, match="output must be one of"):
        SSLHead(feature_size=12, output="features")


# ---------------------------------------------------------------- SwinUNETR v2 encoders (use_v2)

V2_BLOCKS = ("swinViT.layers1c.", "swinViT.layers2c.", "swinViT.layers3c.", "swinViT.layers4c.")
TINY_ROI = (64, 32, 32)


def _encoders(use_v2: bool) -> dict[str, nn.Module]:
    """The encoders of every network of the collection at feature 12, window 4."""
    return {
        "SSLHead": SSLHead(feature_size=12, window_size=4, use_v2=use_v2).swinViT,
        "SwinViTEmbedding": SwinViTEmbedding(feature_size=12, window_size=4, use_v2=use_v2).swinViT,
        "SelfDistillationNetwork": SelfDistillationNetwork(
            feature_size=12, out_dim=32, hidden_dim=32, bottleneck_dim=16, window_size=4, use_v2=use_v2
        ).swinViT,
    }


@pytest.mark.parametrize("use_v2", [False, True], ids=["v1", "v2"])
def test_encoders_load_into_swinunetr_of_the_same_version(use_v2):
    """Keys and shapes of every recipe's encoder are those of ``SwinUNETR(use_v2=...).swinViT``: a strict load."""
    target = SwinUNETR(in_channels=1, out_channels=2, feature_size=12, window_size=4, use_v2=use_v2).swinViT
    expected = {k: tuple(v.shape) for k, v in target.state_dict().items()}
    assert any(k.startswith("layers1c.") for k in expected) == use_v2
    for name, encoder in _encoders(use_v2).items():
        state = encoder.state_dict()
        assert {k: tuple(v.shape) for k, v in state.items()} == expected, name
        result = target.load_state_dict(state, strict=True)
        assert not result.missing_keys and not result.unexpected_keys, name
        assert all(torch.equal(target.state_dict()[k], v) for k, v in state.items()), name


def test_v1_is_the_default_and_v2_only_adds_the_residual_blocks():
    v1_default = SSLHead(feature_size=12).state_dict()
    v1 = SSLHead(feature_size=12, use_v2=False).state_dict()
    v2 = SSLHead(feature_size=12, use_v2="true").state_dict()  # a bundle's command-line string
    assert list(v1_default) == list(v1)
    assert not any(k.startswith(V2_BLOCKS) for k in v1)
    assert [k for k in v2 if not k.startswith(V2_BLOCKS)] == list(v1)
    assert {k: tuple(v.shape) for k, v in v2.items() if k in v1} == {k: tuple(v.shape) for k, v in v1.items()}
    # MONAI's UnetrBasicBlock per stage: two bias-free 3x3x3 convolutions on the stage's c = f, 2f, 4f, 8f channels
    added = {k: tuple(v.shape) for k, v in v2.items() if k.startswith(V2_BLOCKS)}
    assert added == {
        f"swinViT.layers{i + 1}c.0.layer.conv{j}.conv.weight": (12 * 2**i, 12 * 2**i, 3, 3, 3)
        for i in range(4)
        for j in (1, 2)
    }
    v2_blocks = n_params(SwinViTSettings(1, 12, use_v2=True).build()) - n_params(SwinViTSettings(1, 12).build())
    assert v2_blocks == 54 * 12**2 * (1 + 4 + 16 + 64)
    with pytest.raises(ValueError, match="use_v2 must be true or false, got 'v2'"):
        SSLHead(feature_size=12, use_v2="v2")


def test_v2_encoder_computes_what_swinunetr_v2_computes():
    """The recipes' v2 networks run on a tiny ROI, and their encoder's features equal SwinUNETR v2's own with the
    same weights (the residual blocks are used, not only present)."""
    torch.manual_seed(0)
    x = torch.rand(2, 1, *TINY_ROI)
    ssl = SSLHead(feature_size=12, window_size=4, use_v2=True).eval()
    student = SelfDistillationNetwork(
        feature_size=12, out_dim=32, hidden_dim=32, bottleneck_dim=16, window_size=4, use_v2=True
    ).eval()
    seg = SwinUNETR(in_channels=1, out_channels=2, feature_size=12, window_size=4, use_v2=True).eval()
    with torch.no_grad():
        rot, contrastive, rec = ssl(x)
        assert rot.shape == (2, 4) and contrastive.shape == (2, 512) and rec.shape == (2, 1, *TINY_ROI)
        seg.swinViT.load_state_dict(ssl.swinViT.state_dict())
        expected = seg.swinViT(x, normalize=True)[4]
        torch.testing.assert_close(ssl.swinViT(x, normalize=True)[4], expected, rtol=0, atol=0)
        v1 = SwinUNETR(in_channels=1, out_channels=2, feature_size=12, window_size=4).swinViT.eval()
        v1.load_state_dict({k: v for k, v in ssl.swinViT.state_dict().items() if "c.0.layer." not in k})
        assert not torch.allclose(v1(x, normalize=True)[4], expected, atol=1e-3)  # the residual blocks count
        embeddings, logits = student([x, x[:, :, :32]])
        assert embeddings.shape == (4, 16 * 12) and logits.shape == (4, 32)
        seg.swinViT.load_state_dict(student.swinViT.state_dict())
        torch.testing.assert_close(embeddings[:2], seg.swinViT(x, normalize=True)[4].flatten(2).mean(2))


def _voco_checkpoint(feature_size: int, window_size: int) -> tuple[dict, dict]:
    """A checkpoint as VoCo's ``voco_train.py`` saves it (``{"global_step", "state_dict": {"module.backbone.*",
    "module.student.*", "module.teacher.*"}}``, the backbone a SwinUNETR v2 without its decoder), with random
    values; and the backbone's encoder tensors by their SwinUNETR key."""
    voco = nn.Module()
    voco.backbone = SwinUNETR(
        in_channels=1, out_channels=21, feature_size=feature_size, window_size=window_size, use_v2=True
    )
    for name in ("decoder5", "decoder4", "decoder3", "decoder2", "decoder1", "out"):
        delattr(voco.backbone, name)
    voco.student = nn.Linear(24 * feature_size, 8)
    voco.teacher = nn.Linear(24 * feature_size, 8)
    state = {k: torch.randn(v.shape) if v.is_floating_point() else v for k, v in voco.state_dict().items()}
    encoder = {k[len("backbone.") :]: v for k, v in state.items() if k.startswith("backbone.swinViT.")}
    return {"global_step": 100, "state_dict": {f"module.{k}": v for k, v in state.items()}}, encoder


def test_convert_a_v2_checkpoint_without_flags(tmp_path):
    """use_v2 and the window are read from the file: a VoCo v2 checkpoint (window 4 here, to tell it from the default
    7) converts into SwinUNETR v2 and SSLHead v2 state dicts that load strictly, every encoder tensor the file's."""
    checkpoint, encoder = _voco_checkpoint(12, 4)
    src = tmp_path / "voco.pt"
    torch.save(checkpoint, src)
    report = convert_checkpoint(src, tmp_path / "swinunetr.pt", feature_size=12)
    assert report.layout == "voco" and len(report.encoder_loaded) == len(encoder)
    seg = SwinUNETR(in_channels=1, out_channels=14, feature_size=12, window_size=4, use_v2=True)
    seg.load_state_dict(torch.load(tmp_path / "swinunetr.pt", weights_only=True), strict=True)
    assert all(torch.equal(seg.state_dict()[k], v) for k, v in encoder.items())
    assert main(["convert-checkpoint", str(src), str(tmp_path / "ssl.pt"), "--target", "sslhead", "--feature_size", "12"]) == 0
    ssl = SSLHead(feature_size=12, window_size=4, use_v2=True)
    ssl.load_state_dict(torch.load(tmp_path / "ssl.pt", weights_only=True), strict=True)
    assert all(torch.equal(ssl.state_dict()[k], v) for k, v in encoder.items())
    # an explicit value other than the file's fails before anything is written, naming it
    with pytest.raises(CheckpointLoadError, match="use_v2=true in the checkpoint, false in the network"):
        convert_checkpoint(src, tmp_path / "v1.pt", feature_size=12, use_v2=False)
    with pytest.raises(CheckpointLoadError, match="window_size=4 in the checkpoint, 7 in the network"):
        convert_checkpoint(src, tmp_path / "w7.pt", feature_size=12, window_size=7)
    assert not (tmp_path / "v1.pt").exists() and not (tmp_path / "w7.pt").exists()


@pytest.mark.parametrize("bundle", ["swin_unetr_ssl_pretrain", "swin_unetr_dino_pretrain", "swin_unetr_btcv_finetune",
                                    "swin_unetr_brats_finetune"])
def test_every_bundle_builds_a_v2_encoder_from_one_id(bundle):
    """``--network_def#use_v2 true`` gives every network of a bundle (the DINO student included) MONAI's v2 encoder,
    which runs at a tiny ROI; the default stays v1."""
    from monai.bundle import ConfigParser

    configs = Path(__file__).resolve().parents[1] / "bundles" / bundle / "configs"
    for config in ("train.json", "inference.json"):
        parser = ConfigParser()
        parser.read_config(str(configs / config))
        assert parser["network_def"]["use_v2"] is False
        parser.update({"network_def#use_v2": True, "feature_size": 12, "network_def#window_size": 4})
        networks = [parser.get_parsed_content("network_def")]
        if bundle == "swin_unetr_dino_pretrain" and config == "train.json":
            networks.append(parser.get_parsed_content("train#student_def"))
        for net in networks:
            assert any(".layers1c." in k for k in net.state_dict()), (config, type(net).__name__)
    x = torch.rand(1, networks[0].swinViT.patch_embed.proj.in_channels, 64, 32, 32)
    with torch.no_grad():
        assert torch.isfinite(networks[0].swinViT(x)[4]).all()
