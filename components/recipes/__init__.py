"""Pretraining recipes for :class:`~components.engine.PretrainingTrainer`, one module or sub-package each."""

from .inpainting_contrast import InpaintingContrastRecipe, SSLEvaluator, SSLTrainer, SSLViewsImageHandler
from .self_distillation import (
    MultiCrop,
    SelfDistillationLoss,
    SelfDistillationNetwork,
    SelfDistillationRecipe,
    StopOnCollapse,
    SwinViTEmbedding,
    TeacherCollapseError,
    weight_decay_groups,
)

__all__ = [
    "InpaintingContrastRecipe",
    "MultiCrop",
    "SSLEvaluator",
    "SSLTrainer",
    "SSLViewsImageHandler",
    "SelfDistillationLoss",
    "SelfDistillationNetwork",
    "SelfDistillationRecipe",
    "StopOnCollapse",
    "SwinViTEmbedding",
    "TeacherCollapseError",
    "weight_decay_groups",
]
