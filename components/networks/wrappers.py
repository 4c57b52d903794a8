"""The network under its DDP, DataParallel and ``torch.compile`` wrappers: its own attributes and its
``state_dict`` without the wrappers' key prefixes (``module.``, ``_orig_mod.``)."""

from __future__ import annotations

from torch import nn

__all__ = ["unwrap"]


def unwrap(network: nn.Module) -> nn.Module:
    """The module under any nesting of DDP / DataParallel (``.module``) and ``torch.compile`` wrappers."""
    while True:
        if isinstance(network, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            network = network.module
        elif isinstance(getattr(network, "_orig_mod", None), nn.Module):
            network = network._orig_mod  # torch has no public accessor for the module torch.compile wrapped
        else:
            return network
