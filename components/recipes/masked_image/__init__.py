"""Masked image modelling on the Swin ViT encoder (SimMIM-style): block masks over the patch tokens, a learned mask
token, a light decoder and a loss on the masked voxels only."""

from .loss import LOSSES, MaskedReconstructionLoss, normalise_blocks
from .masks import MaskedViews, block_grid, block_masks, masked_views
from .network import DECODERS, MaskedImageModel, voxel_shuffle
from .recipe import MaskedImageRecipe, MaskedViewsImageHandler

__all__ = [
    "DECODERS",
    "LOSSES",
    "MaskedImageModel",
    "MaskedImageRecipe",
    "MaskedReconstructionLoss",
    "MaskedViews",
    "MaskedViewsImageHandler",
    "block_grid",
    "block_masks",
    "masked_views",
    "normalise_blocks",
    "voxel_shuffle",
]
