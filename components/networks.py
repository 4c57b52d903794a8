"""What every recipe and bundle shares about the network: the Swin ViT encoder in ``SwinUNETR``'s configuration,
the ROI check, and :func:`prepare_network` (attention kernel, activation checkpointing, device) that every bundle's
``network`` goes through. The recipes' heads live in :mod:`components.recipes`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from monai.networks.nets.swin_unetr import SwinTransformer
from torch import nn

from .attention import use_fused_attention
from .config_values import as_bool
from .step_memory import checkpointing_decision, set_checkpointing

__all__ = ["prepare_network", "swin_vit", "DEFAULT_WINDOW", "SPATIAL_REDUCTION", "check_roi_size"]

#: total downsampling of the encoder: patch embedding (2) times four patch-merging stages (2**4).
SPATIAL_REDUCTION: int = 32

#: attention window of the published SSL model (and of MONAI's ``SwinUNETR``).
DEFAULT_WINDOW: int = 7

# fixed encoder hyper-parameters of the published SSL model
_PATCH = 2
_DEPTHS = (2, 2, 2, 2)
_NUM_HEADS = (3, 6, 12, 24)


def _nearest_multiples(size: int, k: int) -> tuple[int, int]:
    """The multiples of ``k`` just below and just above ``size`` (the lower one at least ``k``)."""
    lower = max(k, (size // k) * k)
    upper = max(k, -(-size // k) * k)
    return lower, upper


def check_roi_size(roi_size: Sequence[int], spatial_dims: int | None = None) -> int:
    """Check that a spatial size can go through :class:`SSLHead` and return its number of final tokens.

    The encoder reduces every spatial dimension by 32 (patch size 2, then four patch-merging stages), and the
    reconstruction decoders upsample by exactly 32, so every spatial size must be a multiple of 32 for the
    reconstruction to match the input. The rotation head reads final token 0 and the contrastive head final
    token 1, so the last stage must hold at least two tokens (e.g. 32^3 gives 1 token and fails, 64^3 gives 8).

    Args:
        roi_size: the spatial size, e.g. ``(96, 96, 96)``; no batch or channel dimension.
        spatial_dims: if given, the number of spatial dimensions ``roi_size`` must have.

    Returns:
        the number of tokens of the last encoder stage, ``prod(s // 32 for s in roi_size)``.

    Raises:
        ValueError: when the size has the wrong number of dimensions, a size is not a positive multiple of
            32, or the last stage would hold fewer than two tokens.

    Example::

        >>> check_roi_size((96, 96, 96))
        27
    """
    roi = tuple(int(s) for s in roi_size)
    if spatial_dims is not None and len(roi) != spatial_dims:
        raise ValueError(
            f"SSLHead: expected a spatial size with {spatial_dims} dimensions (spatial_dims={spatial_dims}), "
            f"got {len(roi)}: {roi}."
        )
    k = SPATIAL_REDUCTION
    if any(s <= 0 for s in roi):
        raise ValueError(f"SSLHead: spatial sizes must be positive, got {roi}.")
    bad = [(i, s) for i, s in enumerate(roi) if s % k != 0]
    if bad:
        lower = tuple(_nearest_multiples(s, k)[0] for s in roi)
        upper = tuple(_nearest_multiples(s, k)[1] for s in roi)
        rec = tuple(-(-s // k) * k for s in roi)
        bad_txt = ", ".join(f"dim {i} = {s}" for i, s in bad)
        options = [upper] if lower == upper or math.prod(s // k for s in lower) < 2 else [lower, upper]
        options_txt = " or ".join(str(o) for o in options)
        raise ValueError(
            f"SSLHead: every spatial size must be divisible by {k} (the encoder reduces each dimension by {k} "
            f"and the decoder upsamples by {k}); got {roi} ({bad_txt}). The reconstruction would have size "
            f"{rec} and would not match the input. Nearest valid size: {options_txt} "
            f"(crop or pad the input, e.g. with monai.transforms.DivisiblePad(k={k}))."
        )
    grid = tuple(s // k for s in roi)
    n_tokens = math.prod(grid)
    if n_tokens < 2:
        works = tuple(2 * k for _ in roi)
        raise ValueError(
            f"SSLHead: the ROI {roi} gives {n_tokens} token at the last encoder stage (grid {grid}), but at "
            f"least 2 tokens are needed: the rotation head reads token 0 and the contrastive head token 1. "
            f"Use a larger ROI, e.g. {works}, which gives {math.prod(s // k for s in works)} tokens."
        )
    return n_tokens


def swin_vit(
    in_channels: int,
    feature_size: int,
    spatial_dims: int = 3,
    dropout_path_rate: float = 0.0,
    use_checkpoint: bool = False,
    window_size: int = DEFAULT_WINDOW,
    use_v2: bool | str = False,
) -> SwinTransformer:
    """MONAI's Swin ViT encoder in the configuration of ``SwinUNETR`` (window 7 by default, patch 2, depths
    (2, 2, 2, 2), heads (3, 6, 12, 24)): held as attribute ``swinViT``, its state dict loads into
    ``SwinUNETR(feature_size=f, window_size=w, use_v2=v).swinViT``.

    ``use_v2``: SwinUNETR v2 (the encoder of VoCo B / L / H): MONAI's residual convolution block
    (``UnetrBasicBlock``: two bias-free 3x3x3 convolutions, instance norm without parameters) before each stage,
    keys ``layers1c`` .. ``layers4c``; a stage taking ``c`` channels (``f``, ``2f``, ``4f``, ``8f``) adds
    ``2 * 27 * c ** 2`` weights, ``4590 * f ** 2`` in all (3D). The other keys are those of v1. Accepts a config
    flag ("true" / "false").

    Its last stage output (``swinViT(x, normalize=True)[4]``) has shape ``(B, 16 * feature_size, *[s // 32])``.

    Raises:
        ValueError: ``use_v2`` is not a clear yes / no.

    Example::

        >>> swin_vit(1, 48, use_v2=True).layers1c[0].__class__.__name__
        'UnetrBasicBlock'
    """
    return SwinTransformer(
        in_chans=in_channels,
        embed_dim=feature_size,
        window_size=(window_size,) * spatial_dims,
        patch_size=(_PATCH,) * spatial_dims,
        depths=_DEPTHS,
        num_heads=_NUM_HEADS,
        mlp_ratio=4.0,
        qkv_bias=True,
        drop_rate=0.0,
        attn_drop_rate=0.0,
        drop_path_rate=float(dropout_path_rate),
        norm_layer=nn.LayerNorm,
        use_checkpoint=bool(use_checkpoint),
        spatial_dims=spatial_dims,
        downsample="merging",
        use_v2=as_bool(use_v2, "use_v2"),
    )


def prepare_network(
    network: nn.Module,
    device: str | torch.device,
    fused_attention: bool | str = True,
    use_checkpoint: bool | str = False,
    step_inputs: Sequence[Sequence[int]] | None = None,
    amp: bool | str = False,
    teacher: bool | str = False,
    world_size: int | None = None,
) -> nn.Module:
    """The network of a run, from the bundle's ``network_def``: its window-attention kernel
    (:func:`~components.attention.use_fused_attention`), activation checkpointing (true, false, or ``"auto"``:
    :func:`~components.step_memory.checkpointing_decision` for one training step whose network inputs have the
    shapes ``step_inputs``; ``teacher``: a frozen copy of the network trains too, as in self-distillation;
    ``world_size``: the ranks training, default the process group's) and its device. Every bundle config builds
    ``network`` with this one call, so ``network_def`` stays the bare architecture that ``monai.bundle.load`` returns.

    Raises:
        ValueError: for a flag that is not a clear yes / no, or ``"auto"`` without ``step_inputs``.

    Example::

        "network": "$components.prepare_network(@network_def, @device, @speed#fused_attention, @speed#use_checkpoint, @speed#step_inputs, @speed#amp)"
    """
    use_fused_attention(network, as_bool(fused_attention, "fused_attention"))
    if step_inputs is None and str(use_checkpoint).strip().lower() == "auto":
        raise ValueError('use_checkpoint "auto" needs the shapes of a training step\'s inputs (step_inputs).')
    enabled = as_bool(use_checkpoint, "use_checkpoint") if step_inputs is None else checkpointing_decision(
        network, use_checkpoint, step_inputs, device, amp, teacher=teacher, world_size=world_size)  # fmt: skip
    return set_checkpointing(network, enabled).to(device)

