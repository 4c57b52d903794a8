"""The inpainting / contrastive recipe of Tang et al. (CVPR 2022) for the Swin ViT encoder: the SSL head (rotation,
contrastive and reconstruction heads), the two corrupted rotated views, the three-part loss, and the recipe object
the trainer runs."""

from __future__ import annotations

from ...lazy import lazy_names

# the modules whose public names (each one's __all__) are offered here
__getattr__, __dir__ = lazy_names(__name__, modules=("inference", "loss", "network", "recipe", "settings", "views"))
