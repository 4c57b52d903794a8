"""The recipe object of masked image modelling, for the recipe-agnostic pretraining engines.

One step: block masks for the batch's crops (:mod:`.masks`), one forward of the crops with the masked patch embeddings
replaced by the mask token (:class:`~.network.MaskedImageModel`), and the reconstruction error on the masked voxels
(:class:`~.loss.MaskedReconstructionLoss`); optionally, the self-distillation of the masked tokens
(:class:`~.distillation.MaskedTokenDistillation`). :class:`MaskedViewsImageHandler` shows a user what the model sees
and predicts.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from ignite.engine import Engine
from monai.utils import CommonKeys as Keys
from torch import nn

from ...training.health import Signal, collapse_signal, loss_signal, visible_fill_errors
from ..pictures import ValidationPictures
from .distillation import TOKEN_STRIDE, MaskedTokenDistillation
from .loss import MaskedReconstructionLoss, normalise_blocks
from .masks import MaskedViews, masked_views

__all__ = ["MaskedImageRecipe", "MaskedViewsImageHandler"]

#: the spread of the reconstructions across crops, as a share of the targets' own, at or below which every crop gets
#: the same output
COLLAPSED_SPREAD = 0.1
_ADVICE = ("the reconstruction is no better than each crop's visible {fill}: train longer first (a masked model "
           "predicts the average before any structure); then try smaller mask blocks, norm_target or a lower learning rate")  # fmt: skip


class MaskedImageRecipe(nn.Module):
    """Views, forward and loss of masked image modelling, and optionally the self-distillation of the masked tokens.

    An ``nn.Module`` so that a distillation's teacher and centre are part of the bundle's resumable checkpoint (its
    state dict is empty without one).

    Args:
        loss_function: a :class:`MaskedReconstructionLoss` (its ``block_size`` is the mask block's), or None for an
            evaluator.
        mask_ratio: the share of each crop's blocks that is masked (SimMIM 2D: 0.6; nnssl's 3D MAE: 0.75).
        mask_block: the mask block's edge in voxels, a multiple of the patch size that divides the crop (16: nnssl).
        patch_size: the encoder's patch edge (2 in Swin UNETR).
        distillation: a :class:`MaskedTokenDistillation` to add its term (the loss parts are then ``recon`` and
            ``distill``, the total ``recon + weight x distill``), or None; it needs whole third-stage tokens hidden,
            so ``mask_block`` a multiple of 16.

    Outputs (for handlers and the evaluator's metric): ``image`` (the crops), ``masked`` (the crops with the masked
    voxels at 0: what the encoder is shown), ``reconstruction`` (every voxel), ``target`` (the loss's target), and
    ``pred`` / ``label``: the reconstruction and the target at the masked voxels only, as one row ``(1, N)`` (MONAI's
    regression metrics need a batch and a channel axis), so that a mean error metric over them is the masked-voxel
    error the loss minimises (the batch's mean, averaged over batches).
    """

    def __init__(
        self,
        loss_function: MaskedReconstructionLoss | None = None,
        mask_ratio: float = 0.6,
        mask_block: int = 16,
        patch_size: int = 2,
        distillation: MaskedTokenDistillation | None = None,
    ) -> None:
        super().__init__()
        self.loss_function = loss_function
        self.mask_ratio = float(mask_ratio)
        self.mask_block = int(mask_block)
        self.patch_size = int(patch_size)
        if loss_function is not None and loss_function.norm_target and loss_function.block_size != self.mask_block:
            raise ValueError(
                f"the loss normalises targets per block of {loss_function.block_size} voxels, the masks use blocks of "
                f"{self.mask_block}: give both the same size."
            )
        if distillation is not None and self.mask_block % TOKEN_STRIDE:
            raise ValueError(f"the masked-token distillation needs whole {TOKEN_STRIDE}^3-voxel tokens hidden: "
                             f"masking#block_size must be a multiple of {TOKEN_STRIDE}, got {self.mask_block}.")  # fmt: skip
        self.distillation = distillation

    def views(self, image: torch.Tensor, generator: torch.Generator) -> MaskedViews:
        return masked_views(image, generator, self.mask_ratio, self.mask_block, self.patch_size)

    def forward(self, network: nn.Module, views: MaskedViews) -> Any:  # type: ignore[override]
        """The reconstruction, or with a distillation ``(reconstruction, student logits, teacher logits)``."""
        outputs = network(views.image, views.token_mask)
        if self.distillation is None:
            return outputs
        return (*outputs, self.distillation.teacher_logits(views.image))

    def target(self, image: torch.Tensor) -> torch.Tensor:
        """What the reconstruction is compared with: the crops, or their per-block normalised values."""
        if self.loss_function is not None and self.loss_function.norm_target:
            return normalise_blocks(image, self.mask_block)
        return image

    def loss(self, outputs: Any, views: MaskedViews) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        if self.loss_function is None:
            raise RuntimeError("MaskedImageRecipe was built without a loss_function (an evaluator's recipe).")
        if self.distillation is None:
            return self.loss_function(outputs, views.image, views.voxel_mask)
        reconstruction, student_logits, teacher_logits = outputs
        recon, _ = self.loss_function(reconstruction, views.image, views.voxel_mask)
        stride = TOKEN_STRIDE
        token_mask = views.voxel_mask[:, 0, ::stride, ::stride, ::stride].flatten(start_dim=1)  # (B, N)
        count = self.loss_function.global_count(token_mask, views.image)
        distill = self.distillation.loss(student_logits, teacher_logits, token_mask, count)
        return recon + self.distillation.weight * distill, {"recon": recon, "distill": distill}

    def outputs(self, outputs: Any, views: MaskedViews) -> dict[str, Any]:
        reconstruction = (outputs[0] if isinstance(outputs, tuple) else outputs).detach().float()
        target = self.target(views.image).float()
        mask = views.voxel_mask.expand_as(target)
        return {
            Keys.IMAGE: views.image,
            "masked": views.image.masked_fill(views.voxel_mask, 0.0),
            "reconstruction": reconstruction,
            "target": target,
            Keys.PRED: reconstruction[mask].unsqueeze(0),
            Keys.LABEL: target[mask].unsqueeze(0),
        }

    def health(self, outputs: Any, views: MaskedViews) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """This batch's pretext signals beside their trivial answers (see :meth:`health_signals`)."""
        reconstruction = (outputs[0] if isinstance(outputs, tuple) else outputs).float()
        target = self.target(views.image).float()
        mask = views.voxel_mask
        kind = self.loss_function.loss if self.loss_function is not None else "l1"
        error = (reconstruction - target).abs() if kind == "l1" else (reconstruction - target) ** 2
        value = (error * mask).sum() / mask.expand_as(error).sum().clamp_min(1)
        mean_fill, median_fill = visible_fill_errors(target, ~mask, mask, kind)
        stats = {f"masked_{kind}": (value, mean_fill), f"masked_{kind}_median": (value, median_fill)}
        if target.shape[0] > 1:
            stats["reconstruction_spread"] = (reconstruction.std(dim=0).mean(), target.std(dim=0).mean())
        if self.distillation is not None:
            teacher = outputs[2].float() - self.distillation.center
            log_targets = torch.log_softmax(teacher / self.distillation.teacher_temperature_at(self.distillation.step), dim=-1)
            entropy = -(log_targets.exp() * log_targets).sum(dim=-1).mean()
            stats["distill_teacher_entropy"] = (entropy, torch.tensor(math.log(teacher.shape[-1])))
        return stats

    def health_signals(self, means: dict[str, tuple[float, float]], crops: int) -> list[Signal]:
        """The pretext signals from :meth:`health`'s means over the validation crops:

        - ``masked_l1`` (or ``masked_mse``): the error on the masked voxels against filling each crop's masked voxels
          with the mean of its visible ones, and ``masked_l1_median`` against its visible median;
        - ``reconstruction_spread``: the reconstructions' standard deviation across the crops of a batch as a share
          of the targets' own (collapsed at or below :data:`COLLAPSED_SPREAD`: every crop gets the same output);
        - with the masked-token distillation, ``distill_teacher_entropy`` against ``ln K`` (uniform targets).
        """
        signals = []
        for name, (value, baseline) in means.items():
            if name.startswith("masked_"):
                fill = "median" if name.endswith("_median") else "mean"
                signals.append(loss_signal(name, value, baseline, _ADVICE.format(fill=fill)))
            elif name == "reconstruction_spread":
                signals.append(collapse_signal(name, value / baseline if baseline > 0 else 0.0, COLLAPSED_SPREAD,
                                               "every crop gets nearly the same reconstruction: " + _ADVICE.format(fill="mean")))  # fmt: skip
            elif name == "distill_teacher_entropy":
                signals.append(loss_signal(name, value, baseline, "the teacher's targets are uniform over the "
                                           "prototypes: lower masking#teacher_temperature or train longer"))  # fmt: skip
        return signals

    def monitor(self, outputs: Any, views: MaskedViews) -> dict[str, Any]:
        """The reconstruction's trivial value on this batch (``loss_recon_trivial``: each crop's masked voxels filled
        with its visible mean), logged beside it; with a distillation its schedules and ``ln K``."""
        kind = self.loss_function.loss if self.loss_function is not None else "l1"
        target = self.target(views.image).float()
        fill, _ = visible_fill_errors(target, ~views.voxel_mask, views.voxel_mask, kind, median=False)
        if self.distillation is None:
            return {"loss_recon_trivial": fill}
        step = self.distillation.step
        return {"loss_recon_trivial": fill, "loss_distill_trivial": math.log(outputs[2].shape[-1]),
                "teacher_temperature": self.distillation.teacher_temperature_at(step),
                "momentum": self.distillation.momentum_at(step)}  # fmt: skip

    def after_step(self, engine: Engine) -> None:
        if self.distillation is not None:
            self.distillation.update_teacher(engine.network)

    def attach(self, engine: Engine) -> None:
        if self.distillation is not None:
            self.distillation.attach(engine)


class MaskedViewsImageHandler(ValidationPictures):
    """Middle slices of the first validation crops in TensorBoard after each evaluation: one row per crop (up to
    ``max_crops``) of the crop, the masked input, the reconstruction and the target, scaled together to [0, 1] (a
    normalised target is not). Attach to the evaluator; only rank 0 writes."""

    COLUMNS = (Keys.IMAGE, "masked", "reconstruction", "target")

    def __init__(self, log_dir: str, max_crops: int = 2, tag: str = "masked_views") -> None:
        super().__init__(log_dir, tag)
        self.max_crops = int(max_crops)

    def picture(self, output: dict) -> torch.Tensor:
        n = min(self.max_crops, output[Keys.IMAGE].shape[0])
        middle = [output[key][:n, 0, ..., output[key].shape[-1] // 2].float().cpu() for key in self.COLUMNS]
        rows = [torch.cat([column[i] for column in middle], dim=1) for i in range(n)]  # (H, 4W) per crop
        grid = torch.cat(rows, dim=0)
        low, high = grid.min(), grid.max()
        return ((grid - low) / (high - low).clamp_min(1e-8)).unsqueeze(0)
