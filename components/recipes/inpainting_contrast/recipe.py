"""The recipe object of the inpainting / contrastive recipe (Tang et al., CVPR 2022).

It gives the recipe's views (:mod:`.views`), network outputs (:mod:`.network`) and loss (:mod:`.loss`) to the
recipe-agnostic engines (:class:`~components.training.trainer.PretrainingTrainer`), and holds the recipe's ready-made trainer
and evaluator and its TensorBoard view of the reconstructions.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from monai.utils import CommonKeys as Keys

from ...training.evaluator import PretrainingEvaluator
from ...training.trainer import PretrainingTrainer
from ...training.health import Signal, accuracy_margin, accuracy_signal, collapse_signal, loss_signal, visible_fill_errors
from ..pictures import ValidationPictures
from .loss import nt_xent_loss
from .views import ssl_views

__all__ = ["InpaintingContrastRecipe", "SSLTrainer", "SSLEvaluator", "SSLViewsImageHandler"]

_TEMPERATURE = 0.5  # the recipe's NT-Xent temperature, for a recipe built without its loss (an evaluator's)


class _Views(NamedTuple):
    """The clean crops ``image`` (B, ...) and :class:`~components.recipes.inpainting_contrast.SSLViews` of them (2B rows each)."""

    image: torch.Tensor
    inputs: torch.Tensor
    rot_labels: torch.Tensor
    targets: torch.Tensor


class InpaintingContrastRecipe:
    """Views, forward and loss of the rotation + contrastive + inpainting recipe, for the pretraining engines.

    One step: two rotated views of every crop, each corrupted by ``aug_rand``; one forward of the concatenated
    views (exact: the model has no BatchNorm); ``loss_function(rot_logits, rot_labels, emb_1, emb_2, recon,
    clean_views)`` in float32, e.g. :class:`~components.SSLLoss`, whose parts (``rot``, ``contrast``, ``recon``)
    are logged as ``loss_rot``, ``loss_contrast``, ``loss_recon``.

    Args:
        loss_function: the six-argument loss returning ``(total, parts)``.

    Outputs (for handlers and the evaluator's metric): ``image`` (clean crops), ``views`` (the augmented network
    inputs), ``pred`` (reconstructions of both views) and ``label`` (the clean rotated views).
    """

    def __init__(self, loss_function: Callable) -> None:
        self.loss_function = loss_function

    def views(self, image: torch.Tensor, generator: torch.Generator, host_generator: torch.Generator | None = None) -> _Views:
        """The two views of every crop; on an accelerator the cutout boxes are drawn and trimmed on the host
        (``host_generator``, see :func:`~components.recipes.inpainting_contrast.aug_rand`'s ``box_generator``)."""
        return _Views(image, *ssl_views(image, generator=generator, box_generator=host_generator))

    def forward(self, network: torch.nn.Module, views: _Views) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return network(views.inputs)

    def loss(self, outputs: tuple, views: _Views) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        rot_logits, embeddings, recon = outputs
        emb_1, emb_2 = embeddings.float().chunk(2)
        return self.loss_function(rot_logits.float(), views.rot_labels, emb_1, emb_2, recon.float(), views.targets)

    def outputs(self, outputs: tuple, views: _Views) -> dict[str, Any]:
        return {Keys.IMAGE: views.image, "views": views.inputs, Keys.PRED: outputs[2].detach().float(), Keys.LABEL: views.targets}

    def monitor(self, outputs: tuple, views: _Views) -> dict[str, Any]:
        """Each loss part's trivial value on this batch, logged beside it (``loss_<part>_trivial``): ``ln 4`` for the
        rotation, ``ln(2B - 1)`` for the contrastive term over this rank's ``B`` crops (the candidates of a loss that
        gathers over ranks are more: its trivial value is higher), the visible-mean fill's L1 for the
        reconstruction."""
        crops = views.targets.shape[0] // 2
        return {"loss_rot_trivial": math.log(4), "loss_contrast_trivial": math.log(max(2 * crops - 1, 1)),
                "loss_recon_trivial": self._visible_mean_fill(views)}  # fmt: skip

    @staticmethod
    def _visible_mean_fill(views: _Views) -> torch.Tensor:
        """The reconstruction L1 of each view filled with the mean of the voxels its cutouts left (those equal to the
        clean view's)."""
        targets = views.targets.float()
        every_voxel = torch.ones_like(targets, dtype=torch.bool)
        return visible_fill_errors(targets, views.inputs == views.targets, every_voxel, median=False)[0]

    def health(self, outputs: tuple, views: _Views) -> dict[str, tuple[Any, Any]]:
        """This batch's pretext signals beside their trivial answers (see :meth:`health_signals`)."""
        rot_logits, embeddings, recon = (output.float() for output in outputs)
        labels = views.rot_labels
        stats: dict[str, tuple[Any, Any]] = {
            "rotation_accuracy": ((rot_logits.argmax(dim=1) == labels).float().mean(), 0.25),
            "rotation_loss": (F.cross_entropy(rot_logits, labels), math.log(4)),
        }
        crops = embeddings.shape[0] // 2
        if crops > 1:  # one crop has no negative: its positive is the only candidate
            z = F.normalize(embeddings, dim=1)
            similarity = (z @ z.T).fill_diagonal_(-2.0)
            rows = torch.arange(crops, device=z.device)
            positives = torch.cat([rows + crops, rows])
            temperature = getattr(self.loss_function, "temperature", _TEMPERATURE)
            stats["contrast_accuracy"] = ((similarity.argmax(dim=1) == positives).float().mean(), 1.0 / (2 * crops - 1))
            stats["contrast_loss"] = (nt_xent_loss(*embeddings.chunk(2), temperature), math.log(2 * crops - 1))
        stats["inpainting_l1"] = ((recon - views.targets.float()).abs().mean(), self._visible_mean_fill(views))
        return stats

    def health_signals(self, means: dict[str, tuple[float, float]], crops: int) -> list[Signal]:
        """The pretext signals from :meth:`health`'s means over ``crops`` validation crops (two views each):

        - ``rotation_accuracy`` against chance (1/4) and ``rotation_loss`` against ``ln 4``;
        - ``contrast_loss`` (NT-Xent) against ``ln(2B - 1)``, its value when the two views of a crop are as far apart
          as the other crops' (B: crops per batch), and ``contrast_accuracy``, how often a view's nearest other view
          (cosine) is its positive, a collapse signal: at chance, ``1 / (2B - 1)``, every view has the same
          contrastive embedding. Above chance it says little on its own: a random encoder already puts the two
          views of a crop, which share most voxels, nearer than other crops;
        - ``inpainting_l1``: the reconstruction's L1 against filling each view with the mean of its voxels the cutout
          left visible.
        """
        advice = {
            "rotation": "rotation is at chance: train longer, or lower the learning rate if the loss jumped early",
            "contrast": ("the two views of a crop are no closer than other crops: train longer, lower the "
                         "temperature (ssl#temperature) at small batches, or raise the batch"),
            "inpainting": "the reconstruction is no better than the visible mean: train longer",
        }  # fmt: skip
        signals = []
        for name, (value, baseline) in means.items():
            topic = name.split("_")[0]
            if name == "contrast_accuracy":
                line = accuracy_margin(baseline, 2 * crops)
                signals.append(collapse_signal(name, value, line, advice[topic], baseline=baseline))
            elif name.endswith("_accuracy"):
                signals.append(accuracy_signal(name, value, baseline, 2 * crops, advice[topic]))
            else:
                signals.append(loss_signal(name, value, baseline, advice[topic]))
        return signals


class SSLTrainer(PretrainingTrainer):
    """:class:`~components.training.trainer.PretrainingTrainer` with :class:`InpaintingContrastRecipe` built from
    ``loss_function`` (e.g. :class:`~components.SSLLoss`); other arguments as that trainer."""

    def __init__(self, *args: Any, loss_function: Callable, **kwargs: Any) -> None:
        super().__init__(*args, recipe=InpaintingContrastRecipe(loss_function), **kwargs)


class SSLEvaluator(PretrainingEvaluator):
    """:class:`~components.training.evaluator.PretrainingEvaluator` of the recipe's views: its ``pred`` / ``label`` (the
    reconstructions and the clean rotated views) give the reconstruction L1, the key metric (lower is better)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, recipe=InpaintingContrastRecipe(loss_function=None), **kwargs)


class SSLViewsImageHandler(ValidationPictures):
    """Middle slices of the first validation batch in TensorBoard after each evaluation: one row per crop (up to
    ``max_crops``) of the clean crop, its two augmented views and the two reconstructions, so a user sees what the
    model learns. Attach to the evaluator; only rank 0 writes."""

    def __init__(self, log_dir: str, max_crops: int = 2, tag: str = "ssl_views") -> None:
        super().__init__(log_dir, tag)
        self.max_crops = max_crops

    def picture(self, output: dict) -> torch.Tensor:
        crops = output[Keys.IMAGE].shape[0]
        n = min(self.max_crops, crops)
        views, recon = output["views"], output[Keys.PRED]
        columns = [output[Keys.IMAGE][:n], views[:n], views[crops : crops + n], recon[:n], recon[crops : crops + n]]
        middle = [c[:, 0, :, :, c.shape[-1] // 2].float().clamp(0, 1).cpu() for c in columns]  # (n, H, W) each
        rows = [torch.cat([col[i] for col in middle], dim=1) for i in range(n)]  # (H, 5W) per crop
        return torch.cat(rows, dim=0).unsqueeze(0)  # (1, nH, 5W)
