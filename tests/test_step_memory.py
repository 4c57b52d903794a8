"""use_checkpoint "auto": the activation estimate, the decision, and the bundles' networks built with it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from monai.bundle import ConfigParser
from monai.networks.nets import SwinUNETR

import components
from components import step_memory

BUNDLES = Path(__file__).resolve().parents[1] / "bundles"
GIB = 2**30


def _net() -> SwinUNETR:
    torch.manual_seed(0)
    return SwinUNETR(in_channels=1, out_channels=3, feature_size=12, window_size=4)


def _checkpointed(net: torch.nn.Module) -> list[bool]:
    return [m.use_checkpoint for m in net.modules() if isinstance(getattr(m, "use_checkpoint", None), bool)]


def _real_saved_bytes(net: torch.nn.Module, shape: list[int]) -> int:
    """Bytes of the distinct storages a real CPU forward saves for backward."""
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        net(torch.rand(shape))
    return sum(storages.values())


@pytest.mark.parametrize("shape", [[1, 1, 64, 32, 32], [2, 1, 64, 64, 32]])
def test_meta_estimate_matches_what_a_real_forward_saves(shape):
    net = _net().train()
    estimate = components.saved_activation_bytes(net, [shape])
    real = _real_saved_bytes(net, shape)
    assert 0.85 < estimate / real < 1.15, (estimate, real)
    assert _checkpointed(net) and not any(_checkpointed(net))  # the probe ran on a copy


def test_checkpointing_saves_less_and_is_switched_on_every_block():
    net = components.set_checkpointing(_net().train(), True)
    assert len(_checkpointed(net)) > 8 and all(_checkpointed(net))
    shape = [1, 1, 64, 32, 32]
    with_ckpt = _real_saved_bytes(net, shape)
    without = _real_saved_bytes(components.set_checkpointing(net, False), shape)
    assert with_ckpt < 0.7 * without


def test_auto_decides_from_free_memory_and_forced_values_win(caplog):
    net, shapes = _net(), [[2, 1, 64, 32, 32]]
    need = components.saved_activation_bytes(net, shapes) + 4 * sum(p.numel() * 4 for p in net.parameters())
    with caplog.at_level("INFO", logger="components.step_memory"):
        assert components.checkpointing_decision(net, "auto", shapes, "cpu", free_bytes=int(need * 2)) is False
        assert components.checkpointing_decision(net, "auto", shapes, "cpu", free_bytes=int(need * 1.1)) is True  # margin
    assert "checkpointing off" in caplog.text and "checkpointing on" in caplog.text and "GiB free on cpu" in caplog.text
    half = components.saved_activation_bytes(net, shapes) / 2 + 4 * sum(p.numel() * 4 for p in net.parameters())
    assert components.checkpointing_decision(net, "auto", shapes, "cpu", amp="true", free_bytes=int(half * 1.3)) is False
    assert components.checkpointing_decision(net, True, shapes, "cpu", free_bytes=0) is True
    assert components.checkpointing_decision(net, "false", shapes, "cpu", free_bytes=0) is False
    with pytest.raises(ValueError, match='use_checkpoint must be true, false or "auto"'):
        components.checkpointing_decision(net, "sometimes", shapes, "cpu")


def test_free_memory_of_the_cpu_is_positive_and_below_the_total():
    free = components.free_memory_bytes("cpu")
    assert 0 < free <= __import__("os").sysconf("SC_PHYS_PAGES") * __import__("os").sysconf("SC_PAGE_SIZE")


def test_prepare_network_needs_step_inputs_for_auto():
    with pytest.raises(ValueError, match="step_inputs"):
        components.prepare_network(_net(), "cpu", use_checkpoint="auto")
    net = components.prepare_network(_net(), "cpu", fused_attention="false", use_checkpoint="true")
    assert all(_checkpointed(net))


@pytest.mark.parametrize("bundle", ["swin_unetr_ssl_pretrain", "swin_unetr_btcv_finetune", "swin_unetr_brats_finetune",
                                    "swin_unetr_dino_pretrain"])  # fmt: skip
def test_bundles_checkpoint_only_when_the_step_does_not_fit(bundle, monkeypatch):
    for free, expected in ((GIB**2, False), (1, True)):
        monkeypatch.setattr(step_memory, "free_memory_bytes", lambda device, free=free: free)
        parser = ConfigParser()
        parser.read_config(str(BUNDLES / bundle / "configs" / "train.json"))
        parser.update({"feature_size": 12, "device": "cpu", "roi_size": [64, 64, 64], "training#local_size": [32, 32, 32]})
        parser.get_parsed_content("imports")
        assert parser["speed#use_checkpoint"] == "auto"
        flags = _checkpointed(parser.get_parsed_content("network"))
        assert flags and all(f is expected for f in flags)
