"""The network of masked image modelling: the Swin ViT encoder, a learned mask token and a light decoder to voxels.

SimMIM (Xie et al., CVPR 2022): masked patch embeddings are replaced by one learned token before the first Swin stage,
and a one-layer linear decoder predicts the voxels of the whole crop from the last stage's features (a 1x1x1
convolution to ``32^3 x C`` channels, rearranged into ``32^3`` voxels per final token). The encoder is
:class:`components.networks.swin.SwinViTSettings` held as ``swinViT``, so the encoder's weights load into ``SwinUNETR.swinViT`` and
every loader of this collection as the other recipes' do.
"""

from __future__ import annotations

from typing import Any

import torch
from monai.networks.layers import Conv
from torch import nn

from ...networks.swin import SPATIAL_REDUCTION, SwinViTSettings
from ..self_distillation.network import ProjectionHead

__all__ = ["DECODERS", "MaskedImageModel", "voxel_shuffle"]

#: the decoders :class:`MaskedImageModel` can build (``decoder`` argument).
DECODERS: tuple[str, ...] = ("linear", "deconv")


def voxel_shuffle(x: torch.Tensor, factor: int) -> torch.Tensor:
    """3D pixel shuffle: ``(B, C * f^3, d, h, w)`` -> ``(B, C, d * f, h * f, w * f)`` (``torch.nn.PixelShuffle`` is
    2D only). Channel ``c * f^3 + (i * f + j) * f + k`` of a token becomes its voxel ``(i, j, k)`` of output channel
    ``c``."""
    b, channels, *grid = x.shape
    dims = len(grid)
    out_channels = channels // factor**dims
    x = x.reshape(b, out_channels, *([factor] * dims), *grid)
    # (B, C, f_1..f_n, g_1..g_n) -> (B, C, g_1, f_1, ..., g_n, f_n)
    order = [0, 1] + [p for axis in range(dims) for p in (2 + dims + axis, 2 + axis)]
    return x.permute(*order).reshape(b, out_channels, *(g * factor for g in grid))


class MaskedImageModel(nn.Module):
    """Swin ViT encoder with SimMIM's mask token and a light reconstruction decoder.

    Args:
        decoder: ``"linear"`` (SimMIM: a 1x1x1 convolution ``16f -> 32^dims * in_channels`` and :func:`voxel_shuffle`,
            keys ``decoder.weight`` / ``decoder.bias``) or ``"deconv"`` (five transposed convolutions, kernel 2 stride 2,
            ``16f -> 8f -> 4f -> 2f -> f -> in_channels``, as the SSL recipe's ``deconv`` decoder).
        distill_prototypes: with K > 0, a DINO projection head ``token_head`` (``8f -> head_hidden_dim ->
            head_bottleneck_dim -> K``) on the third-stage tokens, for the masked-token self-distillation
            (:mod:`.distillation`); ``forward`` then also returns its logits ``(B, N, K)``.
        head_hidden_dim, head_bottleneck_dim: the token head's MLP widths.
        encoder: the encoder's arguments (:class:`~components.networks.swin.SwinViTSettings`: ``in_channels``,
            ``feature_size``, ``spatial_dims``, ``dropout_path_rate``, ``use_checkpoint``, ``window_size``, ``use_v2``,
            ``depths``, ``num_heads``); ``feature_size`` a multiple of 12, as ``SwinUNETR`` needs to reuse the weights.

    ``forward(x, token_mask)``: ``x`` ``(B, in_channels, *spatial)`` (every spatial size a multiple of 32) and
    ``token_mask`` ``(B, *[s // 2])`` bool (True: that patch's embedding becomes ``mask_token``; None: no masking)
    give the reconstruction ``(B, in_channels, *spatial)`` of every voxel (the loss reads the masked ones), and with a
    ``token_head`` also the logits of the third-stage tokens ``(B, N, K)``.

    Example::

        >>> net = MaskedImageModel(feature_size=12)
        >>> mask = torch.zeros(2, 16, 16, 16, dtype=torch.bool)
        >>> net(torch.rand(2, 1, 32, 32, 32), mask).shape
        torch.Size([2, 1, 32, 32, 32])
    """

    def __init__(
        self,
        decoder: str = "linear",
        distill_prototypes: int = 0,
        head_hidden_dim: int = 2048,
        head_bottleneck_dim: int = 256,
        **encoder: Any,
    ) -> None:
        super().__init__()
        settings = SwinViTSettings(**encoder).check_reusable()
        if decoder not in DECODERS:
            raise ValueError(f"decoder must be one of {DECODERS}, got {decoder!r}.")
        self.in_channels = settings.in_channels
        self.spatial_dims = settings.spatial_dims
        feature_size = settings.feature_size
        self.swinViT = settings.build()
        self.mask_token = nn.Parameter(torch.zeros(1, feature_size, *([1] * self.spatial_dims)))
        nn.init.trunc_normal_(self.mask_token, std=0.02)
        self.decoder_kind = decoder
        self.decoder = self._build_decoder(decoder, feature_size)
        self.token_head = (
            ProjectionHead(8 * feature_size, int(distill_prototypes), int(head_hidden_dim), int(head_bottleneck_dim))
            if int(distill_prototypes) > 0 else None
        )  # fmt: skip
        self._token_mask: torch.Tensor | None = None
        self.swinViT.patch_embed.register_forward_hook(self._mask_patches)

    def _build_decoder(self, decoder: str, feature_size: int) -> nn.Module:
        dim = 16 * feature_size
        if decoder == "linear":
            out = self.in_channels * SPATIAL_REDUCTION**self.spatial_dims
            return Conv[Conv.CONV, self.spatial_dims](dim, out, kernel_size=1)
        deconv = Conv[Conv.CONVTRANS, self.spatial_dims]
        widths = [dim, dim // 2, dim // 4, dim // 8, feature_size, self.in_channels]
        return nn.Sequential(*(deconv(a, b, kernel_size=2, stride=2) for a, b in zip(widths[:-1], widths[1:])))

    def _mask_patches(self, module: nn.Module, inputs: tuple, embeddings: torch.Tensor) -> torch.Tensor:
        """Forward hook of ``swinViT.patch_embed``: the masked patches' embeddings ``(B, f, *grid)`` become the token."""
        if self._token_mask is None:
            return embeddings
        if self._token_mask.shape != (embeddings.shape[0], *embeddings.shape[2:]):
            raise ValueError(
                f"token_mask of shape {tuple(self._token_mask.shape)} does not match the patch grid "
                f"{(embeddings.shape[0], *embeddings.shape[2:])} of the input."
            )
        return torch.where(self._token_mask.unsqueeze(1), self.mask_token.to(embeddings.dtype), embeddings)

    def without_token_head(self) -> nn.Module:
        """The model as a release holds it: ``swinViT``, ``mask_token`` and ``decoder`` (the same parameters, not
        copies). The distillation's token head is a part of pretraining only: the bundle's ``models/model.pt`` leaves
        it out, so that inference, packaging and the finetuning bundles see the model they build."""
        release = nn.Module()
        release.swinViT, release.decoder, release.mask_token = self.swinViT, self.decoder, self.mask_token
        return release

    def forward(
        self, x: torch.Tensor, token_mask: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if x.ndim != self.spatial_dims + 2 or x.shape[1] != self.in_channels or any(s % SPATIAL_REDUCTION for s in x.shape[2:]):
            raise ValueError(
                f"expected an input (B, {self.in_channels}, *spatial) with every spatial size a multiple of "
                f"{SPATIAL_REDUCTION}, got shape {tuple(x.shape)}."
            )
        self._token_mask = token_mask
        try:
            hidden = self.swinViT(x.contiguous(), normalize=True)  # stage 4: (B, 16f, *[s // 32])
        finally:
            self._token_mask = None
        decoded = self.decoder(hidden[4])
        reconstruction = voxel_shuffle(decoded, SPATIAL_REDUCTION) if self.decoder_kind == "linear" else decoded
        if self.token_head is None:
            return reconstruction
        tokens = hidden[3].flatten(start_dim=2).transpose(1, 2)  # (B, N, 8f)
        return reconstruction, self.token_head(tokens)

