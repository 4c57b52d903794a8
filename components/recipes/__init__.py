"""Pretraining recipes for :class:`~components.engine.PretrainingTrainer`, one module or sub-package each."""

from .inpainting_contrast import InpaintingContrastRecipe, SSLEvaluator, SSLTrainer, SSLViewsImageHandler

__all__ = ["InpaintingContrastRecipe", "SSLEvaluator", "SSLTrainer", "SSLViewsImageHandler"]
