"""The CUDA paths of issue 15, on a GPU (every test skips without CUDA): fused window attention in training, the
memory-based checkpointing decision, host-drawn views, one bf16 bundle step and the inductor-compiled step.

The CPU suite checks the same functions where the CPU allows (tests/test_attention.py, test_step_memory.py,
test_augment.py, test_host_sync.py); here the CUDA kernels themselves are compared with the explicit paths.
"""

from __future__ import annotations

import copy

import pytest
import torch
from ignite.engine import Events
from monai.networks.nets import SwinUNETR
from monai.networks.nets.swin_unetr import WindowAttention

import components
from components.recipes.inpainting_contrast.views import _apply_aug, _draw_aug

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _swin_unetr(window: int) -> SwinUNETR:
    torch.manual_seed(0)
    net = SwinUNETR(in_channels=1, out_channels=3, feature_size=12, window_size=window)
    with torch.no_grad():  # a spread bias exercises the bias path and its gradient
        for module in net.modules():
            if isinstance(module, WindowAttention):
                module.relative_position_bias_table.normal_(0.0, 0.5)
    return net.cuda()


def _grads(net: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    net.zero_grad(set_to_none=True)
    out = net(x)
    (out.float().square().mean() + out.float().mean()).backward()
    return out.detach().float(), {n: p.grad.detach().float().clone() for n, p in net.named_parameters() if p.grad is not None}


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("window, roi", [(4, (64, 32, 32)), (7, (64, 64, 32))])
def test_fused_cuda_kernel_equals_explicit_in_float32(window, roi):
    """The fused CUDA kernel (bias with its gradient, shifted-window mask) against MONAI's explicit attention, both
    in float32 without TF32: outputs and every gradient, the bias tables included."""
    matmul_tf32, cudnn_tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        explicit = _swin_unetr(window)
        fused = components.use_fused_attention(copy.deepcopy(explicit))
        x = torch.rand(2, 1, *roi, device="cuda", generator=torch.Generator(device="cuda").manual_seed(1))
        out_e, grads_e = _grads(explicit, x)
        out_f, grads_f = _grads(fused, x)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul_tf32, cudnn_tf32
    assert _relative(out_f, out_e) < 1e-5
    floor = 1e-6 * max(g.norm().item() for g in grads_e.values())
    for name, grad in grads_e.items():
        error = ((grads_f[name] - grad).norm() / max(grad.norm().item(), floor)).item()
        assert error < 1e-3, (name, error)


def test_fused_bf16_training_uses_less_memory_and_stays_close():
    explicit = _swin_unetr(7)
    fused = components.use_fused_attention(copy.deepcopy(explicit))
    x = torch.rand(2, 1, 96, 96, 96, device="cuda")
    reference, _ = _grads(explicit, x)
    peaks = {}
    for name, net in (("explicit", explicit), ("fused", fused)):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out, grads = _grads(net, x)
        peaks[name] = torch.cuda.max_memory_allocated()
        assert _relative(out, reference) < 0.05 and all(torch.isfinite(g).all() for g in grads.values())
    assert peaks["fused"] < peaks["explicit"], peaks


def test_auto_checkpointing_reads_the_gpu_free_memory():
    net = components.SSLHead(feature_size=12, window_size=4).cuda()
    free = components.free_memory_bytes("cuda")
    assert 0 < free <= torch.cuda.get_device_properties(0).total_memory
    assert components.checkpointing_decision(net, "auto", [[4, 1, 64, 64, 64]], "cuda", amp=True) is False
    assert components.checkpointing_decision(net, "auto", [[4, 1, 64, 64, 64]], "cuda", free_bytes=1) is True


def test_host_drawn_views_on_the_gpu_equal_the_cpu_computation():
    """Boxes from the host generator, noise from the CUDA generator: the views equal the CPU computation of the same
    draws, and the boxes stay on the host, where the views read them without a synchronisation."""
    x = torch.rand(4, 1, 96, 96, 96, device="cuda")
    draws = _draw_aug(x, torch.Generator(device="cuda").manual_seed(0), 0.3, 0.25, 0.05, sync=False,
                      box_generator=torch.Generator().manual_seed(1))  # fmt: skip
    assert draws.inner.start.device.type == "cpu" and draws.noise.device.type == "cuda"
    on_cpu = type(draws)(*(type(d)(*(t.cpu() for t in d)) if isinstance(d, tuple) else d.cpu() for d in draws))
    assert torch.equal(_apply_aug(x, draws).cpu(), _apply_aug(x.cpu(), on_cpu))


def test_bf16_bundle_step_on_the_gpu():
    """A few SSL trainer iterations in bf16 on the GPU with fused attention: finite, the loss parts logged."""
    torch.manual_seed(0)
    network = components.use_fused_attention(components.SSLHead(feature_size=12, window_size=4).cuda())
    loader = [{"image": torch.rand(2, 1, 64, 64, 64).pin_memory()} for _ in range(3)]
    trainer = components.SSLTrainer(device="cuda", max_epochs=1, train_data_loader=loader, network=network,
                                    optimizer=torch.optim.AdamW(network.parameters(), lr=1e-4),
                                    loss_function=components.SSLLoss(), amp=True, amp_dtype="bfloat16", log_interval=1,
                                    train_handlers=[components.StopOnNonFiniteLoss()])  # fmt: skip
    assert trainer.host_generator is not None and trainer.host_generator.device.type == "cpu"
    trainer.run()
    log = trainer.state.output[0]["log"]
    assert set(log) >= {"loss", "loss_rot", "loss_contrast", "loss_recon"}
    assert all(torch.isfinite(torch.tensor(v)) for v in log.values())


def test_inductor_compiled_steps_match_eager_on_the_gpu():
    """The bundles' --compile true with inductor: 3 bf16 steps of an SSLHead within rounding of eager (inductor
    fuses and reorders float operations: 1e-2 relative on bf16 losses), and no graph compiled after the first
    epoch."""
    torch._dynamo.reset()
    loader = [{"image": torch.rand(2, 1, 64, 64, 64, generator=torch.Generator().manual_seed(i))} for i in range(3)]
    losses, graphs = {}, []
    for compile in (False, True):
        torch.manual_seed(0)
        network = components.use_fused_attention(components.SSLHead(feature_size=12, window_size=4).cuda())
        trainer = components.SSLTrainer(device="cuda", max_epochs=2, train_data_loader=loader, network=network,
                                        optimizer=torch.optim.AdamW(network.parameters(), lr=1e-4),
                                        loss_function=components.SSLLoss(), amp=True, amp_dtype="bfloat16",
                                        compile=compile, train_handlers=[components.CompileMonitor()])  # fmt: skip
        seen = losses.setdefault(compile, [])
        trainer.add_event_handler(Events.ITERATION_COMPLETED, lambda e, seen=seen: seen.append(float(e.state.output[0]["loss"])))
        trainer.add_event_handler(Events.EPOCH_COMPLETED, lambda e: graphs.append(components.compiled_graphs()))
        trainer.run()
    torch.testing.assert_close(torch.tensor(losses[True]), torch.tensor(losses[False]), rtol=1e-2, atol=1e-3)
    assert graphs[-1] == graphs[-2] >= 1
