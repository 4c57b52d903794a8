"""Tests of components.checkpoint: layouts, key mapping, reports, channel policy, atomic and resumable checkpoints."""

from __future__ import annotations

import functools
import logging
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from ignite.engine import Engine, Events
from monai.networks.nets import SwinUNETR
from monai.networks.nets.swin_unetr import filter_swinunetr
from monai.networks.utils import copy_model_state
from torch import nn

from components.checkpoint import (
    CheckpointLoadError,
    PretrainedLoader,
    ResumableCheckpointSaver,
    ResumeHandler,
    convert_state_dict,
    detect_layout,
    load_pretrained,
    save_atomic,
)
from components.release.conversion import convert_checkpoint
from components.recipes.inpainting_contrast import SSLHead
from tests.ranks import run_scenario

FS = 12  # feature size of the small test models (16 * FS = 192 channels in the last stage)
N_ENCODER = 126  # swinViT.* tensors: 118 parameters + 8 relative_position_index buffers
REPO = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------------------------------
# builders of source checkpoints in each published layout, from randomly initialised models
# ------------------------------------------------------------------------------------------------------------


def _randomised(state: dict) -> dict:
    """Every float tensor redrawn (LayerNorm ones/zeros would compare equal without being loaded) and every
    relative_position_index flipped, so that a tensor equal to the source was really copied from it."""
    return {k: torch.randn_like(v) if v.is_floating_point() else v.flip(0).clone() for k, v in state.items()}


def _sslhead_state(seed: int) -> dict:
    torch.manual_seed(seed)
    return _randomised(SSLHead(feature_size=FS).state_dict())


def _swinunetr_state(seed: int, in_channels: int = 1) -> dict:
    torch.manual_seed(seed)
    return _randomised(SwinUNETR(in_channels=in_channels, out_channels=14, feature_size=FS).state_dict())


def _encoder_only(state: dict) -> dict:
    """swinViT.* tensors of a collection state, keys without the swinViT. prefix (MONAI SwinTransformer names)."""
    return {k[len("swinViT.") :]: v for k, v in state.items() if k.startswith("swinViT.")}


def _to_release(enc: dict) -> dict:
    """The CVPR release model_swinvit.pt layout built from MONAI SwinTransformer keys."""
    sd = {
        "module." + k.replace(".mlp.linear1.", ".mlp.fc1.").replace(".mlp.linear2.", ".mlp.fc2."): v
        for k, v in enc.items()
    }
    sd["module.norm.weight"] = torch.randn(16 * FS)
    sd["module.norm.bias"] = torch.randn(16 * FS)
    return {"state_dict": sd}


def _to_autoencoder(enc: dict) -> dict:
    """MONAI's disruptive-autoencoder ssl_pretrained_weights.pth layout (what filter_swinunetr reads)."""
    sd = {}
    for k, v in enc.items():
        if k.startswith("patch_embed."):
            sd["encoder." + k] = v
        else:  # layersN.0.rest -> encoder.layersN.0.0.rest
            layer, rest = k.split(".0.", 1)
            sd[f"encoder.{layer}.0.0.{rest}"] = v
    sd["encoder.mask_token"] = torch.randn(1, 1, FS)
    sd["encoder.norm.weight"] = torch.randn(16 * FS)
    sd["encoder.norm.bias"] = torch.randn(16 * FS)
    sd["out.conv.conv.weight"] = torch.randn(1, FS, 1, 1, 1)
    sd["out.conv.conv.bias"] = torch.randn(1)
    return {"model": sd}


def _optimizer_state() -> dict:
    return torch.optim.AdamW(nn.Linear(2, 2).parameters(), lr=1e-3).state_dict()


@functools.lru_cache(maxsize=None)
def _case(name: str):
    """Cached (the tests only read these objects): (checkpoint object, collection-space state it comes from,
    layout, number of dropped-by-design keys into an SSLHead target, into a SwinUNETR target)."""
    if name == "model_swinvit":
        src = _sslhead_state(1)
        return _to_release(_encoder_only(src)), src, "model_swinvit", 2, 2
    if name == "ssl_original_global_step":
        src = _sslhead_state(2)
        sd = {"module." + k: v for k, v in src.items()}
        ck = {"global_step": 100, "state_dict": sd, "optimizer": _optimizer_state()}
        return ck, src, "ssl_original", 0, 16
    if name == "ssl_original_swin_vit_epoch":
        src = _sslhead_state(3)
        sd = {"module." + k.replace("swinViT.", "swin_vit.", 1): v for k, v in src.items()}
        return {"epoch": 7, "state_dict": sd, "optimizer": _optimizer_state()}, src, "ssl_original", 0, 16
    if name == "ssl_collection_saver":  # MONAI CheckpointSaver: {"model": ..., "optimizer": ...}
        src = _sslhead_state(4)
        return {"model": src, "optimizer": _optimizer_state()}, src, "ssl_collection", 0, 16
    if name == "ssl_collection_bare":  # MONAI save_final / key-metric file
        src = _sslhead_state(5)
        return dict(src), src, "ssl_collection", 0, 16
    if name == "ssl_collection_compiled":  # torch.compile: _orig_mod. (here inside DDP too), under "network"
        torch.manual_seed(6)
        model = SSLHead(feature_size=FS)
        model.load_state_dict(_randomised(model.state_dict()))
        src = model.state_dict()
        compiled = torch.compile(model).state_dict()
        assert all(k.startswith("_orig_mod.") for k in compiled)
        return {"network": {"module." + k: v for k, v in compiled.items()}, "epoch": 1}, src, "ssl_original", 0, 16
    if name == "ssl_collection_orig_mod":
        src = _sslhead_state(7)
        return {"net": {"_orig_mod." + k: v for k, v in src.items()}}, src, "ssl_collection", 0, 16
    if name == "monai_ssl_autoencoder":
        src = _sslhead_state(8)
        return _to_autoencoder(_encoder_only(src)), src, "monai_ssl_autoencoder", 5, 5
    if name == "swinunetr":
        src = _swinunetr_state(9)
        return {"state_dict": src}, src, "swinunetr", 33, 0
    raise KeyError(name)


CASES = [
    "model_swinvit",
    "ssl_original_global_step",
    "ssl_original_swin_vit_epoch",
    "ssl_collection_saver",
    "ssl_collection_bare",
    "ssl_collection_compiled",
    "ssl_collection_orig_mod",
    "monai_ssl_autoencoder",
    "swinunetr",
]


def _state_copy(model: nn.Module) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _make_target(kind: str, in_channels: int = 1) -> nn.Module:
    torch.manual_seed(123)
    if kind == "sslhead":
        return SSLHead(in_channels=in_channels, feature_size=FS)
    return SwinUNETR(in_channels=in_channels, out_channels=14, feature_size=FS)


@pytest.mark.parametrize("target", ["sslhead", "swinunetr"])
@pytest.mark.parametrize("case", CASES)
def test_every_layout_loads_exactly(case, target, tmp_path, caplog):
    ck, src, layout, dropped_ssl, dropped_unetr = _case(case)
    path = tmp_path / f"{case}.pt"
    torch.save(ck, path)
    model = _make_target(target)
    before = _state_copy(model)

    with caplog.at_level(logging.INFO, logger="components.checkpoint"):
        report = load_pretrained(model, path)

    assert report.layout == layout
    assert report.target == target
    assert report.source == str(path)
    after = model.state_dict()
    # every encoder tensor equals the source tensor it comes from
    enc_keys = [k for k in after if k.startswith("swinViT.")]
    assert len(enc_keys) == N_ENCODER
    for k in enc_keys:
        assert torch.equal(after[k], src[k]), k
    assert len(report.encoder_loaded) == N_ENCODER and report.encoder_missing == []
    # other tensors: from the source where both sides have them, untouched otherwise
    for k, v in after.items():
        if k.startswith("swinViT."):
            continue
        if k in report.loaded:
            assert torch.equal(v, src[k]), k
        else:
            assert torch.equal(v, before[k]), k
    assert set(report.loaded) | set(report.missing) == set(after)
    assert not set(report.loaded) & set(report.missing)
    assert report.missing == report.allowed_missing
    assert report.unknown == {}
    assert report.shape_mismatched == {} and report.adapted == {}
    assert len(report.dropped) == (dropped_ssl if target == "sslhead" else dropped_unetr)
    n_unused = len(report.dropped)
    # a source key is either loaded or reported unused
    n_source = len(ck.get("state_dict", ck.get("model", ck.get("network", ck.get("net", ck)))))
    assert len(report.loaded) + n_unused == n_source
    if layout in ("ssl_original", "ssl_collection") and target == "sslhead":
        assert report.missing == []  # heads and decoder too
    if layout == "swinunetr" and target == "swinunetr":
        assert report.missing == []
    assert report.summary() in caplog.text
    assert f"loaded {N_ENCODER}/{N_ENCODER} encoder tensors" in report.summary()


def test_report_reasons_and_prefixes(tmp_path):
    ck, _, _, _, _ = _case("model_swinvit")
    report = load_pretrained(_make_target("swinunetr"), ck)
    assert set(report.dropped) == {"module.norm.weight", "module.norm.bias"}
    assert "final LayerNorm" in report.dropped["module.norm.weight"]
    assert report.stripped_prefixes == ["module."] and report.container == "state_dict"
    assert all(k.startswith(("encoder", "decoder", "out.")) for k in report.missing)
    ck, _, _, _, _ = _case("ssl_collection_saver")
    report = load_pretrained(_make_target("swinunetr"), ck)
    assert set(report.dropped) == {k for k in ck["model"] if not k.startswith("swinViT.")}
    assert all("SSL pretraining head" in r for r in report.dropped.values())
    ck, _, _, _, _ = _case("swinunetr")
    report = load_pretrained(_make_target("sslhead"), ck)
    assert all("segmentation decoder" in r for r in report.dropped.values())
    assert set(report.missing) == {k for k in SSLHead(feature_size=FS).state_dict() if not k.startswith("swinViT.")}
    assert "dropped by design" in report.details() and report.as_dict()["layout"] == "swinunetr"


def test_detect_layout_names():
    release = ["patch_embed.proj.weight", "layers1.0.blocks.0.mlp.fc1.weight", "norm.weight"]
    assert detect_layout(release) == "model_swinvit"
    assert detect_layout(["swinViT.patch_embed.proj.weight", "rotation_head.weight"]) == "ssl_collection"
    ssl = ["swinViT.patch_embed.proj.weight", "rotation_head.weight"]
    assert detect_layout(ssl, had_module_prefix=True) == "ssl_original"
    assert detect_layout(["swin_vit.patch_embed.proj.weight", "conv.0.weight"]) == "ssl_original"
    assert detect_layout(["encoder.layers1.0.0.blocks.0.norm1.weight", "encoder.mask_token"]) == "monai_ssl_autoencoder"
    unetr = ["swinViT.patch_embed.proj.weight", "encoder1.layer.conv1.conv.weight", "out.conv.conv.weight"]
    assert detect_layout(unetr) == "swinunetr"
    assert detect_layout(["swinViT.patch_embed.proj.weight"]) == "swinvit_encoder"
    assert detect_layout(["backbone.conv1.weight"]) is None


def test_same_as_monai_load_from_on_release_layout():
    ck, _, _, _, _ = _case("model_swinvit")
    ref = _make_target("swinunetr")
    ref.load_from(ck)  # MONAI's own loader of the CVPR release: reads weights["state_dict"]["module...."]
    ours = _make_target("swinunetr")
    load_pretrained(ours, ck)
    ref_sd, our_sd = ref.state_dict(), ours.state_dict()
    for k in ref_sd:
        if k.startswith("swinViT."):
            assert torch.equal(ref_sd[k], our_sd[k]), k


def test_same_as_monai_filter_swinunetr_on_autoencoder_layout():
    ck, _, _, _, _ = _case("monai_ssl_autoencoder")
    ref = _make_target("swinunetr")
    copy_model_state(ref, ck["model"], filter_func=filter_swinunetr)
    ours = _make_target("swinunetr")
    load_pretrained(ours, ck)
    ref_sd, our_sd = ref.state_dict(), ours.state_dict()
    for k in ref_sd:
        assert torch.equal(ref_sd[k], our_sd[k]), k


def test_naive_rule_loads_nothing_ours_raises_clearly():
    ck, src, _, _, _ = _case("model_swinvit")
    # the finetuning script's rule: strip module., rename swin_vit, load_state_dict(strict=False)
    naive = {k.replace("module.", "").replace("swin_vit", "swinViT"): v for k, v in ck["state_dict"].items()}
    model = _make_target("sslhead")
    before = _state_copy(model)
    result = model.load_state_dict(naive, strict=False)  # no error at all ...
    loaded = [k for k in model.state_dict() if k not in result.missing_keys]
    assert loaded == []  # ... and zero tensors loaded
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())

    # ours, with half of the encoder absent: a clear error and an untouched model
    half = {k: v for k, v in ck["state_dict"].items() if not k.startswith(("module.layers3", "module.layers4"))}
    with pytest.raises(CheckpointLoadError) as err:
        load_pretrained(model, {"state_dict": half})
    msg = str(err.value)
    assert "layout=model_swinvit" in msg
    assert "58 of 118 required tensors" in msg  # 2 stages x (2 blocks x 13 + 3 downsample tensors)
    assert "swinViT.layers3.0.blocks.0.norm1.weight" in msg
    assert "Hint" in msg and "required='none'" in msg and "not modified" in msg
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())

    # required="none" accepts the partial encoder and reports it
    report = load_pretrained(model, {"state_dict": half}, required="none")
    assert len(report.encoder_loaded) == N_ENCODER - 62  # 58 required + 4 relative_position_index buffers absent
    assert all(k.startswith(("swinViT.layers3", "swinViT.layers4")) for k in report.encoder_missing)
    key = "swinViT.layers1.0.blocks.0.norm1.weight"
    assert torch.equal(model.state_dict()[key], src[key])


def test_required_all_and_relative_position_index_not_required():
    ck, src, _, _, _ = _case("model_swinvit")
    with pytest.raises(CheckpointLoadError, match=r"required='all'"):
        load_pretrained(_make_target("swinunetr"), ck, required="all")
    # a release without the deterministic relative_position_index buffers still loads the whole encoder
    no_index = {k: v for k, v in ck["state_dict"].items() if not k.endswith("relative_position_index")}
    model = _make_target("swinunetr")
    fresh_index = model.state_dict()["swinViT.layers1.0.blocks.0.attn.relative_position_index"].clone()
    report = load_pretrained(model, {"state_dict": no_index})
    assert len(report.encoder_missing) == 8
    assert all(k.endswith("relative_position_index") for k in report.encoder_missing)
    assert set(report.encoder_missing) <= set(report.allowed_missing)
    assert torch.equal(model.state_dict()["swinViT.layers1.0.blocks.0.attn.relative_position_index"], fresh_index)
    # an SSL checkpoint loads everything into an SSLHead even with required="all"
    ck, _, _, _, _ = _case("ssl_collection_bare")
    assert load_pretrained(_make_target("sslhead"), ck, required="all").missing == []


def test_shape_mismatch_reported_and_feature_size_hint():
    ck, _, _, _, _ = _case("model_swinvit")
    model = SwinUNETR(in_channels=1, out_channels=14, feature_size=24)
    with pytest.raises(CheckpointLoadError, match=r"feature_size=12"):
        load_pretrained(model, ck)
    # a SwinUNETR with another number of classes: the output layer is reported, not loaded
    ck, src, _, _, _ = _case("swinunetr")
    model = SwinUNETR(in_channels=1, out_channels=3, feature_size=FS)
    report = load_pretrained(model, ck)
    assert report.shape_mismatched["out.conv.conv.weight"] == ((14, FS, 1, 1, 1), (3, FS, 1, 1, 1))
    assert "out.conv.conv.weight" in report.missing and "out.conv.conv.weight" not in report.loaded
    key = "decoder1.conv_block.conv1.conv.weight"
    assert torch.equal(model.state_dict()[key], src[key])


def test_channel_policy_repeat_matches_single_channel_response():
    ck, src, _, _, _ = _case("model_swinvit")
    one = _make_target("swinunetr", in_channels=1)
    load_pretrained(one, ck)
    four = _make_target("swinunetr", in_channels=4)
    report = load_pretrained(four, ck, channel_policy="repeat")
    key = "swinViT.patch_embed.proj.weight"
    assert list(report.adapted) == [key] and report.adapted[key].startswith("repeat")
    assert key in report.loaded
    assert torch.equal(four.state_dict()[key], src[key].repeat(1, 4, 1, 1, 1) / 4)
    with torch.no_grad():
        const = torch.full((2, 4, 4, 4, 4), 0.7)
        assert torch.allclose(four.swinViT.patch_embed(const), one.swinViT.patch_embed(const[:, :1]), atol=1e-6)
        img = torch.randn(2, 1, 4, 4, 4)
        out4 = four.swinViT.patch_embed(img.repeat(1, 4, 1, 1, 1))
        assert torch.allclose(out4, one.swinViT.patch_embed(img), atol=1e-5)
    # 2 -> 3 channels (not a multiple): the channel mean is spread, the constant response is kept
    two_src = _swinunetr_state(10, in_channels=2)
    two = SwinUNETR(in_channels=2, out_channels=14, feature_size=FS)
    two.load_state_dict(two_src)
    three = SwinUNETR(in_channels=3, out_channels=14, feature_size=FS)
    load_pretrained(three, two_src, channel_policy="repeat")
    with torch.no_grad():
        c3, c2 = torch.full((1, 3, 4, 4, 4), -1.3), torch.full((1, 2, 4, 4, 4), -1.3)
        assert torch.allclose(three.swinViT.patch_embed(c3), two.swinViT.patch_embed(c2), atol=1e-5)


def test_channel_policy_skip_and_error():
    ck, src, _, _, _ = _case("model_swinvit")
    key = "swinViT.patch_embed.proj.weight"
    model = _make_target("swinunetr", in_channels=4)
    before = _state_copy(model)
    with pytest.raises(CheckpointLoadError) as err:
        load_pretrained(model, ck)
    msg = str(err.value)
    assert "[12, 1, 2, 2, 2]" in msg and "[12, 4, 2, 2, 2]" in msg
    assert "channel_policy='repeat'" in msg and "channel_policy='skip'" in msg
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())

    report = load_pretrained(model, ck, channel_policy="skip")
    assert report.adapted[key].startswith("skip")
    assert key in report.missing and key in report.allowed_missing
    assert torch.equal(model.state_dict()[key], before[key])
    assert torch.equal(model.state_dict()["swinViT.patch_embed.proj.bias"], src["swinViT.patch_embed.proj.bias"])
    assert len(report.encoder_loaded) == N_ENCODER - 1
    with pytest.raises(ValueError, match="channel_policy must be one of"):
        load_pretrained(model, ck, channel_policy="average")


def test_unknown_layout_missing_file_and_weights_only(tmp_path):
    with pytest.raises(CheckpointLoadError, match=r"unknown layout.*backbone\.conv1\.weight"):
        load_pretrained(_make_target("swinunetr"), {"backbone.conv1.weight": torch.zeros(1), "fc.bias": torch.zeros(1)})
    missing = tmp_path / "nowhere" / "model_swinvit.pt"
    with pytest.raises(FileNotFoundError, match=str(missing).replace("\\", "\\\\")):
        load_pretrained(_make_target("swinunetr"), missing)
    with pytest.raises(FileNotFoundError):
        PretrainedLoader(missing, _make_target("swinunetr"))()
    unsafe = tmp_path / "unsafe.pt"
    release = _to_release(_encoder_only(_sslhead_state(1)))["state_dict"]
    torch.save({"state_dict": release, "args": _NotATensor()}, unsafe)
    with pytest.raises(CheckpointLoadError) as err:
        load_pretrained(_make_target("swinunetr"), unsafe)
    msg = str(err.value)
    assert str(unsafe) in msg and "weights_only=True" in msg and "_NotATensor" in msg
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"not a checkpoint at all")
    with pytest.raises(CheckpointLoadError, match="garbage.pt"):
        load_pretrained(_make_target("swinunetr"), garbage)
    with pytest.raises(CheckpointLoadError, match=r"found no state dict.*'epoch'"):
        load_pretrained(_make_target("swinunetr"), {"epoch": 3, "optimizer": {"state": {}}})


class _NotATensor:
    """A pickled custom object that torch.load(weights_only=True) must refuse."""

    value = 3


def test_convert_state_dict_does_not_touch_model():
    ck, src, _, _, _ = _case("model_swinvit")
    model = _make_target("sslhead")
    before = _state_copy(model)
    state, report = convert_state_dict(ck, model)
    assert sorted(state) == sorted(report.loaded) and len(state) == N_ENCODER
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    key = "swinViT.layers1.0.blocks.0.mlp.linear1.weight"
    assert torch.equal(state[key], src[key])


@pytest.mark.parametrize("target", ["swinunetr", "sslhead"])
def test_convert_checkpoint_writes_strictly_loadable_file(target, tmp_path):
    ck, src, _, _, _ = _case("model_swinvit")
    src_path, dst_path = tmp_path / "model_swinvit.pt", tmp_path / "out" / f"{target}.pt"
    torch.save(ck, src_path)
    report = convert_checkpoint(str(src_path), str(dst_path), target=target, feature_size=FS)
    assert report.layout == "model_swinvit" and len(report.encoder_loaded) == N_ENCODER
    written = torch.load(dst_path, map_location="cpu", weights_only=True)
    fresh = _make_target(target)
    fresh.load_state_dict(written, strict=True)
    for k in fresh.state_dict():
        if k.startswith("swinViT."):
            assert torch.equal(fresh.state_dict()[k], src[k]), k
    assert not [p for p in dst_path.parent.iterdir() if p.name != dst_path.name]  # no temp files left
    # encoder-only output, 4 input channels
    enc_path = tmp_path / "enc4.pt"
    convert_checkpoint(
        src_path, enc_path, target=target, in_channels=4, feature_size=FS, channel_policy="repeat", full_state=False
    )
    enc = torch.load(enc_path, weights_only=True)
    assert len(enc) == N_ENCODER and detect_layout(enc) == "swinvit_encoder"
    assert enc["swinViT.patch_embed.proj.weight"].shape[1] == 4


def test_pretrained_loader_handler(tmp_path, caplog):
    ck, src, _, _, _ = _case("ssl_original_global_step")
    path = tmp_path / "ssl.pt"
    torch.save(ck, path)
    model = _make_target("swinunetr")
    trainer = Engine(lambda e, b: None)
    loader = PretrainedLoader(path, model)
    loader.attach(trainer)
    PretrainedLoader(None, model).attach(trainer)  # no-op
    with caplog.at_level(logging.INFO, logger="components.checkpoint"):
        trainer.run([0], max_epochs=1)
    assert loader.report is not None and loader.report.layout == "ssl_original"
    assert "layout=ssl_original target=swinunetr" in caplog.text
    assert torch.equal(model.state_dict()["swinViT.patch_embed.proj.weight"], src["swinViT.patch_embed.proj.weight"])
    # a failing load stops the run
    bad = Engine(lambda e, b: None)
    PretrainedLoader(path, SwinUNETR(in_channels=4, out_channels=2, feature_size=FS)).attach(bad)
    with pytest.raises(CheckpointLoadError, match="channel_policy"):
        bad.run([0], max_epochs=1)


def test_load_into_ddp_like_and_compiled_wrappers():
    ck, src, _, _, _ = _case("model_swinvit")
    inner = _make_target("swinunetr")
    report = load_pretrained(nn.DataParallel(inner), ck)
    assert len(report.encoder_loaded) == N_ENCODER
    inner2 = _make_target("sslhead")
    load_pretrained(torch.compile(inner2), ck)
    key = "swinViT.layers4.0.downsample.norm.bias"
    assert torch.equal(inner2.state_dict()[key], src[key])


# ------------------------------------------------------------------------------------------------------------
# atomic saving
# ------------------------------------------------------------------------------------------------------------


def test_save_atomic_keeps_previous_file_on_failure(tmp_path, monkeypatch):
    path = tmp_path / "checkpoint.pt"
    old = {"w": torch.arange(5.0)}
    save_atomic(old, path)
    real_save = torch.save

    def failing_save(obj, f, *args, **kwargs):
        f.write(b"PK\x03\x04 partial bytes of a new checkpoint")
        f.flush()
        raise RuntimeError("disk full (simulated)")

    monkeypatch.setattr(torch, "save", failing_save)
    with pytest.raises(RuntimeError, match="simulated"):
        save_atomic({"w": torch.zeros(5)}, path)
    monkeypatch.setattr(torch, "save", real_save)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.pt"]
    assert torch.equal(torch.load(path, weights_only=True)["w"], old["w"])
    save_atomic({"w": torch.ones(2)}, path)
    assert torch.equal(torch.load(path, weights_only=True)["w"], torch.ones(2))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.pt"]


def test_save_atomic_survives_kill_mid_write(tmp_path):
    path = tmp_path / "checkpoint.pt"
    save_atomic({"w": torch.arange(3.0)}, path)
    script = textwrap.dedent(
        f"""
        import sys, time, torch
        from components.checkpoint import save_atomic
        def slow_save(obj, f, *a, **k):
            f.write(b"PK partial")
            f.flush()
            print("writing", flush=True)
            time.sleep(120)
        torch.save = slow_save
        save_atomic({{"w": torch.zeros(3)}}, {str(path)!r})
        """
    )
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, env=env, cwd=REPO)
    try:
        assert proc.stdout.readline().strip() == b"writing"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert torch.equal(torch.load(path, weights_only=True)["w"], torch.arange(3.0))
    leftovers = [p for p in tmp_path.iterdir() if p.name != "checkpoint.pt"]
    assert len(leftovers) == 1 and leftovers[0].name.startswith(".checkpoint.pt.")
    # the saver removes leftovers of its own file when a run starts
    saver = ResumableCheckpointSaver(tmp_path, {"model": nn.Linear(1, 1)}, save_final=False)
    trainer = Engine(lambda e, b: None)
    saver.attach(trainer)
    trainer.run([0], max_epochs=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.pt"]


# ------------------------------------------------------------------------------------------------------------
# resumable checkpoints with a real ignite Engine
# ------------------------------------------------------------------------------------------------------------

_W_TRUE = torch.tensor([[1.5], [-2.0], [0.5]])


def _data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 3, generator=g)
    y = x @ _W_TRUE + 0.3
    return [(x[i : i + 4], y[i : i + 4]) for i in range(0, 16, 4)]  # epoch_length 4


def _objects(seed: int):
    torch.manual_seed(seed)
    model = nn.Linear(3, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda it: min(1.0, (it + 1) / 6))  # warm-up over 6 iterations
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**seed)
    evaluator = Engine(lambda e, b: None)
    evaluator.state.best_metric = -1
    evaluator.state.best_metric_epoch = -1
    return model, opt, sched, scaler, evaluator


def _trainer(model, opt, sched, log):
    def step(engine, batch):
        x, y = batch
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        log.append((engine.state.iteration, opt.param_groups[0]["lr"]))
        sched.step()  # per iteration
        return loss.item()

    return Engine(step)


def test_resume_equals_uninterrupted_training(tmp_path):
    data = _data()
    # uninterrupted: 2 epochs
    model, opt, sched, _, _ = _objects(1)
    full_log: list = []
    _trainer(model, opt, sched, full_log).run(data, max_epochs=2)
    assert [it for it, _ in full_log] == list(range(1, 9))

    # 1 epoch + save ...
    model1, opt1, sched1, scaler1, eval1 = _objects(1)
    log1: list = []
    trainer1 = _trainer(model1, opt1, sched1, log1)

    @trainer1.on(Events.EPOCH_COMPLETED)
    def _validate(engine):  # stands for a validation handler attached before the saver
        eval1.state.best_metric = 0.25
        eval1.state.best_metric_epoch = engine.state.epoch

    saver = ResumableCheckpointSaver(tmp_path, {"model": torch.compile(model1), "optimizer": opt1, "lr_scheduler": sched1,
                                                "scaler": scaler1, "evaluator": eval1})
    saver.attach(trainer1)
    trainer1.run(data, max_epochs=1)
    ckpt = torch.load(saver.path, map_location="cpu", weights_only=True)  # plain objects only
    assert ckpt["trainer"] == {"epoch": 1, "iteration": 4, "epoch_length": 4, "max_epochs": 1, "batch_size": None}
    assert ckpt["best_metric"] == 0.25 and ckpt["best_metric_epoch"] == 1
    assert set(ckpt["model"]) == {"weight", "bias"}  # unwrapped from torch.compile
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.pt"]

    # ... new objects (other init, other scaler) + resume for 1 more epoch
    model2, opt2, sched2, scaler2, eval2 = _objects(7)
    log2: list = []
    trainer2 = _trainer(model2, opt2, sched2, log2)
    resume = ResumeHandler(saver.path, {"model": model2, "optimizer": opt2, "lr_scheduler": sched2, "scaler": scaler2,
                                         "evaluator": eval2})
    resume.attach(trainer2)
    state = trainer2.run(data, max_epochs=2)

    assert resume.resumed
    assert [it for it, _ in log2] == [5, 6, 7, 8]  # the iteration count continues
    assert log1 + log2 == full_log  # same LR sequence (warm-up continued, not restarted)
    assert state.epoch == 2 and state.iteration == 8
    for p_full, p_res in zip(model.parameters(), model2.parameters()):
        assert torch.allclose(p_full, p_res, atol=1e-6)
    assert scaler2.get_scale() == scaler1.get_scale() == 2.0
    assert eval2.state.best_metric == 0.25 and eval2.state.best_metric_epoch == 1


def test_auto_resume_says_what_it_resumes_and_how_to_start_fresh(tmp_path, caplog):
    """auto_resume: one INFO line names the file it found, its epoch, iteration and the settings it was written
    with; a found file that cannot be continued (another run's epoch length) fails saying it was auto-resumed,
    from which file, and how to start fresh. An explicit --resume does not mention auto_resume."""
    model, opt, sched, _, _ = _objects(1)
    saver = ResumableCheckpointSaver(tmp_path, {"model": model, "optimizer": opt, "lr_scheduler": sched})
    first = _trainer(model, opt, sched, [])
    saver.attach(first)
    first.run(_data(), max_epochs=1)

    model2, opt2, sched2, _, _ = _objects(2)
    with caplog.at_level(logging.INFO, logger="components.checkpoint"):
        handler = ResumeHandler(None, {"model": model2, "optimizer": opt2, "lr_scheduler": sched2}, auto_resume="true",
                                ckpt_dir=tmp_path)
        second = _trainer(model2, opt2, sched2, [])
        handler.attach(second)
        second.run(_data(), max_epochs=2)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("resumed from")]
    assert lines == [
        f"resumed from {saver.path} (found by auto_resume; --checkpointing#auto_resume false or another --ckpt_dir starts fresh) "
        "at epoch 1, iteration 4; it was written with max_epochs=1, epoch_length=4"
    ]
    assert handler.auto and handler.report["written_with"] == {"max_epochs": 1, "epoch_length": 4}

    # the same folder, another run: 3 iterations per epoch
    model3, opt3, sched3, _, _ = _objects(3)
    trainer = _trainer(model3, opt3, sched3, [])
    ResumeHandler(None, {"model": model3, "optimizer": opt3, "lr_scheduler": sched3}, auto_resume=True, ckpt_dir=tmp_path).attach(trainer)
    with pytest.raises(CheckpointLoadError) as err:
        trainer.run(_data()[:3], max_epochs=2)
    message = str(err.value)
    assert message.startswith(f"auto_resume found '{saver.path}'")
    assert "epoch_length=4 but this run has epoch_length=3" in message
    assert "--checkpointing#auto_resume false or another --ckpt_dir" in message
    given = ResumeHandler(saver.path, {"model": model3, "optimizer": opt3, "lr_scheduler": sched3}, auto_resume=True,
                          ckpt_dir=tmp_path)
    trainer = _trainer(model3, opt3, sched3, [])
    given.attach(trainer)
    with pytest.raises(CheckpointLoadError, match=f"^resume checkpoint '{saver.path}'") as err:
        trainer.run(_data()[:3], max_epochs=2)
    assert "--checkpointing#auto_resume false" not in str(err.value)

    # a file auto_resume cannot read at all names the same way out
    saver.path.write_bytes(b"not a checkpoint")
    model4, opt4, _, _, _ = _objects(4)
    trainer = Engine(lambda e, b: None)
    ResumeHandler(None, {"model": model4, "optimizer": opt4}, auto_resume=True, ckpt_dir=tmp_path).attach(trainer)
    with pytest.raises(CheckpointLoadError, match="auto_resume found .*not a readable torch checkpoint.*--checkpointing#auto_resume false"):
        trainer.run(_data(), max_epochs=1)
    with pytest.raises(ValueError, match="auto_resume needs ckpt_dir"):
        ResumeHandler(None, {"model": model4}, auto_resume=True)
    assert ResumeHandler(None, {"model": model4}, auto_resume=False, ckpt_dir=tmp_path).path is None  # off: from scratch


@pytest.mark.parametrize("handler", [ResumableCheckpointSaver, ResumeHandler])
def test_the_saver_and_the_resume_handler_take_one_to_save_dict(tmp_path, handler):
    """One dict, written once in a config for both; a key outside the file's entries, no model, or a model that is no
    module is refused naming the handler, before any training."""
    model = nn.Linear(1, 1)
    built = handler(tmp_path, {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1)})
    assert built.objects.model is model and built.objects.optimizer is not None and built.objects.sampler is None
    name = handler.__name__
    with pytest.raises(ValueError, match=rf"^{name}: to_save has \['network'\]; its keys are model, optimizer, "):
        handler(tmp_path, {"model": model, "network": model})
    with pytest.raises(ValueError, match=rf"^{name}: to_save needs a 'model'"):
        handler(tmp_path, {"optimizer": torch.optim.SGD(model.parameters(), lr=0.1)})
    with pytest.raises(TypeError, match=rf"^{name}: to_save\['model'\] must be a torch.nn.Module, got dict"):
        handler(tmp_path, {"model": {}})
    with pytest.raises(TypeError, match=rf"^{name}: to_save\['optimizer'\] has no state_dict"):
        handler(tmp_path, {"model": model, "optimizer": object()})


def test_resume_handler_errors_and_noop(tmp_path):
    data = _data()
    model, opt, sched, _, _ = _objects(1)
    saver = ResumableCheckpointSaver(tmp_path, {"model": model}, epoch_interval=None, iteration_interval=3, save_final=False)
    trainer = _trainer(model, opt, sched, [])
    saver.attach(trainer)
    trainer.run(data, max_epochs=1)
    assert torch.load(saver.path, weights_only=True)["trainer"]["iteration"] == 3  # mid-epoch save

    # None path: nothing happens (configs can pass @resume = null)
    m2, o2, s2, _, _ = _objects(2)
    before = _state_copy(m2)
    t2 = _trainer(m2, o2, s2, [])
    ResumeHandler(None, {"model": m2, "optimizer": o2, "lr_scheduler": s2}).attach(t2)
    t2.run(data, max_epochs=1)
    assert t2.state.iteration == 4 and not torch.equal(m2.weight, before["weight"])

    # the file lacks the optimizer entry: clear error naming file and entry, model untouched
    m3, o3, s3, _, _ = _objects(3)
    before = _state_copy(m3)
    t3 = _trainer(m3, o3, s3, [])
    ResumeHandler(saver.path, {"model": m3, "optimizer": o3, "lr_scheduler": s3}).attach(t3)
    with pytest.raises(CheckpointLoadError) as err:
        t3.run(data, max_epochs=2)
    assert str(saver.path) in str(err.value) and "'optimizer'" in str(err.value) and "'lr_scheduler'" in str(err.value)
    assert all(torch.equal(v, before[k]) for k, v in m3.state_dict().items())

    # another architecture: error before anything is modified
    other = nn.Linear(3, 2)
    t4 = Engine(lambda e, b: None)
    ResumeHandler(saver.path, {"model": other}).attach(t4)
    with pytest.raises(CheckpointLoadError, match="does not match the network"):
        t4.run(data, max_epochs=1)

    # missing file: error unless missing_ok
    t5 = Engine(lambda e, b: None)
    ResumeHandler(tmp_path / "nope.pt", {"model": nn.Linear(3, 1)}).attach(t5)
    with pytest.raises(FileNotFoundError, match="nope.pt"):
        t5.run(data, max_epochs=1)
    t6 = Engine(lambda e, b: None)
    ResumeHandler(tmp_path / "nope.pt", {"model": nn.Linear(3, 1)}, missing_ok=True).attach(t6)
    assert t6.run(data, max_epochs=1).iteration == 4

    # mid-epoch checkpoint: the counters continue from iteration 3
    m7, o7, s7, _, _ = _objects(1)
    log7: list = []
    t7 = _trainer(m7, o7, s7, log7)
    ResumeHandler(saver.path, {"model": m7}).attach(t7)
    t7.run(data, max_epochs=1)
    assert [it for it, _ in log7] == [4]


def test_saver_writes_on_rank0_only(tmp_path, monkeypatch):
    monkeypatch.setattr("ignite.distributed.get_rank", lambda: 1)
    saver = ResumableCheckpointSaver(tmp_path, {"model": nn.Linear(1, 1)})
    trainer = Engine(lambda e, b: None)
    saver.attach(trainer)
    trainer.run([0, 1], max_epochs=2)
    assert list(tmp_path.iterdir()) == []


def test_resumable_checkpoint_is_a_pretrained_source(tmp_path):
    torch.manual_seed(0)
    ssl = SSLHead(feature_size=FS)
    saver = ResumableCheckpointSaver(tmp_path, {"model": ssl, "optimizer": torch.optim.AdamW(ssl.parameters())})
    saver.save(Engine(lambda e, b: None))
    target = _make_target("swinunetr")
    report = load_pretrained(target, saver.path)
    assert report.layout == "ssl_collection" and report.container == "model"
    assert torch.equal(target.swinViT.patch_embed.proj.weight, ssl.swinViT.patch_embed.proj.weight)


# ------------------------------------------------------------------------------------------------------------
# resume follows this run's config; the best model survives restarts
# ------------------------------------------------------------------------------------------------------------


def _scheduled(max_epochs: int, weight_decay: float = 0.01):
    """Model, AdamW and the bundles' WarmupCosineSchedule (warm-up 3 iterations, t_total from max_epochs)."""
    from monai.optimizers import WarmupCosineSchedule

    torch.manual_seed(1)
    model = nn.Linear(3, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=weight_decay)
    return model, opt, WarmupCosineSchedule(opt, warmup_steps=3, t_total=max_epochs * 4)


def _lr_run(tmp_path, max_epochs: int, resume: bool = False, stop_after: int | None = None, **kw) -> dict[int, float]:
    model, opt, sched = _scheduled(max_epochs, **kw)
    log: list = []
    trainer = _trainer(model, opt, sched, log)
    to_save = {"model": model, "optimizer": opt, "lr_scheduler": sched}
    ResumeHandler(tmp_path / "checkpoint.pt" if resume else None, to_save).attach(trainer)
    ResumableCheckpointSaver(tmp_path, to_save).attach(trainer)
    if stop_after:
        trainer.add_event_handler(Events.EPOCH_COMPLETED(once=stop_after), lambda e: e.terminate())
    trainer.run(_data(), max_epochs=max_epochs)
    return dict(log)


@pytest.mark.parametrize("first, stop, resumed", [(2, None, 4), (4, 2, 3)], ids=["longer", "shorter"])
def test_resume_follows_the_configured_max_epochs(tmp_path, caplog, first, stop, resumed):
    """2 epochs of a 2-epoch schedule resumed with max_epochs 4 (and 2 epochs of a 4-epoch schedule resumed with 3):
    every LR after the resume is that of an uninterrupted run with the resumed max_epochs."""
    straight = _lr_run(tmp_path / "straight", resumed)
    head = _lr_run(tmp_path / "run", first, stop_after=stop)
    assert sorted(head) == list(range(1, 9))
    with caplog.at_level(logging.INFO, logger="components.checkpoint"):
        tail = _lr_run(tmp_path / "run", resumed, resume=True, weight_decay=0.05)
    assert sorted(tail) == list(range(9, 4 * resumed + 1))
    assert tail == {it: straight[it] for it in tail}  # every iteration, exactly
    assert tail[max(tail)] > 0 and max(tail.values()) < 0.1  # no LR of 0 at the old end, no climb back to the peak
    settings = "{'warmup_steps': 3, 't_total': %d}" % (4 * resumed)
    assert f"LR schedule continues at step 8 with this run's settings {settings}" in caplog.text
    assert "optimizer param_groups[0].weight_decay: 0.01 -> 0.05 from this run's config" in caplog.text


def test_restored_schedule_keeps_this_runs_settings():
    from components.checkpoint import restore_schedule

    _, _, old = _scheduled(2)
    for _ in range(5):
        old.optimizer.step()
        old.step()
    _, opt, new = _scheduled(10)
    assert restore_schedule(new, old.state_dict()) == "position"
    assert (new.last_epoch, new._step_count, new.t_total, new.warmup_steps) == (5, 6, 40, 3)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * new.lr_lambda(5))
    step = torch.optim.lr_scheduler.StepLR(torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=1.0), step_size=2)
    assert restore_schedule(step, step.state_dict()) == "full"  # no closed form of the step count: restored whole


class _Weight(nn.Module):
    """One weight; the validation metric (mean absolute error against 0 of the output for input 1) is |w|."""

    def __init__(self, w: float) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor([[w]]))

    def forward(self, x):
        return x * self.w


def _validated_run(tmp_path, weight_after_step: float, epochs: int, saver_cls=None) -> tuple:
    """A trainer whose step sets w, validated each epoch (MAE = |w|, lower is better) by a MONAI evaluator with the
    bundles' best-model saver, the resumable saver and (when a checkpoint exists) the resume handler."""
    from monai.engines import SupervisedEvaluator
    from monai.handlers import MeanAbsoluteError, StatsHandler, ValidationHandler, from_engine

    from components.checkpoint import BestModelSaver

    net = _Weight(1.0)
    data = [{"image": torch.ones(1, 1), "label": torch.zeros(1, 1)}]
    evaluator = SupervisedEvaluator(
        "cpu", data, net, key_val_metric={"val_mae": MeanAbsoluteError(output_transform=from_engine(["pred", "label"]))},
        metric_cmp_fn=lambda current, best: current < best, decollate=False,
    )  # fmt: skip
    (saver_cls or BestModelSaver)(str(tmp_path), {"model": net}, key_metric_filename="model.pt",
                                  key_metric_negative_sign=True).attach(evaluator)  # fmt: skip
    StatsHandler(iteration_log=False, name="val_stats").attach(evaluator)  # logs the best metric, as in the bundles

    def step(engine, batch):
        with torch.no_grad():
            net.w.fill_(weight_after_step)

    trainer = Engine(step)
    ckpt = tmp_path / "checkpoint.pt"
    ResumeHandler(ckpt if ckpt.exists() else None, {"model": net, "evaluator": evaluator}).attach(trainer)
    ValidationHandler(1, evaluator).attach(trainer)
    ResumableCheckpointSaver(tmp_path, {"model": net, "evaluator": evaluator}).attach(trainer)
    trainer.run([0], max_epochs=epochs)
    return evaluator.state, torch.load(ckpt, weights_only=True)


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_best_model_survives_a_resume_with_a_worse_validation(tmp_path, caplog):
    state, ckpt = _validated_run(tmp_path, 0.5, epochs=1)
    stats, logged = logging.getLogger("val_stats"), _Lines()
    stats.addHandler(logged)
    model = tmp_path / "model.pt"
    assert (ckpt["best_metric"], ckpt["best_metric_epoch"], ckpt["best_metric_iteration"]) == (0.5, 1, 1)
    before = model.read_bytes()
    with caplog.at_level(logging.INFO):
        state, ckpt = _validated_run(tmp_path, 0.8, epochs=2)  # resumed; its validation (0.8) is worse
    assert model.read_bytes() == before  # byte-identical
    assert (state.best_metric, state.best_metric_epoch, state.best_metric_iteration) == (0.5, 1, 1)
    assert (ckpt["best_metric"], ckpt["best_metric_epoch"], ckpt["best_metric_iteration"]) == (0.5, 1, 1)
    assert "restored best val_mae 0.5 (epoch 1, iteration 1)" in caplog.text
    assert f"best model {model} has val_mae 0.5 (epoch 1, iteration 1, restored from the resumed checkpoint)" in caplog.text
    stats.removeHandler(logged)
    assert "Key metric: val_mae best value: 0.5 at epoch: 1" in logged.lines  # MONAI's StatsHandler: the stored best
    state, ckpt = _validated_run(tmp_path, 0.25, epochs=3)  # a strictly better validation replaces it
    assert model.read_bytes() != before
    assert torch.load(model, weights_only=True)["w"].item() == 0.25
    assert (ckpt["best_metric"], ckpt["best_metric_epoch"], ckpt["best_metric_iteration"]) == (0.25, 3, 3)


def test_monai_checkpoint_saver_alone_overwrites_the_best_model_after_a_resume(tmp_path):
    """Why BestModelSaver exists: with MONAI's saver the worse model of the resumed run replaces model.pt."""
    from monai.handlers import CheckpointSaver

    def saver(*args, **kwargs):
        return CheckpointSaver(*args, save_key_metric=True, **kwargs)

    _validated_run(tmp_path, 0.5, epochs=1, saver_cls=saver)
    _validated_run(tmp_path, 0.8, epochs=2, saver_cls=saver)
    assert torch.load(tmp_path / "model.pt", weights_only=True)["w"].item() == pytest.approx(0.8)


@pytest.mark.parametrize("none", [None, "", "None", "null", " NULL "])
def test_pretrained_loader_without_weights_warns_and_keeps_the_initialisation(none, caplog):
    model = _make_target("swinunetr")
    before = _state_copy(model)
    loader = PretrainedLoader(none, model, hint="the default is ../ssl/models/model.pt")
    assert loader.path is None
    with caplog.at_level(logging.INFO, logger="components.checkpoint"):
        assert loader() is None
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # random initialisation kept
    (record,) = [r for r in caplog.records if "PretrainedLoader" in r.getMessage()]
    assert record.levelno == logging.WARNING
    assert record.getMessage() == (
        "PretrainedLoader: no pretrained weights (pretrained_path is none): SwinUNETR trains from random "
        "initialisation; the default is ../ssl/models/model.pt"
    )
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="components.checkpoint"):
        PretrainedLoader(none, model, warn_from_scratch=False)()  # pretraining from scratch is the normal case
    assert [r.levelno for r in caplog.records] == [logging.INFO]


def test_pretrained_loader_says_where_the_weights_came_from(tmp_path, caplog):
    ck = tmp_path / "ssl.pt"
    torch.save(_sslhead_state(4), ck)
    model = _make_target("swinunetr")
    with caplog.at_level(logging.INFO, logger="components.checkpoint"):
        PretrainedLoader(ck, model)()
    assert f"PretrainedLoader: SwinUNETR starts from {ck}: layout=ssl_collection target=swinunetr: loaded " in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_window_size_mismatch_names_the_window():
    """An encoder pretrained with another attention window has other bias tables: the error says which window."""
    source = SSLHead(feature_size=12, window_size=4).state_dict()
    with pytest.raises(CheckpointLoadError, match=r"window_size=4 in the checkpoint, 7 in the network\. Run with --network_def#window_size 4\."):
        load_pretrained(SwinUNETR(in_channels=1, out_channels=2, feature_size=12), source)
    model = SwinUNETR(in_channels=1, out_channels=2, feature_size=12, window_size=4)
    report = load_pretrained(model, source)
    assert report.encoder_loaded == report.encoder_keys and not report.shape_mismatched
    for key, value in source.items():
        if key.startswith("swinViT."):
            assert torch.equal(model.state_dict()[key], value), key


# ------------------------------------------------------------------------------------------------------------
# saving by time
# ------------------------------------------------------------------------------------------------------------


class FakeClock:
    """Seconds that advance by ``per_iteration(iteration)`` at every trainer iteration (attached first)."""

    def __init__(self, per_iteration) -> None:
        self.now, self.per_iteration = 0.0, per_iteration

    def attach(self, engine: Engine) -> None:
        engine.add_event_handler(Events.ITERATION_COMPLETED, lambda e: setattr(self, "now", self.now + self.per_iteration(e.state.iteration)))

    def __call__(self) -> float:
        return self.now


def _timed_saver(tmp_path, model, opt, sched, clock: FakeClock, evaluator=None,
                 **kwargs) -> tuple[ResumableCheckpointSaver, list]:
    to_save = {"model": model, "optimizer": opt, "lr_scheduler": sched, "evaluator": evaluator}
    saver = ResumableCheckpointSaver(tmp_path, to_save, epoch_interval=None, save_final=False, **kwargs)
    saver.clock = clock
    saved: list = []
    save = saver.save
    saver.save = lambda engine: (saved.append(engine.state.iteration), save(engine))[1]  # every call, on every rank
    return saver, saved


@pytest.mark.parametrize(
    "per_iteration, expected",
    [
        (lambda it: 1.0, [6, 11, 16, 21]),  # 5 s: every 5 iterations after the first (the clock starts after it)
        (lambda it: 1.0 if it <= 11 else 0.5, [6, 11, 21]),  # faster after 11: at 16 only 2.5 s passed, look again
    ],
)
def test_saves_by_time_at_the_iterations_of_the_interval(tmp_path, per_iteration, expected):
    model, opt, sched, _, _ = _objects(1)
    trainer = _trainer(model, opt, sched, [])
    clock = FakeClock(per_iteration)
    clock.attach(trainer)
    saver, saved = _timed_saver(tmp_path, model, opt, sched, clock, time_interval_s=5.0, calibration_iterations=2)
    saver.attach(trainer)
    trainer.run(_data(), max_epochs=6)  # 24 iterations
    assert saved == expected


def _ranks_with_their_own_clocks(rank: int) -> dict:
    """Rank r's clock runs 1 + 2r seconds per iteration: only rank 0's decides."""
    import tempfile

    model, opt, sched, _, _ = _objects(1)
    trainer = _trainer(model, opt, sched, [])
    clock = FakeClock(lambda it: 1.0 + 2 * rank)
    clock.attach(trainer)
    with tempfile.TemporaryDirectory() as tmp:
        saver, saved = _timed_saver(tmp, model, opt, sched, clock, time_interval_s=5.0, calibration_iterations=2)
        saver.attach(trainer)
        trainer.run(_data(), max_epochs=6)
    return {"saved": saved}


def test_every_rank_saves_at_rank_zeros_times(tmp_path):
    first, second = run_scenario(_ranks_with_their_own_clocks, tmp_path, world=2)
    assert first["saved"] == second["saved"] == [6, 11, 16, 21]


def test_a_time_saved_checkpoint_resumes_mid_epoch_with_the_uninterrupted_lr(tmp_path):
    data = _data()
    model, opt, sched, _, _ = _objects(1)
    full_log: list = []
    _trainer(model, opt, sched, full_log).run(data, max_epochs=3)

    model1, opt1, sched1, _, _ = _objects(1)
    log1: list = []
    trainer1 = _trainer(model1, opt1, sched1, log1)
    clock = FakeClock(lambda it: 1.0)
    clock.attach(trainer1)
    saver, saved = _timed_saver(tmp_path, model1, opt1, sched1, clock, time_interval_s=5.0, calibration_iterations=2)
    saver.attach(trainer1)
    trainer1.add_event_handler(Events.ITERATION_COMPLETED(once=7), lambda e: e.terminate())  # killed after 7
    trainer1.run(data, max_epochs=3)
    assert saved == [6]  # in the middle of epoch 2

    model2, opt2, sched2, _, _ = _objects(7)
    log2: list = []
    trainer2 = _trainer(model2, opt2, sched2, log2)
    ResumeHandler(saver.path, {"model": model2, "optimizer": opt2, "lr_scheduler": sched2}).attach(trainer2)
    trainer2.run(data, max_epochs=3)
    assert [it for it, _ in log2] == list(range(7, 13))
    assert log1[:6] + log2 == full_log


def test_a_new_best_validation_is_saved_at_once(tmp_path):
    model, opt, sched, _, evaluator = _objects(1)
    trainer = _trainer(model, opt, sched, [])
    scores = iter([0.5, 0.4, 0.7])

    @trainer.on(Events.EPOCH_COMPLETED)
    def _validate(engine):  # stands for MONAI's validation: best_metric_epoch is the trainer epoch of a new best
        evaluator.state.epoch = engine.state.epoch
        score = next(scores)
        if score > evaluator.state.best_metric:
            evaluator.state.best_metric, evaluator.state.best_metric_epoch = score, engine.state.epoch
        evaluator.fire_event(Events.EPOCH_COMPLETED)

    saver, saved = _timed_saver(tmp_path, model, opt, sched, FakeClock(lambda it: 1.0), evaluator=evaluator)
    saver.attach(trainer)
    trainer.run(_data(), max_epochs=3)
    assert saved == [4, 12]  # epochs 1 and 3 improved; epoch 2 did not
    ckpt = torch.load(saver.path, weights_only=True)
    assert ckpt["best_metric"] == 0.7 and ckpt["best_metric_iteration"] == 12


def test_time_interval_errors(tmp_path):
    model = nn.Linear(1, 1)
    for bad in (0, -1.0, "600"):
        with pytest.raises(ValueError, match="time_interval_s must be a positive number"):
            ResumableCheckpointSaver(tmp_path, {"model": model}, time_interval_s=bad)
    with pytest.raises(ValueError, match="nothing to do"):
        ResumableCheckpointSaver(tmp_path, {"model": model}, epoch_interval=None, save_final=False)
