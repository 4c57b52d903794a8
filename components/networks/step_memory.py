"""Activation checkpointing only when a training step would not fit: ``use_checkpoint: "auto"``.

Checkpointing the Swin blocks recomputes their forward in the backward pass: about a third more time per step for
much less activation memory. Whether a step needs it depends on the network, the step's inputs, the precision, the
attention kernel, the training set-up and the device's free memory, so the bundles decide it at start from an
estimate of the step's memory without checkpointing:

- activations: the bytes of every tensor autograd saves for the backward pass, counted by running the forward once
  on the ``meta`` device (shapes only: no memory, no compute; a fraction of a second) with
  ``torch.autograd.graph.saved_tensors_hooks``; halved under 16-bit autocast, which saves most activations in half
  precision. The window attention is counted as the kernel that will run on the target device (see
  :func:`saved_activation_bytes`): on CUDA the fused kernel keeps no ``n x n`` attention matrix for the backward
  pass, explicit attention keeps one per window and head, often the largest activation of a Swin block. The count
  stays within 15 % of the storages a real CPU forward saves (SwinUNETR, feature 12).
- weights, gradients and the two AdamW moments: 4x the parameters' bytes; a self-distillation teacher (a frozen
  copy of the student) one copy more, and DistributedDataParallel's gradient buckets (``gradient_as_bucket_view``
  off, its default: a copy of the gradients) one more when more than one rank trains.

Checkpointing is switched on when their sum with a margin exceeds the free memory: ``torch.cuda.mem_get_info`` on
CUDA (one GPU per rank); on a CPU the host's ``MemAvailable`` divided among the ranks of the node
(``LOCAL_WORLD_SIZE``, set by torchrun), which all train in it. The decision is logged with every term. The peak of
a real CPU step (forward, backward, AdamW; its live tensors) was 1.09x the estimate (feature 12, 64 x 32 x 32); the
default margin of 25 % covers that, not glibc's habit of keeping freed heap memory resident (peak RSS 1.5-2x).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import ignite.distributed as idist
import torch
import torch.nn.functional as F
from monai.networks.nets.swin_unetr import WindowAttention
from torch.overrides import TorchFunctionMode

from .attention import FusedWindowAttention
from ..config.values import as_bool
from ..distributed import get_local_world_size

__all__ = ["checkpointing_decision", "free_memory_bytes", "saved_activation_bytes", "set_checkpointing"]

logger = logging.getLogger(__name__)

_GIB = 2**30

#: PyTorch pads an attention bias whose strides are not multiples of 8 elements to a multiple of 8 columns before
#: the memory-efficient kernel (``preprocess_mask`` in ATen's ``attention.cpp``); the padded tensor is what it saves.
_BIAS_ALIGNMENT = 8

_FUSED = "fused kernel"
_EXPLICIT = "explicit"


def set_checkpointing(network: torch.nn.Module, enabled: bool) -> torch.nn.Module:
    """Sets ``use_checkpoint`` of every submodule that has one (MONAI's Swin blocks and stages read it at each
    forward) and returns ``network``."""
    for module in network.modules():
        if isinstance(getattr(module, "use_checkpoint", None), bool):
            module.use_checkpoint = bool(enabled)
    return network


def _fused_kernel_accepts(head_dim: int, half_precision: bool) -> bool:
    """Whether PyTorch's fused CUDA kernels that take a bias with a gradient (memory-efficient; cuDNN, preferred on
    Hopper in 16 bits) run for this head size: a multiple of 8 in 16 bits, of 4 in float32 (the GEMM alignment on
    sm80 and newer, ``sdp_utils.cpp``). Otherwise PyTorch's math kernel runs, with explicit matrices."""
    return head_dim % (8 if half_precision else 4) == 0


def _kernel_of(module: torch.nn.Module, device: torch.device, half_precision: bool) -> str | None:
    """The attention computation a window-attention module runs in training on ``device`` (None for other modules):
    "fused kernel" for :class:`FusedWindowAttention` on CUDA with a head size the fused kernels accept, otherwise
    "explicit" (MONAI's code, or PyTorch's math kernel: both keep ``n x n`` matrices)."""
    if not isinstance(module, WindowAttention):
        return None
    fused = isinstance(module, FusedWindowAttention) and device.type == "cuda"
    return _FUSED if fused and _fused_kernel_accepts(module.dim // module.num_heads, half_precision) else _EXPLICIT


def _attention_kernels(network: torch.nn.Module, device: torch.device, half_precision: bool) -> dict[str, int]:
    """How many window-attention modules of ``network`` run each computation in training on ``device``, e.g.
    ``{"fused kernel": 8}`` for a fused network on CUDA, ``{"explicit": 8}`` on a CPU or with MONAI's attention."""
    return dict(Counter(k for k in (_kernel_of(m, device, half_precision) for m in network.modules()) if k))


class _MemoryEfficientAttention(TorchFunctionMode):
    """While the meta probe runs for a CUDA target: each ``scaled_dot_product_attention`` call whose head size the
    fused kernels accept is computed by ATen's memory-efficient op (it has a meta kernel), so that autograd saves what
    it saves on CUDA: q, k, v, the output, the log-sum-exp per head and query (rows padded to 32) and the bias as
    the composite passes it (padded to 8 columns where unaligned, broadcast over the batch by ``expand``, not
    copied). Other calls run as given (on meta PyTorch's math kernel, as on CUDA)."""

    def __init__(self, half_precision: bool) -> None:
        super().__init__()
        self.half_precision = half_precision

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and not kwargs.get("enable_gqa", False):
            query = args[0]
            if _fused_kernel_accepts(query.shape[-1], self.half_precision):
                return _memory_efficient_attention(*args, **kwargs)
        return func(*args, **kwargs)


def _memory_efficient_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
) -> torch.Tensor:
    """``scaled_dot_product_attention`` as its CUDA composite runs it with the memory-efficient backend."""
    bias = attn_mask
    if bias is not None:
        if bias.dtype == torch.bool:  # the composite turns a boolean mask into an additive one
            bias = torch.zeros_like(bias, dtype=query.dtype)
        aligned = bias.stride(-1) == 1 and all(s % _BIAS_ALIGNMENT == 0 for s in bias.stride()[:-1])
        if not aligned:
            columns = bias.shape[-1]
            bias = F.pad(bias, (0, _BIAS_ALIGNMENT - columns % _BIAS_ALIGNMENT))[..., :columns]
        bias = bias.expand(query.shape[0], query.shape[1], query.shape[2], key.shape[2])
    log_sumexp = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    # on meta tensors the public scaled_dot_product_attention picks its math kernel; this op saves what CUDA's does
    return torch.ops.aten._scaled_dot_product_efficient_attention(
        query, key, value, bias, log_sumexp, dropout_p, is_causal, scale=scale)[0]  # fmt: skip


def saved_activation_bytes(
    network: torch.nn.Module,
    input_shapes: Sequence[Sequence[int]],
    device: str | torch.device = "cpu",
    amp: bool | str = False,
) -> int:
    """Bytes autograd saves for the backward pass of one training forward per shape in ``input_shapes`` on
    ``device`` (no checkpointing; float32, halved for 16-bit ``amp``), counted on a ``meta`` copy of ``network``.
    Each tensor (a view: its base) counts once, however often it is saved; an empty shape (0 local crops) saves
    nothing.

    The window attention is counted as the computation that will run (:attr:`StepMemory.attention`). On meta
    ``scaled_dot_product_attention`` has only its math kernel, which saves the ``n x n`` matrices, so:

    - a CUDA target: the :class:`~components.networks.attention.FusedWindowAttention` calls are counted as the fused kernel,
      which keeps q, k, v, the output, the log-sum-exp and the bias (one per window and head, shared by the images
      of the batch) and no attention matrix; with a head size the fused kernels refuse, the math kernel as on CUDA;
    - a CPU target: the fused modules compute MONAI's explicit attention in training, and so does the probe
      (``fused_cpu_training`` modules: PyTorch's math kernel); other devices: the math kernel. MONAI's
      ``WindowAttention`` is explicit everywhere.

    Example::

        >>> net = SwinUNETR(in_channels=1, out_channels=2, feature_size=12)
        >>> saved_activation_bytes(net, [[1, 1, 64, 64, 32]]) > 100 * 2**20  # about 0.2 GiB at window 7
        True
    """
    device, half_precision = torch.device(device), as_bool(amp, "amp")
    probe = set_checkpointing(copy.deepcopy(network).to("meta"), False).train()
    if device.type == "cpu":
        for module in probe.modules():
            if isinstance(module, FusedWindowAttention) and not module.fused_cpu_training:
                module.__class__ = WindowAttention  # what FusedWindowAttention computes in CPU training
    sizes: dict[int, int] = {}
    keep: list[torch.Tensor] = []  # alive until counted, so that ids are not reused

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        base = tensor if tensor._base is None else tensor._base  # views share their base (no public accessor of it)
        keep.append(base)
        sizes[id(base)] = base.numel() * base.element_size()
        return tensor

    kernel = _MemoryEfficientAttention(half_precision) if device.type == "cuda" else contextlib.nullcontext()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor), kernel:
        for size in ([int(s) for s in shape] for shape in input_shapes):
            if 0 not in size:  # an empty batch (a step without local crops): the network skips it, nothing is saved
                probe(torch.empty(size, device="meta"))
    return int(sum(sizes.values()) * (0.5 if half_precision else 1.0))


def free_memory_bytes(device: str | torch.device) -> int:
    """Free memory of ``device``: ``torch.cuda.mem_get_info`` on CUDA; otherwise the kernel's ``MemAvailable``
    (physical pages free, where ``/proc/meminfo`` is missing), the whole host's."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def local_ranks_sharing(device: str | torch.device) -> int:
    """How many training processes share the free memory of ``device``: on CUDA 1 (a GPU per rank); otherwise the
    ranks of this node, ``LOCAL_WORLD_SIZE`` (set by torchrun; 1 without it), which all allocate in host memory.

    Raises:
        ValueError: when ``LOCAL_WORLD_SIZE`` is set but is not a positive integer.
    """
    if torch.device(device).type == "cuda":
        return 1
    return get_local_world_size()


@dataclass(frozen=True)
class StepMemory:
    """The estimated memory of one training step without checkpointing, in bytes, by term (see the module).

    Attributes:
        activations: what autograd saves for the backward pass (:func:`saved_activation_bytes`).
        states: weights, gradients and the two AdamW moments: 4x the parameters' bytes.
        teacher: a frozen copy of the parameters (self-distillation's EMA teacher), else 0.
        ddp_buckets: DistributedDataParallel's gradient buckets, a copy of the gradients, when ``world_size`` > 1.
        world_size: the ranks training.
        attention: the window-attention modules per computation counted, e.g. ``{"fused kernel": 8}``.
    """

    activations: int
    states: int
    teacher: int
    ddp_buckets: int
    world_size: int
    attention: dict[str, int]

    @property
    def total(self) -> int:
        return self.activations + self.states + self.teacher + self.ddp_buckets


def estimate_step_memory(
    network: torch.nn.Module,
    input_shapes: Sequence[Sequence[int]],
    device: str | torch.device,
    amp: bool | str = False,
    teacher: bool | str = False,
    world_size: int | None = None,
) -> StepMemory:
    """The memory of one training step of ``network`` on ``device`` without checkpointing, by term.

    Args:
        network: the network as built, its attention kernel chosen (measured on a copy, not changed).
        input_shapes: the network inputs of one step, e.g. ``[[views, channels, *roi]]``.
        device: where the step runs ("cuda" suffices to estimate for a GPU: the estimate itself needs none).
        amp: 16-bit autocast (activations counted at half size; the fused kernels then need a head size
            divisible by 8).
        teacher: a frozen copy of the network trains alongside (self-distillation's EMA teacher).
        world_size: the ranks training, each network wrapped in DDP when above 1 (default
            :func:`~components.distributed.get_world_size`).

    Raises:
        ValueError: for an ``amp`` or ``teacher`` that is not a clear yes / no, or a ``world_size`` below 1.

    Example::

        >>> net = use_fused_attention(SwinUNETR(in_channels=1, out_channels=2, feature_size=48))
        >>> step = estimate_step_memory(net, [[2, 1, 96, 96, 96]], "cuda", amp=True, teacher=True)
        >>> step.attention, step.teacher == step.states // 4
        ({'fused kernel': 8}, True)
    """
    device, half_precision = torch.device(device), as_bool(amp, "amp")
    with_teacher = as_bool(teacher, "teacher")
    ranks = idist.get_world_size() if world_size is None else world_size
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}.")
    parameters = sum(p.numel() * p.element_size() for p in network.parameters())
    return StepMemory(
        activations=saved_activation_bytes(network, input_shapes, device, half_precision),
        states=4 * parameters,
        teacher=parameters if with_teacher else 0,
        ddp_buckets=parameters if ranks > 1 else 0,
        world_size=ranks,
        attention=_attention_kernels(network, device, half_precision),
    )


def checkpointing_decision(
    network: torch.nn.Module,
    use_checkpoint: bool | str,
    input_shapes: Sequence[Sequence[int]],
    device: str | torch.device,
    amp: bool | str = False,
    margin: float = 0.25,
    free_bytes: int | None = None,
    teacher: bool | str = False,
    world_size: int | None = None,
) -> bool:
    """Whether to checkpoint: ``use_checkpoint`` true / false as given; ``"auto"`` when the step's estimated memory
    (:func:`estimate_step_memory` of ``network``, ``input_shapes``, ``device``, ``amp``, ``teacher`` and
    ``world_size``) times ``1 + margin`` exceeds this rank's share of the free memory.

    Args:
        use_checkpoint: true, false, or "auto" (bool or string).
        margin: headroom for what the estimate leaves out (the backward pass's transient gradients, the
            allocator's caching).
        free_bytes: the device's free memory (default :func:`free_memory_bytes` of ``device``); on a CPU divided
            among :func:`local_ranks_sharing`.

    Raises:
        ValueError: for any other ``use_checkpoint``, naming the id and the value; for bad ``amp``, ``teacher``,
            ``world_size`` or ``LOCAL_WORLD_SIZE`` (before any estimate).

    Example (what ``components.prepare_network`` asks when a bundle's ``train#network`` says ``"auto"``)::

        checkpointing_decision(student, "auto", [[4, 1, 96, 96, 96], [8, 1, 64, 64, 64]], "cuda", True, teacher=True)
    """
    if not (isinstance(use_checkpoint, str) and use_checkpoint.strip().lower() == "auto"):
        try:
            return as_bool(use_checkpoint, "use_checkpoint")
        except ValueError as err:
            raise ValueError(f"use_checkpoint must be true, false or \"auto\", got {use_checkpoint!r}.") from err
    sharing = local_ranks_sharing(device)
    step = estimate_step_memory(network, input_shapes, device, amp, teacher, world_size)
    need = step.total * (1.0 + margin)
    device_free = free_memory_bytes(device) if free_bytes is None else int(free_bytes)
    free = device_free // sharing
    decision = need > free
    device = torch.device(device)
    attention = ", ".join(f"{kernel} in {count} blocks" for kernel, count in sorted(step.attention.items())) or "none"
    shared = "" if device.type == "cuda" else (
        f" (MemAvailable {device_free / _GIB:.2f} GiB shared by {sharing} local rank{'s' if sharing > 1 else ''})")
    logger.info("use_checkpoint auto: a step of %s needs about %.2f GiB without checkpointing: activations %.2f "
                "(window attention as computed on %s: %s), weights + gradients + AdamW moments %.2f, teacher %.2f, "
                "DDP gradient buckets %.2f (world size %d), +%d %% margin; %.2f GiB free on %s%s -> checkpointing %s",
                [list(s) for s in input_shapes], need / _GIB, step.activations / _GIB, device, attention,
                step.states / _GIB, step.teacher / _GIB, step.ddp_buckets / _GIB, step.world_size,
                round(margin * 100), free / _GIB, device, shared, "on" if decision else "off")  # fmt: skip
    return decision
