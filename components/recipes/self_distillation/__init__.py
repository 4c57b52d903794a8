"""Self-distillation (DINO, Caron et al. 2021; DINOv2, Oquab et al. 2023) for the Swin ViT encoder."""

from __future__ import annotations

from ...lazy import lazy_names

# the modules whose public names (each one's __all__) are offered here
__getattr__, __dir__ = lazy_names(__name__, modules=("collapse", "loss", "network", "recipe", "settings", "views"))
