"""Student / teacher networks of self-distillation: a Swin ViT encoder with a DINO projection head.

The encoder is built from :class:`components.networks.swin.SwinViTSettings`, held as attribute ``swinViT`` (the layout
every loader of this collection reads); a volume's embedding is the mean of its last-stage tokens. The head follows
DINO (Caron et al., 2021): an MLP to a bottleneck, L2 normalisation, and a weight-normalised linear layer onto the
prototypes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.parametrizations import weight_norm

from ...training.encoder_lr import encoder_param_groups
from ...networks.wrappers import unwrap
from ...networks.swin import SPATIAL_REDUCTION, SwinViTSettings

__all__ = ["SwinViTEmbedding", "ProjectionHead", "SelfDistillationNetwork", "weight_decay_groups"]

ENCODER = "swinViT"  # the encoder's attribute: the layout every loader of this collection reads


class SwinViTEmbedding(nn.Module):
    """One embedding per volume from the Swin ViT encoder: the mean of the normalised last-stage tokens.

    Args:
        encoder: the encoder's arguments (:class:`~components.networks.swin.SwinViTSettings`: ``in_channels``,
            ``feature_size``, ``spatial_dims``, ``dropout_path_rate``, ``use_checkpoint``, ``window_size``, ``use_v2``,
            ``depths``, ``num_heads``); ``feature_size`` a multiple of 12, as ``SwinUNETR`` needs to reuse the weights.
            The embedding has ``16 * feature_size`` values.

    Shapes:
        input ``(B, in_channels, *spatial)``, every spatial size a multiple of 32; output ``(B, 16 * feature_size)``.

    Example::

        >>> SwinViTEmbedding(feature_size=12)(torch.rand(2, 1, 32, 32, 32)).shape
        torch.Size([2, 192])
    """

    def __init__(self, **encoder: Any) -> None:
        super().__init__()
        settings = SwinViTSettings(**encoder).check_reusable()
        self.in_channels = settings.in_channels
        self.spatial_dims = settings.spatial_dims
        self.embed_dim = 16 * settings.feature_size
        self.swinViT = settings.build()

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, C, *spatial)`` -> ``(B, 16 * feature_size)``; raises ValueError on a shape the encoder cannot take."""
        if x.ndim != self.spatial_dims + 2 or x.shape[1] != self.in_channels:
            raise ValueError(
                f"expected an input (B, {self.in_channels}, {', '.join(['S'] * self.spatial_dims)}), "
                f"got shape {tuple(x.shape)}."
            )
        bad = [s for s in x.shape[2:] if s % SPATIAL_REDUCTION]
        if bad:
            raise ValueError(
                f"every spatial size must be a multiple of {SPATIAL_REDUCTION} (the encoder's reduction), got "
                f"{tuple(x.shape[2:])}; pad or crop, e.g. with monai.transforms.DivisiblePad(k={SPATIAL_REDUCTION})."
            )
        features = self.swinViT(x.contiguous(), normalize=True)[4]  # (B, 16f, *[s // 32])
        return features.flatten(start_dim=2).mean(dim=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.embed(x)


class ProjectionHead(nn.Module):
    """DINO's projection head: MLP -> L2-normalised bottleneck -> weight-normalised prototype layer (no bias).

    Args:
        in_dim: embedding size.
        out_dim: number of prototypes K (the softmax size).
        hidden_dim, bottleneck_dim: MLP widths.
        num_layers: linear layers of the MLP (>= 1), GELU between them.
        norm_last_layer: fix the prototype layer's weight-norm magnitude ``g`` at 1 (not trained), which DINO found
            to stabilise training.

    Shapes: ``(N, in_dim)`` -> ``(N, out_dim)`` logits.
    """

    def __init__(
        self,
        in_dim: int,
        out_dim: int = 8192,
        hidden_dim: int = 2048,
        bottleneck_dim: int = 256,
        num_layers: int = 3,
        norm_last_layer: bool = True,
    ) -> None:
        super().__init__()
        if num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {num_layers}.")
        widths = [in_dim] + [hidden_dim] * (num_layers - 1) + [bottleneck_dim]
        layers: list[nn.Module] = []
        for i, (a, b) in enumerate(zip(widths[:-1], widths[1:])):
            layers += [nn.Linear(a, b)] + ([nn.GELU()] if i < num_layers - 1 else [])
        self.mlp = nn.Sequential(*layers)
        for layer in self.mlp:
            if isinstance(layer, nn.Linear):
                nn.init.trunc_normal_(layer.weight, std=0.02)
                nn.init.zeros_(layer.bias)
        self.last_layer = weight_norm(nn.Linear(bottleneck_dim, out_dim, bias=False))
        magnitude = self.last_layer.parametrizations.weight.original0
        magnitude.data.fill_(1.0)
        magnitude.requires_grad_(not norm_last_layer)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last_layer(F.normalize(self.mlp(x), dim=-1))


class SelfDistillationNetwork(SwinViTEmbedding):
    """A student (or teacher) of self-distillation: :class:`SwinViTEmbedding` plus a :class:`ProjectionHead`
    (attribute ``head``).

    ``forward`` takes one batch or a sequence of batches of different spatial sizes (DINO's multi-crop: the global
    and the local crops); each is encoded on its own, the embeddings are concatenated in order and the head runs
    once on all. Giving all crops to one call keeps one DDP forward per step.

    Args:
        out_dim, hidden_dim, bottleneck_dim, num_layers, norm_last_layer: of the :class:`ProjectionHead`.
        encoder: as :class:`SwinViTEmbedding`; ``dropout_path_rate`` is the student's stochastic depth (DINO's
            ViT-S: 0.1); the teacher, copied by :func:`~components.recipes.self_distillation.teacher_copy`, has none.

    Returns:
        ``(embeddings (N, 16 * feature_size), logits (N, out_dim))`` with N the total number of crops.
    """

    def __init__(
        self,
        out_dim: int = 8192,
        hidden_dim: int = 2048,
        bottleneck_dim: int = 256,
        num_layers: int = 3,
        norm_last_layer: bool = True,
        **encoder: Any,
    ) -> None:
        super().__init__(**encoder)
        self.head = ProjectionHead(self.embed_dim, out_dim, hidden_dim, bottleneck_dim, num_layers, norm_last_layer)

    def forward(self, crops: torch.Tensor | Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        batches = [crops] if isinstance(crops, torch.Tensor) else list(crops)
        embeddings = torch.cat([self.embed(b) for b in batches if b.shape[0] > 0])
        return embeddings, self.head(embeddings)


def _learning_rates(
    module: nn.Module, learning_rate: float, encoder_lr_decay: float, patch_embed_lr_mult: float
) -> dict[int, float]:
    """Each trainable parameter's learning rate (by ``id``): layer-wise decay into the encoder as
    :func:`~components.encoder_param_groups` gives it, times ``patch_embed_lr_mult`` for the patch embedding."""
    if not float(patch_embed_lr_mult) > 0:
        raise ValueError(f"patch_embed_lr_mult must be > 0, got {patch_embed_lr_mult}.")
    groups = encoder_param_groups(module, float(learning_rate), float(encoder_lr_decay), prefix=f"{ENCODER}.")
    if encoder_lr_decay == 1:  # one list of parameters, all at the learning rate
        groups = [{"params": groups, "lr": float(learning_rate)}]
    rates = {id(param): group["lr"] for group in groups for param in group["params"]}
    for param in getattr(unwrap(module), ENCODER).patch_embed.parameters():
        rates[id(param)] *= float(patch_embed_lr_mult)
    return rates


def weight_decay_groups(
    module: nn.Module,
    weight_decay: float,
    learning_rate: float | None = None,
    encoder_lr_decay: float = 1.0,
    patch_embed_lr_mult: float = 1.0,
) -> list[dict]:
    """Optimizer parameter groups as DINO uses them: weights decayed, biases and norm parameters (ndim <= 1) not;
    on request with DINOv2's layer-wise learning rates.

    Every decayed group is marked ``"scheduled_weight_decay": True`` for the recipe's weight-decay schedule; frozen
    parameters (``requires_grad=False``) are left out. Without ``learning_rate``: two groups, the optimizer's own
    rate for both. With it every group carries its ``lr``: ``learning_rate`` for the projection head; for the
    encoder times ``encoder_lr_decay ** depth``, depth 1 for its last stage up to 5 for the patch embedding (as
    :func:`~components.encoder_param_groups` counts), and the patch embedding times ``patch_embed_lr_mult`` too
    (DINOv2's default config: 0.9 per transformer block and 0.2; here the decay steps per Swin stage of 2 blocks).
    A ``LambdaLR`` schedule such as MONAI's ``WarmupCosineSchedule`` keeps the ratios. The groups come by decreasing
    rate, weights first: the first group holds the head's weights, whose rate the trainer logs as ``lr``.

    Raises:
        ValueError: for ``encoder_lr_decay`` or ``patch_embed_lr_mult`` other than 1 without ``learning_rate``, an
            ``encoder_lr_decay`` outside (0, 1] or a ``patch_embed_lr_mult`` <= 0.

    Example::

        torch.optim.AdamW(weight_decay_groups(student, 0.04), lr=5e-4)
        torch.optim.AdamW(weight_decay_groups(student, 0.04, 5e-4, encoder_lr_decay=0.9, patch_embed_lr_mult=0.2))
    """
    if learning_rate is None and (encoder_lr_decay != 1 or patch_embed_lr_mult != 1):
        raise ValueError(f"encoder_lr_decay {encoder_lr_decay} and patch_embed_lr_mult {patch_embed_lr_mult} need the "
                         "learning_rate (the head's) to set the encoder's rates from.")  # fmt: skip
    rates = None if learning_rate is None else _learning_rates(module, learning_rate, encoder_lr_decay, patch_embed_lr_mult)
    groups: dict[tuple[float, bool], list[nn.Parameter]] = {}
    for param in module.parameters():
        if param.requires_grad:
            groups.setdefault((rates[id(param)] if rates else 0.0, param.ndim > 1), []).append(param)
    return [
        {"params": params, "weight_decay": float(weight_decay) if decayed else 0.0}
        | ({"scheduled_weight_decay": True} if decayed else {})
        | ({"lr": rate} if rates else {})
        for (rate, decayed), params in sorted(groups.items(), key=lambda item: (-item[0][0], not item[0][1]))
    ]
