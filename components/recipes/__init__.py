"""Pretraining recipes for :class:`~components.training.trainer.PretrainingTrainer`, one module or sub-package each.

The recipes' public names are re-exported here and in ``components``, imported on first use.
"""

from __future__ import annotations

from ..lazy import lazy_names

# the recipes whose public names (each module's __all__) are offered here
__getattr__, __dir__ = lazy_names(__name__, packages=("inpainting_contrast", "masked_image", "self_distillation"))
