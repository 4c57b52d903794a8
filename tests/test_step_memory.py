"""use_checkpoint "auto": the activation estimate, the decision, and the bundles' networks built with it."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from monai.bundle import ConfigParser
from monai.networks.nets import SwinUNETR
from monai.networks.nets.swin_unetr import WindowAttention

import components
from components.networks import step_memory
from components.config.running import run_config_files

BUNDLES = Path(__file__).resolve().parents[1] / "bundles"
GIB = 2**30


def _net(window: int = 4) -> SwinUNETR:
    torch.manual_seed(0)
    return SwinUNETR(in_channels=1, out_channels=3, feature_size=12, window_size=window)


def _parameter_bytes(net: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in net.parameters())


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
    with caplog.at_level("INFO", logger="components.networks.step_memory"):
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


def test_an_empty_input_saves_nothing():
    """A step without local crops feeds the self-distillation student an empty batch, which it skips: the probe
    skips it too (it used to fail in torch.cat with use_checkpoint "auto" and num_local_crops 0)."""
    net = components.SelfDistillationNetwork(feature_size=12, out_dim=8, hidden_dim=8, bottleneck_dim=8, window_size=4)
    alone = components.saved_activation_bytes(net, [[2, 1, 32, 32, 32]])
    assert alone > 0
    assert components.saved_activation_bytes(net, [[2, 1, 32, 32, 32], [0, 1, 32, 32, 32]]) == alone


@pytest.mark.parametrize("bundle", ["swin_unetr_ssl_pretrain", "swin_unetr_btcv_finetune", "swin_unetr_brats_finetune",
                                    "swin_unetr_dino_pretrain"])  # fmt: skip
def test_bundles_checkpoint_only_when_the_step_does_not_fit(bundle, monkeypatch):
    for free, expected in ((GIB**2, False), (1, True)):
        monkeypatch.setattr(step_memory, "free_memory_bytes", lambda device, free=free: free)
        parser = ConfigParser()
        parser.read_config([str(f) for f in run_config_files(BUNDLES / bundle, ["train.json"])])
        parser.update({"feature_size": 12, "device": "cpu", "roi_size": [64, 64, 64], "training#local_size": [32, 32, 32]})
        parser.get_parsed_content("imports")
        assert parser["speed#use_checkpoint"] == "auto"
        flags = _checkpointed(parser.get_parsed_content("train#network"))
        assert flags and all(f is expected for f in flags)


def _attention_calls(net: torch.nn.Module, shape: list[int]) -> list[tuple[int, int, int, int, int]]:
    """(windows b, heads h, tokens n, channels c, masks g) of every window-attention call of one forward, on a meta
    copy; g: the shifted-window masks (the fused bias is one per mask and head), 0 without a mask."""
    calls = []

    def record(module, args, kwargs):
        (b, n, c), mask = args[0].shape, args[1] if len(args) > 1 else kwargs.get("mask")
        calls.append((b, module.num_heads, n, c, 0 if mask is None else mask.shape[0]))

    probe = copy.deepcopy(net).to("meta")
    for module in probe.modules():
        if isinstance(module, WindowAttention):
            module.register_forward_pre_hook(record, with_kwargs=True)
    probe(torch.empty(shape, device="meta"))
    return calls


WINDOW7_STEP = [2, 1, 64, 64, 32]


@pytest.fixture(scope="module")
def window7():
    """The explicit (MONAI) and the fused network at window 7 and the estimates of a WINDOW7_STEP on cpu and cuda."""
    nets = {"explicit": _net(window=7)}
    nets["fused"] = components.use_fused_attention(copy.deepcopy(nets["explicit"]))
    estimates = {(name, device): step_memory.estimate_step_memory(net, [WINDOW7_STEP], device, world_size=1)
                 for name, net in nets.items() for device in ("cpu", "cuda")}  # fmt: skip
    return nets, estimates


def test_fused_kernel_is_counted_on_cuda_and_explicit_attention_on_the_cpu(window7):
    nets, on = window7
    # the CPU computes MONAI's explicit attention in training, so the fused network's step is the explicit one
    assert on["fused", "cpu"].activations == on["explicit", "cpu"].activations == on["explicit", "cuda"].activations
    assert on["fused", "cpu"].attention == on["explicit", "cuda"].attention == {"explicit": 8}
    assert on["fused", "cuda"].attention == {"fused kernel": 8}
    # per call (float32): explicit keeps q, k, v, the projection's input (b*n*c each) and the b*h*n*n softmax; the
    # fused kernel keeps q, k, v, the projection's input, the bias (max(g, 1)*h*n rows of n plus at most 8 padding
    # columns), the log-sum-exp (b*h rows of n plus at most 32) and, with a mask, its output (regrouped windows:
    # a copy of b*n*c; without one the projection's input is a view of it)
    calls = _attention_calls(nets["fused"], WINDOW7_STEP)
    most = sum(4 * (b * h * n * n - max(g, 1) * h * n * n - b * h * n - (b * n * c if g else 0))
               for b, h, n, c, g in calls)  # fmt: skip
    least = sum(4 * (b * h * n * n - max(g, 1) * h * n * (n + 8) - b * h * (n + 32) - (b * n * c if g else 0)) - 16
                for b, h, n, c, g in calls)  # fmt: skip
    explicit_bytes, fused_bytes = on["explicit", "cuda"].activations, on["fused", "cuda"].activations
    ratio, bounds = fused_bytes / explicit_bytes, (1 - most / explicit_bytes, 1 - least / explicit_bytes)
    print(f"activations on cuda: explicit {explicit_bytes / 2**20:.1f} MiB, fused {fused_bytes / 2**20:.1f} MiB, "
          f"ratio {ratio:.4f} in [{bounds[0]:.4f}, {bounds[1]:.4f}] from the shapes of {len(calls)} attention calls")
    assert bounds[0] <= ratio <= bounds[1] < 0.6, (ratio, bounds)
    # 16-bit: feature 12 has heads of 4 channels, which the fused kernels refuse; PyTorch's math kernel runs
    half = step_memory.estimate_step_memory(nets["fused"], [WINDOW7_STEP], "cuda", amp=True, world_size=1)
    assert half.attention == {"explicit": 8} and half.activations == explicit_bytes // 2


def test_auto_checkpoints_the_explicit_step_but_not_the_fused_one_of_the_same_size(window7, caplog):
    nets, on = window7
    free = int((on["fused", "cuda"].total + on["explicit", "cuda"].total) / 2 * 1.25)  # between the two needs
    with caplog.at_level("INFO", logger="components.networks.step_memory"):
        for name, expected in (("fused", False), ("explicit", True)):
            decision = components.checkpointing_decision(nets[name], "auto", [WINDOW7_STEP], "cuda", free_bytes=free,
                                                         world_size=1)  # fmt: skip
            assert decision is expected
    assert "cuda: fused kernel in 8 blocks" in caplog.text and "cuda: explicit in 8 blocks" in caplog.text
    assert "free on cuda -> checkpointing off" in caplog.text and "free on cuda -> checkpointing on" in caplog.text


# one training step (forward, backward, AdamW) in a fresh process: its peak resident memory (the address space's
# high-water mark, VmHWM: not ru_maxrss, which keeps the parent's across fork and exec) above the interpreter's
_REAL_STEP = """
import json, sys
import torch
from monai.networks.nets import SwinUNETR

def status_bytes(field):
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith(field + ":"))

shape, window = json.loads(sys.argv[1]), int(sys.argv[2])
before = status_bytes("VmRSS")
torch.manual_seed(0)
net = SwinUNETR(in_channels=1, out_channels=3, feature_size=12, window_size=window).train()
optimizer = torch.optim.AdamW(net.parameters())
net(torch.rand(shape)).mean().backward()
optimizer.step()
print(json.dumps(status_bytes("VmHWM") - before))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status; glibc's malloc")
def test_estimate_is_close_to_the_peak_of_a_real_cpu_step():
    shape, window = [1, 1, 64, 32, 32], 4
    estimate = step_memory.estimate_step_memory(_net(window), [shape], "cpu", world_size=1)
    # a fixed mmap threshold returns each freed tensor to the system, so that the peak RSS is the peak of the live
    # tensors; with glibc's default (a threshold that grows up to 32 MiB) freed heap memory stays resident
    env = dict(os.environ, OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="65536")
    result = subprocess.run([sys.executable, "-c", _REAL_STEP, json.dumps(shape), str(window)], env=env,
                            capture_output=True, text=True, timeout=300, check=True)  # fmt: skip
    real = json.loads(result.stdout.strip().splitlines()[-1])
    ratio = real / estimate.total
    print(f"CPU step {shape} at window {window}: estimated {estimate.total / 2**20:.1f} MiB (activations "
          f"{estimate.activations / 2**20:.1f}, states {estimate.states / 2**20:.1f}); peak RSS of the real step "
          f"{real / 2**20:.1f} MiB; ratio {ratio:.3f}")
    assert 0.85 < ratio < 1.25, ratio  # above 1 + margin the default margin would not cover the step


def test_teacher_and_ddp_buckets_add_one_parameter_copy_each(monkeypatch):
    net, shapes = _net(), [[1, 1, 64, 32, 32]]
    parameters = _parameter_bytes(net)
    plain = step_memory.estimate_step_memory(net, shapes, "cpu")  # one process: world size 1
    with_teacher = step_memory.estimate_step_memory(net, shapes, "cpu", teacher="true")
    distributed = step_memory.estimate_step_memory(net, shapes, "cpu", world_size=2)
    both = step_memory.estimate_step_memory(net, shapes, "cpu", teacher=True, world_size=4)
    assert (plain.teacher, plain.ddp_buckets, plain.world_size, plain.states) == (0, 0, 1, 4 * parameters)
    assert with_teacher.total - plain.total == with_teacher.teacher == parameters
    assert distributed.total - plain.total == distributed.ddp_buckets == parameters
    assert both.total - plain.total == 2 * parameters
    for bad in (0, 1.5, "2"):
        with pytest.raises(ValueError, match="world_size must be an integer >= 1"):
            step_memory.estimate_step_memory(net, shapes, "cpu", world_size=bad)
    with pytest.raises(ValueError, match="teacher must be true or false"):
        step_memory.estimate_step_memory(net, shapes, "cpu", teacher="maybe")
    # through prepare_network: the step fits alone (need 1.25 x total), not with a teacher and DDP's buckets
    monkeypatch.setattr(step_memory, "free_memory_bytes", lambda device: int((plain.total + parameters) * 1.25))
    alone = components.prepare_network(_net(), "cpu", "false", "auto", shapes)
    trained_with_both = components.prepare_network(_net(), "cpu", "false", "auto", shapes, teacher=True, world_size=2)
    assert not any(_checkpointed(alone)) and all(_checkpointed(trained_with_both))


def test_ranks_of_a_node_share_the_host_memory_but_not_their_gpus(monkeypatch, caplog):
    net, shapes = _net(), [[1, 1, 64, 32, 32]]
    need = step_memory.estimate_step_memory(net, shapes, "cpu", world_size=1).total * 1.25
    host = int(need * 1.5)  # the whole host's MemAvailable fits the step; half of it does not
    monkeypatch.setattr(step_memory, "free_memory_bytes", lambda device: host)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert step_memory.local_ranks_sharing("cpu") == 1
    assert components.checkpointing_decision(net, "auto", shapes, "cpu", world_size=1) is False
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert step_memory.local_ranks_sharing("cpu") == 2 and step_memory.local_ranks_sharing("cuda:1") == 1
    with caplog.at_level("INFO", logger="components.networks.step_memory"):
        assert components.checkpointing_decision(net, "auto", shapes, "cpu", world_size=1) is True
    shared = f"{host // 2 / GIB:.2f} GiB free on cpu (MemAvailable {host / GIB:.2f} GiB shared by 2 local ranks)"
    assert shared in caplog.text
    assert components.checkpointing_decision(net, "auto", shapes, "cuda", world_size=1) is False  # a GPU per rank
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "none")
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE must be a positive integer, got 'none'"):
        components.checkpointing_decision(net, "auto", shapes, "cpu")
