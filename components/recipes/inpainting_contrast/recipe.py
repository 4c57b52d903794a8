"""The recipe object of the inpainting / contrastive recipe (Tang et al., CVPR 2022).

It gives the recipe's views (:mod:`.views`), network outputs (:mod:`.network`) and loss (:mod:`.loss`) to the
recipe-agnostic engines (:class:`~components.training.engine.PretrainingTrainer`), and holds the recipe's ready-made trainer
and evaluator and its TensorBoard view of the reconstructions.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from monai.utils import CommonKeys as Keys

from ...training.engine import PretrainingEvaluator, PretrainingTrainer
from ..pictures import ValidationPictures
from .views import ssl_views

__all__ = ["InpaintingContrastRecipe", "SSLTrainer", "SSLEvaluator", "SSLViewsImageHandler"]


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


class SSLTrainer(PretrainingTrainer):
    """:class:`~components.training.engine.PretrainingTrainer` with :class:`InpaintingContrastRecipe` built from
    ``loss_function`` (e.g. :class:`~components.SSLLoss`); other arguments as that trainer."""

    def __init__(self, *args: Any, loss_function: Callable, **kwargs: Any) -> None:
        super().__init__(*args, recipe=InpaintingContrastRecipe(loss_function), **kwargs)


class SSLEvaluator(PretrainingEvaluator):
    """:class:`~components.training.engine.PretrainingEvaluator` of the recipe's views: its ``pred`` / ``label`` (the
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
