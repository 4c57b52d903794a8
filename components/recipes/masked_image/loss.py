"""The loss of masked image modelling: the reconstruction error on the masked voxels only, as one mean over the masked
voxels of the global batch.

SimMIM (Xie et al., CVPR 2022) regresses raw pixels with L1 on the masked patches only; nnssl's masked autoencoder uses
MSE on masked voxels of the preprocessed intensities; MAE (He et al., CVPR 2022) found targets normalised per patch
(``norm_pix_loss``) better. Both errors and the per-block normalisation are options here.

Distributed: ranks may mask different numbers of voxels (another batch size on the last step of an uneven shard), so
a mean of per-rank means is not the global mean. Each rank's loss is its sum of errors divided by the *mean* masked
count over the ranks; DDP's gradient averaging then gives exactly the gradient of (global sum) / (global count), and the
logged rank average is the global mean. With ``equal_rank_batches`` every rank masks the same number of voxels (the
masks hold a fixed number of blocks per volume), so the local count is that mean and no collective runs.
"""

from __future__ import annotations

import torch
from torch import nn

from ...config.values import as_bool
from ...distributed import RankBatches, all_reduce_mean

__all__ = ["LOSSES", "MaskedReconstructionLoss", "normalise_blocks"]

#: the reconstruction errors :class:`MaskedReconstructionLoss` computes (``loss`` argument).
LOSSES: tuple[str, ...] = ("l1", "mse")


def normalise_blocks(target: torch.Tensor, block_size: int, eps: float = 1e-6) -> torch.Tensor:
    """``target`` ``(B, C, *spatial)`` with each ``block_size``-cube of each channel shifted to mean 0 and scaled to
    variance 1 (MAE's normalised targets, per mask block; ``eps`` keeps constant blocks finite)."""
    b, c, *spatial = target.shape
    grid = [s // block_size for s in spatial]
    shape = [b, c] + [n for g in grid for n in (g, block_size)]
    blocks = target.reshape(shape)
    inner = tuple(3 + 2 * i for i in range(len(spatial)))  # the within-block axes
    mean = blocks.mean(dim=inner, keepdim=True)
    var = blocks.var(dim=inner, keepdim=True, unbiased=False)
    return ((blocks - mean) / torch.sqrt(var + eps)).reshape(target.shape)


class MaskedReconstructionLoss(nn.Module):
    """Reconstruction error on masked voxels, averaged over the masked voxels of the global batch.

    Args:
        loss: ``"l1"`` (SimMIM, default) or ``"mse"`` (nnssl's MAE).
        norm_target: compare with targets normalised per mask block (:func:`normalise_blocks`) instead of the raw
            intensities.
        block_size: the mask block's edge in voxels (for ``norm_target``).
        equal_rank_batches: every rank's batch has the same shape (the bundles' full batches), so no collective
            runs (checked once); False: the masked counts are all-reduced every step.

    ``forward(pred, target, voxel_mask)`` with ``pred`` and ``target`` ``(B, C, *spatial)`` and ``voxel_mask``
    ``(B, 1, *spatial)`` bool returns ``(total, {"recon": total})``.

    Raises:
        ValueError: an unknown ``loss``.

    Example:
        >>> loss = MaskedReconstructionLoss()
        >>> mask = torch.zeros(1, 1, 4, 4, 4, dtype=torch.bool); mask[..., :2] = True
        >>> float(loss(torch.ones(1, 1, 4, 4, 4), torch.zeros(1, 1, 4, 4, 4), mask)[0])
        1.0
    """

    def __init__(
        self, loss: str = "l1", norm_target: bool | str = False, block_size: int = 16, equal_rank_batches: bool = True
    ) -> None:
        super().__init__()
        if loss not in LOSSES:
            raise ValueError(f"loss must be one of {LOSSES}, got {loss!r}.")
        self.loss = loss
        self.norm_target = as_bool(norm_target, "norm_target")
        self.block_size = int(block_size)
        self.ranks = RankBatches(gather=None, equal_sizes=bool(equal_rank_batches), owner="MaskedReconstructionLoss(equal_rank_batches=True)")

    def forward(
        self, pred: torch.Tensor, target: torch.Tensor, voxel_mask: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        if self.norm_target:
            target = normalise_blocks(target, self.block_size)
        error = (pred.float() - target.float()).abs() if self.loss == "l1" else (pred.float() - target.float()) ** 2
        mask = voxel_mask.expand_as(error)
        total = (error * mask).sum() / self.global_count(mask, pred)
        return total, {"recon": total}

    def global_count(self, mask: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
        """The number of True entries of ``mask``, as the divisor of a sum over this rank's ``batch`` that makes the
        global mean under DDP (the mean count over ranks; this rank's own count with equal rank batches); >= 1."""
        count = mask.sum()
        if self.ranks.active:
            self.ranks.check_once(batch)
            if not self.ranks.equal_sizes:
                count = all_reduce_mean(count)
        return count.clamp_min(1).float()
