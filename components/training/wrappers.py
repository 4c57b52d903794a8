"""The network under its DDP and ``torch.compile`` wrappers, for code that needs its own attributes."""

from __future__ import annotations

import torch

__all__ = ["unwrap"]


def unwrap(network: torch.nn.Module) -> torch.nn.Module:
    """The module under DDP (``.module``) and ``torch.compile`` (``._orig_mod``) wrappers."""
    while hasattr(network, "module") or hasattr(network, "_orig_mod"):
        network = getattr(network, "module", None) or network._orig_mod
    return network
