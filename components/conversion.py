"""Converting a checkpoint file of any known layout into a clean state dict of a target architecture.

It builds the target (MONAI's ``SwinUNETR`` or the inpainting / contrastive recipe's :class:`SSLHead`) and loads
the file with :func:`components.checkpoint.load_pretrained`. It lives above :mod:`components.checkpoint` and
:mod:`components.recipes` because it needs both: the checkpoint package knows layouts, not recipes.
"""

from __future__ import annotations

import logging
import os

import torch
from monai.networks.nets import SwinUNETR
from torch import nn

from .checkpoint import LoadReport, load_pretrained, save_atomic
from .recipes.inpainting_contrast import SSLHead

__all__ = ["convert_checkpoint"]

logger = logging.getLogger("components.checkpoint")

def _build_target(target: str, in_channels: int, feature_size: int, out_channels: int, upsample: str) -> nn.Module:
    if target == "swinunetr":
        return SwinUNETR(in_channels=in_channels, out_channels=out_channels, feature_size=feature_size)
    return SSLHead(in_channels=in_channels, feature_size=feature_size, upsample=upsample)


def convert_checkpoint(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    target: str = "swinunetr",
    in_channels: int = 1,
    feature_size: int = 48,
    channel_policy: str = "error",
    required: str = "encoder",
    out_channels: int = 14,
    upsample: str = "vae",
    full_state: bool = True,
    seed: int = 0,
) -> LoadReport:
    """Convert a checkpoint of any known layout into a clean bare state dict of the target architecture.

    The target model is built (``SwinUNETR(in_channels, out_channels, feature_size)`` or
    ``SSLHead(in_channels, feature_size, upsample=upsample)``) with parameters initialised under
    ``torch.manual_seed(seed)``, the checkpoint is loaded with :func:`load_pretrained`, and

    - ``full_state=True`` (default): the model's *full* state dict is written, so the file loads with
      ``strict=True`` into that architecture (``model.load_state_dict(torch.load(dst, weights_only=True))``).
      Tensors the source did not provide (e.g. the SwinUNETR decoder) hold the seeded random initialisation;
      the returned report lists them as ``missing``.
    - ``full_state=False``: only the loaded tensors are written (layout ``swinvit_encoder`` or a partial model),
      to be loaded with :func:`load_pretrained`.

    The file is written with :func:`save_atomic`. ``out_channels`` only shapes the SwinUNETR decoder output.

    Returns:
        the :class:`LoadReport` of the conversion.
    """
    if target not in ("swinunetr", "sslhead"):
        raise ValueError(f"target must be one of ['swinunetr', 'sslhead'], got {target!r}.")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = _build_target(target, in_channels, feature_size, out_channels, upsample)
    report = load_pretrained(model, src, target=target, channel_policy=channel_policy, required=required)
    state = model.state_dict()
    if not full_state:
        loaded = set(report.loaded)
        state = {k: v for k, v in state.items() if k in loaded}
    save_atomic({k: v.detach().clone() for k, v in state.items()}, dst)
    logger.info("convert_checkpoint: wrote %d tensors to %s", len(state), dst)
    return report
