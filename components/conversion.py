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

from .checkpoint import LoadReport, infer_architecture, load_pretrained, save_atomic
from .config_values import as_bool
from .networks import DEFAULT_WINDOW
from .recipes.inpainting_contrast import SSLHead

__all__ = ["convert_checkpoint"]

logger = logging.getLogger("components.checkpoint")


def _build_target(
    target: str, in_channels: int, feature_size: int, out_channels: int, upsample: str, use_v2: bool, window_size: int
) -> nn.Module:
    if target == "swinunetr":
        return SwinUNETR(
            in_channels=in_channels,
            out_channels=out_channels,
            feature_size=feature_size,
            use_v2=use_v2,
            window_size=window_size,
        )
    return SSLHead(
        in_channels=in_channels, feature_size=feature_size, upsample=upsample, use_v2=use_v2, window_size=window_size
    )


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
    use_v2: bool | str | None = None,
    window_size: int | None = None,
) -> LoadReport:
    """Convert a checkpoint of any known layout into a clean bare state dict of the target architecture.

    The target model is built (``SwinUNETR(in_channels, out_channels, feature_size, use_v2=..., window_size=...)``
    or ``SSLHead(in_channels, feature_size, upsample=upsample, use_v2=..., window_size=...)``) with parameters
    initialised under ``torch.manual_seed(seed)``, the checkpoint is loaded with :func:`load_pretrained`, and

    - ``full_state=True`` (default): the model's *full* state dict is written, so the file loads with
      ``strict=True`` into that architecture (``model.load_state_dict(torch.load(dst, weights_only=True))``).
      Tensors the source did not provide (e.g. the SwinUNETR decoder) hold the seeded random initialisation;
      the returned report lists them as ``missing``.
    - ``full_state=False``: only the loaded tensors are written (layout ``swinvit_encoder`` or a partial model),
      to be loaded with :func:`load_pretrained`.

    The file is written with :func:`save_atomic`. ``out_channels`` only shapes the SwinUNETR decoder output.
    ``use_v2`` (SwinUNETR v2: residual convolution blocks before the stages) and ``window_size`` default to what
    :func:`~components.checkpoint.infer_architecture` reads from ``src`` (no v2 blocks: v1; no attention bias table:
    window 7), so a VoCo v2 file converts without them; a value given that differs from the file's fails in
    :func:`load_pretrained` with one line naming it.

    Returns:
        the :class:`LoadReport` of the conversion.

    Raises:
        ValueError: an unknown ``target`` or a ``use_v2`` that is not a clear yes / no.
        FileNotFoundError / CheckpointLoadError: as :func:`load_pretrained`, before anything is written.

    Example::

        >>> report = convert_checkpoint("VoCo_B_SSL_head.pt", "swinunetr_v2.pt")  # v2 and window 7 from the file
        >>> SwinUNETR(1, 14, feature_size=48, use_v2=True).load_state_dict(torch.load("swinunetr_v2.pt", weights_only=True))
        <All keys matched successfully>
    """
    if target not in ("swinunetr", "sslhead"):
        raise ValueError(f"target must be one of ['swinunetr', 'sslhead'], got {target!r}.")
    configured_v2 = None if use_v2 is None else as_bool(use_v2, "use_v2")
    if configured_v2 is None or window_size is None:
        found = infer_architecture(src)
        configured_v2 = bool(found.use_v2) if configured_v2 is None else configured_v2
        window_size = (found.window_size or DEFAULT_WINDOW) if window_size is None else window_size
        logger.info("convert_checkpoint: %s target with use_v2=%s, window_size=%s", target, configured_v2, window_size)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = _build_target(
            target, in_channels, feature_size, out_channels, upsample, configured_v2, int(window_size)
        )
    report = load_pretrained(model, src, target=target, channel_policy=channel_policy, required=required)
    state = model.state_dict()
    if not full_state:
        loaded = set(report.loaded)
        state = {k: v for k, v in state.items() if k in loaded}
    save_atomic({k: v.detach().clone() for k, v in state.items()}, dst)
    logger.info("convert_checkpoint: wrote %d tensors to %s", len(state), dst)
    return report
