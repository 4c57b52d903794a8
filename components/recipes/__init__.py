"""Pretraining recipes for :class:`~components.training.trainer.PretrainingTrainer`, one module or sub-package each."""

from .inpainting_contrast import (
    InpaintingContrastRecipe,
    SSLEvaluator,
    SSLHead,
    SSLLoss,
    SSLTrainer,
    SSLViewsImageHandler,
    aug_rand,
    rot_rand,
    ssl_views,
)
from .masked_image import (
    MaskedImageModel,
    MaskedImageRecipe,
    MaskedReconstructionLoss,
    MaskedTokenDistillation,
    MaskedViewsImageHandler,
    block_grid,
)
from .self_distillation import (
    MultiCrop,
    SelfDistillationLoss,
    SelfDistillationNetwork,
    SelfDistillationRecipe,
    StopOnCollapse,
    SwinViTEmbedding,
    TeacherCollapseError,
    check_koleo_batch,
    weight_decay_groups,
)

__all__ = [
    "InpaintingContrastRecipe",
    "MaskedImageModel",
    "MaskedImageRecipe",
    "MaskedReconstructionLoss",
    "MaskedTokenDistillation",
    "MaskedViewsImageHandler",
    "MultiCrop",
    "SSLEvaluator",
    "SSLHead",
    "SSLLoss",
    "SSLTrainer",
    "SSLViewsImageHandler",
    "SelfDistillationLoss",
    "SelfDistillationNetwork",
    "SelfDistillationRecipe",
    "StopOnCollapse",
    "SwinViTEmbedding",
    "TeacherCollapseError",
    "aug_rand",
    "block_grid",
    "check_koleo_batch",
    "rot_rand",
    "ssl_views",
    "weight_decay_groups",
]
