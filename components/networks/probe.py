"""The linear probe: the finetuning bundles' test of a pretrained Swin ViT encoder alone."""

from __future__ import annotations

from numbers import Integral
from typing import Any

import torch
import torch.nn.functional as F
from monai.networks.layers import Conv, Norm
from torch import nn

from .swin import NUM_FEATURE_MAPS, SwinViTSettings

__all__ = ["LinearProbe"]

_INTERPOLATION = {2: "bilinear", 3: "trilinear"}


class LinearProbe(nn.Module):
    """A segmentation network that only reads a frozen Swin ViT encoder: one 1x1x1 convolution per feature map.

    The finetuning bundles' frozen-encoder arms freeze ``swinViT`` only: SwinUNETR's convolutional ``encoder1`` (on
    the full-resolution image, with a skip to the output), ``encoder2``-``encoder4``, ``encoder10`` and the decoder
    still train, so even a random frozen encoder segments nearly as well as one trained from scratch. Here nothing
    but a linear map of the encoder's features trains, so the Dice it reaches measures the representation alone.

    The encoder (:class:`~components.networks.swin.SwinViTSettings`, SwinUNETR's configuration, attribute ``swinViT`` so that every loader of this
    collection fills it) is frozen for good: its parameters never require gradients, it runs without autograd, and it
    stays in eval mode whatever ``train()`` says. Its five normalised feature maps (``swinViT(x, normalize=True)``:
    ``f`` channels at ``s / 2``, ``2f`` at ``s / 4``, ``4f`` at ``s / 8``, ``8f`` at ``s / 16``, ``16f`` at
    ``s / 32``, ``f`` the feature size) are each standardised by a batch norm without affine parameters (attribute
    ``norms``, as MAE's linear probe: the scales' feature magnitudes differ by orders, and an encoder is not judged by
    how well plain SGD copes with that) and go through a 1x1x1 convolution to ``out_channels`` logits (attribute
    ``heads``), upsampled (trilinear, bilinear in 2D) to the input size and summed. In eval mode the standardisation is
    a fixed per-channel affine map and interpolation is linear, so this is one linear classifier per voxel over the
    upsampled features of every scale.

    Args:
        in_channels: image channels.
        out_channels: classes (logits per voxel).
        standardise: the batch norms before the convolutions (default); ``False`` reads the raw features (the probe
            of 0.4.0, whose checkpoints hold no ``norms``).
        encoder: the encoder's other arguments (:class:`~components.networks.swin.SwinViTSettings`), ``feature_size``
            the pretrained weights' own (e.g. 48); ``use_checkpoint`` is accepted so that a ``SwinUNETR``
            configuration builds the probe, but saves no memory here: the encoder runs without autograd.

    Shapes:
        input ``(B, in_channels, *spatial)``, spatial sizes best multiples of 32 (as for SwinUNETR); output
        ``(B, out_channels, *spatial)``.

    Raises:
        ValueError: one line naming an argument out of range, or in ``forward`` an input of the wrong dimensions or
            channels.

    Example (a finetuning bundle's command line: ``--network_def#network '$components.LinearProbe'``, in single
    quotes so that the shell leaves ``$components`` alone)::

        >>> probe = LinearProbe(in_channels=1, out_channels=14, feature_size=48)
        >>> probe(torch.rand(1, 1, 96, 96, 96)).shape
        torch.Size([1, 14, 96, 96, 96])
        >>> sum(p.numel() for p in probe.parameters() if p.requires_grad)  # 14 * (48 + 96 + 192 + 384 + 768 + 5)
        20902
    """

    def __init__(self, in_channels: int, out_channels: int, standardise: bool = True, **encoder: Any) -> None:
        super().__init__()
        if isinstance(out_channels, bool) or not isinstance(out_channels, Integral) or out_channels < 1:
            raise ValueError(f"LinearProbe: out_channels must be a positive integer, got {out_channels!r}.")
        settings = SwinViTSettings(in_channels=in_channels, **encoder)
        self.in_channels, self.spatial_dims = settings.in_channels, settings.spatial_dims
        self.swinViT = settings.build()
        self.swinViT.requires_grad_(False)
        conv, norm = Conv[Conv.CONV, self.spatial_dims], Norm[Norm.BATCH, self.spatial_dims]
        widths = [settings.feature_size * 2**scale for scale in range(NUM_FEATURE_MAPS)]
        self.norms = nn.ModuleList(norm(width, affine=False) if standardise else nn.Identity() for width in widths)
        self.heads = nn.ModuleList(conv(width, int(out_channels), kernel_size=1) for width in widths)
        self.train()

    def train(self, mode: bool = True) -> LinearProbe:
        """Sets the norms' and heads' mode; the encoder stays in eval mode (no drop-path or dropout draws, ever)."""
        super().train(mode)
        self.swinViT.eval()
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, in_channels, *spatial)`` -> ``(B, out_channels, *spatial)`` logits."""
        if x.ndim != self.spatial_dims + 2 or x.shape[1] != self.in_channels:
            raise ValueError(
                f"LinearProbe: expected an input (B, {self.in_channels}, {', '.join(['S'] * self.spatial_dims)}), "
                f"got shape {tuple(x.shape)}."
            )
        with torch.no_grad():
            features = self.swinViT(x.contiguous(), normalize=True)
        size, mode = x.shape[2:], _INTERPOLATION[self.spatial_dims]
        logits = None
        for norm, head, feature in zip(self.norms, self.heads, features):
            scale_logits = F.interpolate(head(norm(feature)), size=size, mode=mode, align_corners=False)
            logits = scale_logits if logits is None else logits + scale_logits
        return logits
