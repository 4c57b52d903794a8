"""Activation checkpointing only when a training step would not fit: ``use_checkpoint: "auto"``.

Checkpointing the Swin blocks recomputes their forward in the backward pass: about a third more time per step for
much less activation memory. Whether a step needs it depends on the network, the step's inputs, the precision and
the device's free memory, so the bundles decide it at start from an estimate:

- activations: the bytes of every tensor autograd saves for the backward pass, counted by running the forward once
  on the ``meta`` device (shapes only: no memory, no compute; a fraction of a second) with
  ``torch.autograd.graph.saved_tensors_hooks``; halved under 16-bit autocast, which saves most activations in half
  precision. It stays within 15 % of the storages a real forward saves (tested on CPU with SwinUNETR, feature 12;
  it counts the first stage's padded windows and the explicit attention matrices the same way).
- weights, gradients and the two AdamW moments: 4x the parameters' bytes.

Checkpointing is switched on when their sum with a margin exceeds the free memory (``torch.cuda.mem_get_info`` on
CUDA, ``MemAvailable`` on a CPU). The decision is logged with its figures.
"""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Sequence

import torch

from .config_values import as_bool

__all__ = ["checkpointing_decision", "free_memory_bytes", "saved_activation_bytes", "set_checkpointing"]

logger = logging.getLogger(__name__)

_GIB = 2**30


def set_checkpointing(network: torch.nn.Module, enabled: bool) -> torch.nn.Module:
    """Sets ``use_checkpoint`` of every submodule that has one (MONAI's Swin blocks and stages read it at each
    forward) and returns ``network``."""
    for module in network.modules():
        if isinstance(getattr(module, "use_checkpoint", None), bool):
            module.use_checkpoint = bool(enabled)
    return network


def saved_activation_bytes(network: torch.nn.Module, input_shapes: Sequence[Sequence[int]]) -> int:
    """Bytes autograd saves for the backward pass of one forward per shape in ``input_shapes`` (float32, no
    checkpointing), counted on a ``meta`` copy of ``network``. Each tensor (a view: its base) counts once, however
    often it is saved.

    Example::

        >>> net = SwinUNETR(in_channels=1, out_channels=2, feature_size=12)
        >>> saved_activation_bytes(net, [[1, 1, 64, 64, 32]]) > 100 * 2**20  # about 0.2 GiB at window 7
        True
    """
    probe = set_checkpointing(copy.deepcopy(network).to("meta"), False).train()
    sizes: dict[int, int] = {}
    keep: list[torch.Tensor] = []  # alive until counted, so that ids are not reused

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        base = tensor if tensor._base is None else tensor._base  # views saved twice share one storage
        keep.append(base)
        sizes[id(base)] = base.numel() * base.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        for shape in input_shapes:
            probe(torch.empty([int(s) for s in shape], device="meta"))
    return sum(sizes.values())


def free_memory_bytes(device: str | torch.device) -> int:
    """Free memory of ``device``: ``torch.cuda.mem_get_info`` on CUDA; otherwise the kernel's ``MemAvailable``
    (physical pages free, where ``/proc/meminfo`` is missing)."""
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


def checkpointing_decision(
    network: torch.nn.Module,
    use_checkpoint: bool | str,
    input_shapes: Sequence[Sequence[int]],
    device: str | torch.device,
    amp: bool | str = False,
    margin: float = 0.25,
    free_bytes: int | None = None,
) -> bool:
    """Whether to checkpoint: ``use_checkpoint`` true / false as given; ``"auto"`` when the step's estimated memory
    times ``1 + margin`` exceeds the free memory (``free_bytes``, default :func:`free_memory_bytes` of ``device``).

    Args:
        network: the network as built (its parameters and architecture are measured, it is not changed).
        use_checkpoint: true, false, or "auto" (bool or string).
        input_shapes: the network inputs of one step, e.g. ``[[views, channels, *roi]]``.
        device: where the step runs.
        amp: 16-bit autocast (activations counted at half size).

    Raises:
        ValueError: for any other ``use_checkpoint``, naming the id and the value.
    """
    if isinstance(use_checkpoint, str) and use_checkpoint.strip().lower() == "auto":
        activations = saved_activation_bytes(network, input_shapes) * (0.5 if as_bool(amp, "amp") else 1.0)
        states = 4 * sum(p.numel() * p.element_size() for p in network.parameters())
        need = (activations + states) * (1.0 + margin)
        free = free_memory_bytes(device) if free_bytes is None else int(free_bytes)
        decision = need > free
        logger.info("use_checkpoint auto: a step of %s needs about %.2f GiB without checkpointing (activations %.2f, "
                    "weights + gradients + optimizer %.2f, +%d %% margin); %.2f GiB free on %s -> checkpointing %s",
                    [list(s) for s in input_shapes], need / _GIB, activations / _GIB, states / _GIB, round(margin * 100),
                    free / _GIB, torch.device(device), "on" if decision else "off")  # fmt: skip
        return decision
    try:
        return as_bool(use_checkpoint, "use_checkpoint")
    except ValueError as err:
        raise ValueError(f"use_checkpoint must be true, false or \"auto\", got {use_checkpoint!r}.") from err
