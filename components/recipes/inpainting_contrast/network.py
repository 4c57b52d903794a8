"""The network of the inpainting / contrastive recipe ("SSL head"): MONAI's Swin ViT encoder with three heads.

The model follows Tang et al., "Self-Supervised Pre-Training of Swin Transformers for 3D Medical Image
Analysis" (CVPR 2022): the encoder of :class:`components.networks.swin.SwinViTSettings` (attribute ``swinViT``), a rotation
head (``rotation_head``), a contrastive head (``contrastive_head``) and a reconstruction decoder (``conv``). The
attribute names and the decoder layouts are those of the published checkpoints, so weights move between this
module, those checkpoints and ``SwinUNETR.swinViT`` unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
from monai.networks.layers import Conv, Norm
from torch import nn

from ...networks.swin import SPATIAL_REDUCTION, SwinViTSettings, check_roi_size

__all__ = ["SSLHead", "UPSAMPLE_MODES", "OUTPUT_MODES"]

#: the reconstruction decoders :class:`SSLHead` can build (``upsample`` argument).
UPSAMPLE_MODES: tuple[str, ...] = ("vae", "deconv", "large_kernel_deconv")

#: what :meth:`SSLHead.forward` returns (``output`` argument).
OUTPUT_MODES: tuple[str, ...] = ("all", "reconstruction")

_CONTRASTIVE_DIM = 512
_NUM_ROTATIONS = 4


class SSLHead(nn.Module):
    """
    Swin ViT with the three self-supervised heads of Tang et al., "Self-Supervised Pre-Training of Swin
    Transformers for 3D Medical Image Analysis" <https://arxiv.org/abs/2111.14791>: rotation prediction,
    contrastive coding and masked-volume (inpainting) reconstruction.

    The encoder is MONAI's :class:`~monai.networks.nets.swin_unetr.SwinTransformer` with the configuration of
    ``SwinUNETR`` (window 7, patch 2, depths (2, 2, 2, 2), heads (3, 6, 12, 24) by default), so
    ``model.swinViT``'s state dict loads into ``SwinUNETR(feature_size=f, window_size=w, use_v2=v, depths=d,
    num_heads=h).swinViT`` as is. Its
    last stage output (normalised) of shape ``(B, 16 * feature_size, *[s // 32 for s in spatial])`` is
    flattened to tokens ``(B, N, 16 * feature_size)``; token 0 feeds ``rotation_head``, token 1
    ``contrastive_head``, and the whole map the reconstruction decoder ``conv``.

    Args:
        upsample: the reconstruction decoder, one of

            - ``"vae"`` (default): five blocks ``[Conv k3 p1, InstanceNorm, LeakyReLU, Upsample x2]`` taking
              ``16f -> 8f -> 4f -> 2f -> f -> f`` channels, then ``Conv(f, in_channels, 1)``
              (keys ``conv.0``, ``conv.4``, ``conv.8``, ``conv.12``, ``conv.16``, ``conv.20``);
            - ``"deconv"``: five transposed convolutions, kernel 2 stride 2,
              ``16f -> 8f -> 4f -> 2f -> f -> in_channels`` (keys ``conv.0`` .. ``conv.4``);
            - ``"large_kernel_deconv"``: one transposed convolution ``16f -> in_channels``, kernel 32 stride 32
              (keys ``conv.weight``, ``conv.bias``).
        output: what ``forward`` returns: ``"all"`` (default, for training) the tuple below, or
            ``"reconstruction"`` only the reconstruction tensor (for inference and ``verify_net_in_out``, which
            need a single tensor); the parameters and state-dict keys are the same.
        encoder: the encoder's arguments (:class:`~components.networks.swin.SwinViTSettings`: ``in_channels``,
            ``feature_size``, ``spatial_dims``, ``dropout_path_rate``, ``use_checkpoint``, ``window_size``, ``use_v2``,
            ``depths``, ``num_heads``); ``feature_size`` a multiple of 12, as ``SwinUNETR`` needs to reuse the
            weights. A smaller ``window_size`` is cheaper: at a 64x64x32 ROI, 7 pads the first stage's 32x32x16 tokens
            to 35x35x21 and attends over 343 tokens per window, 4 needs no padding and attends over 64.

    Shapes:
        - input ``x``: ``(B, in_channels, *spatial)``, every spatial size a multiple of 32 and the last stage
          holding at least 2 tokens (``prod(s // 32) >= 2``: 64^3 works, 32^3 does not);
        - output (``output="all"``): a tuple ``(rotation logits (B, 4), contrastive embedding (B, 512),
          reconstruction (B, in_channels, *spatial))``. The reconstruction has no output activation.

    Raises:
        ValueError: on an invalid argument, and in ``forward`` on an input of the wrong number of dimensions,
            the wrong number of channels, a spatial size not divisible by 32 or fewer than 2 final tokens;
            the input checks run before the encoder.

    Example::

        >>> import torch
        >>> net = SSLHead(in_channels=1, feature_size=48)  # 19.10M parameters, 8.06M in net.swinViT
        >>> rot, contrastive, rec = net(torch.randn(2, 1, 96, 96, 96))
        >>> rot.shape, contrastive.shape, rec.shape
        (torch.Size([2, 4]), torch.Size([2, 512]), torch.Size([2, 1, 96, 96, 96]))
        >>> # 2D, deconvolution decoder
        >>> net2d = SSLHead(in_channels=3, feature_size=24, spatial_dims=2, upsample="deconv")
        >>> [o.shape for o in net2d(torch.randn(1, 3, 64, 64))]
        [torch.Size([1, 4]), torch.Size([1, 512]), torch.Size([1, 3, 64, 64])]
    """

    def __init__(self, upsample: str = "vae", output: str = "all", **encoder: Any) -> None:
        super().__init__()
        settings = SwinViTSettings(**encoder).check_reusable()
        if not isinstance(upsample, str) or upsample not in UPSAMPLE_MODES:
            raise ValueError(f"SSLHead: upsample must be one of {UPSAMPLE_MODES}, got {upsample!r}.")
        if output not in OUTPUT_MODES:
            raise ValueError(f"SSLHead: output must be one of {OUTPUT_MODES}, got {output!r}.")
        self.output = output

        self.in_channels = in_channels = settings.in_channels
        self.feature_size = feature_size = settings.feature_size
        self.spatial_dims = settings.spatial_dims
        self.upsample = upsample
        self.window_size = settings.window_size
        dim = 16 * feature_size  # channels of the last stage output (after the final patch merging)
        self.hidden_dim = dim

        self.swinViT = settings.build()
        self.rotation_head = nn.Linear(dim, _NUM_ROTATIONS)
        self.contrastive_head = nn.Linear(dim, _CONTRASTIVE_DIM)
        self.conv = self._build_decoder(upsample, dim, feature_size, in_channels, self.spatial_dims)

    @staticmethod
    def _build_decoder(upsample: str, dim: int, feature_size: int, in_channels: int, spatial_dims: int) -> nn.Module:
        conv_t = Conv[Conv.CONV, spatial_dims]
        deconv_t = Conv[Conv.CONVTRANS, spatial_dims]
        if upsample == "vae":
            norm_t = Norm[Norm.INSTANCE, spatial_dims]
            mode = "trilinear" if spatial_dims == 3 else "bilinear"
            widths = [dim, dim // 2, dim // 4, dim // 8, feature_size, feature_size]
            layers: list[nn.Module] = []
            for c_in, c_out in zip(widths[:-1], widths[1:]):
                layers += [
                    conv_t(c_in, c_out, kernel_size=3, stride=1, padding=1),
                    norm_t(c_out),
                    nn.LeakyReLU(),
                    nn.Upsample(scale_factor=2, mode=mode, align_corners=False),
                ]
            layers.append(conv_t(feature_size, in_channels, kernel_size=1, stride=1))
            return nn.Sequential(*layers)
        if upsample == "deconv":
            widths = [dim, dim // 2, dim // 4, dim // 8, feature_size, in_channels]
            return nn.Sequential(
                *(deconv_t(c_in, c_out, kernel_size=2, stride=2) for c_in, c_out in zip(widths[:-1], widths[1:]))
            )
        # "large_kernel_deconv"
        k = SPATIAL_REDUCTION
        return deconv_t(dim, in_channels, kernel_size=k, stride=k)

    def check_input(self, x: torch.Tensor) -> int:
        """Validate an input batch's shape (no computation) and return the number of final tokens.

        Raises:
            ValueError: wrong number of dimensions or channels, a spatial size not divisible by 32, or fewer
                than 2 tokens at the last stage.
        """
        expected_ndim = self.spatial_dims + 2
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"SSLHead: expected a torch.Tensor input, got {type(x).__name__}.")
        if x.ndim != expected_ndim:
            layout = "(B, C, H, W, D)" if self.spatial_dims == 3 else "(B, C, H, W)"
            raise ValueError(
                f"SSLHead: expected a {expected_ndim}-dimensional input {layout} for spatial_dims="
                f"{self.spatial_dims}, got {x.ndim} dimensions, shape {tuple(x.shape)}."
            )
        if x.shape[1] != self.in_channels:
            raise ValueError(
                f"SSLHead: expected in_channels={self.in_channels} input channels, got {x.shape[1]} "
                f"(input shape {tuple(x.shape)})."
            )
        return check_roi_size(tuple(x.shape[2:]), self.spatial_dims)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | torch.Tensor:
        """
        Args:
            x: ``(B, in_channels, *spatial)``.

        Returns:
            ``(rotation logits (B, 4), contrastive embedding (B, 512), reconstruction (B, in_channels, *spatial))``,
            or only the reconstruction when ``output="reconstruction"``.
        """
        self.check_input(x)
        feats = self.swinViT(x.contiguous(), normalize=True)[4]  # (B, 16f, *[s // 32])
        if self.output == "reconstruction":
            return self.conv(feats)
        tokens = feats.flatten(start_dim=2).transpose(1, 2)  # (B, N, 16f), N = prod(s // 32) >= 2
        x_rot = self.rotation_head(tokens[:, 0])  # (B, 4)
        x_contrastive = self.contrastive_head(tokens[:, 1])  # (B, 512)
        x_rec = self.conv(feats)  # (B, in_channels, *spatial)
        return x_rot, x_contrastive, x_rec
