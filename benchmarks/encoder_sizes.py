"""SwinUNETR v2 at the VoCo encoder sizes B / L / H (feature 48 / 96 / 192): parameters, the memory of a training
step and what ``use_checkpoint: "auto"`` decides for it.

Per feature size, with ``use_v2=True`` and window 7 (VoCo's encoders):

- ``parameters``: of ``SwinUNETR(in_channels=1, out_channels=14)`` (BTCV's network) and of its encoder
  ``swinViT``; ``v2_blocks`` is what ``use_v2`` adds to the encoder (MONAI's residual blocks ``layers1c`` ..
  ``layers4c``: ``4590 * f ** 2``);
- ``step_estimate``: ``components.networks.step_memory.estimate_step_memory`` of one BTCV training step (``train#network#step_inputs``: batch 1 x
  4 crops at 96^3, so ``[4, 1, 96, 96, 96]``) on CUDA with amp and the fused attention kernel, one rank, no teacher,
  and ``checkpointing_decision("auto", free_bytes=80 GiB)``: whether the bundle would switch activation
  checkpointing on on an 80 GB GPU. The networks are built with their parameters on the ``meta`` device, so no
  memory and no GPU are needed, whatever the size;
- ``cpu_step`` (``--cpu_step``): a real CPU training step (forward, DiceCE loss, backward, AdamW) at a tiny ROI in a
  fresh process per size: the median wall time of ``--iters`` steps after one warm-up, the process's peak resident
  memory, and the CPU estimate of the same step beside it. When the AdamW step's estimate exceeds the host's
  ``MemAvailable`` (H needs about 23 GiB at 64x32x32), the step is timed with plain SGD instead, which keeps no
  optimizer state, and the entry says so (``optimizer``, ``adamw_estimate_gib``, ``mem_available_gib``): a step
  that cannot fit is not started, so the benchmark never ends in the kernel's out-of-memory kill. Sizes outside
  ``--cpu_sizes`` say ``"not measured"``.

    python benchmarks/encoder_sizes.py                                  # B / L / H estimates (a few seconds)
    python benchmarks/encoder_sizes.py --cpu_step                       # + CPU steps for B, L, H at 64x32x32
    python benchmarks/encoder_sizes.py --sizes 12 --roi 64 --cpu_step --cpu_sizes 12    # CI

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import queue
import resource
import statistics
import sys
import time
from collections.abc import Iterator, Sequence

import torch
from torch import nn

from machine import machine_info, write_result
from ssl_step import json_stdout

_GIB = 2**30
#: BTCV's network: 1 input channel, 14 labels (background and 13 organs)
IN_CHANNELS, OUT_CHANNELS = 1, 14
#: BTCV's training step: ``batch_size`` 1 x ``training#num_samples`` 4 crops
CROPS_PER_STEP = 4
WINDOW = 7
GPU_FREE_BYTES = 80 * _GIB
NOT_MEASURED = "not measured"


def _int_list(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Every parameter registered inside is moved to the ``meta`` device as it is registered (buffers stay real), so
    a network of any size costs only the memory of its largest single tensor while it is built.
    (``with torch.device("meta")`` cannot build MONAI's SwinTransformer: it reads its drop-path rates with
    ``.item()``.)"""
    register = nn.Module.register_parameter

    def to_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = to_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def swinunetr(feature_size: int, use_v2: bool = True) -> nn.Module:
    """BTCV's network at ``feature_size`` with the VoCo encoder (v2, window 7)."""
    from monai.networks.nets import SwinUNETR

    return SwinUNETR(
        in_channels=IN_CHANNELS, out_channels=OUT_CHANNELS, feature_size=feature_size, window_size=WINDOW, use_v2=use_v2
    )


def _count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def parameter_counts(feature_size: int) -> dict:
    """Parameters of BTCV's SwinUNETR v2 at ``feature_size``, of its encoder and of the v1 encoder (built on meta)."""
    with parameters_on_meta():
        v2, v1 = swinunetr(feature_size, True), swinunetr(feature_size, False)
    encoder, encoder_v1 = _count(v2.swinViT), _count(v1.swinViT)
    return {
        "swinunetr": _count(v2),
        "encoder": encoder,
        "encoder_v1": encoder_v1,
        "v2_blocks": encoder - encoder_v1,
        "swinunetr_millions": round(_count(v2) / 1e6, 2),
        "encoder_millions": round(encoder / 1e6, 2),
    }


def step_estimate(feature_size: int, roi: Sequence[int]) -> dict:
    """The CUDA step estimate (amp, fused attention, one rank) and the ``"auto"`` decision with 80 GiB free."""
    from components.networks.attention import use_fused_attention
    from components.networks.step_memory import checkpointing_decision, estimate_step_memory

    with parameters_on_meta():
        network = use_fused_attention(swinunetr(feature_size))
    shapes = [[CROPS_PER_STEP, IN_CHANNELS, *roi]]
    step = estimate_step_memory(network, shapes, "cuda", amp=True, teacher=False, world_size=1)
    checkpointing = checkpointing_decision(
        network, "auto", shapes, "cuda", amp=True, free_bytes=GPU_FREE_BYTES, world_size=1
    )
    return {
        "step_inputs": shapes,
        "activations_gib": round(step.activations / _GIB, 2),
        "weights_grads_adamw_gib": round(step.states / _GIB, 2),
        "total_gib": round(step.total / _GIB, 2),
        "with_margin_gib": round(step.total * 1.25 / _GIB, 2),
        "attention": step.attention,
        "free_gib": GPU_FREE_BYTES / _GIB,
        "auto_checkpointing": checkpointing,
    }


def _peak_rss_bytes() -> int:
    """This process's peak resident memory (``ru_maxrss``: KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _cpu_step(feature_size: int, roi: Sequence[int], iters: int, threads: int, optimizer_name: str, results) -> None:
    """One size's CPU steps, run in a fresh process so that its peak RSS is its own."""
    from monai.losses import DiceCELoss

    from components.networks.attention import use_fused_attention

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    rss_before = _peak_rss_bytes()
    network = use_fused_attention(swinunetr(feature_size)).train()
    loss_function = DiceCELoss(to_onehot_y=True, softmax=True)
    if optimizer_name == "adamw":
        optimizer = torch.optim.AdamW(network.parameters(), lr=1e-4, weight_decay=1e-5)
    else:
        optimizer = torch.optim.SGD(network.parameters(), lr=1e-4)
    image = torch.rand(1, IN_CHANNELS, *roi)
    label = torch.randint(0, OUT_CHANNELS, (1, 1, *roi)).float()
    times = []
    for _ in range(iters + 1):  # the first is the warm-up (AdamW allocates its states)
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = loss_function(network(image), label)
        loss.backward()
        optimizer.step()
        times.append(time.perf_counter() - start)
    results.put({
        "s_per_step_median": round(statistics.median(times[1:]), 2),
        "s_per_step": [round(t, 2) for t in times[1:]],
        "warmup_s": round(times[0], 2),
        "loss_finite": bool(torch.isfinite(loss).item()),
        "peak_rss_gib": round(_peak_rss_bytes() / _GIB, 2),
        "rss_before_network_gib": round(rss_before / _GIB, 2),
    })  # fmt: skip


def cpu_step(
    feature_size: int, roi: Sequence[int], iters: int, threads: int, available_bytes: int | None = None
) -> dict:
    """:func:`_cpu_step` in a spawned process, with AdamW where its step's estimate fits ``available_bytes``
    (default: the host's ``MemAvailable``) and with SGD, which keeps no optimizer state, where it does not.

    Raises:
        RuntimeError: the step's process died (e.g. killed for memory) before reporting.
    """
    from components.networks.attention import use_fused_attention
    from components.networks.step_memory import estimate_step_memory, free_memory_bytes

    with parameters_on_meta():
        network = use_fused_attention(swinunetr(feature_size)).train()
    estimate = estimate_step_memory(network, [[1, IN_CHANNELS, *roi]], "cpu", amp=False, world_size=1)
    available = free_memory_bytes("cpu") if available_bytes is None else available_bytes
    optimizer_name = "adamw" if estimate.total <= available else "sgd"
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    process = context.Process(
        target=_cpu_step, args=(feature_size, list(roi), iters, threads, optimizer_name, results)
    )
    process.start()
    while True:  # a process killed for memory reports nothing: poll, never block on it
        try:
            measured = results.get(timeout=5)
            break
        except queue.Empty:
            if not process.is_alive():
                raise RuntimeError(
                    f"the CPU step at feature {feature_size} died (exit code {process.exitcode}) before reporting."
                ) from None
    process.join()
    return {
        "roi_size": list(roi),
        "batch": 1,
        "torch_threads": threads,
        "optimizer": optimizer_name,
        "adamw_estimate_gib": round(estimate.total / _GIB, 2),
        "mem_available_gib": round(available / _GIB, 2),
        **measured,
        # the estimate's states are weights, gradients and AdamW's two moments; an SGD step keeps the first two
        "estimate_cpu_gib": round((estimate.total - (0 if optimizer_name == "adamw" else estimate.states // 2)) / _GIB, 2),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=_int_list, default=[48, 96, 192], help="feature sizes, e.g. 48,96,192")
    parser.add_argument("--roi", type=int, default=96, help="cubic ROI edge of the estimated step (BTCV: 96)")
    parser.add_argument("--cpu_step", action="store_true", help="also time a real CPU step for --cpu_sizes")
    parser.add_argument("--cpu_sizes", type=_int_list, default=[48, 96, 192], help="feature sizes of the CPU step")
    parser.add_argument("--cpu_roi", type=_int_list, default=[64, 32, 32], help="ROI of the CPU step")
    parser.add_argument("--iters", type=int, default=3, help="timed CPU steps after one warm-up")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads of the CPU step")
    args = parser.parse_args(argv)
    bad = [f for f in args.sizes + args.cpu_sizes if f < 12 or f % 12]
    rois = ([args.roi] * 3, args.cpu_roi)
    if bad or len(args.cpu_roi) != 3 or any(s < 32 or s % 32 for roi in rois for s in roi) or min(map(max, rois)) < 64:
        parser.error(f"feature sizes must be positive multiples of 12 (got {bad}); ROI edges multiples of 32, each "
                     f"ROI with an edge of 64 or more (the bottleneck's instance norm needs more than one element in "
                     f"training): --roi {args.roi}, --cpu_roi {args.cpu_roi}")  # fmt: skip
    out = json_stdout()
    start = time.perf_counter()
    result: dict = {"benchmark": "encoder_sizes", "machine": machine_info(), "use_v2": True, "window_size": WINDOW,
                    "network": f"SwinUNETR(in_channels={IN_CHANNELS}, out_channels={OUT_CHANNELS})",
                    "estimate": {"device": "cuda", "amp": True, "fused_attention": True, "world_size": 1,
                                 "roi_size": [args.roi] * 3, "crops_per_step": CROPS_PER_STEP},
                    "sizes": {}}  # fmt: skip
    for feature_size in args.sizes:
        entry = {
            "parameters": parameter_counts(feature_size),
            "step_estimate": step_estimate(feature_size, [args.roi] * 3),
            "cpu_step": NOT_MEASURED,
        }
        if args.cpu_step and feature_size in args.cpu_sizes:
            print(f"CPU step at feature {feature_size} ...", file=sys.stderr, flush=True)
            entry["cpu_step"] = cpu_step(feature_size, args.cpu_roi, args.iters, args.threads)
        result["sizes"][str(feature_size)] = entry
    return write_result(result, out, start)


if __name__ == "__main__":
    main()
