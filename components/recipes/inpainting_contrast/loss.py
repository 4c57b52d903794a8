"""Losses of the Swin UNETR self-supervised pretraining recipe (Tang et al., CVPR 2022).

``SSLLoss`` = a1 * rotation cross-entropy + a2 * NT-Xent contrastive loss + a3 * L1 reconstruction, with the
contrastive term optionally computed over the global (all-ranks) batch. The gathering itself lives in
:mod:`components.distributed`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import ignite.distributed as idist
import torch
import torch.nn as nn
import torch.nn.functional as F

from ...distributed import RankBatches, all_gather_with_grad

__all__ = ["SSLLoss", "nt_xent_loss"]


def nt_xent_loss(
    emb_1: torch.Tensor,
    emb_2: torch.Tensor,
    temperature: float = 0.5,
    candidates_1: torch.Tensor | None = None,
    candidates_2: torch.Tensor | None = None,
    offset: int = 0,
) -> torch.Tensor:
    """NT-Xent (normalised temperature-scaled cross-entropy, SimCLR) of the anchors ``emb_1``, ``emb_2``.

    With z = normalize(cat(C1, C2)) over the candidates (C = the anchors themselves by default, so 2B
    candidates), anchor a with positive p(a) (the other view of the same sample) contributes
    ``-log(exp(s_ap / t) / sum_{j != a} exp(s_aj / t))`` with s the cosine similarity; the result is the mean
    over the 2B anchors. Computed as one matrix product of normalised embeddings (O(N^2) memory, not the
    O(N^2 F) broadcast of MONAI's ``ContrastiveLoss``) and a cross-entropy (log-sum-exp) over rows with the
    anchor itself masked by -inf, in at least float32 and outside autocast: stable at low temperatures.

    Args:
        emb_1: anchors of view 1, shape (B, F).
        emb_2: anchors of view 2, shape (B, F); row i is the positive of ``emb_1`` row i.
        temperature: t > 0.
        candidates_1, candidates_2: optional larger candidate sets (Bc, F) of view 1 / view 2, e.g. the embeddings
            of all ranks, which must contain the (normalised) anchors at rows ``offset .. offset + B - 1``.
            Both or neither. They are normalised here as well (a no-op for already normalised rows).
        offset: row of the first anchor inside the candidate sets.

    Returns:
        scalar: mean over the 2B anchors.
    """
    if (candidates_1 is None) != (candidates_2 is None):
        raise ValueError("candidates_1 and candidates_2 must be given together.")
    dtype = torch.promote_types(emb_1.dtype, torch.float32)
    with torch.autocast(device_type=emb_1.device.type, enabled=False):
        # (2B, F) anchors: [view 1 ; view 2]
        anchors = F.normalize(torch.cat([emb_1, emb_2], dim=0).to(dtype), dim=1)
        if candidates_1 is None:
            candidates, n_cand, offset = anchors, emb_1.shape[0], 0  # (2B, F)
        else:
            n_cand = candidates_1.shape[0]
            candidates = F.normalize(torch.cat([candidates_1, candidates_2], dim=0).to(dtype), dim=1)  # (2Bc, F)
        n = emb_1.shape[0]
        rows = torch.arange(n, device=emb_1.device) + offset  # anchors' rows among the view-1 candidates
        self_idx = torch.cat([rows, rows + n_cand])  # (2B,) column of each anchor itself
        pos_idx = torch.cat([rows + n_cand, rows])  # (2B,) column of its positive (the other view)
        logits = anchors @ candidates.T / temperature  # (2B, 2Bc) cosine similarity / t
        cols = torch.arange(candidates.shape[0], device=emb_1.device)
        logits = logits.masked_fill(self_idx[:, None] == cols[None, :], float("-inf"))  # exclude j == i
        return F.cross_entropy(logits, pos_idx)


class SSLLoss(nn.Module):
    """Loss of Swin UNETR self-supervised pretraining (Tang et al., CVPR 2022):

        total = alpha[0] * rot + alpha[1] * contrast + alpha[2] * recon

    - ``rot``: cross-entropy of the rotation logits of both views against their k labels (k * 90 degrees).
    - ``contrast``: NT-Xent between the contrastive embeddings of view 1 and view 2 (:func:`nt_xent_loss`):
      z = normalize(cat(z1, z2)); positives are the pairs (i, i + B); the denominator runs over all j != i;
      mean over the 2B anchors. On one process this equals ``monai.losses.ContrastiveLoss(temperature)``,
      computed stably (one matrix product, log-sum-exp) instead of exp / sum / log.
    - ``recon``: mean absolute error (L1) between the reconstruction and the rotated, uncorrupted views.

    Distributed (``gather_distributed``): every rank gathers all ranks' z1 and z2 with an autograd-aware
    all-gather and computes NT-Xent for *its own* 2*B_local anchors against all 2*B_global candidates, so each
    anchor has 2*B_global - 2 negatives, as on one process with the concatenated global batch. Each part is
    then multiplied by ``W * n_local / n_global`` (W = world size; n = anchors for ``contrast``, rows for
    ``rot``, elements for ``recon``), which makes each rank's value its share of the global-batch mean:

    - the mean over ranks of ``total`` (and of each part) equals the single-process loss on the concatenated
      global batch (log it with ``components.distributed.all_reduce_mean``), and
    - after DDP averages the gradients over ranks they equal the single-process gradient on that batch.

    With equal local batches the factor is exactly 1 (the loss is the plain mean over the local anchors / rows /
    elements); with unequal ones (e.g. a last, smaller batch) it weights each rank by its share of the
    samples. Without gathering (``gather_distributed=False`` or no process group) every part is the plain local
    mean: under DDP each rank's contrastive term then only sees its own 2*B_local - 2 negatives and the averaged
    gradient is *not* the global-batch gradient (the behaviour of the original code and of MONAI's loss).
    ``equal_rank_batches=True`` promises that every rank's batch has the same size at every step (the bundles'
    training shards are equal and their batches fixed): the factors are then 1 without exchanging counts, and the
    embeddings are gathered with one ``all_gather_into_tensor``, so a step reads nothing back to the host (no CUDA
    sync). The promise is checked once, at the first gathered step (a ``ValueError`` on every rank if broken).
    With gathering on, every rank must call the loss, and run backward through it, on every step (it runs
    collectives). So do not gather where ranks may run different numbers of iterations, e.g. validation with
    ``DistributedSampler(even_divisible=False)``: use ``gather_distributed=False`` there (or only the
    reconstruction L1, the recipe's validation metric), otherwise a rank waits in the gather until timeout.

    Args:
        temperature: NT-Xent temperature t > 0 (0.5 in the recipe).
        alpha: the three weights (rot, contrast, recon), each finite and >= 0.
        gather_distributed: gather the embeddings across ranks. ``None`` (default): gather when a process group
            is initialised at call time. ``True`` without a process group is the same as ``False``.
        equal_rank_batches: every rank has a batch of the same size at every step (see above).

    Shapes:
        - rot_logits: (N, C) floating, N = rotation samples of both views (2B), C = 4 rotation classes.
        - rot_labels: (N,) integer (int64) class indices in [0, C).
        - emb_1, emb_2: (B, F) floating contrastive embeddings of view 1 and view 2; row i of both = sample i.
        - recon, recon_target: the same shape, e.g. (2B, C_in, H, W, D), floating.
        - returns ``(total, parts)``: ``total`` a scalar tensor, ``parts`` a dict with the scalar tensors
          ``"rot"``, ``"contrast"``, ``"recon"`` (unweighted, scaled as described above). They are *not*
          detached: they are the graph nodes ``total`` is built from; detach them (or use
          ``all_reduce_mean``, which does) before logging or storing.

    Raises:
        ValueError: for a non-positive temperature, an ``alpha`` that is not three finite non-negative numbers,
            and inputs of the wrong rank, dtype or mismatched shapes (the message names the argument).

    Example:
        >>> import torch
        >>> loss_fn = SSLLoss(temperature=0.5)
        >>> B = 4
        >>> rot_logits, rot_labels = torch.randn(2 * B, 4), torch.randint(0, 4, (2 * B,))
        >>> emb_1, emb_2 = torch.randn(B, 512), torch.randn(B, 512)
        >>> recon, target = torch.rand(2 * B, 1, 8, 8, 8), torch.rand(2 * B, 1, 8, 8, 8)
        >>> total, parts = loss_fn(rot_logits, rot_labels, emb_1, emb_2, recon, target)
        >>> sorted(parts)
        ['contrast', 'recon', 'rot']
    """

    def __init__(
        self,
        temperature: float = 0.5,
        alpha: Sequence[float] = (1.0, 1.0, 1.0),
        gather_distributed: bool | None = None,
        equal_rank_batches: bool = False,
    ) -> None:
        super().__init__()
        try:
            temperature = float(temperature)
        except (TypeError, ValueError):
            raise ValueError(f"temperature must be a positive number, got {temperature!r}.") from None
        if not (math.isfinite(temperature) and temperature > 0):
            raise ValueError(f"temperature must be a finite number > 0, got {temperature}.")
        if isinstance(alpha, (str, bytes)) or not isinstance(alpha, Sequence) or len(alpha) != 3:
            raise ValueError(f"alpha must be a sequence of 3 weights (rot, contrast, recon), got {alpha!r}.")
        try:
            weights = tuple(float(a) for a in alpha)
        except (TypeError, ValueError):
            raise ValueError(f"alpha must hold 3 numbers (rot, contrast, recon), got {alpha!r}.") from None
        if not all(math.isfinite(a) and a >= 0 for a in weights):
            raise ValueError(f"alpha weights must be finite and >= 0, got {weights}.")
        self._ranks = RankBatches(gather_distributed, equal_rank_batches, "SSLLoss(equal_rank_batches=True)")
        self.temperature = temperature
        self.alpha = weights
        self.gather_distributed = gather_distributed
        self.equal_rank_batches = bool(equal_rank_batches)

    def extra_repr(self) -> str:
        return (
            f"temperature={self.temperature}, alpha={self.alpha}, gather_distributed={self.gather_distributed}, "
            f"equal_rank_batches={self.equal_rank_batches}"
        )

    @staticmethod
    def _check_inputs(
        rot_logits: torch.Tensor,
        rot_labels: torch.Tensor,
        emb_1: torch.Tensor,
        emb_2: torch.Tensor,
        recon: torch.Tensor,
        recon_target: torch.Tensor,
    ) -> None:
        named = {
            "rot_logits": rot_logits,
            "rot_labels": rot_labels,
            "emb_1": emb_1,
            "emb_2": emb_2,
            "recon": recon,
            "recon_target": recon_target,
        }
        for name, value in named.items():
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}.")
        for name in ("rot_logits", "emb_1", "emb_2", "recon", "recon_target"):
            if not named[name].is_floating_point():
                raise ValueError(f"{name} must be a floating-point tensor, got dtype {named[name].dtype}.")
        if rot_logits.dim() != 2 or rot_logits.shape[0] < 1 or rot_logits.shape[1] < 2:
            raise ValueError(
                f"rot_logits must have shape (N, C) with N >= 1 and C >= 2 classes, got {tuple(rot_logits.shape)}."
            )
        if rot_labels.is_floating_point() or rot_labels.is_complex() or rot_labels.dtype == torch.bool:
            raise ValueError(f"rot_labels must be an integer tensor (int64) of class indices, got {rot_labels.dtype}.")
        if rot_labels.dim() != 1 or rot_labels.shape[0] != rot_logits.shape[0]:
            raise ValueError(
                f"rot_labels must have shape (N,) = ({rot_logits.shape[0]},) to match rot_logits "
                f"{tuple(rot_logits.shape)}, got {tuple(rot_labels.shape)}."
            )
        for name in ("emb_1", "emb_2"):
            if named[name].dim() != 2 or named[name].shape[0] < 1:
                raise ValueError(f"{name} must have shape (B, F) with B >= 1, got {tuple(named[name].shape)}.")
        if emb_1.shape != emb_2.shape:
            raise ValueError(
                f"emb_1 and emb_2 must have the same shape (B, F) (batch and feature size), got "
                f"{tuple(emb_1.shape)} and {tuple(emb_2.shape)}."
            )
        if recon.shape != recon_target.shape:
            raise ValueError(
                f"recon and recon_target shapes differ: {tuple(recon.shape)} vs {tuple(recon_target.shape)}."
            )
        if recon.numel() == 0:
            raise ValueError(f"recon must not be empty, got shape {tuple(recon.shape)}.")

    @staticmethod
    def _shares(anchors: int, rows: int, elements: int, device: torch.device) -> tuple[int, list[float]]:
        """(this rank's first row in the gathered embeddings, the factors W * n_local / n_global of the parts),
        from every rank's counts (one small gather, read back to the host)."""
        world, rank = idist.get_world_size(), idist.get_rank()
        local_counts = torch.tensor([[anchors, rows, elements]], dtype=torch.int64, device=device)
        counts = all_gather_with_grad(local_counts).tolist()  # (W, 3)
        offset = sum(row[0] for row in counts[:rank])
        totals = [sum(row[k] for row in counts) for k in range(3)]
        return offset, [world * local / total for local, total in zip(counts[rank], totals)]

    def forward(
        self,
        rot_logits: torch.Tensor,
        rot_labels: torch.Tensor,
        emb_1: torch.Tensor,
        emb_2: torch.Tensor,
        recon: torch.Tensor,
        recon_target: torch.Tensor,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Compute ``(total, {"rot", "contrast", "recon"})``; see the class docstring for shapes."""
        self._check_inputs(rot_logits, rot_labels, emb_1, emb_2, recon, recon_target)

        rot = F.cross_entropy(rot_logits, rot_labels.long())
        recon_l1 = F.l1_loss(recon, recon_target)

        if not self._ranks.active:
            contrast = nt_xent_loss(emb_1, emb_2, self.temperature)
        else:
            rank = idist.get_rank()
            if self.equal_rank_batches:
                self._ranks.check_once(emb_1, rot_logits, recon)
                offset, scale = rank * emb_1.shape[0], [1.0, 1.0, 1.0]
            else:
                offset, scale = self._shares(emb_1.shape[0], rot_logits.shape[0], recon.numel(), emb_1.device)
            # normalise before gathering (row-wise, so identical to normalising the gathered arrays)
            dtype = torch.promote_types(emb_1.dtype, torch.float32)
            z1 = F.normalize(emb_1.to(dtype), dim=1)  # (B_local, F)
            z2 = F.normalize(emb_2.to(dtype), dim=1)
            # one gather of both views: (B_local, 2F) -> (B_global, 2F), rank order
            z_all = all_gather_with_grad(torch.cat([z1, z2], dim=1), equal_sizes=self.equal_rank_batches)
            feat = z1.shape[1]
            contrast = nt_xent_loss(
                z1, z2, self.temperature, candidates_1=z_all[:, :feat], candidates_2=z_all[:, feat:], offset=offset
            )
            # local mean over own anchors / rows / elements -> share of the global-batch mean, times W (for DDP)
            contrast = contrast * scale[0]
            rot = rot * scale[1]
            recon_l1 = recon_l1 * scale[2]

        a_rot, a_contrast, a_recon = self.alpha
        total = a_rot * rot + a_contrast * contrast + a_recon * recon_l1
        return total, {"rot": rot, "contrast": contrast, "recon": recon_l1}
