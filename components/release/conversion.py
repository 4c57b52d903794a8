"""Converting a checkpoint file of any known layout into a clean state dict of a target architecture.

It builds the target (MONAI's ``SwinUNETR`` or the inpainting / contrastive recipe's :class:`SSLHead`) and loads
the file with :func:`components.checkpoint.load_pretrained`. It lives above :mod:`components.checkpoint` and
:mod:`components.recipes` because it needs both: the checkpoint package knows layouts, not recipes.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

import torch
from monai.networks.nets import SwinUNETR
from torch import nn

from ..checkpoint import (
    CheckpointLoadError,
    LoadReport,
    SwinArchitecture,
    check_architecture,
    infer_architecture,
    load_pretrained,
    save_atomic,
)
from ..checkpoint.layouts import source_name
from ..config.values import as_bool
from ..networks.swin import DEFAULT_DEPTHS, DEFAULT_NUM_HEADS, DEFAULT_WINDOW
from ..recipes.inpainting_contrast import SSLHead

__all__ = ["convert_checkpoint"]

logger = logging.getLogger("components.checkpoint")

#: how the converter's messages name what to change: the flags of ``python -m components convert-checkpoint``
#: (``--use_v2 true``), not the bundles' config ids. The patch size has no flag: it is always the file's.
COMMAND_FLAGS: dict[str, str] = {
    name: name
    for name in (
        "feature_size", "use_v2", "window_size", "depths", "num_heads", "in_channels", "channel_policy", "required"
    )
}

_DEFAULT_PATCH = 2  # SwinUNETR's default patch edge and SSLHead's only one (its decoders upsample by 2 x 2 ** 4)


def _target_architecture(src: str | os.PathLike, found: SwinArchitecture, given: dict[str, Any]) -> dict[str, Any]:
    """The encoder values to build the target with: each flag given, else the checkpoint's, else SwinUNETR's default.

    Raises:
        CheckpointLoadError: a flag given that differs from the checkpoint (one line with the flags to run with).
    """
    check_architecture(found, given, source_name(src), COMMAND_FLAGS)
    defaults = {
        "use_v2": False, "window_size": DEFAULT_WINDOW, "depths": DEFAULT_DEPTHS, "num_heads": DEFAULT_NUM_HEADS
    }
    values = {"feature_size": found.feature_size}
    for name, default in defaults.items():
        values[name] = getattr(found, name) if getattr(found, name) is not None else default
    values.update(given)
    values["use_v2"] = as_bool(values["use_v2"], "use_v2")
    return values


def _build_target(
    target: str, in_channels: int, out_channels: int, upsample: str, encoder: dict[str, Any], patch_size: Any
) -> nn.Module:
    if target == "swinunetr":
        return SwinUNETR(
            in_channels=in_channels, out_channels=out_channels, patch_size=patch_size or _DEFAULT_PATCH, **encoder
        )
    return SSLHead(in_channels=in_channels, upsample=upsample, **encoder)


def convert_checkpoint(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    target: str = "swinunetr",
    in_channels: int | None = None,
    feature_size: int | None = None,
    channel_policy: str = "error",
    required: str = "encoder",
    out_channels: int = 14,
    upsample: str = "vae",
    full_state: bool = True,
    seed: int = 0,
    use_v2: bool | str | None = None,
    window_size: int | None = None,
    depths: Sequence[int] | None = None,
    num_heads: Sequence[int] | None = None,
) -> LoadReport:
    """Convert a checkpoint of any known layout into a clean bare state dict of the target architecture.

    The target model is built (``SwinUNETR(in_channels, out_channels, feature_size, use_v2, window_size, depths,
    num_heads, patch_size)`` or ``SSLHead(in_channels, feature_size, upsample=upsample, use_v2, window_size, depths,
    num_heads)``) with parameters initialised under ``torch.manual_seed(seed)``, the checkpoint is loaded with
    :func:`load_pretrained`, and

    - ``full_state=True`` (default): the model's *full* state dict is written, so the file loads with
      ``strict=True`` into that architecture (``model.load_state_dict(torch.load(dst, weights_only=True))``).
      Tensors the source did not provide (e.g. the SwinUNETR decoder) hold the seeded random initialisation;
      the returned report lists them as ``missing``.
    - ``full_state=False``: only the loaded tensors are written (layout ``swinvit_encoder`` or a partial model),
      to be loaded with :func:`load_pretrained`.

    The file is written with :func:`save_atomic`. ``out_channels`` only shapes the SwinUNETR decoder output.
    Every architecture value left None (``in_channels``, ``feature_size``, ``use_v2``, ``window_size``, ``depths``,
    ``num_heads``; and the patch size, which has no argument) is the one
    :func:`~components.checkpoint.infer_architecture` reads from ``src`` (a value the file does not hold: SwinUNETR's
    default), so a VoCo v2 file or BrainSegFounder's deeper encoder converts without any. A value given that differs
    from the file's fails before anything is built, in one line naming the flags of ``python -m components
    convert-checkpoint`` to run with (:data:`COMMAND_FLAGS`); ``in_channels`` is the ``channel_policy``'s to adapt.

    Returns:
        the :class:`LoadReport` of the conversion.

    Raises:
        ValueError: an unknown ``target`` or a ``use_v2`` that is not a clear yes / no.
        FileNotFoundError / CheckpointLoadError: as :func:`load_pretrained`, a value given that differs from the
            file's, or a file whose patch size ``SSLHead`` cannot take, before anything is written.

    Example::

        >>> report = convert_checkpoint("VoCo_B_SSL_head.pt", "swinunetr_v2.pt")  # every value from the file
        >>> SwinUNETR(1, 14, feature_size=48, use_v2=True).load_state_dict(torch.load("swinunetr_v2.pt", weights_only=True))
        <All keys matched successfully>
    """
    if target not in ("swinunetr", "sslhead"):
        raise ValueError(f"target must be one of ['swinunetr', 'sslhead'], got {target!r}.")
    found = infer_architecture(src)
    if target == "sslhead" and found.patch_size not in (None, _DEFAULT_PATCH):
        raise CheckpointLoadError(
            f"checkpoint {source_name(src)} has patch_size={found.patch_size}; SSLHead's patch size is "
            f"{_DEFAULT_PATCH} (its decoders upsample by 32): convert it with --target swinunetr."
        )
    flags = {"feature_size": feature_size, "use_v2": use_v2, "window_size": window_size, "depths": depths,
             "num_heads": num_heads}  # fmt: skip
    encoder = _target_architecture(src, found, {name: value for name, value in flags.items() if value is not None})
    channels = in_channels if in_channels is not None else (found.in_channels or 1)
    logger.info("convert_checkpoint: %s target with in_channels=%s, %s", target, channels, encoder)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = _build_target(target, int(channels), out_channels, upsample, encoder, found.patch_size)
    report = load_pretrained(
        model, src, target=target, channel_policy=channel_policy, required=required, override_ids=COMMAND_FLAGS
    )
    state = model.state_dict()
    if not full_state:
        loaded = set(report.loaded)
        state = {k: v for k, v in state.items() if k in loaded}
    save_atomic({k: v.detach().clone() for k, v in state.items()}, dst)
    logger.info("convert_checkpoint: wrote %d tensors to %s", len(state), dst)
    return report
