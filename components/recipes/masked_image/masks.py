"""The views of masked image modelling: random block masks over the encoder's patch tokens.

SimMIM (Xie et al., CVPR 2022) masks random blocks larger than a patch and replaces the masked patch embeddings by a
learned token; the block size and the ratio matter more than the decoder. In 3D, nnssl's masked autoencoder masks 75 %
of the volume in blocks of 16^3 voxels, and Chen et al. (2022) find a high ratio with a relatively small block best
for CT and MRI. Here a block is ``block_size`` voxels per axis, a whole number of patches (the Swin encoder's patch is
2 voxels), and every volume of a batch has exactly ``round(ratio * blocks)`` of its blocks masked, so a step's number
of masked voxels is fixed by the batch's shape: no host read is needed to know it (the loss's global mean under DDP).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

__all__ = ["MaskedViews", "block_grid", "block_masks", "masked_views"]


class MaskedViews(NamedTuple):
    """One step's inputs and targets.

    Attributes:
        image: the crops ``(B, C, *spatial)``: the network's input (masked inside the network) and the target.
        token_mask: ``(B, *[s // patch_size])`` bool, True where a patch embedding is replaced by the mask token.
        voxel_mask: ``(B, 1, *spatial)`` bool, the same mask on voxels (what the loss averages over).
    """

    image: torch.Tensor
    token_mask: torch.Tensor
    voxel_mask: torch.Tensor


def block_grid(spatial: Sequence[int], block_size: int, patch_size: int = 2) -> tuple[int, ...]:
    """The number of mask blocks per axis of a crop of ``spatial`` voxels.

    Raises:
        ValueError: ``block_size`` is not a positive multiple of ``patch_size``, or does not divide every axis.

    Example:
        >>> block_grid([96, 96, 96], 16)
        (6, 6, 6)
    """
    block, patch = int(block_size), int(patch_size)
    if block < patch or block % patch:
        raise ValueError(f"mask block size {block_size} must be a positive multiple of the patch size {patch_size}.")
    if any(int(s) % block for s in spatial):
        raise ValueError(
            f"mask block size {block_size} (masking#block_size) must divide every axis of the crop {list(spatial)}: choose a block that "
            f"divides roi_size (e.g. 16 for multiples of 32)."
        )
    return tuple(int(s) // block for s in spatial)


def block_masks(
    batch: int, grid: Sequence[int], ratio: float, generator: torch.Generator, device: torch.device | str
) -> torch.Tensor:
    """``(batch, *grid)`` bool block masks, each with exactly ``round(ratio * prod(grid))`` True blocks (at least
    one, at most all but one), drawn from ``generator`` on ``device`` (no host sync).

    Raises:
        ValueError: ``ratio`` outside (0, 1).
    """
    if not 0.0 < float(ratio) < 1.0:
        raise ValueError(f"mask ratio must be in (0, 1), got {ratio!r}.")
    blocks = 1
    for g in grid:
        blocks *= int(g)
    masked = min(max(round(float(ratio) * blocks), 1), blocks - 1)
    scores = torch.rand((batch, blocks), generator=generator, device=device)
    rank = scores.argsort(dim=1).argsort(dim=1)  # each block's place in a random order
    return (rank < masked).reshape(batch, *grid)


def masked_views(
    image: torch.Tensor, generator: torch.Generator, ratio: float, block_size: int, patch_size: int = 2
) -> MaskedViews:
    """Block masks for a batch of crops ``image`` (B, C, *spatial), at patch-token and voxel resolution."""
    spatial = tuple(image.shape[2:])
    grid = block_grid(spatial, block_size, patch_size)
    blocks = block_masks(image.shape[0], grid, ratio, generator, image.device)
    per_block = int(block_size) // int(patch_size)
    token_mask = _repeat(blocks, per_block)
    voxel_mask = _repeat(blocks, int(block_size)).unsqueeze(1)
    return MaskedViews(image, token_mask, voxel_mask)


def _repeat(mask: torch.Tensor, factor: int) -> torch.Tensor:
    """Each cell of a ``(B, *grid)`` mask repeated ``factor`` times along every spatial axis."""
    for axis in range(1, mask.ndim):
        mask = mask.repeat_interleave(factor, dim=axis)
    return mask
