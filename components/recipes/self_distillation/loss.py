"""The self-distillation loss: DINO's centred cross-entropy over view pairs, with an optional KoLeo term.

DINO (Caron et al., 2021): the teacher's outputs of the global crops, centred and sharpened
(``softmax((t - c) / tau_t)``), are the targets of the student's outputs of every *other* crop
(``log_softmax(s / tau_s)``); the centre ``c`` is an EMA of the teacher's batch mean. KoLeo (Sablayrolles et al.,
2019; used by DINOv2, Oquab et al., 2023) spreads the student's normalised embeddings within a batch:
``-mean_i log(min_{j != i} ||z_i - z_j||)``; DINOv2 computes it separately for each global crop (the student's
embeddings of crop 1, then of crop 2) and adds the per-crop terms, each times the weight.

Distributed: the centre is updated with the mean over *all ranks'* teacher outputs (one all-reduce of each rank's
row sums and row count per step), so every rank holds the same centre, equal to that of one process on the global
batch, as in DINO; the same all-reduce gives each rank its share of the DINO term when batches differ, on the
device. KoLeo is computed on each rank's own batch, as in DINOv2: its value on a rank equals that of one process on
the rank's shard, whatever the world size, and needs at least 2 volumes per rank (:func:`check_koleo_batch`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ...distributed import RankBatches, all_reduce_mean

__all__ = ["SelfDistillationLoss", "check_koleo_batch", "koleo_loss"]


def koleo_loss(z: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """KoLeo entropy estimator of the embeddings ``z`` (normalised here), mean over the rows.

    Args:
        z: embeddings ``(B, D)``, B >= 2 (every row needs a neighbour).
        eps: added to the distances before the log.

    Returns:
        scalar ``-mean_i log(||z_i - z_nn(i)|| + eps)``, nn(i) the nearest other row (cosine similarity).

    Raises:
        ValueError: with fewer than 2 rows.
    """
    if z.ndim != 2 or z.shape[0] < 2:
        raise ValueError(
            f"koleo_loss needs embeddings (B, D) with B >= 2 (a neighbour for every row), got {tuple(z.shape)}."
        )
    z = F.normalize(z.float(), dim=-1)
    similarity = (z @ z.T).detach()  # (B, B); only the choice of neighbour, no gradient
    # never its own neighbour (cosine similarity >= -1 otherwise); fill_diagonal_ and index_select, unlike an
    # assignment through index tensors (index_put_), do not synchronise the host with a GPU
    similarity.fill_diagonal_(-2.0)
    distance = (z - z.index_select(0, similarity.argmax(dim=1))).norm(dim=1)
    return -torch.log(distance + eps).mean()


def check_koleo_batch(batch_size: int, koleo_weight: float) -> None:
    """Fails when KoLeo is on and a rank's batch cannot give every embedding a neighbour.

    KoLeo is computed per rank and per global crop (DINOv2), so every rank needs at least 2 volumes per step.
    A bundle calls this in ``initialize`` with ``@batch_size * @training#num_samples``, before any data is cached;
    :class:`SelfDistillationLoss` checks every step's batch the same way.

    Args:
        batch_size: volumes per rank and step (a loader's ``batch_size`` times the crops drawn per volume).
        koleo_weight: the KoLeo weight (0: off, nothing to check).

    Raises:
        ValueError: naming both settings and the fixes.

    Example::

        >>> check_koleo_batch(batch_size=2, koleo_weight=0.1)  # batch_size=1 raises, unless koleo_weight=0
    """
    if float(koleo_weight) > 0 and int(batch_size) < 2:
        raise ValueError(
            f"batch_size {batch_size} with koleo_weight {koleo_weight}: KoLeo compares every student embedding with "
            "its nearest neighbour in the same rank's batch (per global crop, as DINOv2), which needs at least 2 "
            "volumes per rank and step; raise the batch size (bundle: --batch_size, or --training#num_samples crops "
            "per volume) or turn KoLeo off (--training#koleo_weight 0)."
        )


class SelfDistillationLoss(nn.Module):
    """DINO loss with output centring and an optional KoLeo regulariser.

    Args:
        out_dim: number of prototypes K (size of the centre).
        student_temperature: tau_s (0.1 in DINO).
        center_momentum: the centre's EMA momentum (0.9 in DINO).
        koleo_weight: weight of each global crop's KoLeo term on the student's embeddings (0: off; DINOv2 0.1).
        equal_rank_batches: every rank has a batch of the same size at every step (the bundle's equal training
            shards): the DINO term needs no share of the batch (it is 1); checked once, at the first distributed
            step. Without it the share comes from the centre's all-reduce, with no read back to the host either.

    ``forward(student_logits, teacher_logits, teacher_temperature, num_global, student_embeddings=None)``:

    - student_logits ``(V * B, K)``: the student's outputs of all V crops, crop-major (the ``num_global`` global
      crops first, rows ``v * B + i`` = crop v of volume i);
    - teacher_logits ``(G * B, K)``: the teacher's outputs of the G = ``num_global`` global crops, same order;
    - student_embeddings ``(V * B, D)``: needed when ``koleo_weight > 0`` (its first G * B rows are used);
    - returns ``(total, parts)``: ``parts["dino"]`` the mean over the G * (V - 1) pairs (teacher crop g, student
      crop v != g) of the per-volume cross-entropy; with ``koleo_weight > 0`` ``parts["koleo"]``, the sum over the
      G global crops of :func:`koleo_loss` of that crop's B embeddings on this rank, and
      ``total = dino + koleo_weight * koleo``.

    Raises:
        ValueError: for logits of the wrong shapes, or ``koleo_weight > 0`` with B < 2 (:func:`check_koleo_batch`).

    After the loss, the centre is updated (no gradient) and ``stats`` holds the teacher's mean output entropy
    normalised by log K (``teacher_entropy``: ~0 when one prototype takes everything, ~1 when the output is uniform,
    both signs of collapse) and the mean student-teacher KL over the pairs (``kl``, nats), detached.

    Example::

        >>> loss = SelfDistillationLoss(out_dim=64)
        >>> total, parts = loss(torch.randn(8, 64), torch.randn(4, 64), teacher_temperature=0.04, num_global=2)
        >>> sorted(parts), loss.center.shape
        (['dino'], torch.Size([1, 64]))
    """

    def __init__(
        self,
        out_dim: int,
        student_temperature: float = 0.1,
        center_momentum: float = 0.9,
        koleo_weight: float = 0.0,
        equal_rank_batches: bool = False,
    ) -> None:
        super().__init__()
        if int(out_dim) < 2:
            raise ValueError(f"out_dim must be >= 2 prototypes, got {out_dim}.")
        if not float(student_temperature) > 0:
            raise ValueError(f"student_temperature must be > 0, got {student_temperature}.")
        if not 0.0 <= float(center_momentum) <= 1.0:
            raise ValueError(f"center_momentum must lie in [0, 1], got {center_momentum}.")
        if not float(koleo_weight) >= 0:
            raise ValueError(f"koleo_weight must be >= 0, got {koleo_weight}.")
        self.out_dim = int(out_dim)
        self.student_temperature = float(student_temperature)
        self.center_momentum = float(center_momentum)
        self.koleo_weight = float(koleo_weight)
        self.equal_rank_batches = bool(equal_rank_batches)
        self._ranks = RankBatches(False, equal_rank_batches, "SelfDistillationLoss(equal_rank_batches=True)")
        self.register_buffer("center", torch.zeros(1, self.out_dim))
        self.stats: dict[str, torch.Tensor] = {}

    def extra_repr(self) -> str:
        return (
            f"out_dim={self.out_dim}, student_temperature={self.student_temperature}, "
            f"center_momentum={self.center_momentum}, koleo_weight={self.koleo_weight}"
        )

    def forward(
        self,
        student_logits: torch.Tensor,
        teacher_logits: torch.Tensor,
        teacher_temperature: float,
        num_global: int = 2,
        student_embeddings: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        g = int(num_global)
        if teacher_logits.ndim != 2 or teacher_logits.shape[1] != self.out_dim or teacher_logits.shape[0] % g:
            raise ValueError(
                f"teacher_logits must be (num_global * B, {self.out_dim}) with num_global={g}, got "
                f"{tuple(teacher_logits.shape)}."
            )
        b = teacher_logits.shape[0] // g
        if student_logits.ndim != 2 or student_logits.shape[1] != self.out_dim or student_logits.shape[0] % b:
            raise ValueError(
                f"student_logits must be (V * {b}, {self.out_dim}) (V crops of the {b} volumes), got "
                f"{tuple(student_logits.shape)}."
            )
        if self.koleo_weight > 0:
            if student_embeddings is None:
                raise ValueError("koleo_weight > 0 needs student_embeddings.")
            check_koleo_batch(b, self.koleo_weight)
        with torch.autocast(device_type=student_logits.device.type, enabled=False):
            teacher = teacher_logits.detach().float()
            targets = F.softmax((teacher - self.center) / teacher_temperature, dim=-1).chunk(g)
            log_targets = F.log_softmax((teacher - self.center) / teacher_temperature, dim=-1)
            log_probs = F.log_softmax(student_logits.float() / self.student_temperature, dim=-1).chunk(
                student_logits.shape[0] // b
            )
            pairs = [(-q * log_probs[v]).sum(dim=-1).mean() for t, q in enumerate(targets) for v in range(len(log_probs)) if v != t]
            dino = torch.stack(pairs).mean()
            entropy = -(log_targets.exp() * log_targets).sum(dim=-1).mean()
            self.stats = {"teacher_entropy": entropy / math.log(self.out_dim), "kl": dino.detach() - entropy}
            batch_mean, share = self._global_teacher_mean(teacher)
            parts = {"dino": dino * share}
            total = parts["dino"]
            if self.koleo_weight > 0:
                crops = student_embeddings[: g * b].chunk(g)
                parts["koleo"] = torch.stack([koleo_loss(z) for z in crops]).sum()
                total = total + self.koleo_weight * parts["koleo"]
        self.update_center(batch_mean)
        return total, parts

    @torch.no_grad()
    def _global_teacher_mean(self, teacher: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | float]:
        """The mean of every rank's teacher rows ``(1, K)`` and this rank's share of the DINO term, from one
        all-reduce of the row sums and the row count, on the device (nothing is read back to the host).

        The share is this rank's rows over the mean rows per rank: after DDP averages the gradients, the DINO
        term's equals that of one process on the global batch. 1 with equal batches (promised and checked once);
        a tensor equal to 1 on one process.
        """
        rows = teacher.shape[0]
        means = all_reduce_mean(torch.cat([teacher.sum(dim=0), teacher.new_full((1,), rows)]))  # over the ranks
        batch_mean = (means[:-1] / means[-1]).unsqueeze(0)
        if self.equal_rank_batches:
            self._ranks.check_once(teacher)
            return batch_mean, 1.0
        return batch_mean, rows / means[-1]

    @torch.no_grad()
    def update_center(self, batch_mean: torch.Tensor) -> None:
        """``c <- m c + (1 - m) batch_mean``, ``batch_mean`` ``(1, K)`` the teacher's mean output over every rank."""
        self.center.mul_(self.center_momentum).add_(batch_mean.to(self.center), alpha=1.0 - self.center_momentum)
