"""Pretraining recipes for :class:`~components.engine.PretrainingTrainer`, one module or sub-package each."""

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
    "check_koleo_batch",
    "rot_rand",
    "ssl_views",
    "weight_decay_groups",
]
