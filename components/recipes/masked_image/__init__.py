"""Masked image modelling on the Swin ViT encoder (SimMIM-style): block masks over the patch tokens, a learned mask
token, a light decoder and a loss on the masked voxels only."""

from __future__ import annotations

from ...lazy import lazy_names

# the modules whose public names (each one's __all__) are offered here
__getattr__, __dir__ = lazy_names(__name__, modules=("distillation", "loss", "masks", "network", "recipe", "settings"))
