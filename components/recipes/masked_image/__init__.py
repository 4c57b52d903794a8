"""Masked image modelling on the Swin ViT encoder (SimMIM-style): block masks over the patch tokens, a learned mask
token, a light decoder and a loss on the masked voxels only."""

from .distillation import TOKEN_STRIDE, MaskedTokenDistillation, stage_tokens
from .loss import LOSSES, MaskedReconstructionLoss, normalise_blocks
from .masks import MaskedViews, block_grid, block_masks, masked_views
from .network import DECODERS, MaskedImageModel, voxel_shuffle
from .recipe import MaskedImageRecipe, MaskedViewsImageHandler
from .settings import MASKED_IMAGE_SETTINGS

__all__ = [
    "DECODERS",
    "TOKEN_STRIDE",
    "LOSSES",
    "MASKED_IMAGE_SETTINGS",
    "MaskedImageModel",
    "MaskedImageRecipe",
    "MaskedReconstructionLoss",
    "MaskedTokenDistillation",
    "MaskedViews",
    "MaskedViewsImageHandler",
    "block_grid",
    "block_masks",
    "masked_views",
    "normalise_blocks",
    "stage_tokens",
    "voxel_shuffle",
]
